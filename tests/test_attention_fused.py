"""The fused attention path (`jax.nn.dot_product_attention`: cuDNN on a GPU, its XLA
implementation here, after the same layout conversion) against the einsum reference.

Rows of one sequence padded every way; new tokens over a shared prompt prefix and over a
row cache (the trainer's completion rows and a later prefill), with a sliding window and a
scale; the whole decoder on prompt and completion rows and on the trainer's shared-prompt
forward; the default GRPO step. Values and gradients within the tolerances of
`attention_cases` (float32 1e-5 of the reference's scale, bf16 2^-7 of max |v|). Then what
the fused op cannot take falls back to exactly the unfused path, logged once per reason, a
failure at compile time included; `auto` takes the fused op on a GPU only; and the compiled
default GRPO step calls it at every attention site (HLO).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from attention_cases import (
    BF16_TOL,
    F32_TOL,
    assert_grads_close,
    fused_case,
    grads_of,
    make_case,
    path_equals_einsum,
    rand,
    shared_prompt_rows,
)
from model_fixtures import model_config, scrambled

import grpojax.models as gm
from grpojax.models import attention as attn

REAL_OP = jax.nn.dot_product_attention
# On a GPU the fused op is cuDNN's, which takes bfloat16 and float16: a float32 call falls
# back there (`fused_refusal_for`), so the float32 checks that the op ran are this CPU's
# (XLA's implementation of the op).
CUDNN_F32 = pytest.mark.skipif(attn.on_gpu(), reason="cuDNN takes no float32: it falls back")


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize(
    "how", [{}, dict(window=4), dict(scale=0.5, window=3)], ids=["plain", "window", "scale"]
)
def test_fused_equals_einsum_values_and_gradients(dtype, how):
    """`jax.nn.dot_product_attention` (its XLA implementation here, cuDNN's on a GPU) after
    the mask conversion (real tokens moved first, lengths, window in moved columns) equals
    the einsum path at every real query, and the gradients of q, k, v of a loss on the real
    queries' outputs match: float32 within 1e-5 of the reference's scale, bf16 within
    2^-7 (as blockwise against einsum); padding queries give 0. A window changes the
    outputs by far more than the bound."""
    q, k, v, mask, real = fused_case(dtype)
    sel = np.asarray(real)
    tol = F32_TOL if dtype == jnp.float32 else BF16_TOL
    w_out = rand(np.random.default_rng(9), q.shape, jnp.float32)

    def run(impl, q, k, v, **kw):
        return attn.attention(q, k, v, mask, implementation=impl, **kw)

    ref, got = run("einsum", q, k, v, **how), run("fused", q, k, v, **how)
    ref32, got32 = np.asarray(ref, np.float32), np.asarray(got, np.float32)
    bound = tol * np.abs(ref32[sel]).max()
    assert np.abs(got32[sel] - ref32[sel]).max() <= bound
    if attn.fused_refusal(q, mask, None, None) is None:  # on a GPU: bf16 only (cuDNN)
        assert np.all(got32[~sel] == 0)
    if "window" in how:
        unwindowed = np.asarray(run("einsum", q, k, v, **{**how, "window": None}), np.float32)
        assert np.abs(unwindowed[sel] - ref32[sel]).max() > 10 * bound

    def loss(impl, q, k, v):
        out = run(impl, q, k, v, **how).astype(jnp.float32)
        return jnp.sum(jnp.where(real[:, :, None, None], out * w_out, 0.0))

    args = (q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32))
    if dtype != jnp.float32:
        return  # bf16 gradients: the values' bound above is the contract
    g_ref = jax.grad(functools.partial(loss, "einsum"), argnums=(0, 1, 2))(*args)
    g_got = jax.grad(functools.partial(loss, "fused"), argnums=(0, 1, 2))(*args)
    for a, b in zip(g_ref, g_got):
        a, b = np.asarray(a), np.asarray(b)
        assert np.all(np.isfinite(b))
        assert np.abs(a - b).max() <= F32_TOL * np.abs(a).max()


def test_fused_falls_back_for_what_it_cannot_express_and_says_so_once(caplog):
    """Packed rows, soft-capped scores and a traced (per-layer) window are not expressible:
    `fused` then gives exactly the unfused choice's output (einsum at this size), and logs
    each reason once."""
    q, k, v, mask = make_case("packed", jnp.float32)[:4]
    caplog.set_level("INFO", logger=attn.__name__)
    attn._TOLD.clear()
    cases = [
        (mask, dict(), "packed rows"),
        (fused_case(jnp.float32)[3], dict(softcap=2.0), "soft-capped scores"),
        (fused_case(jnp.float32)[3], dict(window=jnp.int32(4)), "differs by layer"),
    ]
    for m, how, why in cases:
        qq, kk, vv = (q, k, v) if m is mask else fused_case(jnp.float32)[:3]
        for _ in range(2):
            got = attn.attention(qq, kk, vv, m, implementation="fused", **how)
            ref = attn.attention(qq, kk, vv, m, implementation="einsum", **how)
            np.testing.assert_array_equal(np.asarray(got), np.asarray(ref))
        told = [r.getMessage() for r in caplog.records if why in r.getMessage()]
        assert len(told) == 1 and "fused falls back" in told[0], told


def test_auto_takes_the_fused_op_on_a_gpu_for_bf16_masks_it_expresses(monkeypatch):
    """Where JAX's backend is a GPU (simulated: the op's XLA implementation stands in for
    cuDNN), `auto` calls the fused op for bfloat16 rows of one sequence, and not for float32
    inputs (cuDNN's dtypes) or packed rows; elsewhere `auto` never does."""
    calls = []
    real_fused = attn.fused_attention

    def spy(*args, **kw):
        calls.append(args[0].dtype)
        return real_fused(*args, **{**kw, "implementation": "xla"})

    monkeypatch.setattr(attn, "fused_attention", spy)
    monkeypatch.setattr(attn, "fused_implementation", lambda: "xla")
    q, k, v, mask, _ = fused_case(jnp.bfloat16)
    monkeypatch.setattr(attn, "on_gpu", lambda: False)
    attn.attention(q, k, v, mask, implementation="auto")
    assert calls == []  # not a GPU: auto keeps the einsum / blockwise choice
    monkeypatch.setattr(attn, "on_gpu", lambda: True)
    attn.attention(q, k, v, mask, implementation="auto")
    assert calls == [jnp.bfloat16]
    f32 = [x.astype(jnp.float32) for x in (q, k, v)]
    assert "float32 inputs" in attn.fused_refusal(f32[0], mask, None, None)
    attn.attention(*f32, mask, implementation="auto")
    packed = make_case("packed", jnp.bfloat16)
    attn.attention(*packed[:4], implementation="auto")
    assert calls == [jnp.bfloat16]


# ----------------------------------------------------------------------------- in the decoder


@CUDNN_F32
@pytest.mark.parametrize("window", [None, 5], ids=["full", "sliding"])
def test_decoder_fused_equals_einsum_on_prompt_and_completion_rows(window, caplog):
    """The whole decoder with `attention="fused"` against `"einsum"` on the trainer's rows
    (a left-padded prompt, a right-padded completion), with and without one sliding window
    for every layer (a Python int through the layer scan): hidden states at real positions
    and every parameter's gradient within 1e-5 (float32); no call fell back."""
    caplog.set_level("INFO", logger=attn.__name__)
    attn._TOLD.clear()
    base = model_config(sliding_window=window)
    models = {
        impl: scrambled(dataclasses.replace(base, attention=impl), seed=5)
        for impl in ("einsum", "fused")
    }
    rng = np.random.default_rng(6)
    prompt, completion, n = 7, 9, 4
    pmask = np.arange(prompt)[None, :] >= np.array([0, 3, 6, 2])[:, None]
    cmask = np.arange(completion)[None, :] < np.array([9, 4, 1, 6])[:, None]
    mask = jnp.asarray(np.concatenate([pmask, cmask], 1))
    tokens = jnp.where(mask, jnp.asarray(rng.integers(0, base.vocab_size, mask.shape)), 0)
    positions = gm.positions_from_mask(mask)
    weights = jnp.asarray(rng.standard_normal((n, prompt + completion, base.hidden_size)))
    real = mask[:, :, None]

    def fwd(model):
        return model(tokens, positions_nt=positions, mask_nt=mask)[0]

    ref, got = fwd(models["einsum"]), fwd(models["fused"])
    assert float(jnp.abs(jnp.where(real, ref - got, 0.0)).max()) <= F32_TOL * float(
        jnp.abs(ref).max()
    )

    def loss(model):
        return jnp.sum(jnp.where(real, fwd(model) * weights, 0.0))

    assert_grads_close(grads_of(models["einsum"], loss), grads_of(models["fused"], loss), F32_TOL)
    assert not [r for r in caplog.records if "falls back" in r.getMessage()]


# ----------------------------------------------------------------- over a prefix or a cache


@pytest.fixture
def op_calls(monkeypatch):
    """The calls made to `jax.nn.dot_product_attention` (their query shapes)."""
    calls = []
    real_op = jax.nn.dot_product_attention

    def spy(q, *args, **kw):
        calls.append(q.shape)
        return real_op(q, *args, **kw)

    monkeypatch.setattr(jax.nn, "dot_product_attention", spy)
    return calls


@pytest.mark.parametrize("kind", ["causal", "prefix", "cache"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize(
    "how", [{}, dict(window=5), dict(scale=0.5, window=3)], ids=["plain", "window", "scale"]
)
def test_fused_over_a_prefix_or_a_cache_equals_einsum(kind, dtype, how, op_calls, caplog):
    """New tokens over their group's shared prompt prefix (left-padded prompts, read by 2
    rows each) and over a row cache (one empty), right-padded: one fused call over the key
    sets laid side by side equals the einsum path's one softmax over them, values and (in
    float32) the gradients of q, k, v and of the prefix's / cache's keys and values; a
    window counts real keys back across the prefix into the new tokens. Every call went
    through the op (none fell back)."""
    if dtype == jnp.float32 and attn.on_gpu():
        pytest.skip("cuDNN takes no float32: it falls back")
    caplog.set_level("INFO", logger=attn.__name__)
    attn._TOLD.clear()
    path_equals_einsum(kind, dtype, "fused", **how)
    assert op_calls and not [r for r in caplog.records if "falls back" in r.getMessage()]
    if kind != "causal":  # queries laid over the earlier keys' columns too
        q = make_case(kind, dtype)[0]
        assert all(shape[1] > q.shape[1] for shape in op_calls)


# ----------------------------------------------------------------- what it cannot take


def test_decoding_and_a_long_cache_before_few_tokens_fall_back(caplog):
    """One new token over the cache (decoding, `self_keys=False`) and a prefix far wider than
    the new tokens (the fused call's square would compute over twice the scores needed)
    take the unfused path, exactly, each reason logged once."""
    caplog.set_level("INFO", logger=attn.__name__)
    attn._TOLD.clear()
    rng = np.random.default_rng(1)
    n, kv, h, s = 2, 2, 8, 600
    cache = (rand(rng, (n, kv, h, s), jnp.float32), rand(rng, (n, kv, s, h), jnp.float32))
    c_real = jnp.asarray(np.arange(s)[None] < np.array([[600], [250]]))
    q, k, v = (rand(rng, (n, 1, x, h), jnp.float32) for x in (4, kv, kv))
    mask = attn.SelfMask.from_mask(jnp.ones((n, 1)), positions=jnp.asarray([[599], [249]]))
    for self_keys, why in ((False, "decoding"), (True, "scores needed")):
        how = dict(cache=(*cache, c_real), self_keys=self_keys)
        for _ in range(2):
            got, ref = (
                attn.attention_with_cache(q, k, v, mask, implementation=impl, **how)
                for impl in ("fused", "einsum")
            )
            np.testing.assert_array_equal(np.asarray(got), np.asarray(ref))
        told = [r.getMessage() for r in caplog.records if why in r.getMessage()]
        assert len(told) == 1 and "fused falls back" in told[0], told
    # (E + T)^2 / (2 E T + T^2) at T = 200: E = 480 gives 1.99 (taken), E = 520 gives 2.09;
    # a square within the einsum's own budget (512^2 scores) is taken whatever the ratio
    assert attn.fused_refusal_for(t=200, earlier=480) is None
    assert "2.1x the scores" in attn.fused_refusal_for(t=200, earlier=520)
    assert attn.fused_refusal_for(t=4, earlier=500) is None


def _missing_kernel(q, k, v, **kw):
    """The op plus a custom call nobody registered (of inputs without a gradient): it
    traces, differentiates and lowers, and fails when XLA compiles it, as cuDNN fails for a
    shape or GPU it does not support."""
    out = jax.ShapeDtypeStruct(q.shape, q.dtype)
    missing = jax.ffi.ffi_call("grpojax_no_such_kernel", out)(jax.lax.stop_gradient(q))
    return REAL_OP(q, k, v, **kw) + 0 * missing


@CUDNN_F32
def test_a_compile_time_failure_falls_back_as_a_trace_time_one_does(monkeypatch, caplog):
    """Where the op's implementation is probed (`PROBE_COMPILE`: cuDNN's; here the XLA one),
    a fused call that fails only when compiled takes the unfused path inside the caller's
    jit, equal to the einsum path, the reason logged once; unprobed, the same failure fails
    the whole compile. The real op passes the probe and is used."""
    caplog.set_level("INFO", logger=attn.__name__)
    attn._TOLD.clear()
    monkeypatch.setattr(attn, "PROBE_COMPILE", {"xla"})
    monkeypatch.setattr(attn, "_PROBED", {})
    q, k, v, mask, real = fused_case(jnp.float32)
    real = real[:, :, None, None]  # padding queries' outputs differ (0 fused) and are unused
    step = lambda impl: jax.jit(
        lambda q, k, v: jax.grad(
            lambda q: jnp.sum(
                jnp.where(real, attn.attention(q, k, v, mask, implementation=impl), 0) ** 2
            )
        )(q)
    )
    ref = np.asarray(step("einsum")(q, k, v))
    np.testing.assert_allclose(np.asarray(step("fused")(q, k, v)), ref, rtol=0, atol=1e-5)
    assert len(attn._PROBED) == 1 and None in attn._PROBED.values()  # probed, compiles
    monkeypatch.setattr(jax.nn, "dot_product_attention", _missing_kernel)
    attn._PROBED.clear()
    for _ in range(2):
        np.testing.assert_array_equal(np.asarray(step("fused")(q, k, v)), ref)
    told = [r.getMessage() for r in caplog.records if "at compile" in r.getMessage()]
    assert len(told) == 1 and "grpojax_no_such_kernel" in told[0], told
    monkeypatch.setattr(attn, "PROBE_COMPILE", set())
    with pytest.raises(Exception, match="grpojax_no_such_kernel"):
        step("fused")(q, k, v)


# ----------------------------------------------------------------- in the decoder and the step


@CUDNN_F32
@pytest.mark.parametrize("window", [None, 4], ids=["full", "sliding"])
def test_decoder_fused_shared_prefix_forward_equals_einsum(window, op_calls, caplog):
    """The trainer's shared-prompt forward (`shared_prefix_forward`: each group's prompt run
    once, its G completions over that prompt as a prefix) with `attention="fused"` against
    `"einsum"`, with and without one sliding window for every layer: completion hidden
    states at real positions and every parameter's gradient within 1e-5 (float32), the
    prompt's gradient summed over its group; every attention call fused."""
    caplog.set_level("INFO", logger=attn.__name__)
    attn._TOLD.clear()
    base = model_config(sliding_window=window)
    models = {
        impl: scrambled(dataclasses.replace(base, attention=impl), seed=4)
        for impl in ("einsum", "fused")
    }
    rows = shared_prompt_rows(base)
    cm = rows.completion_mask
    ref, got = rows.shared(models["einsum"]), rows.shared(models["fused"])
    diff = jnp.where(cm, ref - got, 0.0)
    assert float(jnp.abs(diff).max()) <= F32_TOL * float(jnp.abs(ref).max())

    def loss(model):
        return jnp.sum(jnp.where(cm, rows.shared(model) * rows.weights, 0.0))

    assert_grads_close(grads_of(models["einsum"], loss), grads_of(models["fused"], loss), F32_TOL)
    assert op_calls and not [r for r in caplog.records if "falls back" in r.getMessage()]


def _default_grpo_step(p=5, t=6, **model):
    """The default GRPO config's step (`RunConfig().step_config`: share_prompt, a reference
    pass at beta 0.04, G = 8) on a small decoder with `model`'s settings, its optimizer
    recording the gradient, a batch of 2 ragged prompts (P columns) x 8 completions (T
    columns); (step, state, batch)."""
    from train_helpers import grad_recorder, grouped_grpo_batch, small_model

    from grpojax.config import RunConfig
    from grpojax.models import make_mesh
    from grpojax.train import create_train_state, make_grpo_step
    from grpojax.train.state import shard_train_state

    config = RunConfig().step_config
    assert config.share_prompt and config.beta > 0
    tx = grad_recorder()
    graphdef, state = create_train_state(
        small_model(21, **model), tx, rng=jax.random.key(3), with_ref=True
    )
    state = state.replace(ref_params=jax.tree.map(lambda p: p * 1.01, state.ref_params))
    mesh = make_mesh(fsdp=1)
    state, shardings = shard_train_state(state, tx, mesh)
    batch = grouped_grpo_batch(22, b=2, g=config.group_size, p=p, t=t)
    step = make_grpo_step(
        graphdef, tx, config, mesh=mesh, state_shardings=shardings, batch=batch, donate=False
    )
    return step, state, batch


def _attention_sites(step, state, batch) -> dict[str, int]:
    """How many ops of each attention path the compiled step holds (HLO op metadata: the
    paths' named scopes)."""
    hlo = step.jitted.lower(state, batch).compile().as_text()
    return {p: hlo.count(f"{p}_attention") for p in ("fused", "einsum", "blockwise")}


@CUDNN_F32
def test_the_default_grpo_step_takes_the_fused_op_and_equals_the_einsum_step(caplog):
    """The default GRPO config's compiled step with `model.attention=fused` calls the fused
    op at every attention site (the prompts' forward, the completions over their prompt, the
    reference pass, the backward) and no unfused path, and trains as the einsum step does:
    loss and metrics within 1e-5 relative, the gradient within 1e-5 relative norm."""
    caplog.set_level("INFO", logger=attn.__name__)
    attn._TOLD.clear()
    out = {}
    for impl in ("einsum", "fused"):
        step, state, batch = _default_grpo_step(attention=impl)
        sites = _attention_sites(step, state, batch)
        if impl == "fused":
            assert sites["fused"] > 0 and sites["einsum"] == sites["blockwise"] == 0, sites
        out[impl] = step(state, batch)
    (s0, m0), (s1, m1) = out["einsum"], out["fused"]
    assert {"loss", "pg_loss", "kl_loss", "grad_norm"} <= set(m0), sorted(m0)
    for name in m0:
        np.testing.assert_allclose(float(m1[name]), float(m0[name]), rtol=1e-5, atol=1e-9)
    g0, g1 = (
        np.concatenate([np.ravel(x) for x in jax.tree.leaves(s.opt_state)]).astype(np.float64)
        for s in (s0, s1)
    )
    rel = np.linalg.norm(g1 - g0) / np.linalg.norm(g0)
    assert np.linalg.norm(g0) > 0 and rel <= 1e-5, rel
    assert not [r for r in caplog.records if "falls back" in r.getMessage()]


def test_auto_on_a_gpu_compiles_the_default_bf16_step_with_the_fused_op_only(monkeypatch):
    """Where JAX's backend is a GPU (simulated: the op's XLA implementation stands in for
    cuDNN), the default `model.attention=auto` with bfloat16 compute compiles the default
    GRPO step with the fused op at every attention site; on this CPU, the einsum."""
    step, state, batch = _default_grpo_step(dtype="bfloat16")
    assert attn.on_gpu() or _attention_sites(step, state, batch)["fused"] == 0
    monkeypatch.setattr(attn, "on_gpu", lambda: True)
    monkeypatch.setattr(attn, "fused_implementation", lambda: "xla")
    step, state, batch = _default_grpo_step(dtype="bfloat16")
    sites = _attention_sites(step, state, batch)
    assert sites["fused"] > 0 and sites["einsum"] == sites["blockwise"] == 0, sites


def test_the_dry_run_reports_each_call_sites_path_as_the_step_compiles_it(capsys):
    """`grpojax train --dry-run` names the path of each attention call site on this backend
    (the main job with `model.attention=fused`: the trainer's prompts and completions and
    the sampler's prefill fused, decode and packed steps not, with the reason). With
    prompts far longer than the completions the completions' site is refused, and the
    compiled step holds the two paths the report names, each where it says."""
    from train_helpers import small_config

    from grpojax import cli
    from grpojax.config import load_config
    from grpojax.driver.setup import attention_report

    assert cli.main(["train", "--dry-run", "model.attention=fused"]) == 0
    out = capsys.readouterr().out
    assert attn.on_gpu() or (  # a GPU refuses the main job's float32 (cuDNN)
        "attention on cpu (model.attention=fused, float32): trainer prompts (T<=16): fused; "
        "trainer completions over their prompt (T<=4 after 16): fused; packed steps "
        "(packing.mode=auto): einsum (packed rows" in out
    ), out
    assert attn.on_gpu() or "sampler prefill (T<=16): fused; sampler decode: einsum (one" in out
    cfg = load_config(None, ["data.max_prompt_tokens=640", "rollout.max_new_tokens=8"])
    report = attention_report(cfg, small_config(attention="fused"))
    assert "trainer prompts (T<=640): fused" in report, report
    assert "trainer completions over their prompt (T<=8 after 640): einsum (640" in report
    sites = _attention_sites(*_default_grpo_step(p=640, t=8, attention="fused"))
    assert sites["fused"] > 0 and sites["einsum"] > 0 and sites["blockwise"] == 0, sites
