"""Sharded decoder on 8 fake CPU devices (data=2 x fsdp=2 x tensor=2 and fsdp=4 x tensor=2)
equals one device; parameters land with the partition specs of `sharding.PARAM_AXES`."""

from __future__ import annotations

import pytest
from jax.sharding import PartitionSpec as P
from multidevice import run_with_devices

from grpojax.models.sharding import logical_to_spec


def test_logical_to_spec_drops_non_dividing_axes():
    mesh = {"data": 1, "fsdp": 4, "tensor": 2}
    assert logical_to_spec(("vocab", "embed"), (64, 32), mesh) == P("tensor", "fsdp")
    # 1 kv head cannot be split over tensor=2: replicated on that dimension.
    assert logical_to_spec(("layers", "embed", "kv_heads", "head_dim"), (2, 32, 1, 8), mesh) == P(
        None, "fsdp", None, None
    )
    assert logical_to_spec(("batch", "seq"), (8, 5), mesh) == P(("data", "fsdp"), None)
    assert logical_to_spec(("batch", "seq"), (2, 5), mesh) == P("data", None)
    with pytest.raises(ValueError, match="unknown logical axis 'nope'"):
        logical_to_spec(("nope",))


_CHILD = """
import tempfile
import jax, jax.numpy as jnp, numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P
import grpojax.models as gm

cfg = gm.ModelConfig(model_type="qwen2", vocab_size=64, hidden_size=32, intermediate_size=48,
                     num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, qkv_bias=True)
src = gm.Decoder(cfg, rngs=nnx.Rngs(0))
rng = np.random.default_rng(0)
for name, var in src.named_params().items():
    var.set_value(jnp.asarray(0.2 * rng.standard_normal(var[...].shape) + ("norm" in name),
                              jnp.float32))
path = tempfile.mkdtemp()
gm.save_pretrained(src, path)

n, t = 8, 6
lengths = np.array([6, 3, 1, 5, 6, 2, 4, 6])
mask = jnp.asarray(np.arange(t)[None] >= (t - lengths)[:, None])
tokens = jnp.asarray(np.where(mask, rng.integers(0, 64, (n, t)), 0))

single = gm.from_pretrained(path)
want = np.asarray(gm.forward_logits(single, tokens, mask))

for sizes in [dict(data=1, fsdp=4, tensor=2), dict(data=2, fsdp=2, tensor=2)]:
    mesh = gm.make_mesh(**sizes)
    model = gm.from_pretrained(path, mesh=mesh)
    params = model.named_params()
    assert params["layers.wq"][...].sharding.spec == P(None, "fsdp", "tensor", None), \\
        params["layers.wq"][...].sharding
    assert params["layers.w_down"][...].sharding.spec == P(None, "tensor", "fsdp")
    assert params["embed"][...].sharding.spec == P("tensor", "fsdp")
    assert len(params["layers.wq"][...].addressable_shards) == 8
    # Each device holds a 1/(fsdp*tensor) slice of wq.
    shard = params["layers.wq"][...].addressable_shards[0].data
    assert shard.shape == (2, 32 // sizes["fsdp"], 4 // 2, 8), shard.shape

    bs = gm.batch_sharding(mesh, shape=(n, t))
    tok_s, mask_s = jax.device_put(tokens, bs), jax.device_put(mask, bs)
    with jax.set_mesh(mesh):
        got = nnx.jit(gm.forward_logits)(model, tok_s, mask_s)
    err = float(np.abs(np.asarray(got) - want)[np.asarray(mask)].max())
    assert err <= 1e-5, (sizes, err)

    # Cached decode on the mesh, cache sharded over batch and kv heads.
    cache = gm.init_cache(cfg, n, t + 1)
    cache = jax.device_put(cache, gm.cache_shardings(cache, mesh))
    pos = gm.positions_from_mask(mask)

    @nnx.jit
    def step(model, tok, p, m, cache):
        h, cache = model(tok, positions_nt=p, mask_nt=m, cache=cache)
        return model.logits(h), cache

    with jax.set_mesh(mesh):
        first, cache = step(model, tok_s[:, :-1], pos[:, :-1], mask_s[:, :-1], cache)
        last, cache = step(model, tok_s[:, -1:], pos[:, -1:], mask_s[:, -1:], cache)
    inc = np.concatenate([np.asarray(first), np.asarray(last)], axis=1)
    err = float(np.abs(inc - want)[np.asarray(mask)].max())
    assert err <= 1e-5, (sizes, "cache", err)

# shard_model on an in-memory model gives the same values as before.
mesh = gm.make_mesh(fsdp=4, tensor=2)
fresh = gm.Decoder(cfg, rngs=nnx.Rngs(3))
before = np.asarray(gm.forward_logits(fresh, tokens, mask))
gm.shard_model(fresh, mesh)
assert fresh.named_params()["layers.w_up"][...].sharding.spec == P(None, "fsdp", "tensor")
with jax.set_mesh(mesh):
    after = np.asarray(nnx.jit(gm.forward_logits)(fresh, tokens, mask))
assert float(np.abs(after - before)[np.asarray(mask)].max()) <= 1e-5
print("OK")
"""


@pytest.mark.multidevice
def test_sharded_forward_and_decode_equal_single_device():
    out = run_with_devices(_CHILD, n_devices=8)
    assert out.strip().endswith("OK")
