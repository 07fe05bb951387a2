"""The GRPO step with LoRA adapters: only adapters train and carry optimizer state, the
reference is the base weights with adapters off (no copy), base weights stay bit-identical."""

from __future__ import annotations

import functools
import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from train_helpers import FORWARD, grouped_grpo_batch, small_model

import grpojax.models as gm
from grpojax.train import GRPOConfig, OptimizerConfig, create_train_state, make_optimizer
from grpojax.train.grpo import grpo_update, make_grpo_step
from grpojax.train.grpo.loss import _precompute_logp
from grpojax.train.state import is_lora, shard_train_state, trainable_split

jax.config.update("jax_default_matmul_precision", "highest")


def _lora_model(seed=0, **lora_kw):
    model = small_model(seed)
    gm.add_lora(model, gm.LoRAConfig(**{"rank": 4, "alpha": 8.0, **lora_kw}), rngs=nnx.Rngs(1))
    return model


def _flat(tree):
    return [np.asarray(x) for x in jax.tree.leaves(tree)]


def test_lora_state_has_no_reference_copy_and_adapter_only_optimizer_state():
    model = _lora_model()
    tx = make_optimizer(OptimizerConfig(learning_rate=1e-2))
    _, state = create_train_state(model, tx, rng=jax.random.key(0), with_ref=True)
    assert is_lora(state.params) and state.ref_params is None
    adapters, base = trainable_split(state.params)
    n_adapter = sum(x.size for x in jax.tree.leaves(adapters))
    n_base = sum(x.size for x in jax.tree.leaves(base))
    n_opt = sum(np.size(x) for x in jax.tree.leaves(state.opt_state))
    assert n_adapter < n_base / 5
    assert 2 * n_adapter <= n_opt <= 2 * n_adapter + 8  # Adam's moments + counts only


@pytest.mark.parametrize(
    "kl_estimator, targets",
    [("k3", gm.lora.ALL_TARGETS), ("full", gm.lora.ALL_TARGETS), ("full", gm.lora.TARGET_NAMES)],
)
def test_lora_grpo_step_trains_adapters_only_reference_is_base(kl_estimator, targets):
    """With `lm_head` among the targets the full KL's reference head is the base matrix."""
    model = _lora_model(seed=2, targets=targets)
    tx = make_optimizer(OptimizerConfig(learning_rate=1e-2))
    graphdef, state = create_train_state(model, tx, rng=jax.random.key(0), with_ref=True)
    base0 = _flat(trainable_split(state.params)[1])
    adapters0 = _flat(trainable_split(state.params)[0])
    batch = grouped_grpo_batch(3)
    cfg = GRPOConfig(
        beta=0.1,
        kl_estimator=kl_estimator,
        group_size=4,
        num_minibatches=2,
        num_microbatches=2,
        forward=FORWARD,
    )
    update = jax.jit(functools.partial(grpo_update, graphdef=graphdef, tx=tx, config=cfg))
    state, m1 = update(state, batch)
    state, m2 = update(state, batch)
    for m in (m1, m2):
        assert np.isfinite(float(m["loss"])) and float(m["skipped"]) == 0.0
    assert float(m2["kl_ref"]) > 0  # adapters moved: the policy left the base reference
    adapters, base = trainable_split(state.params)
    for a, b in zip(_flat(base), base0, strict=True):
        np.testing.assert_array_equal(a, b)
    assert any(np.abs(a - b).max() > 0 for a, b in zip(_flat(adapters), adapters0, strict=True))
    if "lm_head" in targets:  # B starts at 0; the head's adapter trains too
        assert np.abs(np.asarray(adapters["lora"]["lm_head_b"][...])).max() > 0


def test_lora_base_in_compute_dtype_steps_as_the_float32_base():
    """bf16 compute: the frozen base is stored in bf16 (adapters, moments float32); two GRPO
    steps give bit for bit the adapters and metrics of the same run over a float32 base (the
    decoder rounds each weight to bf16 where it is used), and the base keeps its bits."""
    model = small_model(3, dtype="bfloat16")
    gm.add_lora(model, gm.LoRAConfig(rank=4, alpha=8.0), rngs=nnx.Rngs(1))
    tx = make_optimizer(OptimizerConfig(learning_rate=1e-2))
    graphdef, state = create_train_state(model, tx, rng=jax.random.key(0), with_ref=True)
    _, state32 = create_train_state(model, tx, rng=jax.random.key(0), base_dtype=None)
    adapters, base = trainable_split(state.params)
    assert {x.dtype for x in jax.tree.leaves(base)} == {np.dtype("bfloat16")}
    assert {x.dtype for x in jax.tree.leaves(adapters)} == {np.dtype("float32")}
    floats = [x for x in jax.tree.leaves(state.opt_state) if jnp.issubdtype(x.dtype, jnp.floating)]
    assert floats and {x.dtype for x in floats} == {np.dtype("float32")}
    nbytes = lambda t: sum(x.nbytes for x in jax.tree.leaves(t))
    assert 2 * nbytes(base) == nbytes(trainable_split(state32.params)[1])
    base0 = _flat(base)

    cfg = GRPOConfig(beta=0.1, group_size=4, num_minibatches=2, forward=FORWARD)
    update = jax.jit(functools.partial(grpo_update, graphdef=graphdef, tx=tx, config=cfg))
    batch = grouped_grpo_batch(4)
    for _ in range(2):
        state, m = update(state, batch)
        state32, m32 = update(state32, batch)
    assert float(m["kl_ref"]) > 0 and float(m["skipped"]) == 0.0
    for k in m:
        np.testing.assert_array_equal(m[k], m32[k], err_msg=k)
    adapters, base = trainable_split(state.params)
    for a, b in zip(_flat(adapters), _flat(trainable_split(state32.params)[0]), strict=True):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(_flat(base), base0, strict=True):
        np.testing.assert_array_equal(a, b)


def test_lora_dropout_step_old_logprobs_undropped_and_keyed_by_the_state():
    """Dropout p > 0: one update (whose pi_old would otherwise be stop_gradient(logp)) sees a
    ratio != 1, as pi_old is the undropped forward and logp a dropped one; with p = 0 (same
    weights) the ratio is exactly 1. The step is a function of the state's key: the same
    state gives bit-identical results, another key other adapters. Base weights unchanged."""
    cfg = GRPOConfig(beta=0.05, group_size=4, forward=FORWARD)  # one update per step
    batch = grouped_grpo_batch(5)
    tx = make_optimizer(OptimizerConfig(learning_rate=1e-2))
    results = {}
    for rate in (0.0, 0.3):
        model = _lora_model(seed=4, dropout=rate)
        for name in model.lora.names():  # nonzero B: the adapters (and dropout) act
            if name.endswith("_b"):
                var = getattr(model.lora, name)
                var.set_value(0.05 * jax.random.normal(jax.random.key(9), var.shape))
        graphdef, state = create_train_state(model, tx, rng=jax.random.key(0), with_ref=True)
        update = jax.jit(functools.partial(grpo_update, graphdef=graphdef, tx=tx, config=cfg))
        results[rate] = (state, update)
    state0, update0 = results[0.0]
    _, m0 = update0(state0, batch)
    assert float(m0["first_ratio_min"]) == float(m0["first_ratio_max"]) == 1.0
    state, update = results[0.3]
    base0 = _flat(trainable_split(state.params)[1])
    s1, m1 = update(state, batch)
    s2, m2 = update(state, batch)
    assert float(m1["skipped"]) == 0.0
    assert abs(float(m1["first_ratio_max"]) - 1) + abs(float(m1["first_ratio_min"]) - 1) > 1e-4
    for a, b in zip(_flat(s1.params), _flat(s2.params), strict=True):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(np.asarray(m1["loss"]), np.asarray(m2["loss"]))
    s3, _ = update(state.replace(rng=jax.random.key(1)), batch)
    a1, a3 = _flat(trainable_split(s1.params)[0]), _flat(trainable_split(s3.params)[0])
    assert any(np.abs(x - y).max() > 0 for x, y in zip(a1, a3, strict=True))
    for a, b in zip(_flat(trainable_split(s1.params)[1]), base0, strict=True):
        np.testing.assert_array_equal(a, b)


def test_lora_reference_equals_a_base_model_copy():
    """The adapters-off reference inside the step == ref logprobs from a separate base model."""
    model = _lora_model(seed=4)
    # Nonzero adapters, so policy and reference differ.
    rng = np.random.default_rng(0)
    for name in model.lora.names():
        var = getattr(model.lora, name)
        var.set_value(0.05 * rng.standard_normal(var.shape).astype(np.float32))
    base_model = small_model(4)
    tx = optax.sgd(1e-2)
    graphdef, state = create_train_state(model, tx, rng=jax.random.key(0), with_ref=True)
    batch = grouped_grpo_batch(5)
    cfg = GRPOConfig(beta=0.1, group_size=4, forward=FORWARD, num_minibatches=2)
    base_gd, base_params = nnx.split(base_model)
    blocks = jax.tree.map(lambda x: x.reshape(1, 1, *x.shape), batch)
    ref_copy = jax.jit(lambda p: _precompute_logp(base_gd, p, blocks, cfg))(base_params)
    ref_off = jax.jit(lambda p: _precompute_logp(graphdef, p, blocks, cfg, adapters=False))(
        state.params
    )
    policy = jax.jit(lambda p: _precompute_logp(graphdef, p, blocks, cfg))(state.params)
    np.testing.assert_array_equal(np.asarray(ref_off), np.asarray(ref_copy))
    assert np.abs(np.asarray(policy - ref_off)).max() > 1e-3


def test_lora_sharded_step_on_a_one_device_mesh_and_refresh_refused():
    model = _lora_model(seed=6)
    tx = make_optimizer(OptimizerConfig(learning_rate=1e-2))
    graphdef, state = create_train_state(model, tx, rng=jax.random.key(0), with_ref=True)
    mesh = gm.make_mesh()
    state, shardings = shard_train_state(state, tx, mesh)
    batch = grouped_grpo_batch(7)
    cfg = GRPOConfig(beta=0.05, group_size=4, forward=FORWARD)
    step = make_grpo_step(graphdef, tx, cfg, mesh=mesh, state_shardings=shardings, batch=batch)
    state, metrics = step(state, batch)
    assert np.isfinite(float(metrics["loss"]))
    refresh = GRPOConfig(beta=0.05, group_size=4, forward=FORWARD, ref_refresh_every=2)
    with pytest.raises(ValueError, match="ref_refresh_every is not supported with LoRA"):
        grpo_update(state, batch, graphdef=graphdef, tx=tx, config=refresh)


# ----------------------------------------------------------------------------------------
# The driver: `grpojax train lora.rank=...` on a local HF checkpoint
# ----------------------------------------------------------------------------------------


# One 2-step GRPO run with LoRA on every target, shared by the tests that read its policy,
# export and checkpoints (a module fixture: one run per test worker).
LORA_RUN = {"total_steps": 2, "grpo.beta": 0.04, "lora.rank": 4, "lora.alpha": 8}


@pytest.fixture(scope="module")
def lora_run(small_model_dir, tmp_path_factory):
    from test_driver_loop import _overrides

    from grpojax.config import load_config
    from grpojax.driver.loop import train

    run_dir = tmp_path_factory.mktemp("lora") / "run"
    cfg = load_config(None, _overrides(small_model_dir, run_dir, **LORA_RUN))
    assert cfg.lora.enabled and cfg.lora.targets == gm.lora.ALL_TARGETS
    return run_dir, train(cfg, show_progress=False, print_fn=lambda s: None)


def test_driver_grpo_run_with_lora_keeps_base_weights(lora_run, small_model_dir, tmp_path, capsys):
    from test_driver_hf import _logits_diff

    run_dir, result = lora_run
    assert result.stopped_by is None
    trainer = result.trainer
    assert trainer.state.ref_params is None and is_lora(trainer.state.params)
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in rows if "loss" in r]
    assert len(losses) == 2 and all(np.isfinite(losses))

    policy = trainer.policy()
    base = gm.from_pretrained(small_model_dir)
    for name, var in base.named_params().items():  # the base weights: bit-identical
        np.testing.assert_array_equal(np.asarray(policy.named_params()[name][...]), var[...])
    assert np.abs(np.asarray(policy.lora.q_b[...])).max() > 0  # the adapters trained
    # The end-of-run export is the merged policy W + (alpha/r) A B, which transformers loads.
    exported = gm.from_pretrained(run_dir / "hf").named_params()
    merged = gm.merge_adapters(policy).named_params()
    assert set(exported) == set(merged)
    for name, var in merged.items():
        np.testing.assert_array_equal(np.asarray(exported[name][...]), np.asarray(var[...]))
    assert np.abs(np.asarray(merged["layers.wq"][...] - base.layers.wq[...])).max() > 0
    assert _logits_diff(run_dir / "hf", policy) <= 1e-4

    # `grpojax export --adapter`: PEFT format over the run's base checkpoint (model.source).
    peft = pytest.importorskip("peft")
    import torch
    import transformers

    from grpojax import cli

    out = tmp_path / "adapter"
    assert cli.main(["export", str(run_dir), "--out", str(out), "--adapter"]) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert line == f"grpojax export: adapter={out} base={small_model_dir} step=2 run_dir={run_dir}"
    assert json.loads((out / "adapter_config.json").read_text())["base_model_name_or_path"] == str(
        small_model_dir
    )
    hf_base = transformers.AutoModelForCausalLM.from_pretrained(
        small_model_dir, attn_implementation="eager"
    )
    hf = peft.PeftModel.from_pretrained(hf_base, str(out)).eval()
    ids = np.array([[5, 9, 13, 7, 21, 30], [8, 8, 40, 2, 11, 3]])
    with torch.no_grad():
        ref = hf(input_ids=torch.tensor(ids)).logits.float().numpy()
    got = np.asarray(gm.forward_logits(policy, jax.numpy.asarray(ids)))
    assert np.abs(ref - got).max() <= 1e-4


def test_lora_config_errors_name_the_field():
    from grpojax.config import ConfigError, load_config

    cases = {
        "lora.rank=-1": "lora.rank must be an int >= 0",
        "lora.alpha=0": "lora.alpha must be",
        "lora.targets=[q,embed]": "lora.targets must be one of",
        "lora.targets=[]": "lora.targets must be a non-empty list",
        "lora.dropout=1": "lora.dropout must be a finite number >= 0 and < 1, got 1",
    }
    for override, match in cases.items():
        with pytest.raises(ConfigError, match=match.replace("[", r"\[")):
            load_config(None, [override])
    with pytest.raises(ConfigError, match=r"algo 'ppo' needs ppo\.critic=shared"):
        load_config(None, ["lora.rank=4", "algo=ppo", "ppo.critic=separate"])
    assert load_config(None, ["lora.rank=4", "algo=ppo", "ppo.critic=shared"]).lora.enabled
    with pytest.raises(ConfigError, match=r"lora\.dropout > 0 is supported with the GRPO-family"):
        load_config(None, ["lora.rank=4", "lora.dropout=0.1", "algo=ppo", "ppo.critic=shared"])
    assert load_config(None, ["lora.rank=4", "lora.dropout=0.1"]).lora.lora_config().dropout == 0.1
    with pytest.raises(ConfigError, match="ref_refresh_every must be null with lora"):
        load_config(None, ["lora.rank=4", "grpo.ref_refresh_every=2"])


def test_export_adapter_writes_the_warm_started_base_beside_it(small_model_dir, tmp_path):
    """After an SFT warm start the base is no longer `model.source`: it goes to out/base."""
    peft = pytest.importorskip("peft")
    import torch
    import transformers
    from test_driver_loop import _overrides

    from grpojax.config import load_config
    from grpojax.driver.loop import train
    from grpojax.jobs.export import export_run

    run_dir = tmp_path / "run"
    extra = {"total_steps": 1, "sft.steps": 2, "lora.rank": 2, "log.export_hf": "false"}
    result = train(load_config(None, _overrides(small_model_dir, run_dir, **extra)),
                   show_progress=False, print_fn=lambda s: None)  # fmt: skip
    policy = result.trainer.policy()
    out = tmp_path / "adapter"
    exported = export_run(run_dir, out=out, adapter=True, print_fn=lambda s: None)
    assert exported["base"] == str(out / "base")
    with gm.adapters_off(policy):  # the base written is the warm-started one, adapters off
        base = gm.from_pretrained(out / "base")
        for name, var in base.named_params().items():
            np.testing.assert_array_equal(np.asarray(policy.named_params()[name][...]), var[...])
    hf = peft.PeftModel.from_pretrained(
        transformers.AutoModelForCausalLM.from_pretrained(out / "base"), str(out)
    ).eval()
    ids = np.array([[5, 9, 13, 7, 21, 30]])
    with torch.no_grad():
        ref = hf(input_ids=torch.tensor(ids)).logits.float().numpy()
    assert np.abs(ref - np.asarray(gm.forward_logits(policy, jax.numpy.asarray(ids)))).max() <= 1e-4

    # A run without adapters has none to export.
    plain = tmp_path / "plain"
    extra = {"total_steps": 1, "log.export_hf": "false"}
    train(load_config(None, _overrides(small_model_dir, plain, **extra)),
          show_progress=False, print_fn=lambda s: None)  # fmt: skip
    from grpojax.errors import UserError

    with pytest.raises(UserError, match="no LoRA adapters"):
        export_run(plain, out=tmp_path / "none", adapter=True)


def test_lora_run_resumes_bit_exactly(small_model_dir, tmp_path):
    """Stopped after 2 of 4 steps and resumed == uninterrupted, bit for bit; the SFT warm
    start's base comes back from the checkpoint (which holds the whole model). With adapter
    dropout (0.1): its masks come from the checkpointed train-state key."""
    from test_driver_loop import _has_digit_one, _overrides

    from grpojax.config import load_config
    from grpojax.driver.checkpoint import host_copy
    from grpojax.driver.loop import train
    from grpojax.rewards import RewardSpec

    specs = [RewardSpec(_has_digit_one, name="digit_one", mode="thread")]
    extra = {
        "total_steps": 4,
        "sft.steps": 2,
        "sft.batch_size": 8,
        "grpo.beta": 0.04,
        "grpo.num_minibatches": 2,
        "lora.rank": 4,
        "lora.targets": "[q,v,down]",
        "lora.dropout": 0.1,
        "log.export_hf": "false",
    }
    quiet = dict(show_progress=False, print_fn=lambda s: None, reward_specs=specs)
    full = train(load_config(None, _overrides(small_model_dir, tmp_path / "a", **extra)), **quiet)
    resume = {**extra, "checkpoint.resume": "true"}
    first = train(load_config(None, _overrides(small_model_dir, tmp_path / "b", **extra)),
                  stop_after=2, **quiet)  # fmt: skip
    assert first.stopped_by == "stop_after" and first.steps == 2
    second = train(
        load_config(None, _overrides(small_model_dir, tmp_path / "b", **resume)), **quiet
    )
    assert second.steps == 4
    a, b = host_copy(full.trainer.state), host_copy(second.trainer.state)
    leaves_a, tree_a = jax.tree.flatten(a)
    leaves_b, tree_b = jax.tree.flatten(b)
    assert tree_a == tree_b
    for x, y in zip(leaves_a, leaves_b, strict=True):
        np.testing.assert_array_equal(x, y)
    assert second.trainer.policy().lora.lora_config.targets == ("q", "v", "down")
    assert second.trainer.policy().lora.lora_config.dropout == 0.1


def test_checkpoints_hold_adapters_only_and_resume_onto_another_base_is_refused(
    lora_run, small_model_dir, tmp_path
):
    from test_driver_loop import _overrides

    from grpojax.config import load_config
    from grpojax.driver.loop import train
    from grpojax.errors import UserError

    run_dir = tmp_path / "run"  # a copy of the shared run: resumed below
    shutil.copytree(lora_run[0], run_dir)
    extra = {**LORA_RUN, "log.export_hf": "false"}
    assert lora_run[1].steps == 2
    meta = json.loads((run_dir / "checkpoints" / "2" / "meta" / "metadata").read_text())
    params = [p for p in meta["leaf_paths"] if p.startswith(".train.params")]
    assert len(params) == 2 * 7 and all(p.startswith(".train.params['lora']") for p in params)
    driver = json.loads((run_dir / "checkpoints" / "2" / "driver" / "metadata").read_text())
    assert (
        len(driver["lora_base_fingerprint"])
        == len(base_leaves := jax.tree.leaves(gm.from_pretrained(small_model_dir).named_params()))
        and base_leaves
    )
    assert not (run_dir / "checkpoints-lora-base").exists()  # the base is model.source itself

    # The same run resumed onto a different base checkpoint: refused, saying why.
    other = tmp_path / "other_base"
    base = gm.from_pretrained(small_model_dir)
    rng = np.random.default_rng(0)
    base.layers.wq.set_value(base.layers.wq[...] + 0.01 * rng.standard_normal(base.layers.wq.shape))
    gm.save_pretrained(base, other, tokenizer=gm.load_tokenizer(small_model_dir))
    more = {**extra, "total_steps": 3, "checkpoint.resume": "true"}
    cfg = load_config(None, _overrides(other, run_dir, **more))
    with pytest.raises(UserError, match="trained on a different base model"):
        train(cfg, show_progress=False, print_fn=lambda s: None)
    # Onto its own base it continues.
    cfg = load_config(None, _overrides(small_model_dir, run_dir, **more))
    assert train(cfg, show_progress=False, print_fn=lambda s: None).steps == 3


def test_driver_logprob_pass_gives_the_base_reference_without_a_copy():
    """The trainer-side pass of a LoRA run computes the reference from the policy's own
    params with adapters off, equal to a separate base model's pass."""
    from grpojax.train.common import ADAPTERS_OFF, make_logprob_pass

    model = _lora_model(seed=8)
    rng = np.random.default_rng(1)
    for name in model.lora.names():
        var = getattr(model.lora, name)
        var.set_value(0.05 * rng.standard_normal(var.shape).astype(np.float32))
    graphdef, params = nnx.split(model)
    base_gd, base_params = nnx.split(small_model(8))
    batch = grouped_grpo_batch(9)
    mesh = gm.make_mesh(devices=jax.devices()[:1])
    args = (batch.tokens_ns, batch.mask_ns, batch.completion_mask_nt)
    logp, _, ref = make_logprob_pass(graphdef, FORWARD, mesh, 4)(params, ADAPTERS_OFF, *args)
    base_logp, _, _ = make_logprob_pass(base_gd, FORWARD, mesh, 4)(base_params, None, *args)
    np.testing.assert_array_equal(np.asarray(ref), np.asarray(base_logp))
    assert np.abs(np.asarray(logp - ref)).max() > 1e-3


def test_ppo_run_with_lora_and_a_shared_critic(small_model_dir, tmp_path):
    """PPO with LoRA: the actor's adapters and the critic's head train, the base stays
    bit-identical, the reference is the base (no copy); resume continues it."""
    from test_driver_loop import _overrides

    from grpojax.config import load_config
    from grpojax.driver.loop import train

    run_dir = tmp_path / "run"
    extra = {"algo": "ppo", "ppo.critic": "shared", "lora.rank": 4, "total_steps": 2,
             "log.export_hf": "false"}  # fmt: skip
    cfg = load_config(None, _overrides(small_model_dir, run_dir, **extra))
    result = train(cfg, show_progress=False, print_fn=lambda s: None)
    assert result.stopped_by is None and result.steps == 2
    trainer = result.trainer
    assert trainer.state.ref_params is None and is_lora(trainer.policy_params())
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in rows if "loss" in r]
    assert len(losses) == 2 and all(np.isfinite(losses))
    policy = trainer.policy()
    base = gm.from_pretrained(small_model_dir)
    for name, var in base.named_params().items():
        np.testing.assert_array_equal(np.asarray(policy.named_params()[name][...]), var[...])
    assert np.abs(np.asarray(policy.lora.q_b[...])).max() > 0
    head_bias = trainer.state.ppo.critic.params["b"][...]  # 0 at init: the head trained
    assert float(np.abs(np.asarray(head_bias))) > 0
    more = {**extra, "total_steps": 3, "checkpoint.resume": "true"}
    cfg = load_config(None, _overrides(small_model_dir, run_dir, **more))
    assert train(cfg, show_progress=False, print_fn=lambda s: None).steps == 3
