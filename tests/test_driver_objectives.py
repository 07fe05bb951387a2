"""Each new policy loss and advantage estimator through `grpojax train`, and a user-defined
loss named by module path, on the built-in arithmetic task.

One warm fork server (`cli_forkserver`) runs six short command lines, two at a time, on the
1-layer model: CISPO, SAPO, DPPO (Binary-TV), Clip-Cov and KL-Cov, each paired with one
estimator (pass@k, OPO, GPG, GRPO, Dr.GRPO), and `custom_objectives:cispo_by_hand`, CISPO
written by hand in a user module, beside the built-in "cispo" with the same settings. Each
run: no SFT, 2 RL steps of 2 mini-batches each (the second mini-batch is off policy, so the
clip bands, DPPO's mask and SAPO's gate act), a reward with variance under a random policy
(`custom_objectives:odd_code_sum`) beside the task's own answer reward, and the held-out
evaluation on 2 prompts.
"""

import json
import math
from unittest import mock

import jax
import numpy as np
import yaml
from safetensors.numpy import load_file

from grpojax.config import load_config
from grpojax.driver.setup import build_mesh, build_model
from grpojax.driver.trainer import make_trainer
from grpojax.models.sharding import batch_sharding, put_global
from grpojax.ops.kl import kl_is_corrected
from grpojax.train.grpo import loss as grpo_loss_mod
from grpojax.train.rows import Group, RowArrays, assemble_batch

STEPS = 2
CISPO = {"clip_low": 0.01, "clip_high": 0.01, "advantage_estimator": "pass_at_k", "pass_at_k": 2}

# name -> (grpo overrides, metrics the loss logs, metrics that must be > 0 at some step)
RUNS = {
    "cispo+pass_at_k": (
        {"policy_loss": "cispo", **CISPO},
        ("clip_frac_low", "clip_frac_high"),
        ("clip_frac_low", "clip_frac_high"),
    ),
    "user_cispo+pass_at_k": (
        {"policy_loss": "custom_objectives:cispo_by_hand", **CISPO},
        ("clip_frac_low", "clip_frac_high"),
        ("clip_frac_low", "clip_frac_high"),
    ),
    "sapo+opo": ({"policy_loss": "sapo", "advantage_estimator": "opo"}, ("gate_weight_mean",), ()),
    "dppo_tv+gpg": (
        {
            "policy_loss": "dppo",
            "dppo_divergence": "tv",
            "dppo_delta": 0.0,
            "advantage_estimator": "gpg",
        },
        ("masked_frac", "divergence_mean"),
        ("masked_frac", "divergence_mean"),
    ),
    "clip_cov+grpo": (
        {
            "policy_loss": "clip_cov",
            "clip_cov_ratio": 0.25,
            "clip_cov_lb": -1000.0,
            "clip_cov_ub": 1000.0,
            "advantage_estimator": "grpo",
        },
        ("clip_cov_frac", "cov_mean", "clip_frac_low", "clip_frac_high"),
        ("clip_cov_frac",),
    ),
    "kl_cov+dr_grpo": (
        {
            "policy_loss": "kl_cov",
            "kl_cov_ratio": 0.25,
            "kl_cov_coef": 1.0,
            "advantage_estimator": "dr_grpo",
        },
        ("kl_cov_frac", "cov_mean", "abs_kl_mean"),
        ("kl_cov_frac", "abs_kl_mean"),
    ),
}
TIMINGS = ("time", "elapsed_s", "step_time_s", "tokens_per_s")
# The user's CISPO and the built-in one are different programs (the built-in one clamps
# |log r| and computes ratio diagnostics), so XLA may fuse and order their float32 arithmetic
# differently: with the suite's classic XLA:CPU fusion emitters (conftest) the weights after
# the 4 Adam updates of lr 1e-2 differ by up to 4.4e-8 (bit-equal with the MLIR emitters).
# The weights check catches a loss that trains another model (each update moves a weight by
# about the learning rate); the exactly compared metrics catch the fine details: with the
# user's upper clip doubled (1.02 for 1.01) the weights moved by only 2.5e-7, but
# clip_frac_high differed (0.0625 vs 0.09375), and a loss off only in scale, which Adam
# would hide, shows in the loss and gradient-norm metrics.
USER_LOSS_ATOL = 1e-6
# The gradient norms sum squares over every parameter's gradient, which reach them through
# the two programs' backward passes: since the decoder reads each group's prompt cache as a
# shared prefix (its backward sums over the group), they differ in the last float32 bit
# (0.46611276 vs 0.46611279). Relative 1e-6 is rounding level; a loss off in scale by 1e-4
# differs 100x more. The losses, rewards and clip fractions stay exactly equal.
GRAD_NORMS = ("grad_norm", "first_grad_norm")
GRAD_NORM_RTOL = 1e-6


def _argv(model_dir, run_dir, grpo):
    over = {
        "model.source": model_dir,
        "log.run_dir": run_dir,
        "log.tensorboard": "false",
        "log.plot": "false",
        "data.size": 100,
        "rollout.prompts_per_step": 2,
        "rollout.max_new_tokens": 4,
        "grpo.group_size": 4,
        "grpo.num_minibatches": 2,
        "optimizer.learning_rate": 1e-2,
        "optimizer.warmup_steps": 0,
        "sft.steps": 0,
        "total_steps": STEPS,
        "eval.heldout_size": 2,
        "eval.batch_size": 2,
        "eval.k": 1,
        "checkpoint.every": STEPS,
        "checkpoint.async_save": "false",
        "rewards.mode": "thread",
        "rewards.num_workers": 1,
        "rewards.functions": "[custom_objectives:odd_code_sum]",
        **{f"grpo.{k}": v for k, v in grpo.items()},
    }
    return ["train", "--no-progress", *(f"{k}={v}" for k, v in over.items())]


def _rl_records(run_dir):
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [
        {k: v for k, v in r.items() if k not in TIMINGS and not k.startswith("time/")}
        for r in records
        if "reward_mean" in r
    ]


def test_each_loss_and_estimator_and_a_user_loss_through_grpojax_train(
    cli_server, small_model_dir, tmp_path
):
    """Per run: exit 0; the run's config names the loss and estimator; 2 RL records, each
    with reward variance, a finite loss, a nonzero gradient and no skipped update; the
    loss's own metrics logged and finite (> 0 at some step where the settings make the
    mechanism act; SAPO's gate weight in (0, 1], below 1 off policy); the exported weights
    differ from the initial ones. The user module's CISPO gives the built-in one's metrics
    exactly (same seeds, so same samples and losses), its gradient norms within
    `GRAD_NORM_RTOL` and its weights within `USER_LOSS_ATOL`: the path-named loss runs in
    the same pipeline."""
    calls = [
        (_argv(small_model_dir, tmp_path / name, grpo), tmp_path, {})
        for name, (grpo, _, _) in RUNS.items()
    ]
    results = cli_server.run_many(calls, parallel=2)
    initial = load_file(small_model_dir / "model.safetensors")
    weights, logs = {}, {}
    for (name, (grpo, logged, positive)), r in zip(RUNS.items(), results, strict=True):
        assert r.returncode == 0, f"{name}: exit {r.returncode}\n{r.stdout}\n{r.stderr}"
        run_cfg = yaml.safe_load((tmp_path / name / "config.yaml").read_text())["grpo"]
        for key in ("policy_loss", "advantage_estimator"):
            assert run_cfg[key] == grpo[key], (name, key, run_cfg[key])
        rl = _rl_records(tmp_path / name)
        assert [x["step"] for x in rl] == list(range(1, STEPS + 1)), name
        for x in rl:
            for key in ("loss", "pg_loss", "grad_norm", *logged):
                assert math.isfinite(x[key]), (name, key, x)
            assert x["reward_std"] > 0 and x["grad_norm"] > 0 and x["skipped"] == 0, (name, x)
        for key in positive:
            assert max(x[key] for x in rl) > 0, (name, key, rl)
        if "gate_weight_mean" in logged:
            assert all(0 < x["gate_weight_mean"] <= 1 for x in rl), rl
            assert min(x["gate_weight_mean"] for x in rl) < 1, rl
        weights[name] = load_file(tmp_path / name / "hf" / "model.safetensors")
        moved = max(float(np.max(np.abs(weights[name][k] - initial[k]))) for k in initial)
        assert moved > 0, name
        logs[name] = rl
    user, builtin = logs["user_cispo+pass_at_k"], logs["cispo+pass_at_k"]
    for u, b in zip(user, builtin, strict=True):
        assert set(u) <= set(b), set(u) - set(b)
    # Step 1 runs both losses on the same weights and rollouts: its metrics are compared
    # exactly (the gradient norms to rounding). Its gradients already differ in the last
    # bits (GRAD_NORMS), so from step 2 on the weights do too (the final ones agree within
    # USER_LOSS_ATOL, below) and so may every metric: once the sampler drew other tokens (one
    # key per sample and token), step 2's loss differed by 1.2e-7 (2.2828e-4 vs 2.2817e-4, a
    # difference of terms of 3e-2). Later steps are checked as every run is above (finite,
    # moving, clipping), and the weights below.
    u, b = user[0], builtin[0]
    exact = {k: v for k, v in u.items() if k not in GRAD_NORMS}
    assert exact == {k: b[k] for k in exact}
    for k in GRAD_NORMS:
        assert abs(u[k] - b[k]) <= GRAD_NORM_RTOL * abs(b[k]), (k, u[k], b[k])
    for k, v in weights["cispo+pass_at_k"].items():
        np.testing.assert_allclose(
            weights["user_cispo+pass_at_k"][k], v, rtol=0, atol=USER_LOSS_ATOL, err_msg=k
        )


# ----------------------------------------------------------------------------------------
# DeepSeek-V3.2's options through the driver's trainer (no sampling: a made batch)
# ----------------------------------------------------------------------------------------

# Two groups of G = 4, rewards with known GRPO advantage signs: group 0 + - - -, group 1
# - + + -. The sampler's logprobs sit one nat above the trainer's on the FAR rows.
REWARDS = [[1.0, 0.0, 0.0, 0.0], [0.0, 1.0, 1.0, 0.0]]
FAR = np.array([True, True, False, True, True, True, False, False])
DROPPED = [1, 3, 4]  # A < 0 and far


def _trainer(model_dir, *overrides):
    """(`GRPOTrainer`, mesh) from `load_config` (the run's config path), 1-layer model."""
    cfg = load_config(
        None,
        [
            f"model.source={model_dir}",
            "rollout.prompts_per_step=2",
            "rollout.max_new_tokens=5",
            "grpo.group_size=4",
            *overrides,
        ],
    )
    mesh = build_mesh(cfg)
    return make_trainer(cfg, build_model(cfg, mesh=mesh)[0], mesh), mesh


def _driver_batch(trainer, mesh, sampler_offset_n=None):
    """The driver's batch (`assemble_batch`) of `REWARDS`' two groups with random
    completions, the sampler's logprobs the trainer's own plus `sampler_offset_n` per row,
    and the trainer-side (policy, ref) logprobs the loop passes to `update`."""
    rng = np.random.default_rng(0)
    groups = [
        Group(
            prompt_ids=[int(x) for x in rng.integers(4, 40, size=3 + i)],
            lengths_g=np.array([5, 3, 4, 5], np.int32),
            eos_g=np.array([False, True, True, False]),
            total_g=np.asarray(r, np.float32),
            valid_g=np.ones(4, bool),
            per_fn={"f": np.asarray(r, np.float32)},
        )
        for i, r in enumerate(REWARDS)
    ]
    tokens = rng.integers(4, 40, size=(8, 5)).astype(np.int32)

    def batch_of(sampler_logp):
        host = RowArrays(tokens, np.asarray(sampler_logp, np.float32), np.zeros_like(tokens))
        rows = put_global(host, jax.tree.map(lambda x: batch_sharding(mesh, 2, x.shape), host))
        return assemble_batch(groups, rows, pad_id=0, mesh=mesh)

    own = np.asarray(trainer.logprobs(batch_of(np.zeros(tokens.shape)))[0])
    offset = np.zeros(8) if sampler_offset_n is None else sampler_offset_n
    batch = batch_of(own + offset[:, None])
    logp, _, ref_logp = trainer.logprobs(batch)
    return batch, logp, ref_logp


def test_off_policy_masking_and_is_corrected_kl_reach_the_step(small_model_dir):
    """`grpo.off_policy_delta` and `grpo.kl_is_corrected` set in the run's config act in the
    step the driver's trainer runs, on the driver's batch (`assemble_batch` of made groups,
    the trainer-side logprobs the loop passes). The sampler's logprobs are the trainer's
    own plus one nat on `FAR` rows, so the rows with A < 0 among them (> delta = 0.5) leave
    the loss: `kept_seq_frac` = 5/8 (the trainer hands the step the sampler's logprobs).
    The KL term is the IS-corrected one (`grpojax.ops.kl_is_corrected` is what the step
    traces; its values are checked in tests/test_train_grpo.py)."""
    on = ["grpo.off_policy_delta=0.5", "grpo.kl_is_corrected=true"]
    trainer, mesh = _trainer(small_model_dir, *on)
    assert trainer.step_config.off_policy_delta == 0.5 and trainer.step_config.kl_is_corrected
    assert trainer.step_config.uses_reference  # the preset's beta: a KL term to correct
    batch, logp, ref_logp = _driver_batch(trainer, mesh, np.where(FAR, 1.0, 0.0))
    traced = []

    def spy(*args, **kwargs):
        traced.append(1)
        return kl_is_corrected(*args, **kwargs)

    with mock.patch.object(grpo_loss_mod, "kl_is_corrected", spy):
        metrics = {k: float(v) for k, v in trainer.update(batch, logp, ref_logp).items()}
    assert traced, "the step did not use the IS-corrected KL"
    assert metrics["kept_seq_frac"] == (8 - len(DROPPED)) / 8
    # The reference is the initial policy: the KL is 0 at this first step (to the rounding
    # of two float32 forwards of the same weights, k3 ~ d^2 / 2 for |d| <~ 1e-6).
    assert metrics["skipped"] == 0 and 0.0 <= metrics["kl_ref"] <= 1e-9


def test_plain_reinforce_pp_is_the_algo_the_step_runs(small_model_dir):
    """`algo=reinforce_pp_plain` reaches the step: on the driver's batch, with the reference
    moved off the policy (so the reward's KL is not 0), the first loss is the NumPy loss
    of REINFORCE++'s advantages (the paper's A_t = r - beta sum_{i >= t} KL_i, k1 of the
    trainer-side logprobs the loop passes, whitened over the batch's real tokens): at
    ratio 1 the PPO surrogate is -A_t, aggregated seq-mean-token-mean."""
    trainer, mesh = _trainer(small_model_dir, "algo=reinforce_pp_plain")
    g = trainer.step_config
    assert (g.advantage_estimator, g.beta, g.kl_estimator) == ("reinforce_pp_plain", 0.0, "k1")
    assert g.reward_kl_coef == 0.01 and g.aggregation == "seq-mean-token-mean"
    state = trainer.state
    trainer.state = state.replace(ref_params=jax.tree.map(lambda p: p * 1.5, state.ref_params))
    batch, logp, ref_logp = _driver_batch(trainer, mesh)
    metrics = {k: float(v) for k, v in trainer.update(batch, logp, ref_logp).items()}
    mask = np.asarray(batch.completion_mask_nt)
    old, ref = np.asarray(logp, np.float64), np.asarray(ref_logp, np.float64)
    kl = np.where(mask, old - ref, 0.0)
    assert np.abs(kl[mask]).max() > 0.05  # the reference moved: the penalty acts
    tail = np.cumsum(kl[:, ::-1], axis=1)[:, ::-1]
    rewards = np.asarray(REWARDS, np.float64).reshape(-1, 1)
    a = np.where(mask, rewards - g.reward_kl_coef * tail, 0.0)
    adv = np.where(mask, (a - a[mask].mean()) / np.sqrt(a[mask].var() + 1e-8), 0.0)
    expected = np.mean((-adv * mask).sum(1) / mask.sum(1))
    # The step's forward and the trainer-side pass round differently (ratio 1 to ~1e-6);
    # float32 whitening against float64: 1e-5 relative.
    np.testing.assert_allclose(metrics["first_loss"], expected, rtol=1e-5, atol=1e-6)
    assert metrics["skipped"] == 0
