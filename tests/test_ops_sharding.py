"""Every public op under `jit` on 8 fake CPU devices, on Explicit and on Auto meshes.

With Explicit axes (sharding in types) an op must trace at all (no "select cases must have
the same shardings", no untyped reshape or sort across a sharded axis), and its outputs'
types must carry its inputs' sharding, as optax's sharding tests check with `jax.typeof`
before and after. On both mesh kinds the values equal the single-device ones (rtol 1e-5,
atol 1e-6: the same float32 math, reduced in a different order across shards).
"""

import pytest
from multidevice import run_with_devices

pytestmark = pytest.mark.multidevice

_CHILD = """
import inspect
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
import grpojax as gj

# B = N / G = 4 groups on 8 devices: groups straddle shard boundaries.
N, T, V, D, G = 16, 6, 24, 8, 4
rng = np.random.default_rng(0)
lengths = rng.integers(1, T + 1, N).astype(np.int32)
mask = np.arange(T)[None, :] < lengths[:, None]
logp = (-rng.uniform(0.1, 3.0, (N, T))).astype(np.float32)
arrays = dict(
    logp=logp,
    old=(logp + 0.3 * rng.normal(size=(N, T))).astype(np.float32),
    ref=(logp + 0.1 * rng.normal(size=(N, T))).astype(np.float32),
    mask=mask,
    lengths=lengths,
    rewards=(rng.random(N) < 0.5).astype(np.float32),
    rewards_nr=rng.normal(size=(N, 3)).astype(np.float32),
    adv=rng.normal(size=N).astype(np.float32),
    values=rng.normal(size=(N, T)).astype(np.float32),
    valid=rng.random(N) > 0.2,
    greedy=rng.random(N).astype(np.float32),
    eos=rng.random(N) > 0.3,
    hidden=rng.normal(size=(N, T, D)).astype(np.float32),
    tokens=rng.integers(0, V, (N, T)).astype(np.int32),
    logits=rng.normal(size=(N, T, V)).astype(np.float32),
    lm_head=(0.3 * rng.normal(size=(D, V))).astype(np.float32),  # replicated
)
ctl = gj.adaptive_kl_controller(0.1, target=6.0, horizon=1000)
fixed = gj.fixed_kl_controller(0.1)
chunk = dict(chunk_size=32, vocab_chunk_size=16)

# name -> (function of the named arrays, argument names, index of the argument to
# differentiate or None). Outputs carry the sharding of the first argument.
CASES = {
    "token_logprobs": (lambda z, tk: gj.token_logprobs(z, tk), ["logits", "tokens"], 0),
    "token_logprobs_from_hidden": (
        lambda h, w, tk: gj.token_logprobs_from_hidden(h, w, tk, **chunk),
        ["hidden", "lm_head", "tokens"], 0),
    "token_logprobs_from_hidden:head": (
        lambda h, w, tk: gj.token_logprobs_from_hidden(h, w, tk, **chunk),
        ["hidden", "lm_head", "tokens"], 1),
    "entropy": (lambda z, m: gj.entropy(z, m), ["logits", "mask"], 0),
    "entropy_from_hidden": (
        lambda h, w, m: gj.entropy_from_hidden(h, w, m, **chunk), ["hidden", "lm_head", "mask"], 0),
    "full_kl": (lambda z, m: gj.full_kl(z, 0.5 * z, m), ["logits", "mask"], 0),
    "kl_from_hidden": (
        lambda h, w, m: gj.kl_from_hidden(h, w, 0.5 * h, w, m, **chunk),
        ["hidden", "lm_head", "mask"], 0),
    "divergence_from_hidden": (
        lambda h, w, m: gj.divergence_from_hidden(
            h, w, 0.5 * h, w, m, divergence="jsd", beta=0.5, **chunk),
        ["hidden", "lm_head", "mask"], 0),
    "gae": (lambda v, r, m: gj.gae(r, v, m, gamma=0.99, lam=0.95), ["values", "logp", "mask"], 0),
    "reinforce_pp_returns": (
        lambda r, m: gj.reinforce_pp_returns(r, m, gamma=0.9), ["values", "mask"], 0),
    "reinforce_pp_baseline_advantages": (
        lambda r, m, v: gj.reinforce_pp_baseline_advantages(r, m, group_size=G, mask_n=v),
        ["rewards", "mask", "valid"], None),
    "group_advantages": (
        lambda r, v: gj.group_advantages(r, group_size=G, mask_n=v), ["rewards", "valid"], 0),
    "group_advantages:batch": (
        lambda r: gj.group_advantages(r, group_size=G, scale="batch"), ["adv"], 0),
    "rloo_advantages": (lambda r: gj.rloo_advantages(r, group_size=G), ["adv"], 0),
    "pass_at_k_advantages": (
        lambda r, v: gj.pass_at_k_advantages(r, group_size=G, k=2, mask_n=v),
        ["rewards", "valid"], None),
    "opo_advantages": (
        lambda r, n: gj.opo_advantages(r, n, group_size=G), ["adv", "lengths"], 0),
    "gpg_advantages": (lambda r: gj.gpg_advantages(r, group_size=G), ["rewards"], 0),
    "maxrl_advantages": (lambda r: gj.maxrl_advantages(r, group_size=G), ["rewards"], 0),
    "gdpo_advantages": (
        lambda r, v: gj.gdpo_advantages(r, group_size=G, weights=jnp.array([1.0, 0.5, 2.0]),
                                        mask_n=v),
        ["rewards_nr", "valid"], 0),
    "remax_advantages": (lambda r, g: gj.remax_advantages(r, g), ["rewards", "greedy"], 0),
    "remax_advantages:per_prompt": (
        lambda r: gj.remax_advantages(r, jnp.array([0.1, 0.5, 0.9, 0.3])), ["rewards"], 0),
    "whiten": (lambda x, m: gj.whiten(x, m), ["values", "mask"], 0),
    "last_token_mask": (gj.last_token_mask, ["mask"], None),
    "policy_loss": (
        lambda lp, o, a, m: gj.policy_loss(
            lp, o, a, m, clip_low=0.2, clip_high=0.28, dual_clip=3.0),
        ["logp", "old", "adv", "mask"], 0),
    "policy_loss:sequence": (
        lambda lp, o, a, m: gj.policy_loss(lp, o, a, m, ratio_level="sequence"),
        ["logp", "old", "adv", "mask"], 0),
    "cispo_loss": (
        lambda lp, o, a, m: gj.cispo_loss(lp, o, a, m, clip_low=1.0, clip_high=0.28),
        ["logp", "old", "adv", "mask"], 0),
    "sapo_loss": (lambda lp, o, a, m: gj.sapo_loss(lp, o, a, m), ["logp", "old", "adv", "mask"], 0),
    "gmpo_loss": (lambda lp, o, a, m: gj.gmpo_loss(lp, o, a, m), ["logp", "old", "adv", "mask"], 0),
    "dppo_loss": (
        lambda lp, o, a, m: gj.dppo_loss(lp, o, a, m, divergence="tv"),
        ["logp", "old", "adv", "mask"], 0),
    "dppo_loss:kl": (
        lambda lp, o, a, m: gj.dppo_loss(lp, o, a, m, divergence="kl"),
        ["logp", "old", "adv", "mask"], 0),
    "clip_cov_loss": (
        lambda lp, o, a, m: gj.clip_cov_loss(lp, o, a, m, clip_cov_ratio=0.1, clip_cov_lb=-1.0),
        ["logp", "old", "adv", "mask"], 0),
    "clip_cov_loss:key": (
        lambda lp, o, a, m: gj.clip_cov_loss(lp, o, a, m, clip_cov_ratio=0.1, clip_cov_lb=-1.0,
                                             key=jax.random.key(3)),
        ["logp", "old", "adv", "mask"], 0),
    "kl_cov_loss": (
        lambda lp, o, a, m: gj.kl_cov_loss(lp, o, a, m, kl_cov_ratio=0.1),
        ["logp", "old", "adv", "mask"], 0),
    "value_loss": (
        lambda v, o, r, m: gj.value_loss(v, o, r, m, clip=0.2),
        ["values", "old", "logp", "mask"], 0),
    "value_loss_with_metrics": (
        lambda v, o, r, m: gj.value_loss_with_metrics(v, o, r, m, clip=0.2),
        ["values", "old", "logp", "mask"], 0),
    "entropy_bonus": (lambda e, m: gj.entropy_bonus(e, m, coef=0.01), ["values", "mask"], 0),
    "kl": (lambda lp, r: gj.kl(lp, r, estimator="k3"), ["logp", "ref"], 0),
    "kl_is_corrected": (lambda lp, o, r: gj.kl_is_corrected(lp, o, r), ["logp", "old", "ref"], 0),
    "kl_penalty_rewards": (
        lambda s, lp, r, m: gj.kl_penalty_rewards(s, lp, r, m, beta=0.1, estimator="k1"),
        ["adv", "logp", "ref", "mask"], None),
    "adaptive_kl_controller": (
        lambda k: ctl.update(ctl.init(), current_kl=jnp.mean(k), n_steps=N).beta,
        ["logp"], None),
    "fixed_kl_controller": (
        lambda k: fixed.update(fixed.init(), current_kl=jnp.mean(k), n_steps=N).beta,
        ["logp"], None),
    "aggregate": (
        lambda l, m: gj.aggregate(l, m, mode="seq-mean-token-mean"), ["values", "mask"], 0),
    "aggregate_parts": (
        lambda l, m: gj.aggregate_parts(l, m, mode="seq-mean-token-sum-norm", norm_constant=6.0),
        ["values", "mask"], 0),
    "off_policy_sequence_mask": (
        lambda lp, o, a, m: gj.off_policy_sequence_mask(lp, o, a, m, delta=0.05),
        ["logp", "old", "adv", "mask"], None),
    "truncated_is_weights": (
        lambda tr, sa, m: gj.truncated_is_weights(tr, sa, m, cap=1.5),
        ["logp", "old", "mask"], None),
    "rollout_correction": (
        lambda tr, sa, m: gj.rollout_correction(
            tr, sa, m, level="sequence", mode="mask", high=3.0),
        ["logp", "old", "mask"], None),
    "rollout_correction:icepop": (
        lambda tr, sa, m: gj.rollout_correction(tr, sa, m, level="token", mode="icepop"),
        ["logp", "old", "mask"], None),
    "truncated_completion_mask": (gj.truncated_completion_mask, ["lengths", "eos"], None),
    "overlong_penalty": (
        lambda n: gj.overlong_penalty(n, max_len=5, buffer_len=2), ["lengths"], None),
    "mask_from_lengths": (lambda n: gj.mask_from_lengths(n, T), ["lengths"], None),
    "masked_sum": (lambda x, m: gj.masked_sum(x, m, axis=-1), ["values", "mask"], 0),
    "masked_mean": (lambda x, m: gj.masked_mean(x, m, axis=-1), ["values", "mask"], 0),
    "masked_var": (lambda x, m: gj.masked_var(x, m, axis=-1), ["values", "mask"], 0),
}

# Every public function is covered (constants and classes aside).
public = {n for n in gj.__all__ if inspect.isfunction(getattr(gj, n))}
covered = {name.split(":")[0] for name in CASES}
assert public == covered, (sorted(public - covered), sorted(covered - public))


def expected_spec(ref_spec, ndim):
    spec = tuple(ref_spec)[:ndim]
    return P(*spec, *([None] * (ndim - len(spec))))


def put(mesh, name):
    x = arrays[name]
    spec = P() if name == "lm_head" else P("data", *([None] * (x.ndim - 1)))
    return jax.device_put(x, NamedSharding(mesh, spec))


single = {name: jax.jit(fn)(*(arrays[a] for a in names)) for name, (fn, names, _) in CASES.items()}

for kind in (AxisType.Explicit, AxisType.Auto):
    mesh = jax.make_mesh((8,), ("data",), axis_types=(kind,))
    with jax.set_mesh(mesh):
        for name, (fn, names, diff) in CASES.items():
            args = [put(mesh, a) for a in names]
            types_before = [jax.typeof(a) for a in args]
            out = jax.jit(fn)(*args)
            ref_spec = types_before[0].sharding.spec
            for leaf, ref in zip(jax.tree.leaves(out), jax.tree.leaves(single[name])):
                np.testing.assert_allclose(np.asarray(leaf), np.asarray(ref), rtol=1e-5, atol=1e-6,
                                           err_msg=f"{kind} {name}")
                want = expected_spec(ref_spec, leaf.ndim)
                assert jax.typeof(leaf).sharding.spec == want, (kind, name, jax.typeof(leaf), want)
                if kind == AxisType.Explicit:
                    assert jax.typeof(leaf).sharding.mesh.axis_types == (kind,), (name, leaf)
                else:  # Auto axes are not in the types: check where the compiler put it
                    got = leaf.sharding.spec
                    want = expected_spec(args[0].sharding.spec, leaf.ndim)
                    assert tuple(got) + (None,) * (leaf.ndim - len(got)) == tuple(want), (
                        name, leaf.sharding)
            if diff is not None:
                def total(x, fn=fn, args=args, diff=diff):
                    full = list(args)
                    full[diff] = x
                    return sum(jnp.sum(l) for l in jax.tree.leaves(fn(*full))
                               if jnp.issubdtype(l.dtype, jnp.floating))
                g = jax.jit(jax.grad(total))(args[diff])
                assert jax.typeof(g) == types_before[diff], (kind, name, jax.typeof(g))
                assert np.isfinite(np.asarray(g)).all(), (kind, name)
    print("ok", kind)

# Without a mesh context the ops find the Explicit mesh from their inputs' types.
mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Explicit,))
r, hidden, w, tk = (put(mesh, a) for a in ("rewards", "hidden", "lm_head", "tokens"))
adv = jax.jit(lambda r: gj.rloo_advantages(r, group_size=G))(r)
assert jax.typeof(adv) == jax.typeof(r), jax.typeof(adv)
lp = jax.jit(lambda h, w, t: gj.token_logprobs_from_hidden(h, w, t, **chunk))(hidden, w, tk)
assert jax.typeof(lp).sharding.spec == P("data", None), jax.typeof(lp)
print("ok no context")
"""


def test_every_op_keeps_input_shardings_on_explicit_and_auto_meshes():
    out = run_with_devices(_CHILD)
    assert "ok no context" in out
