"""Every masked op is safe at padding: garbage where the mask is 0 changes nothing.

For each public op of `grpojax.ops` that takes a mask (`mask_nt`, `mask_n` or `mask`), the
per-token (or per-sample) float inputs are filled at masked positions once with zeros (the
clean case) and once with NaN, +inf and -inf in turn (the poisoned case). The op's outputs
and the gradients of a fixed weighted sum of its float outputs with respect to every float
input must be finite and bitwise equal between the two cases (tolerance 0: the same
compiled program sees the same numbers wherever the mask is 1), and the gradient at masked
positions must be exactly 0. This is the `jnp.where` gradient trap: a NaN that reaches the
arithmetic before the select poisons the gradient even though the value is masked.
"""

import inspect
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import grpojax.ops as ops

N, T, D, V = 4, 6, 8, 13
# Rows: full, left offset with right padding, empty (batch padding), short at the end.
MASK_NT = np.asarray(
    ops.mask_from_lengths(jnp.array([6, 3, 0, 2]), T, offset_n=jnp.array([0, 1, 0, 4]))
)
PAD_NT = ~MASK_NT
EMPTY_N = ~MASK_NT.any(-1)  # [N]: the sequence of a row with no real token is padding too
G = 4
MASK_N = np.array([1, 1, 0, 1, 1, 0, 1, 1], bool)  # [8] valid samples, two groups of 4
PAD_N = ~MASK_N
BG = 2  # groups of 2 for the [N, T] REINFORCE++-baseline case
MASK_N4 = np.array([1, 0, 1, 1], bool)
POISON = np.array([np.nan, np.inf, -np.inf], np.float32)


class Case:
    """`fn(**arrays)`; `arrays[name] = (values, pad)`, `pad` True where `values` is padding
    (None: not padding anywhere, e.g. an LM head, still differentiated)."""

    def __init__(self, fn, **arrays):
        self.fn = fn
        self.arrays = arrays


def _rng(name):
    return np.random.default_rng(zlib.crc32(name.encode()))


def _logps(rng, n=N, t=T):
    logp = -rng.uniform(0.05, 3.0, (n, t))
    old = np.minimum(logp + rng.normal(scale=0.4, size=(n, t)), -1e-3)
    ref = np.minimum(logp + rng.normal(scale=0.4, size=(n, t)), -1e-3)
    return [x.astype(np.float32) for x in (logp, old, ref)]


def _normal(rng, *shape, scale=1.0):
    return (rng.normal(size=shape) * scale).astype(np.float32)


def _surrogate(fn, adv_per_token, **kw):
    def build(name):
        rng = _rng(name)
        logp, old, _ = _logps(rng)
        if adv_per_token:
            adv = (_normal(rng, N, T), PAD_NT)
        else:
            adv = (_normal(rng, N), EMPTY_N)
        return Case(
            lambda logp, old, adv: fn(logp, old, adv, MASK_NT, **kw),
            logp=(logp, PAD_NT),
            old=(old, PAD_NT),
            adv=adv,
        )

    return build


def _value(fn, clip):
    def build(name):
        rng = _rng(name)
        v, o, r = (_normal(rng, N, T) for _ in range(3))
        return Case(
            lambda v, o, r: fn(v, o, r, MASK_NT, clip=clip),
            v=(v, PAD_NT),
            o=(o, PAD_NT),
            r=(r, PAD_NT),
        )

    return build


def _per_token(fn, n_inputs=1, scale=1.0):
    def build(name):
        rng = _rng(name)
        arrays = {f"x{i}": (_normal(rng, N, T, scale=scale), PAD_NT) for i in range(n_inputs)}
        return Case(lambda **xs: fn(*xs.values(), MASK_NT), **arrays)

    return build


def _kl_ops(estimator=None, which="kl"):
    def build(name):
        rng = _rng(name)
        logp, old, ref = _logps(rng)
        if which == "kl":
            fn = lambda logp, ref: ops.kl(logp, ref, mask_nt=MASK_NT, estimator=estimator)
            return Case(fn, logp=(logp, PAD_NT), ref=(ref, PAD_NT))
        if which == "kl_is_corrected":
            fn = lambda logp, old, ref: ops.kl_is_corrected(logp, old, ref, mask_nt=MASK_NT)
            return Case(fn, logp=(logp, PAD_NT), old=(old, PAD_NT), ref=(ref, PAD_NT))
        fn = lambda scores, logp, ref, beta: ops.kl_penalty_rewards(
            scores, logp, ref, MASK_NT, beta=beta, estimator=estimator
        )
        return Case(
            fn,
            scores=(_normal(rng, N), EMPTY_N),
            logp=(logp, PAD_NT),
            ref=(ref, PAD_NT),
            beta=(np.float32(0.3), None),
        )

    return build


def _from_logits(which):
    def build(name):
        rng = _rng(name)
        pad = np.broadcast_to(PAD_NT[..., None], (N, T, V))
        logits, ref = (_normal(rng, N, T, V, scale=2.0) for _ in range(2))
        if which == "entropy":
            return Case(lambda z: ops.entropy(z, MASK_NT), z=(logits, pad))
        return Case(lambda z, y: ops.full_kl(z, y, MASK_NT), z=(logits, pad), y=(ref, pad))

    return build


def _from_hidden(which):
    def build(name):
        rng = _rng(name)
        pad = np.broadcast_to(PAD_NT[..., None], (N, T, D))
        h, ref_h = (_normal(rng, N, T, D) for _ in range(2))
        w, ref_w = (_normal(rng, D, V, scale=D**-0.5) for _ in range(2))
        kw = dict(chunk_size=5, vocab_chunk_size=4)  # ragged tiles on both axes
        if which == "entropy":
            fn = lambda h, w: ops.entropy_from_hidden(h, w, MASK_NT, **kw)
            return Case(fn, h=(h, pad), w=(w, None))
        if which == "kl":
            fn = lambda h, w, ref_h, ref_w: ops.kl_from_hidden(h, w, ref_h, ref_w, MASK_NT, **kw)
        else:  # the two-pass JSD
            fn = lambda h, w, ref_h, ref_w: ops.divergence_from_hidden(
                h, w, ref_h, ref_w, MASK_NT, divergence=which, beta=0.5, **kw
            )
        return Case(fn, h=(h, pad), w=(w, None), ref_h=(ref_h, pad), ref_w=(ref_w, None))

    return build


def _group(fn, **kw):
    def build(name):
        rng = _rng(name)
        # Ties within a group and one all-equal valid group exercise the exact-0 paths.
        r = rng.integers(0, 3, size=8).astype(np.float32) / 2
        return Case(lambda r: fn(r, group_size=G, mask_n=MASK_N, **kw), r=(r, PAD_N))

    return build


def _opo(name):
    rng = _rng(name)
    r = rng.integers(0, 3, size=8).astype(np.float32) / 2
    lengths = rng.integers(1, 9, size=8).astype(np.float32)
    fn = lambda r, lengths: ops.opo_advantages(r, lengths, group_size=G, mask_n=MASK_N)
    return Case(fn, r=(r, PAD_N), lengths=(lengths, PAD_N))


def _gdpo(name):
    rng = _rng(name)
    r = rng.integers(0, 3, size=(8, 2)).astype(np.float32)
    fn = lambda r: ops.gdpo_advantages(r, group_size=G, mask_n=MASK_N)
    return Case(fn, r=(r, np.broadcast_to(PAD_N[:, None], (8, 2))))


def _remax(name):
    rng = _rng(name)
    fn = lambda r, greedy: ops.remax_advantages(r, greedy, mask_n=MASK_N)
    return Case(fn, r=(_normal(rng, 8), PAD_N), greedy=(_normal(rng, 2), None))


def _reinforce_pp_baseline(name):
    rng = _rng(name)
    pad_nt = PAD_NT | ~MASK_N4[:, None]
    fn = lambda r, tok: ops.reinforce_pp_baseline_advantages(
        r, MASK_NT, group_size=BG, token_rewards_nt=tok, mask_n=MASK_N4
    )
    return Case(fn, r=(_normal(rng, N), ~MASK_N4), tok=(_normal(rng, N, T, scale=0.1), pad_nt))


def _gae(name):
    rng = _rng(name)
    fn = lambda r, v: ops.gae(r, v, MASK_NT, gamma=0.9, lam=0.8)
    return Case(fn, r=(_normal(rng, N, T), PAD_NT), v=(_normal(rng, N, T), PAD_NT))


def _off_policy(name):
    rng = _rng(name)
    logp, old, _ = _logps(rng)
    fn = lambda logp, old, adv: ops.off_policy_sequence_mask(logp, old, adv, MASK_NT, delta=0.1)
    return Case(fn, logp=(logp, PAD_NT), old=(old, PAD_NT), adv=(_normal(rng, N), EMPTY_N))


def _rollout(level, mode):
    def build(name):
        rng = _rng(name)
        logp, old, _ = _logps(rng)
        fn = lambda tr, sa: ops.rollout_correction(tr, sa, MASK_NT, level=level, mode=mode)
        return Case(fn, tr=(logp, PAD_NT), sa=(old, PAD_NT))

    return build


def _truncated_is(name):
    rng = _rng(name)
    logp, old, _ = _logps(rng)
    fn = lambda tr, sa: ops.truncated_is_weights(tr, sa, MASK_NT, cap=1.5)
    return Case(fn, tr=(logp, PAD_NT), sa=(old, PAD_NT))


def _reduction(fn, axis):
    return _per_token(lambda x, m: fn(x, m, axis=axis))


# The op (before "[") and its configuration. Every masked public op must appear here.
CASES = {
    "aggregate[token-mean]": _per_token(lambda x, m: ops.aggregate(x, m, mode="token-mean")),
    "aggregate[seq-mean-token-mean]": _per_token(
        lambda x, m: ops.aggregate(x, m, mode="seq-mean-token-mean")
    ),
    "aggregate[seq-mean-token-sum]": _per_token(
        lambda x, m: ops.aggregate(x, m, mode="seq-mean-token-sum")
    ),
    "aggregate_parts[seq-mean-token-sum-norm]": _per_token(
        lambda x, m: ops.aggregate_parts(x, m, mode="seq-mean-token-sum-norm", norm_constant=6)
    ),
    "masked_sum[all]": _reduction(ops.masked_sum, None),
    "masked_mean[rows]": _reduction(ops.masked_mean, -1),
    "masked_var[all]": _reduction(ops.masked_var, None),
    "masked_var[rows]": _reduction(ops.masked_var, -1),
    "whiten[shift]": _per_token(lambda x, m: ops.whiten(x, m)),
    "whiten[unbiased-no-shift]": _per_token(
        lambda x, m: ops.whiten(x, m, shift_mean=False, unbiased=True)
    ),
    "entropy_bonus": _per_token(lambda x, m: ops.entropy_bonus(x, m, coef=0.01)),
    "gae": _gae,
    "reinforce_pp_returns": _per_token(lambda x, m: ops.reinforce_pp_returns(x, m, gamma=0.9)),
    "reinforce_pp_baseline_advantages": _reinforce_pp_baseline,
    "group_advantages[group]": _group(ops.group_advantages, scale="group"),
    "group_advantages[batch-unbiased]": _group(ops.group_advantages, scale="batch", std="unbiased"),
    "group_advantages[none]": _group(ops.group_advantages, scale="none"),
    "rloo_advantages": _group(ops.rloo_advantages),
    "pass_at_k_advantages": _group(ops.pass_at_k_advantages, k=2),
    "gpg_advantages": _group(ops.gpg_advantages),
    "maxrl_advantages": _group(ops.maxrl_advantages),
    "opo_advantages": _opo,
    "gdpo_advantages": _gdpo,
    "remax_advantages": _remax,
    "policy_loss[token]": _surrogate(ops.policy_loss, True),
    "policy_loss[token-adv_n-dual]": _surrogate(ops.policy_loss, False, dual_clip=3.0),
    "policy_loss[sequence]": _surrogate(ops.policy_loss, True, ratio_level="sequence"),
    "cispo_loss": _surrogate(ops.cispo_loss, True, clip_low=0.2, clip_high=0.28),
    "cispo_loss[adv_n]": _surrogate(ops.cispo_loss, False, clip_low=1.0, clip_high=0.28),
    "sapo_loss": _surrogate(ops.sapo_loss, True),
    "gmpo_loss": _surrogate(ops.gmpo_loss, False),
    "dppo_loss[tv]": _surrogate(ops.dppo_loss, True, divergence="tv"),
    "dppo_loss[kl]": _surrogate(ops.dppo_loss, True, divergence="kl"),
    "clip_cov_loss": _surrogate(ops.clip_cov_loss, True, clip_cov_ratio=0.2, clip_cov_lb=-9.0),
    "kl_cov_loss": _surrogate(ops.kl_cov_loss, True, kl_cov_ratio=0.2),
    "value_loss[clip]": _value(ops.value_loss, 0.2),
    "value_loss[none]": _value(ops.value_loss, None),
    "value_loss_with_metrics": _value(ops.value_loss_with_metrics, 0.2),
    "kl[k1]": _kl_ops("k1"),
    "kl[k2]": _kl_ops("k2"),
    "kl[k3]": _kl_ops("k3"),
    "kl[abs]": _kl_ops("abs"),
    "kl_is_corrected": _kl_ops(which="kl_is_corrected"),
    "kl_penalty_rewards[k1]": _kl_ops("k1", which="kl_penalty_rewards"),
    "kl_penalty_rewards[k3]": _kl_ops("k3", which="kl_penalty_rewards"),
    "off_policy_sequence_mask": _off_policy,
    "rollout_correction[token-truncate]": _rollout("token", "truncate"),
    "rollout_correction[sequence-mask]": _rollout("sequence", "mask"),
    "rollout_correction[token-icepop]": _rollout("token", "icepop"),
    "truncated_is_weights": _truncated_is,
    "entropy": _from_logits("entropy"),
    "full_kl": _from_logits("full_kl"),
    "entropy_from_hidden": _from_hidden("entropy"),
    "kl_from_hidden": _from_hidden("kl"),
    "divergence_from_hidden": _from_hidden("jsd"),
}
# Masked ops with no float input to poison: the mask is their only argument.
NO_FLOAT_INPUT = {"last_token_mask"}
MASK_ARGS = {"mask_nt", "mask_n", "mask"}


def test_every_masked_public_op_is_covered():
    masked = set()
    for name in ops.__all__:
        fn = getattr(ops, name)
        if inspect.isfunction(fn) and MASK_ARGS & set(inspect.signature(fn).parameters):
            masked.add(name)
    covered = {case.split("[")[0] for case in CASES}
    assert masked - covered - NO_FLOAT_INPUT == set(), "add these ops to CASES"
    assert covered <= masked, "CASES names an op that takes no mask"


def _fill(values, pad, poison):
    """`values` with 0 (clean) or NaN, +inf, -inf in turn (poisoned) where `pad`."""
    values = np.asarray(values, np.float32)
    if pad is None:
        return values
    pad = np.broadcast_to(pad, values.shape)
    if not poison:
        return np.where(pad, np.float32(0), values)
    cycle = POISON[np.arange(values.size).reshape(values.shape) % 3]
    return np.where(pad, cycle, values)


def _weights(leaf, i):
    return jnp.cos(jnp.arange(leaf.size, dtype=jnp.float32) * 0.7 + i).reshape(leaf.shape)


@pytest.mark.parametrize("case", CASES)
def test_padding_garbage_changes_neither_outputs_nor_gradients(case):
    c = CASES[case](case)
    names = list(c.arrays)

    def scalar(*xs):
        out = c.fn(**dict(zip(names, xs)))
        floats = [x for x in jax.tree.leaves(out) if jnp.issubdtype(x.dtype, jnp.floating)]
        total = sum((jnp.sum(x * _weights(x, i)) for i, x in enumerate(floats)), jnp.float32(0))
        return total, out

    grad_fn = jax.jit(jax.grad(scalar, argnums=tuple(range(len(names))), has_aux=True))
    results = []
    for poison in (False, True):
        args = [_fill(*c.arrays[n], poison) for n in names]
        results.append(jax.tree.map(np.asarray, grad_fn(*args)))
    (grads_clean, out_clean), (grads_bad, out_bad) = results

    leaves_clean, tree_clean = jax.tree.flatten(out_clean)
    leaves_bad, tree_bad = jax.tree.flatten(out_bad)
    assert tree_clean == tree_bad
    for path, x in jax.tree_util.tree_leaves_with_path(out_bad):
        assert np.isfinite(x).all() if x.dtype.kind == "f" else True, f"output {path}"
    for a, b in zip(leaves_clean, leaves_bad):
        np.testing.assert_array_equal(b, a)
    for name, g_clean, g_bad in zip(names, grads_clean, grads_bad):
        assert np.isfinite(g_bad).all(), f"gradient w.r.t. {name} is not finite"
        np.testing.assert_array_equal(g_bad, g_clean, err_msg=f"gradient w.r.t. {name}")
        pad = c.arrays[name][1]
        if pad is not None:
            pad = np.broadcast_to(pad, g_bad.shape)
            np.testing.assert_array_equal(g_bad[pad], 0.0, err_msg=f"d/d {name} at padding")
