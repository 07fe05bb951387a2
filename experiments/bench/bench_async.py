"""Overlapped rewards and pipelined rollouts: wall time per RL step at max_staleness 0, 1, 2.

Workload: the main job (`experiments/configs/default.yaml`: the built-in tiny model, 32 prompts x 8
samples) without its SFT warm start, with a reward that costs real time: the main job's
`numeric_answer` reward plus a sleep per call, calibrated to a multiple (`--reward-ratio`,
default 1) of the measured generation time of a step, as a sandboxed test suite or a
remote judge would cost. A sleep holds no core, so this measures what the pipeline is for:
host work overlapping device work. (A reward that burns CPU competes with XLA for this
machine's two cores; it would measure the cores, not the schedule.)

Runs, in this order, in one process: a calibration run (k 0 in sequence, no sleep: the
median `time/generate` of its steps), then with the sleep (`--steps` RL steps each; the
first `--warmup` steps, which compile, are left out): k 0 in sequence
(`rollout.overlap_rewards=false`: sample, score, logprob pass, update; the baseline), k 0
with the rewards beside the trainer's logprob pass (the default; single-turn only), then
k = 1, 2. Reported per run: the median step wall time (`step_time_s`), its parts
(`time/generate`, `time/reward`: the wait the loop saw, `time/reward_busy`: the scoring's
own time, `time/logprobs`, `time/update`; the rest is the loop's own work: batch assembly,
metrics, logging), and the speedup over the baseline.

`--env`: multi-turn episodes instead (`SlowToolEnv` below: 3 turns, each answered by a
tool that sleeps), the tool's latency calibrated so that a round's tool calls (3 turns, each
in waves of at most 64 environments at once) cost `--reward-ratio` x the calibration run's
round (whose tools cost nothing); with k >= 1 the episodes, tools included,
play on a host thread while the updates run (`time/generate` is then the loop's wait,
`time/generate_busy` the round's own time).

`--arch 0.5b`: the same runs with a random-weight model of Qwen2.5-0.5B's architecture (D 896,
24 layers, 14 heads, 2 kv heads, V 151,936, tied embeddings, q/k/v biases; built with
`transformers` at seed 0 and saved in bfloat16 beside the built-in tokenizer, whose ids fit in
the vocabulary), bf16 compute, float32 masters: the issue's GPU shape. Its samples are noise
of full length (a random model rarely draws the end-of-sequence token), so every step decodes
the whole T.

`--partial`: every k >= 1 runs with partial rollouts too (`rollout.partial=true`: k rounds in
flight in decode slots that outlive the updates; its rewards are computed when a round ends,
in the step that trains it). The baseline for it is the pipelined run of the same k on the
same engine: pass `--engine continuous` (and `--slots`) so both decode in the same slots. With
the main job's model untrained (no SFT here) and `--max-new-tokens 512`, completion lengths
are the random model's: about geometric (the built-in vocabulary's 100 ids, one of them EOS),
mean about 100, a few samples a round running to T, the long tail partial rollouts are for.
The rows then add the decode's utilisation (real tokens / slot-steps decoded) and the
partial runs' mean token lag.

Placement: every k runs interleaved (one device set: the sampler and the trainer take the
devices in turn); with `--rollout-devices n`, every k >= 1 runs split too (`mesh.rollout_devices
= n`: rounds decode on the last n devices while the updates run on the others). Run it with
fake CPU devices for that (`XLA_FLAGS=--xla_force_host_platform_device_count=4`): they share
this machine's cores, so what the split rows show there is the schedule's overhead and the
cores' contention, not the disjoint devices' gain on a real accelerator mesh.

Last line: `bench_async: speedup_0=.. speedup_1=.. speedup_2=.. [split_1=.. split_2=..]
[partial_1=.. partial_2=.. partial_over_pipelined_1=.. ...] ...`

    python experiments/bench/bench_async.py [--steps 10] [--reward-ratio 1.0] [--max-new-tokens 4]
        [--env] [--rollout-devices 2] [--arch 0.5b] [--prompts 32]
        [--partial --engine continuous --slots 8]
"""

from __future__ import annotations

import argparse
import itertools
import json
import pathlib
import statistics
import string
import tempfile
import time

from benchlib import machine

from grpojax.envs import Environment, Step

REPO = pathlib.Path(__file__).resolve().parents[2]
DEFAULT_YAML = REPO / "experiments" / "configs" / "default.yaml"


class SlowToolEnv(Environment):
    """3 turns, each answered "ok" by a tool that sleeps `latency` seconds; reward: the share
    of turns holding a digit. Named `bench_async:SlowToolEnv` in the config."""

    max_turns = 3
    stop_strings = tuple(string.punctuation)

    def __init__(self, row, latency: float = 0.0, **kwargs):
        super().__init__(row, **kwargs)
        self.latency, self.turns = float(latency), []

    def reset(self) -> str:
        return self.row["prompt"]

    def step(self, completion: str) -> Step:
        time.sleep(self.latency)
        self.turns.append(completion)
        return Step(observation="ok")

    def reward(self) -> float:
        return sum(any(c.isdigit() for c in t) for t in self.turns) / self.max_turns


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--reward-ratio", type=float, default=1.0)
    parser.add_argument("--stalenesses", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument(
        "--max-new-tokens", type=int, default=4, help="T (the main job's: 4; reasoning: more)"
    )
    parser.add_argument("--env", action="store_true", help="multi-turn episodes, slow tools")
    parser.add_argument(
        "--rollout-devices", type=int, default=0, help="also run k >= 1 split, n rollout devices"
    )
    parser.add_argument(
        "--arch", choices=("tiny", "0.5b"), default="tiny", help="tiny: the main job's model"
    )
    parser.add_argument("--partial", action="store_true", help="also k >= 1 partial rollouts")
    parser.add_argument("--engine", default="auto", help="rollout.engine of every run")
    parser.add_argument("--slots", type=int, default=None, help="rollout.slots (None: auto)")
    parser.add_argument("--prompts", type=int, default=None, help="B (None: the main job's 32)")
    args = parser.parse_args()

    import jax

    from grpojax.config import load_config
    from grpojax.driver.loop import train
    from grpojax.rewards import RewardSpec, numeric_answer_reward

    tmp = pathlib.Path(tempfile.mkdtemp(prefix="bench_async_"))
    cfg_base = load_config(DEFAULT_YAML)
    model = {}
    if args.arch == "0.5b":
        from benchlib import build_qwen2
        from plan_memory import ARCHS

        from grpojax.models import builtin_tokenizer

        a = ARCHS["0.5b"]
        shape = dict(
            vocab_size=a.vocab_size,
            hidden_size=a.hidden_size,
            intermediate_size=a.intermediate_size,
            num_layers=a.num_layers,
            num_heads=a.num_heads,
            num_kv_heads=a.num_kv_heads,
            head_dim=a.head_dim,
        )
        t0 = time.perf_counter()
        build_qwen2(
            tmp / "model",
            shape,
            dtype="bfloat16",
            tokenizer=builtin_tokenizer(),
            rope_theta=a.rope_theta,
            max_positions=4096,
        )
        print(f"built {a.name}'s architecture at random in {time.perf_counter() - t0:.0f} s")
        model = {"model.source": str(tmp / "model"), "model.dtype": "bfloat16"}

    counter = itertools.count()  # each run its own directory

    def run(k: int, sleep_s: float, rollout_devices: int = 0, overlap: bool = True, partial=False):
        def reward(prompts, completions, *, answer):
            time.sleep(sleep_s)
            return numeric_answer_reward(prompts, completions, answer=answer)

        env = {}
        if args.env:
            # The runner steps at most 64 environments at once: a round's N episodes take
            # ceil(N / 64) waves per turn, 3 turns; so many tool calls in sequence cost sleep_s.
            n = int((args.prompts or cfg_base.rollout.prompts_per_step) * cfg_base.group_size)
            waves = 3 * -(-n // 64)
            env = {
                "env.name": "bench_async:SlowToolEnv",
                "env.kwargs.latency": sleep_s / waves,
                "env.max_turn_tokens": max(1, args.max_new_tokens // 4),
            }

        over = {
            "sft.steps": 0,
            "total_steps": args.steps,
            "optimizer.warmup_steps": 1,
            "rollout.max_staleness": k,
            "mesh.rollout_devices": rollout_devices,
            "rollout.overlap_rewards": str(overlap).lower(),
            "rollout.max_new_tokens": args.max_new_tokens,
            "rollout.engine": args.engine,
            "rollout.slots": "null" if args.slots is None else args.slots,
            "rollout.partial": str(partial).lower(),
            **({"rollout.prompts_per_step": args.prompts} if args.prompts else {}),
            # unpacked: a packed layout is one compilation per new shape, and the runs'
            # lengths differ, so their compilations would land in different steps
            "packing.mode": "never",
            "eval.heldout_size": 8,
            "checkpoint.every": 1000,
            "log.tensorboard": "false",
            "log.plot": "false",
            "log.run_dir": str(
                tmp / f"{next(counter)}_k{k}_{sleep_s:.3f}_r{rollout_devices}_o{overlap:d}"
            ),
            "log.progress": "false",
            **model,
            **env,
        }
        cfg = load_config(DEFAULT_YAML, [f"{a}={b}" for a, b in over.items()])
        specs = None if args.env else [RewardSpec(fn=reward, name="numeric_answer")]
        train(cfg, reward_specs=specs, show_progress=False, print_fn=lambda s: None)
        rows = [json.loads(x) for x in (pathlib.Path(cfg.log.run_dir) / "metrics.jsonl").open()]
        rows = [r for r in rows if "step_time_s" in r][args.warmup :]
        keys = (
            "step_time_s",
            "time/generate",
            "time/generate_busy",
            "time/reward",
            "time/reward_busy",
            "time/logprobs",
            "time/update",
            "decode_utilisation",
            "staleness/token_mean",
        )
        return {key: statistics.median(r.get(key, 0.0) for r in rows) for key in keys}

    print(f"machine: {machine()}")
    print(f"jax {jax.__version__} ({jax.default_backend()}, {jax.device_count()} devices)")
    # The calibration run (skipped without a reward cost: the baseline is that run).
    calib = run(0, 0.0, overlap=False) if args.reward_ratio else None
    calib_s = calib["time/generate"] if calib else float("nan")
    sleep_s = args.reward_ratio * calib_s if calib else 0.0
    cost = (
        f"episodes of 3 turns, tool calls sleeping {sleep_s:.3f} s a round in all"
        if args.env
        else f"reward = numeric_answer + sleep {sleep_s:.3f} s a step"
    )
    print(
        f"workload: experiments/configs/default.yaml without SFT, model {args.arch}, "
        f"B {args.prompts or cfg_base.rollout.prompts_per_step} x G {cfg_base.group_size}, "
        f"T {args.max_new_tokens}, engine {args.engine}, slots {args.slots or 'auto'}, "
        f"{args.steps} RL steps a run (median of the last {args.steps - args.warmup}); "
        f"{cost} ({args.reward_ratio:g} x the calibration run's generation "
        f"{calib_s:.3f} s)"
    )
    print(
        f"{'k':>2} {'mode':>11} {'step s':>7} {'generate':>8} {'gen busy':>8} "
        f"{'reward':>7} {'rew busy':>8} {'logprobs':>8} {'update':>7} {'util':>5} "
        f"{'tok lag':>7} {'speedup':>8}"
    )
    base = None
    speedups = {}
    n_split = args.rollout_devices
    # (k, rollout devices, overlap_rewards, partial, label); the first is the baseline.
    plan = [(0, 0, False, False, "sequential")]
    plan += [] if args.env else [(0, 0, True, False, "overlap")]  # episodes: in sequence
    plan += [(k, 0, True, False, "interleaved") for k in args.stalenesses if k]
    plan += [(k, n_split, True, False, "split") for k in args.stalenesses if k and n_split]
    plan += [(k, 0, True, True, "partial") for k in args.stalenesses if k and args.partial]
    pipelined = {}  # k -> the interleaved run's step time
    for k, rollout_devices, overlap, partial, label in plan:
        m = run(k, sleep_s, rollout_devices, overlap, partial)
        base = m["step_time_s"] if base is None else base
        ratio = base / m["step_time_s"]
        if partial:
            speedups[f"partial_{k}"] = ratio
            speedups[f"partial_over_pipelined_{k}"] = pipelined[k] / m["step_time_s"]
        elif overlap:
            speedups[f"{'split' if rollout_devices else 'speedup'}_{k}"] = ratio
            if k and not rollout_devices:
                pipelined[k] = m["step_time_s"]
        # A phase with nothing in the background: its own time is its wait. Split
        # single-turn rounds log the whole round's wait as time/generate.
        gen_busy = m["time/generate_busy"] or m["time/generate"]
        rew_busy = m["time/reward_busy"] or m["time/reward"]
        if rollout_devices:
            label = f"split {len(jax.devices()) - rollout_devices}+{rollout_devices}"
        print(
            f"{k:>2} {label:>11} {m['step_time_s']:>7.3f} {m['time/generate']:>8.3f} "
            f"{gen_busy:>8.3f} {m['time/reward']:>7.3f} {rew_busy:>8.3f} "
            f"{m['time/logprobs']:>8.3f} {m['time/update']:>7.3f} "
            f"{m['decode_utilisation']:>5.2f} {m['staleness/token_mean']:>7.2f} {ratio:>7.2f}x",
            flush=True,
        )
    line = " ".join(f"{name}={v:.2f}" for name, v in speedups.items())
    print(
        f"bench_async: {line} reward_s={sleep_s:.3f} generate_s={calib_s:.3f} "
        f"t={args.max_new_tokens} arch={args.arch} engine={args.engine} slots={args.slots}"
    )


if __name__ == "__main__":
    main()
