"""TrainState, optimizer and schedule, skipped updates, configs and advantages for the driver."""

from __future__ import annotations

import math
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from train_helpers import small_model

from grpojax.train import (
    GRPO_PRESETS,
    GRPOConfig,
    OptimizerConfig,
    SFTConfig,
    TrainState,
    apply_gradients,
    compute_advantages,
    create_train_state,
    decay_mask_except_bias_norm,
    grpo_preset,
    make_optimizer,
    make_schedule,
)
from grpojax.train.common import (
    ForwardConfig,
    merge_micro,
    merge_units,
    split_micro,
    split_units,
    unit_permutation,
)
from grpojax.train.state import split_params as nnx_split
from grpojax.train.state import trainable_split


def _state(params, tx):
    return TrainState(
        params=params,
        opt_state=tx.init(params),
        step=jnp.zeros((), jnp.int32),
        num_updates=jnp.zeros((), jnp.int32),
        skipped=jnp.zeros((), jnp.int32),
        rng=jax.random.key(0),
        kl_state=None,
    )


def test_warmup_cosine_schedule_matches_formula():
    cfg = OptimizerConfig(
        learning_rate=1e-3,
        schedule="cosine",
        warmup_steps=10,
        total_steps=110,
        final_lr_fraction=0.1,
    )
    sched = make_schedule(cfg)
    for s in (0, 5, 10, 35, 60, 109, 110, 200):
        if s < 10:
            want = 1e-3 * s / 10
        else:
            frac = min(s - 10, 100) / 100
            want = 1e-4 + (1e-3 - 1e-4) * 0.5 * (1 + math.cos(math.pi * frac))
        np.testing.assert_allclose(float(sched(s)), want, rtol=1e-5, atol=1e-12)


def test_warmup_constant_schedule():
    sched = make_schedule(OptimizerConfig(learning_rate=2e-4, warmup_steps=4))
    got = [float(sched(s)) for s in range(7)]
    np.testing.assert_allclose(got, [0, 5e-5, 1e-4, 1.5e-4, 2e-4, 2e-4, 2e-4], rtol=1e-6)
    assert float(make_schedule(OptimizerConfig(learning_rate=3e-4))(0)) == pytest.approx(3e-4)


@pytest.mark.parametrize(
    "kwargs,field",
    [
        (dict(schedule="linear"), "schedule"),
        (dict(learning_rate=0.0), "learning_rate"),
        (dict(warmup_steps=-1), "warmup_steps"),
        (dict(schedule="cosine", warmup_steps=5, total_steps=5), "total_steps"),
        (dict(b2=1.0), "b2"),
        (dict(max_grad_norm=0.0), "max_grad_norm"),
        (dict(weight_decay=-0.1), "weight_decay"),
        (dict(decay_mask="bias"), r"^decay_mask must be one of \('except_bias_norm', 'all'\)"),
        (dict(decay_mask="custom_objectives:nope"), r"^decay_mask: module 'custom_objectives'"),
        (dict(decay_mask="custom_objectives:NOT_A_FUNCTION"), r"^decay_mask: .* got int$"),
    ],
)
def test_optimizer_config_errors_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field) as info:
        OptimizerConfig(**kwargs)
    assert "\n" not in str(info.value)


# ----------------------------------------------------------------------------------------
# Weight-decay mask: the Hugging Face Trainer's rule by default
# ----------------------------------------------------------------------------------------

LR, WD = 0.1, 0.5
EXEMPT = {"bq", "bk", "bv", "attn_norm", "mlp_norm", "q_norm", "k_norm", "final_norm"}


def _names(tree) -> dict[str, object]:
    """Dotted parameter name -> leaf (the `nnx.Variable` node's "value" key dropped)."""
    out = {}
    for path, x in jax.tree_util.tree_leaves_with_path(tree):
        keys = [str(getattr(k, "key", getattr(k, "name", k))) for k in path]
        out[".".join(k for k in keys if k != "value")] = x
    return out


def _one_zero_gradient_update(model, config_mask="except_bias_norm", fn_mask=None):
    """(params before, params after) of one AdamW update with zero gradients: Adam's step is
    exactly 0 (m = v = 0), so only the decoupled decay moves a weight. `config_mask` is
    `OptimizerConfig.decay_mask`, `fn_mask` the mask given to `make_optimizer`."""
    cfg = OptimizerConfig(
        learning_rate=LR, weight_decay=WD, max_grad_norm=None, decay_mask=config_mask
    )
    tx = make_optimizer(cfg, decay_mask=fn_mask)
    _, state = create_train_state(model, tx, rng=jax.random.key(0))
    trainable = trainable_split(state.params)[0]
    grads = jax.tree.map(jnp.zeros_like, trainable)
    new, m = apply_gradients(state, tx, grads, loss=jnp.float32(0.0))
    assert float(m["skipped"]) == 0.0
    before = {k: np.asarray(v) for k, v in _names(state.params).items()}
    after = {k: np.asarray(v) for k, v in _names(new.params).items()}
    return before, after


def _decayed(w: np.ndarray) -> np.ndarray:
    """w - lr * wd * w, in float64 from the float32 weights (AdamW's decoupled decay)."""
    return w.astype(np.float64) * (1.0 - LR * WD)


# float32 arithmetic (two products and a sum, each rounded) against the float64 value:
# 2e-7 relative, a few float32 ulps.
DECAY_RTOL = 2e-7


def test_default_mask_exempts_biases_and_norms_and_decays_the_rest_exactly():
    """Zero gradients, lr 0.1, wd 0.5: biases and norm scales are bit-identical after the
    update; every other parameter (embedding, LM head, projections) is w (1 - lr wd)."""
    model = small_model(0, qkv_bias=True, qk_norm=True)
    before, after = _one_zero_gradient_update(model)
    leaf = {k: k.rsplit(".", 1)[-1] for k in before}
    assert {leaf[k] for k in before} >= EXEMPT | {"embed", "lm_head", "wq", "w_down"}
    for k, w in before.items():
        if leaf[k] in EXEMPT:
            np.testing.assert_array_equal(after[k], w, err_msg=k)
        else:
            assert np.abs(w).max() > 0, k  # the decay is visible
            np.testing.assert_allclose(after[k], _decayed(w), rtol=DECAY_RTOL, err_msg=k)


def test_the_default_mask_classes_flax_modules_as_hugging_face_classes_torch_ones():
    """A researcher's own model of Flax modules (`nnx.Embed`, `nnx.Linear` with and without
    a bias, `nnx.LayerNorm`, `nnx.RMSNorm`): one AdamW update with zero gradients moves
    exactly the parameters the Hugging Face Trainer decays in the same model written with
    torch's modules (`get_decay_parameter_names`): the embedding and the kernels, not the
    biases or the norms' scales."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from flax import nnx

    class Net(nnx.Module):
        def __init__(self, rngs):
            self.embed = nnx.Embed(10, 8, rngs=rngs)
            self.fc1 = nnx.Linear(8, 16, rngs=rngs)
            self.ln = nnx.LayerNorm(16, rngs=rngs)
            self.fc2 = nnx.Linear(16, 8, use_bias=False, rngs=rngs)
            self.out_norm = nnx.RMSNorm(8, rngs=rngs)

    class TorchNet(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(10, 8)
            self.fc1 = torch.nn.Linear(8, 16)
            self.ln = torch.nn.LayerNorm(16)
            self.fc2 = torch.nn.Linear(16, 8, bias=False)
            self.out_norm = torch.nn.RMSNorm(8)

    hf = set(transformers.Trainer.get_decay_parameter_names(None, TorchNet()))
    flax_name = {"embed": "embedding", "fc1": "kernel", "fc2": "kernel", "ln": "scale"}
    flax_name["out_norm"] = "scale"
    expected = {}
    for name, _ in TorchNet().named_parameters():
        module, kind = name.split(".")
        expected[f"{module}.{flax_name[module] if kind == 'weight' else kind}"] = name in hf
    assert set(expected.values()) == {True, False}  # both kinds present

    params = nnx.state(Net(nnx.Rngs(0)), nnx.Param)
    params = jax.tree.map(lambda x: x + 0.5, params)  # every parameter away from 0
    tx = make_optimizer(OptimizerConfig(learning_rate=LR, weight_decay=WD, max_grad_norm=None))
    grads = jax.tree.map(jnp.zeros_like, params)
    updates, _ = tx.update(grads, tx.init(params), params)
    before, after = _names(params), _names(optax.apply_updates(params, updates))
    assert set(before) == set(expected)
    moved = {k: not np.array_equal(np.asarray(after[k]), np.asarray(v)) for k, v in before.items()}
    assert moved == expected


def test_all_mask_decays_every_parameter():
    model = small_model(0, qkv_bias=True, qk_norm=True)
    before, after = _one_zero_gradient_update(model, config_mask="all")
    for k, w in before.items():
        np.testing.assert_allclose(after[k], _decayed(w), rtol=DECAY_RTOL, err_msg=k)
    # Norm scales start at 1 (biases at 0): they moved.
    assert not np.array_equal(after["final_norm"], before["final_norm"])


def test_explicit_masks_are_honoured():
    """A function given to make_optimizer (research code; it replaces the config's mask)
    and one named in the config by "package.module:function" (the driver): only what they
    pick decays."""

    def only_wq(params):
        return jax.tree_util.tree_map_with_path(
            lambda path, _: "'wq'" in jax.tree_util.keystr(path), params
        )

    before, after = _one_zero_gradient_update(small_model(0), config_mask="all", fn_mask=only_wq)
    for k, w in before.items():
        if k == "layers.wq":
            np.testing.assert_allclose(after[k], _decayed(w), rtol=DECAY_RTOL)
        else:
            np.testing.assert_array_equal(after[k], w, err_msg=k)
    before, after = _one_zero_gradient_update(
        small_model(0), config_mask="custom_objectives:no_embedding_decay"
    )
    np.testing.assert_array_equal(after["embed"], before["embed"])
    np.testing.assert_array_equal(after["final_norm"], before["final_norm"])
    np.testing.assert_allclose(after["lm_head"], _decayed(before["lm_head"]), rtol=DECAY_RTOL)


def test_lora_adapters_decay_and_the_frozen_base_does_not_move():
    """With LoRA the optimizer sees the adapters alone: A and B are matrices (decayed, as
    HF + PEFT do); the base weights, norms included, are not trained at all."""
    from flax import nnx

    from grpojax.models import LoRAConfig, add_lora

    model = add_lora(small_model(0), LoRAConfig(rank=2, targets=("q", "down")), rngs=nnx.Rngs(1))
    for name in model.lora.names():  # B starts at 0: give it values the decay can shrink
        var = getattr(model.lora, name)
        var.set_value(var[...] + 0.01)
    before, after = _one_zero_gradient_update(model)
    adapters = [k for k in before if k.startswith("lora.")]
    assert sorted(adapters) == ["lora.down_a", "lora.down_b", "lora.q_a", "lora.q_b"]
    for k, w in before.items():
        if k in adapters:
            np.testing.assert_allclose(after[k], _decayed(w), rtol=DECAY_RTOL, err_msg=k)
        else:
            np.testing.assert_array_equal(after[k], w, err_msg=k)


def test_default_mask_is_the_hugging_face_trainers_rule():
    """Independent check: transformers' own `Trainer.get_decay_parameter_names` on the HF
    model of the same architecture (Qwen2-style q/k/v biases, Qwen3-style q/k norms), its
    tensor names mapped to ours through the checkpoint table: the same parameters decay."""
    torch = pytest.importorskip("torch")
    import transformers

    from grpojax.models import save_pretrained
    from grpojax.models.hf_io import _param_sources

    qwen2 = dict(model_type="qwen2", qkv_bias=True, qk_norm=False)
    for flags in (qwen2, dict(model_type="qwen3", qkv_bias=False, qk_norm=True)):
        model = small_model(0, **flags)
        with tempfile.TemporaryDirectory() as d:
            save_pretrained(model, d)
            hf = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
        hf_decayed = set(transformers.Trainer.get_decay_parameter_names(None, hf))
        assert hf_decayed and hf_decayed < {n for n, _ in hf.named_parameters()}
        expected = {}
        for ours, (hf_name, _, stacked) in _param_sources(model.config).items():
            hf_names = [hf_name.format(i=i) for i in range(2)] if stacked else [hf_name]
            decays = {n in hf_decayed for n in hf_names}
            assert len(decays) == 1, ours  # every layer's slice alike
            expected[ours] = decays.pop()
        _, params = nnx_split(model)
        got = _names(decay_mask_except_bias_norm(params))
        assert got == expected, flags


def test_the_mask_leaves_the_optimizer_state_structure_as_optax_adamw():
    """Every decay_mask gives `optax.adamw`'s state pytree (no `MaskedState` node), so a
    checkpoint restores whatever mask wrote it (Orbax compares tree structures)."""
    _, params = nnx_split(small_model(0))
    for wd in (0.0, 0.1):
        for mask in ("except_bias_norm", "all", "custom_objectives:no_embedding_decay"):
            cfg = OptimizerConfig(learning_rate=1e-3, weight_decay=wd, decay_mask=mask)
            # make_optimizer before the option: optax.adamw without a mask.
            reference = optax.chain(
                optax.clip_by_global_norm(1.0),
                optax.adamw(make_schedule(cfg), weight_decay=wd),
            ).init(params)
            got = make_optimizer(cfg).init(params)
            assert jax.tree.structure(got) == jax.tree.structure(reference), (wd, mask)


def test_apply_gradients_matches_optax_and_clips():
    params = {"w": jnp.array([1.0, -2.0, 3.0]), "b": jnp.array(0.5)}
    grads = {"w": jnp.array([3.0, 0.0, -4.0]), "b": jnp.array(0.0)}  # global norm 5
    # decay_mask="all": "b" would otherwise be exempt as a bias (the default mask).
    cfg = OptimizerConfig(learning_rate=0.1, max_grad_norm=1.0, weight_decay=0.01, decay_mask="all")
    tx = make_optimizer(cfg)
    state = _state(params, tx)
    new, m = apply_gradients(state, tx, grads, loss=jnp.float32(1.0), schedule=make_schedule(cfg))
    # Independent: AdamW's first step moves each coordinate by -lr * sign(g) (bias-corrected
    # m / sqrt(v) = g / |g|, clipping only rescales g) minus lr * wd * p.
    for k in params:
        p, g = np.asarray(params[k]), np.asarray(grads[k])
        g_c = g / 5.0
        step = np.where(g_c != 0, g_c / (np.abs(g_c) + 1e-8), 0.0)
        want = p - 0.1 * (step + 0.01 * p)
        np.testing.assert_allclose(np.asarray(new.params[k]), want, rtol=1e-6)
    assert float(m["grad_norm"]) == pytest.approx(5.0)
    assert float(m["lr"]) == pytest.approx(0.1)
    assert float(m["skipped"]) == 0.0 and int(new.num_updates) == 1 and int(new.skipped) == 0


@pytest.mark.parametrize("bad", ["nan_loss", "inf_loss", "nan_grad", "inf_grad"])
def test_non_finite_update_is_skipped_and_counted(bad):
    params = {"w": jnp.array([1.0, -2.0, 3.0])}
    grads = {"w": jnp.array([0.1, 0.2, 0.3])}
    loss = jnp.float32(1.0)
    if bad == "nan_loss":
        loss = jnp.float32(jnp.nan)
    elif bad == "inf_loss":
        loss = jnp.float32(-jnp.inf)
    elif bad == "nan_grad":
        grads = {"w": grads["w"].at[1].set(jnp.nan)}
    else:
        grads = {"w": grads["w"].at[0].set(jnp.inf)}
    tx = make_optimizer(OptimizerConfig(learning_rate=0.1))
    state = _state(params, tx)
    # One good update first, so the moments are non-trivial.
    state, _ = apply_gradients(state, tx, {"w": jnp.ones(3)}, loss=jnp.float32(0.0))
    new, m = jax.jit(lambda s, g, lo: apply_gradients(s, tx, g, loss=lo))(state, grads, loss)
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(new), strict=False):
        if a.dtype == new.skipped.dtype and a.shape == ():
            continue
        if jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key):
            continue
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    np.testing.assert_array_equal(np.asarray(new.params["w"]), np.asarray(state.params["w"]))
    assert int(new.skipped) == 1 and int(new.num_updates) == 1
    assert float(m["skipped"]) == 1.0


def test_split_micro_roundtrip_and_interleaving():
    x = jnp.arange(12 * 2).reshape(12, 2)
    parts = split_micro(x, 4)
    assert parts.shape == (4, 3, 2)
    np.testing.assert_array_equal(parts[1][:, 0], [2, 10, 18])  # rows 1, 5, 9
    np.testing.assert_array_equal(merge_micro(parts), x)
    with pytest.raises(ValueError, match="not divisible"):
        split_micro(x, 5)


def test_split_units_keep_groups_whole():
    """Units of g contiguous rows (a prompt's G samples) split interleaved like rows, each
    micro-batch holding whole units in order; g = 1 is split_micro; merge_units inverts it;
    unit_permutation moves whole units (g = 1: jax.random.permutation)."""
    g, k, n = 3, 2, 12
    x = {"a": jnp.arange(n), "b": jnp.arange(n * 2).reshape(n, 2)}
    parts = split_units(x, k, g)
    assert parts["a"].shape == (k, n // k) and parts["b"].shape == (k, n // k, 2)
    np.testing.assert_array_equal(parts["a"][1], [3, 4, 5, 9, 10, 11])  # units 1 and 3
    np.testing.assert_array_equal(parts["b"][1][:, 0], 2 * np.asarray([3, 4, 5, 9, 10, 11]))
    for name, y in merge_units(parts, g).items():
        np.testing.assert_array_equal(y, x[name])
    for name, y in split_units(x, k).items():
        np.testing.assert_array_equal(y, split_micro(x[name], k))
    perm = np.asarray(unit_permutation(jax.random.key(2), n, g))
    assert sorted(perm.tolist()) == list(range(n)) and perm.tolist() != list(range(n))
    units = perm.reshape(-1, g)
    np.testing.assert_array_equal(units - units[:, :1], np.broadcast_to(np.arange(g), units.shape))
    assert (units[:, 0] % g == 0).all()
    key = jax.random.key(5)
    np.testing.assert_array_equal(unit_permutation(key, n), jax.random.permutation(key, n))


@pytest.mark.parametrize(
    "kwargs,field",
    [
        (dict(aggregation="mean"), "aggregation"),
        (dict(aggregation="seq-mean-token-sum-norm", norm_constant=0.0), "norm_constant"),
        (dict(ratio_level="seq"), "ratio_level"),
        (dict(kl_estimator="k4"), "kl_estimator"),
        (dict(kl_is_corrected=True, kl_estimator="k1"), "kl_estimator"),
        (dict(beta=-1.0), "beta"),
        (dict(dual_clip=1.0), "dual_clip"),
        (dict(num_epochs=0), "num_epochs"),
        (dict(num_microbatches=1.5), "num_microbatches"),
        (dict(advantage_estimator="ppo"), "advantage_estimator"),
        (dict(group_size=1), "group_size"),
        (dict(rollout_correction_mode="truncate", rollout_correction_high=0.0), "correction_high"),
        (dict(rollout_correction_mode="tis"), "rollout_correction_mode"),
        (dict(policy_loss="ppo"), "policy_loss"),
        (dict(ref_refresh_every=0), "ref_refresh_every"),
        (dict(overlong_max_len=10, overlong_buffer=20), "overlong_buffer"),
    ],
)
def test_grpo_config_errors_name_field_and_allowed_values(kwargs, field):
    with pytest.raises(ValueError, match=field):
        GRPOConfig(**kwargs)


def test_error_lists_allowed_values():
    with pytest.raises(ValueError, match="token-mean"):
        GRPOConfig(aggregation="mean")
    with pytest.raises(ValueError, match="gspo"):
        grpo_preset("ppo")
    with pytest.raises(ValueError, match="temperature"):
        SFTConfig(forward=ForwardConfig(temperature=0.7))


def test_presets_are_replacements_of_one_config():
    assert GRPO_PRESETS["grpo"] == GRPOConfig()
    dapo = grpo_preset("dapo", max_new_tokens=1024, beta=0.01)
    assert (dapo.overlong_max_len, dapo.overlong_buffer) == (1024, 204)
    assert (dapo.clip_low, dapo.clip_high, dapo.aggregation) == (0.2, 0.28, "token-mean")
    assert dapo.beta == 0.01
    assert grpo_preset("gspo").ratio_level == "sequence"
    dr = grpo_preset("dr_grpo", norm_constant=512.0)
    assert (dr.aggregation, dr.advantage_estimator, dr.norm_constant) == (
        "seq-mean-token-sum-norm",
        "dr_grpo",
        512.0,
    )


def test_compute_advantages_against_numpy():
    r = np.array([1.0, 0.0, 0.0, 1.0, 0.5, 0.5, 0.5, 0.5, 3.0, 1.0, 2.0, 0.0], np.float32)
    g = 4
    rg = r.reshape(-1, g).astype(np.float64)
    mean = rg.mean(1, keepdims=True)
    std = rg.std(1, keepdims=True)
    grpo = np.where(std > 0, (rg - mean) / (std + 1e-6), 0.0).ravel()
    np.testing.assert_allclose(
        compute_advantages(r, GRPOConfig(group_size=g)), grpo, rtol=1e-5, atol=1e-6
    )
    dr = (rg - mean).ravel()
    cfg = GRPOConfig(group_size=g, advantage_estimator="dr_grpo")
    np.testing.assert_allclose(compute_advantages(r, cfg), dr, atol=1e-6)
    rloo = (rg - (rg.sum(1, keepdims=True) - rg) / (g - 1)).ravel()
    cfg = GRPOConfig(group_size=g, advantage_estimator="rloo")
    np.testing.assert_allclose(compute_advantages(r, cfg), rloo, atol=1e-6)
    # DAPO overlong penalty: lengths past max_len - buffer are punished before grouping.
    lengths = np.array([4, 9, 10, 12] * 3)
    cfg = GRPOConfig(
        group_size=g, advantage_estimator="dr_grpo", overlong_max_len=10, overlong_buffer=2
    )
    pen = np.array([0.0, -0.5, -1.0, -1.0] * 3)
    rp = (r + pen).reshape(-1, g)
    want = (rp - rp.mean(1, keepdims=True)).ravel()
    got = compute_advantages(r, cfg, lengths_n=jnp.asarray(lengths))
    np.testing.assert_allclose(got, want, atol=1e-6)
    with pytest.raises(ValueError, match="lengths_n"):
        compute_advantages(r, cfg)
    with pytest.raises(ValueError, match="mask_nt"):
        compute_advantages(r, GRPOConfig(group_size=g, advantage_estimator="reinforce_pp"))
    mask = jnp.ones((12, 3), bool)
    tok = compute_advantages(
        r, GRPOConfig(group_size=g, advantage_estimator="reinforce_pp"), mask_nt=mask
    )
    assert tok.shape == (12, 3)
    d = dr.reshape(12, 1) * np.ones((12, 3))
    np.testing.assert_allclose(tok, (d - d.mean()) / np.sqrt(d.var() + 1e-8), atol=1e-5)


def test_cosine_without_length_is_an_error_when_the_schedule_is_built():
    cfg = OptimizerConfig(schedule="cosine")  # the driver fills total_steps in
    with pytest.raises(ValueError, match="schedule='cosine' needs total_steps"):
        make_schedule(cfg)
