"""On 8 fake CPU devices, the ops keep their inputs' shardings under jit and match one device."""

import pytest
from multidevice import run_with_devices

pytestmark = pytest.mark.multidevice


def test_ops_preserve_input_shardings_on_8_devices():
    run_with_devices(
        """
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
import grpojax as gj

# grpojax meshes use Auto axes (GSPMD propagation), as grpojax.models.sharding.make_mesh does.
mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))
n, t, v, d, g = 16, 12, 40, 8, 4
k = jax.random.split(jax.random.key(0), 8)
lengths = jax.random.randint(k[0], (n,), 1, t + 1)
mask = gj.mask_from_lengths(lengths, t)
logp = -jax.random.uniform(k[1], (n, t), minval=0.1, maxval=3.0)
old = logp + 0.1 * jax.random.normal(k[2], (n, t))
ref = logp + 0.1 * jax.random.normal(k[3], (n, t))
rewards = jax.random.uniform(k[4], (n,))
values = jax.random.normal(k[5], (n, t))
hidden = jax.random.normal(k[6], (n, t, d))
w = jax.random.normal(k[7], (d, v)) * 0.3
tokens = jax.random.randint(k[0], (n, t), 0, v)

def ops(logp, old, ref, rewards, values, mask, hidden, tokens):
    adv = gj.group_advantages(rewards, group_size=g)
    loss, _ = gj.policy_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.28)
    gae_adv, ret = gj.gae(rewards[:, None] * mask, values, mask, gamma=0.99, lam=0.95)
    return dict(
        adv=adv,
        loss=loss,
        kl=gj.kl(logp, ref, estimator="k3"),
        gae=gae_adv,
        ret=ret,
        white=gj.whiten(gae_adv, mask),
        rloo=gj.rloo_advantages(rewards, group_size=g),
        lp=gj.token_logprobs_from_hidden(hidden, w, tokens, chunk_size=32, vocab_chunk_size=16),
        agg=gj.aggregate(loss, mask, mode="seq-mean-token-mean"),
    )

args = (logp, old, ref, rewards, values, mask, hidden, tokens)
single = jax.jit(ops)(*args)
sharded_args = tuple(
    jax.device_put(a, NamedSharding(mesh, P("data", *([None] * (a.ndim - 1))))) for a in args
)
out = jax.jit(ops)(*sharded_args)
for name, x in out.items():
    np.testing.assert_allclose(
        np.asarray(x), np.asarray(single[name]), rtol=1e-5, atol=1e-6, err_msg=name
    )
    if x.ndim >= 1:
        spec = x.sharding.spec
        assert isinstance(x.sharding, NamedSharding) and spec[0] == "data", (name, x.sharding)
print("ok")
"""
    )
