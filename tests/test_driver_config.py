"""RunConfig: YAML + overrides through OmegaConf, algo presets, clear errors, round trips."""

from __future__ import annotations

import dataclasses
import json
import textwrap

import pytest

from grpojax.config import (
    ALGOS,
    ConfigError,
    RunConfig,
    algo_grpo_config,
    config_to_dict,
    load_config,
    save_config,
)
from grpojax.jobs.main_job import config_diff
from grpojax.sampling import SamplingConfig
from grpojax.train.config import GRPOConfig, PPOConfig, grpo_preset
from grpojax.train.state import OptimizerConfig


def _write(tmp_path, text: str, name: str = "cfg.yaml"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def test_defaults():
    cfg = load_config()
    assert cfg == RunConfig()
    assert cfg.algo == "grpo" and isinstance(cfg.grpo, GRPOConfig)
    assert cfg.grpo == GRPOConfig(share_prompt=True)
    assert cfg.step_config is cfg.grpo and not cfg.use_dynamic_sampling


def test_yaml_then_overrides(tmp_path):
    path = _write(
        tmp_path,
        """
        seed: 3
        total_steps: 20
        grpo:
          beta: 0.1
          group_size: 4
          use_keep_mask: true
        rewards:
          names: [numeric_answer, format]
          weights: [1.0, 0.25]
        sampling:
          top_p: 0.9
        checkpoint:
          dir: /tmp/ckpt
        """,
    )
    cfg = load_config(path, ["seed=5", "grpo.clip_high=0.3", "optimizer.learning_rate=2e-5"])
    assert cfg.seed == 5  # the override wins over the file
    assert cfg.total_steps == 20
    assert cfg.grpo.beta == 0.1 and cfg.grpo.group_size == 4 and cfg.grpo.clip_high == 0.3
    assert cfg.grpo.clip_low == 0.2  # untouched fields keep their defaults
    assert cfg.rewards.names == ("numeric_answer", "format")
    assert cfg.rewards.weights == (1.0, 0.25)
    assert cfg.sampling == SamplingConfig(top_p=0.9)
    assert cfg.optimizer == OptimizerConfig(learning_rate=2e-5)
    assert cfg.checkpoint.dir == "/tmp/ckpt"
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.seed = 1


def test_algo_presets_under_loaded_values(tmp_path):
    dapo = load_config(overrides=["algo=dapo"])
    assert dapo.grpo.clip_high == 0.28 and dapo.grpo.aggregation == "token-mean"
    assert dapo.grpo.beta == 0.0 and dapo.use_dynamic_sampling
    # The file's values apply on top of the preset; the preset fills the rest.
    path = _write(tmp_path, "algo: dapo\ngrpo:\n  clip_high: 0.3\n")
    cfg = load_config(path)
    assert cfg.grpo.clip_high == 0.3 and cfg.grpo.aggregation == "token-mean"
    assert load_config(path, ["rollout.dynamic_sampling=false"]).use_dynamic_sampling is False
    assert load_config(overrides=["algo=gspo"]).grpo.ratio_level == "sequence"
    assert load_config(overrides=["algo=rloo"]).grpo.advantage_estimator == "rloo"
    assert load_config(overrides=["algo=reinforce_pp"]).grpo.advantage_estimator == "reinforce_pp"
    # Plain REINFORCE++: no baseline, the KL to the reference in the reward, not the loss.
    plain = load_config(overrides=["algo=reinforce_pp_plain"]).grpo
    assert plain.advantage_estimator == "reinforce_pp_plain" and plain.uses_reference
    assert (plain.beta, plain.reward_kl_coef, plain.kl_estimator) == (0.0, 0.01, "k1")
    assert plain == grpo_preset("reinforce_pp_plain", share_prompt=True)
    # ... or the estimator alone on another preset, and the baseline variant's KL moved too.
    est = load_config(overrides=["grpo.advantage_estimator=reinforce_pp_plain"]).grpo
    assert est.advantage_estimator == "reinforce_pp_plain" and est.reward_kl_coef == 0.0
    base = load_config(overrides=["algo=reinforce_pp", "grpo.reward_kl_coef=0.05"]).grpo
    assert base.reward_kl_coef == 0.05 and base.advantage_estimator == "reinforce_pp"
    ppo = load_config(overrides=["algo=ppo", "ppo.gamma=0.99"])
    assert ppo.is_ppo and isinstance(ppo.step_config, PPOConfig) and ppo.ppo.gamma == 0.99
    for algo in ALGOS:
        teacher = ["distill.teacher=/models/teacher"] if algo == "distill" else []
        assert load_config(overrides=[f"algo={algo}", *teacher]).grpo == algo_grpo_config(algo)


def test_cosine_schedule_length_follows_the_run():
    """optimizer.total_steps unset with a cosine schedule: the trainer's schedule spans the
    run's optimizer updates (RL steps x epochs x mini-batches), so `total_steps=...` alone
    resizes it; an explicit length is kept."""
    cfg = load_config(
        overrides=["optimizer.schedule=cosine", "total_steps=30", "grpo.num_minibatches=2"]
    )
    assert cfg.optimizer.total_steps is None and cfg.optimizer_for().total_steps == 60
    cfg = load_config(overrides=["optimizer.schedule=cosine", "optimizer.total_steps=7"])
    assert cfg.optimizer_for().total_steps == 7
    cfg = load_config(overrides=["algo=ppo", "optimizer.schedule=cosine", "total_steps=5"])
    updates = 5 * cfg.ppo.num_epochs * cfg.ppo.num_minibatches
    assert cfg.optimizer_for("critic_optimizer").total_steps == updates


def test_optimizer_decay_mask_defaults_to_the_hugging_face_rule_and_loads():
    """`optimizer.decay_mask` is a field of the optimizer section (OptimizerConfig): the
    default is the HF Trainer's rule; a YAML value or an override reaches the trainer's
    optimizer config (`optimizer_for`), the critic's section has its own."""
    assert load_config().optimizer.decay_mask == "except_bias_norm"
    cfg = load_config(overrides=["optimizer.weight_decay=0.1", "optimizer.decay_mask=all"])
    assert cfg.optimizer_for().decay_mask == "all" and cfg.optimizer_for().weight_decay == 0.1
    ppo = load_config(overrides=["algo=ppo", "critic_optimizer.decay_mask=all"])
    assert ppo.optimizer_for("critic_optimizer").decay_mask == "all"
    assert ppo.optimizer_for().decay_mask == "except_bias_norm"


def test_optional_sections():
    cfg = load_config(overrides=["critic_optimizer.learning_rate=1e-5", "data.template='{q} ='"])
    assert cfg.critic_optimizer == OptimizerConfig(learning_rate=1e-5)
    assert cfg.data.template == "{q} ="
    assert (
        load_config(overrides=["grpo.dual_clip=3", "grpo.ref_refresh_every=null"]).grpo.dual_clip
        == 3.0
    )


@pytest.mark.parametrize(
    ("overrides", "pattern"),
    [
        # unknown key: names the path, suggests, lists the allowed keys
        (["grpo.clip_lo=0.1"], r"unknown config key 'grpo\.clip_lo'.*clip_low.*allowed keys"),
        (["nosuch.x=1"], r"unknown config key 'nosuch'.*allowed keys: \['algo', 'seed'"),
        # wrong type
        (["grpo.clip_low=abc"], r"invalid value for 'grpo\.clip_low'.*\(expected float\)"),
        (["seed=1.5"], r"invalid value for 'seed'.*\(expected int\)"),
        (["rollout.max_new_tokens=[1]"], r"'rollout\.max_new_tokens'"),
        # out of range, in a sub-config validated by its own module
        (["grpo.clip_low=-1"], r"^grpo\.clip_low must be a finite number >= 0, got -1\.0$"),
        (["optimizer.learning_rate=0"], r"^optimizer\.learning_rate must be a finite number > 0"),
        (
            ["optimizer.decay_mask=no_bias"],
            r"^optimizer\.decay_mask must be one of \('except_bias_norm', 'all'\) or "
            r"'package\.module:function', got 'no_bias'$",
        ),
        (
            ["critic_optimizer.decay_mask=nosuchmodule_xyz:mask"],
            r"^critic_optimizer\.decay_mask: cannot import module 'nosuchmodule_xyz'",
        ),
        (["sampling.top_p=0"], r"^sampling\.top_p must be a finite number > 0 and <= 1, got 0\.0$"),
        (["seed=-1"], r"^seed must be an int >= 0, got -1$"),
        (["mesh.fsdp=0"], r"^mesh\.fsdp must be an int >= 1 or -1"),
        # unknown choice: lists the allowed values
        (["algo=trpo"], r"algo must be one of \('grpo', 'dr_grpo', 'dapo', 'gspo', 'rloo'"),
        (["grpo.kl_estimator=k9"], r"^grpo\.kl_estimator must be one of \('k1', 'k2', 'k3'"),
        (
            ["grpo.reward_kl_coef=0.1"],
            r"^grpo\.reward_kl_coef > 0 puts the KL in per-token rewards: advantage_estimator "
            r"must take them .*got 'grpo'$",
        ),
        (
            ["algo=reinforce_pp_plain", "grpo.kl_estimator=full"],
            r"^grpo\.kl_estimator must be a per-token estimator .* with reward_kl_coef > 0",
        ),
        (["grpo.reward_kl_coef=-1"], r"^grpo\.reward_kl_coef must be a finite number >= 0"),
        (
            ["algo=ppo", "ppo.kl_estimator=exact"],
            r"^ppo\.kl_estimator must be one of \('k1', 'k2', 'k3', 'abs', 'full'\), got 'exact'$",
        ),
        (["model.dtype=float16"], r"^model\.dtype must be one of \('float32', 'bfloat16'\)"),
        (["data.name=add99"], r"^data\.name must be one of \("),
        (["rewards.names=[nope]"], r"^rewards\.names: unknown reward 'nope'; allowed: \("),
        # pluggable objectives: a built-in name or an importable "package.module:function"
        (["grpo.policy_loss=cispoo"], r"^grpo\.policy_loss must be one of \('ppo_clip', "),
        (
            ["grpo.policy_loss=no_such_module_xyz:loss"],
            r"^grpo\.policy_loss: cannot import module 'no_such_module_xyz'",
        ),
        (
            ["grpo.advantage_estimator=os.path:join"],
            r"^grpo\.advantage_estimator: 'os\.path:join' must be a function fn\(rewards_n, ",
        ),
        (
            ["grpo.rollout_correction_mode=tis"],
            r"^grpo\.rollout_correction_mode must be one of \('truncate', 'mask', 'icepop'\)",
        ),
        # deeper nesting and cross-field checks
        (["ppo.forward.chunk_size=0"], r"^ppo\.forward\.chunk_size must be an int >= 1, got 0$"),
        (["rollout.decode_loops=0"], r"^rollout\.decode_loops must be an int >= 1, got 0$"),
        (
            ["rollout.engine=paged"],
            r"^rollout\.engine must be one of \['auto', 'static', 'continuous', 'compact', "
            r"'vllm'\], got 'paged'$",
        ),
        (["rollout.slots=0"], r"^rollout\.slots must be an int >= 1, got 0$"),
        (["sft.step.forward.temperature=0.5"], r"^sft\.step: SFT trains"),
        (
            ["rewards.weights=[1,2]"],
            r"^rewards\.weights must have one entry per reward: 1 for names then 0",
        ),
        (["sampling.temperature=0.7"], r"grpo\.forward\.temperature \(1\.0\) must equal sampling"),
        (["sampling.top_k=5"], r"^grpo\.use_keep_mask must be true when sampling truncates"),
        (["sampling.min_p=0.1", "algo=ppo"], r"^sampling\.top_k/top_p/min_p: algo 'ppo'"),
        (["grpo.num_minibatches=3"], r"64 completions per step must be divisible by grpo\."),
        (
            ["grpo.num_minibatches=16"],
            r"^rollout\.prompts_per_step \(8\) must be divisible by grpo\.num_minibatches \* "
            r"grpo\.num_microbatches = 16 with grpo\.share_prompt=true",
        ),
        (
            ["algo=ppo", "ppo.num_minibatches=16"],
            r"^rollout\.prompts_per_step \(8\) must be divisible by ppo\.num_minibatches \* "
            r"ppo\.num_microbatches = 16 with ppo\.share_prompt=true",
        ),
        (["algo=ppo", "ppo.group_size=3"], r"^ppo\.group_size \(3\) is G, taken from grpo"),
        (["data.kind=file"], r"^data\.path is required for kind='file'"),
        (
            ["optimizer.schedule=cosine", "optimizer.warmup_steps=10", "total_steps=4"],
            r"^optimizer\.warmup_steps \(10\) must be below the run's 4 optimizer updates",
        ),
        # a choice given as off/no (a YAML boolean, made text by OmegaConf): said so
        (
            ["model.routing_replay=off"],
            r"^model\.routing_replay must be one of \('none', 'rollout'\), got 'False' "
            r"\(YAML reads an unquoted off, no, on or yes as a boolean\)$",
        ),
        # malformed overrides
        (["seed"], r"override 'seed' must look like key=value"),
        (["data.template={q} ="], r"cannot parse override 'data\.template=\{q\} =' .*quote"),
    ],
)
def test_invalid_values_are_one_clear_error(overrides, pattern):
    with pytest.raises(ConfigError, match=pattern) as info:
        load_config(overrides=overrides)
    assert isinstance(info.value, ValueError)
    assert "\n" not in str(info.value)  # one message, not a traceback dump
    assert info.value.__cause__ is None


def test_yaml_errors(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "missing.yaml")
    with pytest.raises(ConfigError, match="must hold a mapping"):
        load_config(_write(tmp_path, "- a\n- b\n"))
    with pytest.raises(ConfigError, match="cannot parse config file"):
        load_config(_write(tmp_path, "grpo: [unclosed\n"))
    with pytest.raises(ConfigError, match=r"unknown config key 'grpo\.betta'"):
        load_config(_write(tmp_path, "grpo:\n  betta: 0.1\n"))
    with pytest.raises(ConfigError, match=r"^checkpoint\.every must be an int >= 1, got 0$"):
        load_config(_write(tmp_path, "checkpoint:\n  every: 0\n"))


def test_objective_and_rollout_correction_fields_load():
    cfg = load_config(
        None,
        [
            "grpo.policy_loss=cispo",
            "grpo.clip_low=1.0",
            "grpo.clip_high=0.28",
            "grpo.advantage_estimator=pass_at_k",
            "grpo.pass_at_k=4",
            "grpo.rollout_correction_mode=mask",
            "grpo.rollout_correction_level=sequence",
            "grpo.rollout_correction_high=3",
            "grpo.kl_estimator=full",
        ],
    )
    g = cfg.grpo
    assert (g.policy_loss, g.clip_low, g.clip_high) == ("cispo", 1.0, 0.28)
    assert (g.advantage_estimator, g.pass_at_k) == ("pass_at_k", 4)
    assert (g.rollout_correction_mode, g.rollout_correction_level) == ("mask", "sequence")
    assert g.rollout_correction_high == 3.0 and g.rollout_correction_low is None
    assert g.kl_estimator == "full" and g.uses_sampler_logp
    # A user's function by path: the module is imported when the config is built.
    cfg = load_config(None, ["grpo.policy_loss=custom_objectives:vanilla_pg"])
    assert cfg.grpo.policy_loss == "custom_objectives:vanilla_pg"


@pytest.mark.parametrize(
    "overrides",
    [
        [],
        ["algo=dapo", "grpo.clip_high=0.3", "rollout.dynamic_sampling=true"],
        ["optimizer.weight_decay=0.1", "optimizer.decay_mask=all"],
        ["algo=reinforce_pp_plain", "grpo.reward_kl_coef=0.02"],
        ["optimizer.decay_mask=custom_objectives:no_embedding_decay"],
        [
            "grpo.policy_loss=dppo",
            "grpo.dppo_divergence=kl",
            "grpo.dppo_delta=0.01",
            "grpo.advantage_estimator=gpg",
            "grpo.gpg_f_norm=2.0",
            "grpo.rollout_correction_mode=icepop",
            "grpo.rollout_correction_low=0.4",
        ],
        [
            "algo=ppo",
            "ppo.kl_target=6.0",
            "critic_optimizer.learning_rate=1e-5",
            "rewards.names=[math_answer,format]",
            "rewards.weights=[1.0,0.1]",
            "data.kind=file",
            "data.path=/data/train.jsonl",
            "data.template='Q: {question}\\nA:'",
            "sampling.temperature=0.7",
            "ppo.forward.temperature=0.7",
            "grpo.forward.temperature=0.7",
            "log.wandb=true",
            "model.source=/models/qwen",
            "model.dtype=bfloat16",
        ],
    ],
)
def test_save_load_round_trip(tmp_path, overrides):
    cfg = load_config(overrides=overrides)
    path = save_config(cfg, tmp_path / "run" / "config.yaml")
    assert load_config(path) == cfg
    # The dict form is plain JSON (for checkpoints and W&B) and holds every section.
    as_dict = config_to_dict(cfg)
    assert json.loads(json.dumps(as_dict)) == as_dict
    assert set(as_dict) == {f.name for f in dataclasses.fields(RunConfig)}


def test_direct_construction_validates():
    with pytest.raises(ValueError, match="total_steps must be an int >= 1"):
        RunConfig(total_steps=0)
    with pytest.raises(ValueError, match="expected a RunConfig"):
        save_config({"seed": 1}, "x.yaml")


def test_budget_following_fields_come_from_max_new_tokens():
    """DAPO's overlong lengths follow rollout.max_new_tokens (L_max = T, L_cache = T // 5)
    unless the run sets them; Dr.GRPO's norm_constant stays None, which the step reads as
    the batch's completion width T (= max_new_tokens)."""
    dapo = load_config(overrides=["algo=dapo", "rollout.max_new_tokens=32"])
    assert (dapo.grpo.overlong_max_len, dapo.grpo.overlong_buffer) == (32, 6)
    assert load_config(overrides=["algo=dapo"]).grpo.overlong_max_len == 32  # the default T
    set_by_run = load_config(
        overrides=["algo=dapo", "rollout.max_new_tokens=4096", "grpo.overlong_buffer=512"]
    )
    assert (set_by_run.grpo.overlong_max_len, set_by_run.grpo.overlong_buffer) == (4096, 512)
    assert load_config(overrides=["algo=dr_grpo"]).grpo.norm_constant is None
    # What a YAML file needs to say to give the run back: the budget, not the lengths.
    long_dapo = load_config(overrides=["algo=dapo", "rollout.max_new_tokens=4096"])
    assert long_dapo.grpo.overlong_max_len == 4096
    assert config_diff(long_dapo) == {"rollout": {"max_new_tokens": 4096}}
    with pytest.raises(ValueError, match=r"grpo_preset\('dapo'\) needs max_new_tokens"):
        grpo_preset("dapo")
    assert grpo_preset("dapo", max_new_tokens=100).overlong_buffer == 20
    assert grpo_preset("dapo", overlong_max_len=None).overlong_max_len is None


def test_user_functions_are_imported_once_and_derived_values_leave_the_config_as_given():
    """Every "package.module:attr" a config names is imported when the config is built and
    carried as the object itself; the values a run derives (N, the engine, the step's
    config) are derived without rewriting the frozen sections."""
    import custom_envs
    import custom_objectives

    from grpojax.envs.builtin import GuessNumberEnv
    from grpojax.sampling.continuous import auto_episode_engine
    from grpojax.train.objectives import POLICY_LOSSES

    cfg = load_config(
        None,
        [
            "grpo.policy_loss=custom_objectives:vanilla_pg",
            "grpo.advantage_estimator=custom_objectives:sign_advantages",
            "rewards.functions=[custom_objectives:odd_code_sum]",
            "rollout.prompts_per_step=3",
            "grpo.group_size=4",
            "rollout.max_staleness=1",
        ],
    )
    assert cfg.grpo.policy_loss_fn is custom_objectives.vanilla_pg
    assert cfg.grpo.advantage_estimator_fn is custom_objectives.sign_advantages
    assert cfg.rewards.resolved_functions == (custom_objectives.odd_code_sum,)
    assert cfg.samples_per_step == 12 and cfg.batch_inputs == ()
    assert cfg.rollout_engine == "static"  # auto at T 32
    # Staleness's correction is the step's; the section keeps what was given (None).
    assert cfg.grpo.rollout_correction_mode is None
    assert cfg.step_config.rollout_correction_mode == "truncate"
    default = load_config(None, []).grpo
    assert default.policy_loss_fn is POLICY_LOSSES[default.policy_loss]
    env = load_config(None, ["env.name=custom_envs:ShortTurnsEnv", "rollout.max_new_tokens=16"])
    assert env.env.environment_class is custom_envs.ShortTurnsEnv
    assert env.rollout_engine == auto_episode_engine(16)
    builtin = load_config(None, ["env.name=guess_number", "data.kind=env"])
    assert builtin.env.environment_class is GuessNumberEnv
    assert load_config(None, []).env.environment_class is None


def test_auto_engine_choices_and_episodes_on_the_compacting_engine():
    """`rollout.engine=auto`: static below 256 completion tokens; from 256 the compacting
    engine on a CPU, the continuous one on an accelerator; multi-turn episodes on a CPU the
    slot loop. Episodes take the compacting engine (the lock step, ended rows dropped)."""
    from grpojax.sampling.continuous import auto_engine, auto_episode_engine

    assert [auto_engine(t, "cpu") for t in (4, 255, 256)] == ["static", "static", "compact"]
    assert [auto_engine(t, "gpu") for t in (4, 256)] == ["static", "continuous"]
    assert auto_episode_engine(512, "cpu") == "continuous"
    cfg = load_config(None, ["rollout.max_new_tokens=256"])
    assert cfg.rollout_engine == auto_engine(256)  # this backend's: the CPU's in the suite
    episodes = ["env.name=guess_number", "data.kind=env"]
    assert load_config(None, ["rollout.engine=compact", *episodes]).rollout_engine == "compact"


def test_the_vllm_engine_section_and_what_it_refuses():
    """`rollout.engine=vllm`: its Python required, the GRPO step's rollout correction on by
    default (`rollout.vllm.correction`; a given mode wins; PPO's step too), the built-in
    engine for what vLLM does not run, and one line for what it cannot combine with yet."""
    base = ["rollout.engine=vllm", "rollout.vllm.python=/opt/vllm/bin/python"]
    cfg = load_config(None, base)
    assert cfg.rollout_engine == "vllm" and cfg.vllm_probe_tol == 1e-2
    assert cfg.step_config.rollout_correction_mode == "truncate"
    assert cfg.rollout.engine_kwargs()["engine"] in ("static", "continuous", "compact")
    assert (
        load_config(
            None, [*base, "rollout.vllm.correction=none"]
        ).step_config.rollout_correction_mode
        is None
    )
    given = load_config(None, [*base, "grpo.rollout_correction_mode=mask"])
    assert given.step_config.rollout_correction_mode == "mask"
    assert load_config(None, [*base, "rollout.vllm.dtype=bfloat16"]).vllm_probe_tol == 5e-2
    assert load_config(None, [*base, "model.dtype=bfloat16"]).vllm_probe_tol == 5e-2
    ppo = load_config(None, [*base, "algo=ppo"]).step_config
    assert ppo.group_size == cfg.group_size and ppo.rollout_correction_mode == "truncate"
    ppo = load_config(None, [*base, "algo=ppo", "ppo.rollout_correction_mode=icepop"])
    assert ppo.step_config.rollout_correction_mode == "icepop"
    assert load_config(None, ["algo=ppo"]).step_config.rollout_correction_mode is None
    assert load_config(None, ["rollout.vllm.python=/x"]).step_config.rollout_correction_mode is None
    stale = load_config(None, [*base, "rollout.max_staleness=1"])  # rounds decoded ahead
    episodes = load_config(None, [*base, "env.name=guess_number", "data.kind=env"])
    assert episodes.rollout_engine == "vllm"
    assert stale.step_config.rollout_correction_mode == "truncate"
    for extra, match in [
        ([], r"^rollout.engine 'vllm' needs rollout.vllm.python"),
        (["rollout.max_staleness=1", "mesh.rollout_devices=1"], r"with mesh.rollout_devices=1"),
        (["grpo.use_keep_mask=true"], r"not supported with grpo.use_keep_mask"),
        (["rollout.vllm.dtype=fp8"], r"^rollout.vllm.dtype must be one of"),
        (["rollout.vllm.correction=off"], r"^rollout.vllm.correction must be one of"),
    ]:
        over = ["rollout.engine=vllm"] if not extra else [*base, *extra]
        with pytest.raises(ConfigError, match=match):
            load_config(None, over)


def test_truncated_sampling_with_vllm_trains_through_the_correction():
    """`sampling.top_p/top_k/min_p` with `rollout.engine=vllm`: the step's policy stays the
    full one (no keep mask) and the rollout correction weighs vLLM's truncated logprobs, for
    the GRPO family and PPO; refused in one line where nothing would correct them (no
    correction) and, as before, the keep mask with vLLM; the built-in engines still need the
    keep mask (GRPO family) and refuse PPO."""
    base = ["rollout.engine=vllm", "rollout.vllm.python=/opt/vllm/bin/python"]
    for trunc in ("sampling.top_p=0.9", "sampling.top_k=20", "sampling.min_p=0.05"):
        for algo, extra in [
            ("grpo", []),
            ("dapo", []),
            ("gspo", []),  # a per-sequence loss: the correction at sequence level
            ("ppo", []),
            ("grpo", ["grpo.rollout_correction_mode=icepop", "rollout.vllm.correction=none"]),
            ("grpo", ["rollout.max_staleness=1"]),
        ]:
            cfg = load_config(None, [*base, trunc, f"algo={algo}", *extra])
            step = cfg.step_config
            assert cfg.sampling.truncates and step.rollout_correction_mode is not None
            if algo != "ppo":
                assert not step.use_keep_mask
    cases = [
        (
            ["rollout.vllm.correction=none"],
            r"^sampling\.top_k/top_p/min_p with rollout\.engine=vllm need the rollout "
            r"correction: .*or grpo\.rollout_correction_mode$",
        ),
        (
            ["rollout.vllm.correction=none", "algo=ppo"],
            r"^sampling\.top_k/top_p/min_p with rollout\.engine=vllm need .*"
            r"or ppo\.rollout_correction_mode$",
        ),
        (["grpo.use_keep_mask=true"], r"not supported with grpo\.use_keep_mask \(vLLM reports"),
    ]
    for extra, match in cases:
        with pytest.raises(ConfigError, match=match) as info:
            load_config(None, [*base, "sampling.top_p=0.9", *extra])
        assert "\n" not in str(info.value)
    # Greedy sampling does not truncate: nothing to correct.
    greedy = ["sampling.temperature=0", "sampling.top_p=0.9", "rollout.vllm.correction=none"]
    assert load_config(None, [*base, *greedy]).step_config.rollout_correction_mode is None
    # The built-in engines: the keep mask, exactly, and no PPO.
    assert load_config(None, ["sampling.top_p=0.9", "grpo.use_keep_mask=true"]).grpo.use_keep_mask
    with pytest.raises(ConfigError, match=r"^grpo\.use_keep_mask must be true"):
        load_config(None, ["sampling.top_p=0.9"])
    with pytest.raises(ConfigError, match=r"or rollout\.engine=vllm with its correction$"):
        load_config(None, ["sampling.top_p=0.9", "algo=ppo"])
