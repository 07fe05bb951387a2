"""`grpojax train` with an environment (`env.name`): multi-turn episodes through the driver.

Against independent constructions: the step's rows are the episodes' own ids with the loss
on the policy's ids only (each `Episode`'s segments), each row's reward is its episode's
return; the sampler's logprobs equal the trainer's across turns; SFT demonstrations train
on the expert's ids only; a run stopped and resumed equals the uninterrupted run bit for
bit; and the combinations a multi-turn run cannot take are refused by name.
"""

import json
import signal

import jax
import numpy as np
import pytest
from env_fixtures import chatml_tokenizer

from grpojax.config import ConfigError, load_config
from grpojax.data import pad_id_of, stop_ids_of
from grpojax.distributed import KILL_AT_ENV
from grpojax.driver.checkpoint import Checkpointer, host_copy, saved_steps
from grpojax.driver.loop import train
from grpojax.driver.setup import (
    build_datasets,
    build_episode_runner,
    build_mesh,
    build_model,
    build_tokenizer,
    prompt_source,
)
from grpojax.driver.sft import episode_demonstration_batch
from grpojax.driver.trainer import checkpoint_target, make_trainer
from grpojax.envs.registry import environment_rows, is_heldout
from grpojax.errors import UserError
from grpojax.jobs.evaluate import evaluate_run
from grpojax.jobs.sft import sft_job
from grpojax.rollouts.episodes import EpisodeSampler, episode_return
from grpojax.train.rows import assemble_batch

ENV = "custom_envs:ShortTurnsEnv"
AGENT = "agent:custom_envs:chain_agent"


def _overrides(model_dir, run_dir, **extra):
    base = {
        "model.source": str(model_dir),
        "log.run_dir": str(run_dir),
        "log.progress": "false",
        "log.tensorboard": "false",
        "log.plot": "false",
        "log.export_hf": "false",
        "env.name": ENV,
        "env.max_turn_tokens": "4",
        "data.name": "chain3",
        "data.size": "200",
        "rollout.prompts_per_step": "2",
        "rollout.max_new_tokens": "16",
        "grpo.group_size": "4",
        "optimizer.learning_rate": "1e-3",
        "eval.heldout_size": "2",
        "eval.batch_size": "2",
        "eval.k": "2",
        "checkpoint.every": "1",
        "checkpoint.async_save": "false",
        "sft.steps": "0",
    }
    base.update({k: str(v) for k, v in extra.items()})
    return [f"{k}={v}" for k, v in base.items()]


def _quiet():
    return dict(show_progress=False, print_fn=lambda s: None)


def _train_rl(model_dir, run_dir, **extra):
    """`train` of `_overrides(model_dir, run_dir, **extra)`: (its result, the records of its
    RL steps in metrics.jsonl)."""
    result = train(load_config(None, _overrides(model_dir, run_dir, **extra)), **_quiet())
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return result, [r for r in records if "reward_mean" in r]


def test_a_round_lays_out_the_episodes_own_ids_with_the_loss_on_the_policy_ids(
    small_model_dir, tmp_path
):
    cfg = load_config(None, _overrides(small_model_dir, tmp_path / "run"))
    mesh = build_mesh(cfg)
    model, tokenizer = build_model(cfg, mesh=mesh)
    rows, _ = build_datasets(cfg, tokenizer)
    sampler = EpisodeSampler(cfg, tokenizer, prompt_source(cfg, rows, tokenizer), mesh)
    times = {"generate": 0.0, "reward": 0.0}
    key = jax.random.key(3)
    groups, row_arrays, _, _ = sampler.round(model, key, times)
    # The same episodes, played again from the same key (a round is a function of it).
    replay = EpisodeSampler(cfg, tokenizer, prompt_source(cfg, rows, tokenizer), mesh)
    replay.source.next_rows(2)
    _, episode_key = jax.random.split(
        jax.random.wrap_key_data(jax.random.key_data(key), impl=jax.random.key_impl(key))
    )
    _, episodes = replay.play(
        model, prompt_source(cfg, rows, tokenizer).next_rows(2), key=episode_key, group_size=4
    )
    assert max(e.num_turns for e in episodes) > 1, "the test needs multi-turn episodes"
    assert any(s.kind == "env" for e in episodes for s in e.segments)
    batch = assemble_batch(groups, row_arrays, pad_id=sampler.pad_id, mesh=mesh)
    t = cfg.rollout.max_new_tokens
    tokens = np.asarray(batch.tokens_ns)[:, -t:]
    cmask = np.asarray(batch.completion_mask_nt)
    for n, ep in enumerate(episodes):
        ids = ep.completion_ids()
        policy = np.concatenate(
            [np.full(len(s.ids), s.kind == "policy") for s in ep.segments] or [np.zeros(0, bool)]
        )
        np.testing.assert_array_equal(tokens[n, : len(ids)], ids)
        np.testing.assert_array_equal(cmask[n, : len(ids)], policy)
        assert not cmask[n, len(ids) :].any()
        lp = np.concatenate([s.logprobs for s in ep.segments if s.kind == "policy"])
        np.testing.assert_array_equal(np.asarray(batch.sampler_logp_nt)[n][cmask[n]], lp)
        # PPO's per-token rewards: each turn's at its end, the final one on the last policy id
        np.testing.assert_array_equal(
            np.asarray(batch.token_rewards_nt)[n, : len(ids)], ep.token_rewards()
        )
        g = groups[n // 4]
        assert g.total_g[n % 4] == np.float32(episode_return(ep))
        assert g.lengths_g[n % 4] == len(ids) and list(g.prompt_ids) == list(ep.prompt_ids)
    assert times["env/episodes"] == 8 and times["env/turns"] == sum(e.num_turns for e in episodes)
    # The sampler's row-steps: every turn runs all 8 rows until that turn's longest ends.
    turn_lengths = {}
    for e in episodes:
        for k, s in enumerate(x for x in e.segments if x.kind == "policy"):
            turn_lengths[k] = max(turn_lengths.get(k, 0), len(s.ids))
    assert times["decode_row_steps"] == 8 * sum(turn_lengths.values())
    assert 0 < times["decode_tokens"] <= times["decode_row_steps"]
    # rollout.engine=continuous (3 decode slots refilled as episodes end) and compact (lock
    # step, ended episodes' rows dropped): the same round.
    for engine in (
        {"rollout.engine": "continuous", "rollout.slots": 3},
        {"rollout.engine": "compact"},
    ):
        other_cfg = load_config(
            None, _overrides(small_model_dir, tmp_path / engine["rollout.engine"], **engine)
        )
        other = EpisodeSampler(
            other_cfg, tokenizer, prompt_source(other_cfg, rows, tokenizer), mesh
        )
        other_times = {"generate": 0.0, "reward": 0.0}
        other_groups, other_arrays, _, _ = other.round(model, key, other_times)
        np.testing.assert_array_equal(
            np.asarray(other_arrays.tokens_nt), np.asarray(row_arrays.tokens_nt)
        )
        np.testing.assert_array_equal(
            np.asarray(other_arrays.policy_mask_nt), np.asarray(row_arrays.policy_mask_nt)
        )
        np.testing.assert_allclose(
            np.asarray(other_arrays.logp_nt), np.asarray(row_arrays.logp_nt), atol=1e-5, rtol=0
        )
        for a, b in zip(other_groups, groups):
            np.testing.assert_array_equal(a.total_g, b.total_g)
        assert other_times["decode_tokens"] == times["decode_tokens"]
        assert other_times["decode_tokens"] <= other_times["decode_row_steps"]
        assert other_times["decode_row_steps"] <= times["decode_row_steps"], engine


def test_demonstrations_train_the_expert_ids_only(small_model_dir, tmp_path):
    cfg = load_config(None, _overrides(small_model_dir, tmp_path / "run", **{"sft.steps": 2}))
    _, tokenizer = build_model(cfg, mesh=build_mesh(cfg))
    rows, _ = build_datasets(cfg, tokenizer)
    batch = episode_demonstration_batch(tokenizer, rows[:3], cfg, pad_id=pad_id_of(tokenizer))
    seven = tokenizer.encode("7", add_special_tokens=False)
    ok = tokenizer.encode("\nok\n", add_special_tokens=False)
    for n in range(3):
        trained = np.asarray(batch.tokens_ns[n])[np.asarray(batch.loss_mask_ns[n], bool)]
        # three expert turns "7" (a stop string of the env: no EOS after it, as a sampled
        # turn ending there); the answers "ok" between them are context only
        assert trained.tolist() == seven * 3
        real = np.asarray(batch.tokens_ns[n])[np.asarray(batch.mask_ns[n], bool)]
        tail = [*seven, *ok, *seven, *ok, *seven]
        assert real[-len(tail) :].tolist() == tail


def test_an_agents_demonstrations_come_from_its_expert(small_model_dir, tmp_path):
    """`env.kwargs.expert=custom_envs:chain_expert`: the warm start's rows are the agent's
    own episodes with the expert's replies as the policy's ids (trained, EOS after each)
    and the agent's "ok" messages between them (context only)."""
    extra = {"env.name": AGENT, "env.kwargs.expert": "custom_envs:chain_expert"}
    cfg = load_config(None, _overrides(small_model_dir, tmp_path / "run", **extra))
    tokenizer = build_tokenizer(cfg)
    rows, _ = build_datasets(cfg, tokenizer)
    batch = episode_demonstration_batch(tokenizer, rows[:2], cfg, pad_id=pad_id_of(tokenizer))
    turn = [*tokenizer.encode("7", add_special_tokens=False), stop_ids_of(tokenizer)[0]]
    for n in range(2):
        trained = np.asarray(batch.tokens_ns[n])[np.asarray(batch.loss_mask_ns[n], bool)]
        assert trained.tolist() == turn * 3
        context = np.asarray(batch.mask_ns[n], bool) & ~np.asarray(batch.loss_mask_ns[n], bool)
        assert tokenizer.decode(np.asarray(batch.tokens_ns[n])[context]).count("ok") == 2


def test_env_run_logs_its_episodes(small_model_dir, tmp_path):
    """SFT on the demonstrations, then 2 RL steps: every step logs its episodes, and the
    sampler's logprobs equal the trainer's across turns; the held-out evaluation plays
    episodes. (Exact resume: `test_killed_mid_run_and_resumed_equals_uninterrupted`.)"""
    extra = {"total_steps": 2, "sft.steps": 2, "sft.batch_size": 4, "grpo.beta": 0.04}
    result, rl = _train_rl(small_model_dir, tmp_path / "a", **extra)
    assert result.steps == 2 and result.stopped_by is None
    assert len(rl) == 2
    for r in rl:
        assert r["env/episodes"] == 8 and r["env/turns"] >= 8
        assert 0.0 < r["decode_utilisation"] <= 1.0
        assert r["logprob_diff_max"] <= 1e-5, r["logprob_diff_max"]
        assert r["kl"] >= 0.0 and np.isfinite(r["loss"])
    assert {"tool_use", "turns", "pass@1"} <= set(result.eval_before)
    assert {"tool_use", "turns", "pass@1"} <= set(result.eval_after)
    # `grpojax eval` on the final checkpoint plays the same held-out episodes.
    again = evaluate_run(tmp_path / "a", show_progress=False)
    assert {k: again[k] for k in result.eval_after} == result.eval_after


def test_an_openai_client_agent_trains_through_the_endpoint(small_model_dir, tmp_path):
    """`env.name=agent:custom_envs:chain_agent` (an agent of the `openai` client alone): 2
    GRPO steps whose episodes are its calls, served by the endpoint; every turn's logprobs
    equal the trainer's, its requests are counted, the held-out evaluation plays it too."""
    import string

    stops = "[" + ",".join(string.ascii_letters) + "]"
    extra = {
        "total_steps": 2,
        "env.name": AGENT,
        "env.kwargs.stop_strings": stops,
    }
    result, rl = _train_rl(small_model_dir, tmp_path / "a", **extra)
    assert result.steps == 2 and result.stopped_by is None
    assert len(rl) == 2
    for r in rl:
        assert r["env/episodes"] == 8 and r["env/agent_requests"] >= 8, r
        assert r["env/history_mismatches"] == 0
        assert r["logprob_diff_max"] <= 1e-5, r["logprob_diff_max"]
    assert {"turns", "pass@1"} <= set(result.eval_after)


def test_an_environment_prompt_is_chat_rendered_once(tmp_path):
    """With `env.name` set, `data.chat_template` leaves the rows' `prompt` the template's
    text (an agent puts it in its own message, which the endpoint renders): wrapped here
    too, the model would see a chat turn inside a chat turn. Without an environment the
    rows are wrapped as before."""
    over = {"data.name": "add2", "data.template": "What is {question}?"}
    over["data.chat_template"] = "true"
    agent = load_config(None, _overrides("tiny", tmp_path / "a", **over, **{"env.name": AGENT}))
    plain = load_config(None, _overrides("tiny", tmp_path / "b", **over, **{"env.name": "null"}))
    tok = chatml_tokenizer()
    (row, *_), _ = build_datasets(agent, tok)
    assert row["prompt"] == f"What is {row['question']}?"
    (wrapped, *_), _ = build_datasets(plain, tok)
    message = [{"role": "user", "content": row["prompt"]}]
    assert wrapped["prompt"] == tok.apply_chat_template(
        message, add_generation_prompt=True, tokenize=False
    )


def test_a_verifiers_taskset_trains_through_the_endpoint(small_model_dir, tmp_path):
    """`env.name=verifiers:verifiers_envs data.kind=env` (a verifiers v1 taskset of
    additions, tests/verifiers_envs.py): 2 GRPO steps whose episodes are verifiers' own
    rollouts through the endpoint, scored by the taskset's rewards; every turn's logprobs
    equal the trainer's, the held-out evaluation plays it too."""
    import string

    from verifiers_envs import brief_score

    extra = {
        "total_steps": 2,
        "env.name": "verifiers:verifiers_envs",
        "env.kwargs.stop_strings": "[" + ",".join(string.ascii_letters) + "]",
        "data.kind": "env",
    }
    result, rl = _train_rl(small_model_dir, tmp_path / "a", **extra)
    assert result.steps == 2 and result.stopped_by is None
    assert len(rl) == 2
    for r in rl:
        assert r["env/episodes"] == 8 and r["env/turns"] == 8, r  # one call an episode
        assert r.get("env/reward_errors", 0) == 0 and r["logprob_diff_max"] <= 1e-5, r
        # a random policy's reply is never the sum: each reward is 0.5 * brief, in (0, 0.5]
        assert 0 < r["reward_mean"] <= 0.5 * brief_score(""), r["reward_mean"]
    assert {"turns", "pass@1"} <= set(result.eval_after)


def test_a_textarena_game_trains_with_its_seeds_as_rows(small_model_dir, tmp_path):
    """`env.name=textarena:GuessTheNumber-v0 data.kind=env`: the rows are game seeds (train
    and held-out apart), a GRPO step plays the real game's episodes with the sampler's
    logprobs equal to the trainer's, and the held-out evaluation plays games too."""
    extra = {
        "total_steps": 1,
        "env.name": "textarena:GuessTheNumber-v0",
        "env.max_turns": 2,
        "data.kind": "env",
        "data.max_prompt_tokens": 640,  # the game's rules, character by character
    }
    result, (r,) = _train_rl(small_model_dir, tmp_path / "a", **extra)
    assert result.steps == 1 and result.stopped_by is None
    assert r["env/episodes"] == 8 and r["logprob_diff_max"] <= 1e-5, r
    assert {"turns", "pass@1"} <= set(result.eval_after)


def test_textarena_self_play_trains_each_seat_as_its_own_group(small_model_dir, tmp_path):
    """`env.name=textarena:TicTacToe-v0`, both seats the policy: a step's 2 prompts are one
    row's 4 games, seat 0's episodes one group and seat 1's the other; the seats' rewards
    sum to 0 game by game (the step's mean is 0), the sampler's logprobs equal the trainer's,
    and the held-out evaluation plays games. prompts_per_step not a multiple of the seats,
    or the slot engine, is refused in one line."""
    import string

    extra = {
        "total_steps": 1,
        "env.name": "textarena:TicTacToe-v0",
        "env.max_turns": 2,
        # A random policy's turns end at its first letter: an invalid move, a second loses.
        "env.kwargs.stop_strings": "[" + ",".join(string.ascii_letters) + "]",
        "data.kind": "env",
        "data.max_prompt_tokens": 1024,  # the game's rules and board, character by character
        "rollout.max_new_tokens": 768,
    }
    result, (r,) = _train_rl(small_model_dir, tmp_path / "a", **extra)
    assert result.steps == 1 and result.stopped_by is None
    assert r["env/episodes"] == 8 and r["logprob_diff_max"] <= 1e-5, r
    assert r["reward_mean"] == 0.0 and r["reward_std"] > 0, r  # wins and losses
    assert {"turns", "pass@1"} <= set(result.eval_after)
    for key, value, error in (
        ("rollout.prompts_per_step", 3, r"prompts_per_step=3 must be a multiple of 2"),
        ("rollout.engine", "continuous", r"'continuous' cannot play env.name='textarena:Tic"),
    ):
        with pytest.raises(UserError, match=error):
            load_config(None, _overrides(small_model_dir, tmp_path / "b", **{**extra, key: value}))


def test_an_openenv_environment_trains_with_its_seeds_as_rows(small_model_dir, tmp_path):
    """`env.name=openenv:...` (the echo env `openenv init` writes, in process) with
    `data.kind=env`: two GRPO steps play its episodes, each reward its step rewards' sum
    (0.1 a character echoed: > 0), with the sampler's logprobs equal to the trainer's, and
    the held-out evaluation plays episodes too."""
    import string

    from openenv_fixtures import ECHO, echo_scaffold

    extra = {
        "total_steps": 2,
        "env.name": ECHO,
        "env.max_turns": 2,
        "env.kwargs.stop_strings": "[" + ",".join(string.ascii_letters) + "]",
        "data.kind": "env",
    }
    with echo_scaffold(tmp_path):
        result, records = _train_rl(small_model_dir, tmp_path / "a", **extra)
    assert result.steps == 2 and result.stopped_by is None and len(records) == 2
    for r in records:
        assert r["env/episodes"] == 8 and r["env/turns"] > 8, r  # second turns played
        assert r["logprob_diff_max"] <= 1e-5 and r["reward_mean"] > 0, r
    assert {"turns", "pass@1"} <= set(result.eval_after)


def test_ppo_runs_on_episodes(small_model_dir, tmp_path):
    cfg = load_config(
        None, _overrides(small_model_dir, tmp_path / "run", algo="ppo", total_steps=1)
    )
    result = train(cfg, **_quiet())
    assert result.steps == 1
    rec = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    rl = [r for r in rec if "loss" in r]
    assert np.isfinite(rl[0]["loss"]) and rl[0]["logprob_diff_max"] <= 1e-5


def test_builtin_rows_split_by_content():
    train_rows = environment_rows("calculator", "train", 300, seed=5)
    heldout = environment_rows("calculator", "heldout", 40, seed=5)
    assert len(train_rows) == 300 and len(heldout) == 40
    assert not any(is_heldout(r) for r in train_rows) and all(is_heldout(r) for r in heldout)
    assert not {(r["a"], r["b"]) for r in train_rows} & {(r["a"], r["b"]) for r in heldout}
    assert environment_rows("calculator", "train", 300, seed=5) == train_rows


@pytest.mark.parametrize(
    "extra, match",
    [
        ({"env.name": "nope"}, "env.name must be a built-in environment"),
        (
            {"env.name": "custom_envs:Missing"},
            "env.name: module 'custom_envs' has no attribute 'Missing'",
        ),
        ({"data.kind": "env"}, "data.kind='env' takes the rows of a built-in environment"),
        ({"rollout.stop_strings": "[x]"}, "rollout.stop_strings must be empty"),
        ({"sampling.top_k": 5, "grpo.use_keep_mask": "true"}, "sampling.top_k/top_p/min_p"),
        ({"packing.mode": "always"}, "packing.mode='always'"),
        ({"grpo.advantage_estimator": "remax"}, "needs \\['greedy_rewards_n'\\]"),
        ({"env.max_turn_tokens": 0}, "env.max_turn_tokens must be an int >= 1"),
        (
            {"data.chat_template": "true", "data.system_prompt": "Be brief."},
            "data.system_prompt is not used with env.name set",
        ),
    ],
)
def test_refused_combinations_name_the_field(tmp_path, extra, match):
    with pytest.raises(ConfigError, match=match):
        load_config(None, _overrides("tiny", tmp_path / "run", **extra))


def test_a_prompt_over_the_budget_is_refused_before_anything_runs(small_model_dir, tmp_path):
    cfg = load_config(
        None, _overrides(small_model_dir, tmp_path / "run", **{"data.max_prompt_tokens": 3})
    )
    with pytest.raises(
        UserError,
        match=r"a prompt the environment made is \d+ tokens, over "
        r"data.max_prompt_tokens=3",
    ):
        train(cfg, **_quiet())
    assert not (tmp_path / "run" / "checkpoints").exists()


def _final_state_and_metrics(run_dir):
    """(bits of the last RL checkpoint's arrays, its driver state, every logged value but
    timings) of a finished run."""
    cfg = load_config(run_dir / "config.yaml")
    mesh = build_mesh(cfg)
    model, _ = build_model(cfg, mesh=mesh)
    abstract, shardings = checkpoint_target(make_trainer(cfg, model, mesh), mesh)
    steps = saved_steps(run_dir / "checkpoints")
    with Checkpointer(run_dir / "checkpoints", async_save=False) as ckpt:
        r = ckpt.restore(steps[-1], abstract, shardings=shardings)
    leaves = [(x.dtype.str, x.shape, x.tobytes()) for x in jax.tree.leaves(host_copy(r.state))]
    driver = {k: v for k, v in r.driver_state.items() if k != "config"}
    timing = ("time", "elapsed_s", "step_time_s", "tokens_per_s")
    metrics = [
        {k: v for k, v in rec.items() if k not in timing and not k.startswith("time/")}
        for rec in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
    ]
    return steps, leaves, driver, metrics


@pytest.mark.slow
def test_killed_mid_run_and_resumed_equals_uninterrupted(cli_server, small_model_dir, tmp_path):
    """`grpojax train` on episodes killed (SIGKILL) right after RL step 2, before its
    checkpoint, then `--resume`d: the last checkpoint (parameters, optimizer, keys, data
    position, counters) and every logged value but timings equal the uninterrupted run's.
    The episodes play in 3 decode slots (`rollout.engine=continuous`), whose host-side
    schedule must replay too (the lock-step loop plays the same episodes: the round test)."""
    extra = {"total_steps": 3, "sft.steps": 2, "sft.batch_size": 4, "checkpoint.keep": 5}
    extra["optimizer.warmup_steps"] = 1  # the CLI starts from the main job's config
    extra.update({"rollout.engine": "continuous", "rollout.slots": 3})

    def args(run_dir):
        return ["train", "--no-progress", *_overrides(small_model_dir, run_dir, **extra)]

    ref = cli_server.run(args(tmp_path / "ref"), cwd=tmp_path)
    assert ref.returncode == 0, ref.stdout + ref.stderr
    run_dir = tmp_path / "run"
    killed = cli_server.run(args(run_dir), cwd=tmp_path, env={KILL_AT_ENV: "rl_step:2:SIGKILL"})
    assert killed.returncode == -signal.SIGKILL, killed.stdout + killed.stderr
    assert saved_steps(run_dir / "checkpoints")[-1] == 1
    resumed = cli_server.run(
        ["train", "--no-progress", "--resume", f"log.run_dir={run_dir}"], cwd=tmp_path
    )
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    want, got = _final_state_and_metrics(tmp_path / "ref"), _final_state_and_metrics(run_dir)
    assert got[0] == want[0] == [0, 1, 2, 3]
    assert got[2] == want[2]  # driver state: step, data position, counters
    differ = [i for i, (a, b) in enumerate(zip(got[1], want[1], strict=True)) if a != b]
    assert not differ, f"leaves {differ} differ"
    assert got[3] == want[3]


def test_grpojax_sft_warm_starts_on_the_environments_demonstrations(small_model_dir, tmp_path):
    """`grpojax sft` with an environment: SFT on its scripted episodes (a finite loss), the
    held-out episodes evaluated before and after, the model saved."""
    cfg = load_config(
        None, _overrides(small_model_dir, tmp_path / "run", **{"sft.steps": 3, "sft.batch_size": 4})
    )
    out = sft_job(cfg, print_fn=lambda s: None, show_progress=False)
    assert np.isfinite(out["final_loss"]) and out["success_before"] is not None
    assert 0.0 <= out["success_after"] <= 1.0
    assert (tmp_path / "run" / "sft_model" / "config.json").is_file()


def test_reward_functions_are_refused_for_a_multi_turn_run(tmp_path):
    cfg = load_config(None, _overrides("tiny", tmp_path / "run"))
    with pytest.raises(UserError, match="reward_specs: a multi-turn run"):
        train(cfg, reward_specs=[lambda prompts, completions, **_: [0.0] * len(prompts)])
    assert not (tmp_path / "run").exists()


def test_env_kwargs_reach_the_constructor_and_bad_ones_are_named(tmp_path):
    over = {"env.name": "guess_number", "data.kind": "env", "rollout.max_new_tokens": 64}
    cfg = load_config(
        None, _overrides("tiny", tmp_path / "run", **over, **{"env.kwargs.step_penalty": 0.1})
    )
    tokenizer = build_tokenizer(cfg)
    rows, _ = build_datasets(cfg, tokenizer)
    runner = build_episode_runner(cfg, rows[:2], tokenizer, group_size=2)
    assert [e.step_penalty for e in runner.envs] == [0.1] * 4
    bad = load_config(None, _overrides("tiny", tmp_path / "run", **over, **{"env.kwargs.nope": 1}))
    with pytest.raises(UserError, match=r"env.kwargs \{'nope': 1\} for env.name='guess_number'"):
        build_episode_runner(bad, rows[:2], tokenizer, group_size=1)
