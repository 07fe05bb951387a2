"""LoRA adapters on the stacked decoder (grpojax.models.lora), without transformers.

Exact: zero-initialised adapters leave logits bit-identical; with adapters switched off the
model is the base model bit for bit, whatever the adapters hold (eagerly and inside one jit
that runs both settings). Gradients through a LoRA-split state reach only the adapters and an
optax step leaves every base weight bit-identical. Within float32 tolerance: the unmerged
LoRA forward equals the base model with merged weights W + (alpha/r) A B (MERGE_TOL), and
cached prefill + decode equals the full forward with adapters on (CACHE_TOL, as for the base
decoder). Adapter partition specs follow the base weights' rules.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from model_fixtures import cached_decode_logits, left_padded_batch, model_config, scrambled

import grpojax.models as gm
from grpojax.models import lora
from grpojax.models.sharding import PARAM_AXES, logical_to_spec

CACHE_TOL = 1e-5  # float32, the base decoder's cached-decode bound (tests/test_models.py)
# Unmerged x W + s (x A) B vs merged x (W + s A B): the same product summed in a different
# order. Logits here are O(5); float32 rounding of the reassociated sums measured ~1e-6.
MERGE_TOL = 2e-5


def _randomize_adapters(model, seed, scale=0.1):
    """Nonzero B (and fresh A), so the adapters change the outputs."""
    rng = np.random.default_rng(seed)
    for name in model.lora.names():
        var = getattr(model.lora, name)
        var.set_value(jnp.asarray(scale * rng.standard_normal(var.shape), var[...].dtype))


def _logits(model, tokens, mask):
    return np.asarray(gm.forward_logits(model, tokens, mask))


def _base_values(model):
    return {n: np.asarray(v[...]) for n, v in model.named_params().items() if "lora" not in n}


CONFIGS = {
    "qwen3": dict(),
    "qwen2_bias_mha": dict(model_type="qwen2", qk_norm=False, qkv_bias=True, num_kv_heads=4),
    "llama_tied": dict(model_type="llama", qk_norm=False, tie_word_embeddings=True),
}


@pytest.mark.parametrize("case", sorted(CONFIGS))
def test_zero_init_is_exact_and_adapters_off_is_the_base_model(case):
    config = model_config(**CONFIGS[case])
    model = scrambled(config, seed=1)
    tokens, mask = left_padded_batch(config)
    base = _logits(model, tokens, mask)
    base_values = _base_values(model)

    lora.add_lora(model, lora.LoRAConfig(rank=4, alpha=8.0), rngs=nnx.Rngs(2))
    np.testing.assert_array_equal(_logits(model, tokens, mask), base)  # B = 0: bit-identical

    _randomize_adapters(model, seed=3)
    on = _logits(model, tokens, mask)
    assert np.abs(on - base)[np.asarray(mask)].max() > 1e-2  # the adapters do act
    with lora.adapters_off(model):
        np.testing.assert_array_equal(_logits(model, tokens, mask), base)
    assert model.lora_enabled  # restored
    np.testing.assert_array_equal(_logits(model, tokens, mask), on)
    for name, value in base_values.items():  # adding / changing adapters never touches W
        np.testing.assert_array_equal(np.asarray(model.named_params()[name][...]), value)


def test_switch_inside_one_jit_over_graphdef_and_state():
    """Policy and reference in one traced function over one state (the train step's shape)."""
    config = model_config()
    model = scrambled(config, seed=4)
    tokens, mask = left_padded_batch(config, seed=1)
    base_graphdef, base_state = nnx.split(model)
    # Jitted against jitted: eager and jitted programs fuse differently (~5e-7 apart).
    base = jax.jit(lambda s: gm.forward_logits(nnx.merge(base_graphdef, s), tokens, mask))
    base = np.asarray(base(base_state))
    lora.add_lora(
        model, lora.LoRAConfig(rank=2, alpha=4.0, targets=("q", "down")), rngs=nnx.Rngs(5)
    )
    _randomize_adapters(model, seed=6)
    on = _logits(model, tokens, mask)
    graphdef, state = nnx.split(model)

    @jax.jit
    def both(state):
        m = nnx.merge(graphdef, state)
        policy = gm.forward_logits(m, tokens, mask)
        with lora.adapters_off(m):
            ref = gm.forward_logits(m, tokens, mask)
        return policy, ref

    policy, ref = both(state)
    np.testing.assert_array_equal(np.asarray(ref), base)
    # Jitted against the eager `on`: fused differently (~5e-7 apart, 2 ulps of |logit| ~ 3),
    # so the cached-decode bound CACHE_TOL; an adapter off moves the logits by > 1e-2.
    np.testing.assert_allclose(np.asarray(policy), on, rtol=0, atol=CACHE_TOL)


def test_gradients_reach_only_adapters_and_an_optimizer_step_keeps_base_bits():
    config = model_config()
    model = scrambled(config, seed=7)
    lora.add_lora(model, lora.LoRAConfig(rank=4, alpha=8.0), rngs=nnx.Rngs(8))
    tokens, mask = left_padded_batch(config, seed=2)
    graphdef, adapters, base = nnx.split(model, lora.LoRAParam, ...)
    adapter_names = {".".join(map(str, p)) for p, _ in nnx.to_flat_state(adapters)}
    assert adapter_names == {f"lora.{n}" for n in model.lora.names()}
    base_names = {".".join(map(str, p)) for p, _ in nnx.to_flat_state(base)}
    assert not base_names & adapter_names and "layers.wq" in base_names

    def loss_fn(adapters, base):
        m = nnx.merge(graphdef, adapters, base)
        logits = gm.forward_logits(m, tokens, mask)
        return jnp.mean(jnp.where(mask[..., None], logits, 0.0) ** 2)

    grads = jax.grad(loss_fn)(adapters, base)  # w.r.t. the adapters only
    flat = dict(nnx.to_flat_state(grads))
    for path, g in flat.items():
        g = np.asarray(g[...] if hasattr(g, "get_value") else g)
        if path[-1].endswith("_b"):  # dL/dB = s (x A)^T dL/dy: nonzero from the start
            assert np.abs(g).max() > 0, path
        else:  # dL/dA = s x^T dL/dy B^T = 0 while B = 0 (the LoRA init)
            assert np.abs(g).max() == 0, path

    before = [np.asarray(x) for x in jax.tree.leaves(base)]
    tx = optax.adam(1e-2)
    opt_state = tx.init(adapters)
    # Optimizer state only for the adapters: Adam's two moments of each, plus its count.
    n_adapter = sum(x.size for x in jax.tree.leaves(adapters))
    assert sum(np.size(x) for x in jax.tree.leaves(opt_state)) == 2 * n_adapter + 1
    for _ in range(2):
        grads = jax.grad(loss_fn)(adapters, base)
        updates, opt_state = tx.update(grads, opt_state, adapters)
        adapters = optax.apply_updates(adapters, updates)
    # After a step B != 0, so A now gets gradient too.
    grads = jax.grad(loss_fn)(adapters, base)
    assert all(np.abs(np.asarray(g)).max() > 0 for g in jax.tree.leaves(grads))
    nnx.update(model, adapters)
    assert np.abs(np.asarray(model.lora.q_b[...])).max() > 0  # the model took the update
    after = [np.asarray(x) for x in jax.tree.leaves(nnx.state(model, nnx.Not(lora.LoRAParam)))]
    assert len(after) == len(before)
    for a, b in zip(after, before):
        np.testing.assert_array_equal(a, b)


def test_lora_forward_equals_merged_weights():
    config = model_config(model_type="qwen2", qk_norm=False, qkv_bias=True)
    model = scrambled(config, seed=9)
    lora.add_lora(model, lora.LoRAConfig(rank=3, alpha=6.0), rngs=nnx.Rngs(10))
    _randomize_adapters(model, seed=11)
    tokens, mask = left_padded_batch(config, seed=3)
    unmerged = _logits(model, tokens, mask)
    merged_model = lora.merge_adapters(model)
    assert not lora.has_adapters(merged_model) and lora.has_adapters(model)
    merged = _logits(merged_model, tokens, mask)
    m = np.asarray(mask)
    err = np.abs(unmerged - merged)[m].max()
    print(
        f"merge: max |unmerged - merged| = {err:.2e}, max |logit| = {np.abs(merged)[m].max():.2f}"
    )
    assert err <= MERGE_TOL
    with lora.adapters_off(model):  # merging copied: the model's own base weights unchanged
        assert np.abs(_logits(model, tokens, mask) - merged)[m].max() > 1e-2


def test_prefill_then_decode_equals_full_forward_with_adapters():
    config = model_config()
    model = scrambled(config, seed=12)
    lora.add_lora(model, lora.LoRAConfig(rank=4, alpha=4.0), rngs=nnx.Rngs(13))
    _randomize_adapters(model, seed=14)
    n, prompt, steps = 3, 6, 4
    t = prompt + steps
    tokens, prompt_mask = left_padded_batch(config, seed=4, n=n, t=prompt)
    rng = np.random.default_rng(5)
    tokens = jnp.concatenate([tokens, jnp.asarray(rng.integers(0, 64, (n, steps)))], axis=1)
    mask = jnp.concatenate([prompt_mask, jnp.ones((n, steps), bool)], axis=1)
    full = gm.forward_logits(model, tokens, mask)
    logits, _ = cached_decode_logits(model, tokens, mask, prompt=prompt, cache_len=t)
    err = np.abs(np.asarray(logits - full))[np.asarray(mask)]
    print(f"cached decode with adapters: max err {err.max():.2e}")
    assert err.max() <= CACHE_TOL


def test_targets_subset_and_shapes():
    config = model_config()
    model = gm.Decoder(config, rngs=nnx.Rngs(0))
    lora.add_lora(
        model, lora.LoRAConfig(rank=2, alpha=2.0, targets=("v", "q", "o")), rngs=nnx.Rngs(1)
    )
    assert model.lora.lora_config.targets == ("q", "v", "o")  # canonical order
    shapes = {k: v.shape for k, v in model.named_params().items() if k.startswith("lora.")}
    L, D, Q, K, H = 2, 32, 4, 2, 16
    assert shapes == {
        "lora.q_a": (L, D, 2),
        "lora.q_b": (L, 2, Q, H),
        "lora.v_a": (L, D, 2),
        "lora.v_b": (L, 2, K, H),
        "lora.o_a": (L, Q, H, 2),
        "lora.o_b": (L, 2, D),
    }
    assert all(isinstance(getattr(model.lora, n), lora.LoRAParam) for n in model.lora.names())
    assert not any(
        isinstance(v, lora.LoRAParam)
        for v in jax.tree.leaves(
            nnx.state(model, nnx.All(nnx.Param, nnx.Not(lora.LoRAParam))),
            is_leaf=lambda x: isinstance(x, nnx.Variable),
        )
    )
    with pytest.raises(ValueError, match="already has LoRA"):
        lora.add_lora(model, lora.LoRAConfig(), rngs=nnx.Rngs(1))


def test_adapter_partition_specs_follow_base_rules():
    mesh_shape = {"data": 1, "fsdp": 2, "tensor": 2}
    spec = lambda name, shape: tuple(logical_to_spec(PARAM_AXES[name], shape, mesh_shape))
    # A keeps the base's input-dim axes, B its output-dim axes; the rank axis is replicated.
    assert spec("layers.wq", (2, 32, 4, 16)) == (None, "fsdp", "tensor", None)
    assert spec("lora.q_a", (2, 32, 4)) == (None, "fsdp", None)
    assert spec("lora.q_b", (2, 4, 4, 16)) == (None, None, "tensor", None)
    assert spec("lora.o_a", (2, 4, 16, 4)) == (None, "tensor", None, None)
    assert spec("lora.o_b", (2, 4, 32)) == (None, None, "fsdp")
    assert spec("lora.down_a", (2, 48, 4)) == (None, "tensor", None)
    assert spec("lora.down_b", (2, 4, 32)) == (None, None, "fsdp")
    assert spec("lora.gate_b", (2, 4, 48)) == (None, None, "tensor")
    assert spec("lm_head", (32, 64)) == ("fsdp", "tensor")  # the head's adapter: A [D, r] ...
    assert spec("lora.lm_head_a", (32, 4)) == ("fsdp", None)
    assert spec("lora.lm_head_b", (4, 64)) == (None, "tensor")  # ... B [r, V]


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(rank=0), r"^rank must be an int >= 1, got 0$"),
        (dict(alpha=0.0), r"^alpha must be a finite number > 0, got 0\.0$"),
        (dict(alpha=float("nan")), r"^alpha must be a finite number > 0, got nan$"),
        (dict(targets=()), r"^targets must be a non-empty list"),
        (dict(targets=("q", "embed")), r"^targets must be one of \('q', .*\), got 'embed'$"),
        (dict(dropout=1.0), r"^dropout must be a finite number >= 0 and < 1, got 1\.0$"),
        (dict(dropout=-0.1), r"^dropout must be a finite number >= 0 and < 1, got -0\.1$"),
    ],
)
def test_config_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        lora.LoRAConfig(**kwargs)


# Dropout on the adapter input: x W + s (drop(x) A) B with drop(x) = x m / (1 - p).
# float32 einsums against a float64 NumPy product of standard normals (D = 8, r = 3,
# scale 2): the projections reach ~55, where an ulp is 3.8e-6 (3.6e-6 seen), so 5e-5. A
# wrong mask element or a missing 1 / (1 - p) moves them by O(1).
DROPOUT_TOL = 5e-5


def _project_case(seed=0, rate=0.25):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((2, 3, 8)).astype(np.float32)  # [N, T, D]
    p = {
        "wq": rng.standard_normal((8, 4, 5)).astype(np.float32),  # [D, Q, H]
        "lora_q_a": rng.standard_normal((8, 3)).astype(np.float32),  # [D, r]
        "lora_q_b": rng.standard_normal((3, 4, 5)).astype(np.float32),  # [r, Q, H]
    }
    return x, p, rate


def _project_numpy(x, p, scale, keep=None, rate=0.0):
    x64 = np.float64(x)
    xd = x64 if keep is None else x64 * keep / (1.0 - rate)
    base = np.einsum("ntd,dqh->ntqh", x64, np.float64(p["wq"]))
    xa = np.einsum("ntd,dr->ntr", xd, np.float64(p["lora_q_a"]))
    return base + scale * np.einsum("ntr,rqh->ntqh", xa, np.float64(p["lora_q_b"]))


def test_dropout_mask_matches_numpy_and_its_mean_is_the_undropped_delta():
    x, p, rate = _project_case()
    scale = 2.0
    proj = lambda p_: np.asarray(
        lora.project("ntd,dqh->ntqh", jnp.asarray(x), p_, "wq", jnp.float32, scale, rate)
    )
    # Without a key: no dropout whatever the rate.
    np.testing.assert_allclose(proj(p), _project_numpy(x, p, scale), rtol=0, atol=DROPOUT_TOL)
    # With a layer key: the mask of target q is Bernoulli(1 - p) from fold_in(key, index of q).
    key = jax.random.key(3)
    keep = np.asarray(
        jax.random.bernoulli(
            jax.random.fold_in(key, lora.ALL_TARGETS.index("q")), 1 - rate, x.shape
        )
    )
    assert 0 < keep.mean() < 1
    got = proj({**p, lora.DROPOUT_KEY: key})
    want = _project_numpy(x, p, scale, keep, rate)
    np.testing.assert_allclose(got, want, rtol=0, atol=DROPOUT_TOL)
    assert np.abs(got - _project_numpy(x, p, scale)).max() > 0.1  # dropout did act

    # E[drop(x)] = x: the mean over K keys of the adapter delta is the undropped delta, within
    # 5 standard errors of the K-sample mean (elementwise, from the samples' own spread).
    k = 4000
    keys = jax.random.split(jax.random.key(4), k)
    one = lambda kk: lora.project(
        "ntd,dqh->ntqh", jnp.asarray(x), {**p, lora.DROPOUT_KEY: kk}, "wq", jnp.float32, scale, rate
    )
    samples = np.float64(np.asarray(jax.jit(jax.vmap(one))(keys)))
    exact = _project_numpy(x, p, scale)
    stderr = samples.std(axis=0) / np.sqrt(k)
    assert np.all(np.abs(samples.mean(axis=0) - exact) <= 5 * stderr + DROPOUT_TOL)


def test_decoder_dropout_only_with_a_key_and_never_with_adapters_off():
    config = model_config()
    base_model = scrambled(config, seed=7)
    tokens, mask = left_padded_batch(config, seed=2)
    base = _logits(base_model, tokens, mask)
    models = {}
    for rate in (0.0, 0.3):
        model = scrambled(config, seed=7)
        lora.add_lora(model, lora.LoRAConfig(rank=4, alpha=8.0, dropout=rate), rngs=nnx.Rngs(2))
        _randomize_adapters(model, seed=5)
        models[rate] = model

    def run(model, key):
        hidden, _ = model(tokens, mask_nt=mask, lora_dropout_key=key)
        return np.asarray(model.logits(hidden))

    key = jax.random.key(11)
    no_drop = run(models[0.0], None)
    np.testing.assert_array_equal(run(models[0.0], key), no_drop)  # p = 0: the key is unused
    np.testing.assert_array_equal(run(models[0.3], None), no_drop)  # no key: no dropout
    dropped = run(models[0.3], key)
    assert np.abs(dropped - no_drop)[np.asarray(mask)].max() > 1e-3
    np.testing.assert_array_equal(run(models[0.3], key), dropped)  # deterministic in the key
    with lora.adapters_off(models[0.3]):  # the reference: the base exactly, key or not
        np.testing.assert_array_equal(run(models[0.3], key), base)
