"""Multi-turn rollouts: decode slots refilled as episodes end, and the lock-step loop that
drops ended episodes' rows (compaction), against the lock-step loop.

Workload: N episodes (`--episodes`) of the built-in tiny model (random init, float32) in a
synthetic environment whose turn counts are long-tailed, as agentic episodes are (some tasks
end after one tool call, some take ten): row r plays K_r turns, K_r drawn once (lognormal,
sigma 1, clipped to [1, `--max-turns`], median 2), and answers each turn with an 8-character
observation. A turn ends at any of `--stop-share` of the vocabulary (ids drawn once), so a
random model's turns are geometric in length (mean 1 / share), capped at `--turn-tokens`.
The environment costs nothing (a tool's latency is not measured here: the lock-step loop
steps all rows' environments at once each turn, the slots' loop those whose turn ended).

For each engine (lock step, compaction, then slots at each `--slots`): one warm-up rollout
(compiles),
then `--rounds` rollouts with another key, alternating engines; s/rollout is the fastest.
Reported: decode utilisation = policy tokens / row-steps decoded (rows x steps of every
sampler call), sampler calls, policy tokens per second, the speedup over lock step, and
whether the episodes equal lock step's id for id (they should: draws are keyed by row and
policy-token count).

Last line: `bench_multiturn_slots: utilisation_lockstep=.. utilisation_slots=.. speedup=..
utilisation_compact=.. speedup_compact=.. same_episodes=..`, slots at the best slot count.

    python experiments/bench/bench_multiturn_slots.py [--episodes 64] [--slots 8 16 32]
"""

from __future__ import annotations

import argparse
import time

from benchlib import exact_float32_matmuls, machine


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--episodes", type=int, default=64)
    parser.add_argument("--slots", type=int, nargs="+", default=[8, 16, 32])
    parser.add_argument("--max-turns", type=int, default=12)
    parser.add_argument("--turn-tokens", type=int, default=64)
    parser.add_argument("--stop-share", type=float, default=1 / 24)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()

    import jax
    import numpy as np
    from flax import nnx

    from grpojax.envs import Environment, EpisodeRunner, Step, rollout_episodes
    from grpojax.models import Decoder, tiny_config
    from grpojax.models.tokenizer import PAD_ID, builtin_tokenizer
    from grpojax.sampling import SamplingConfig

    precision = exact_float32_matmuls()
    config = tiny_config()
    model = Decoder(config, rngs=nnx.Rngs(0))
    tok = builtin_tokenizer()
    rng = np.random.default_rng(0)
    n = args.episodes
    turns = np.clip(np.round(np.exp(rng.normal(np.log(2), 1.0, n))), 1, args.max_turns)
    share = max(1, round(args.stop_share * config.vocab_size))
    stops = tuple(int(i) for i in rng.choice(np.arange(3, config.vocab_size), share, False))

    class Turns(Environment):
        max_turns = args.max_turns

        def reset(self):
            self.k = 0
            return f"task {self.row['i']}:"

        def step(self, completion: str) -> Step:
            self.k += 1
            done = self.k >= self.row["turns"]
            return Step(observation=None if done else f" obs {self.k:03d} ", done=done)

        def reward(self) -> float:
            return 1.0

    budget = args.max_turns * (args.turn_tokens + 16)

    def rollout(engine, key, stats=None):
        slots = engine if isinstance(engine, int) else None
        envs = [Turns({"i": i, "turns": int(k)}) for i, k in enumerate(turns)]
        runner = EpisodeRunner(envs, tok, max_episode_tokens=budget, chat=False)
        return rollout_episodes(
            model, runner, key=key, max_turn_tokens=args.turn_tokens,
            sampling=SamplingConfig(temperature=1.0), stop_ids=stops, pad_id=PAD_ID,
            slots=slots, compact=engine == "compact", stats=stats,
        )  # fmt: skip

    print(f"machine: {machine()}")
    print(
        f"jax {jax.__version__} ({jax.default_backend()}); model tiny: D={config.hidden_size} "
        f"L={config.num_layers} V={config.vocab_size}, {config.dtype}; {precision}"
    )
    print(
        f"workload: N={n} episodes, turns per episode {int(turns.min())}-{int(turns.max())} "
        f"(mean {turns.mean():.2f}), turns end at {len(stops)} of {config.vocab_size} ids "
        f"(cap {args.turn_tokens}), temperature 1; fastest of {args.rounds} rollouts after one "
        "warm-up"
    )
    engines = [("lockstep", None), ("compact", "compact")]
    engines += [(f"slots:{s}", s) for s in args.slots]
    first, times = {}, {name: [] for name, _ in engines}
    for name, slots in engines:
        stats: dict = {}
        t0 = time.perf_counter()
        eps = rollout(slots, jax.random.key(1), stats)
        first[name] = (time.perf_counter() - t0, eps, stats)
    for r in range(args.rounds):
        for name, slots in engines:
            t0 = time.perf_counter()
            rollout(slots, jax.random.key(2 + r))
            times[name].append(time.perf_counter() - t0)
    ref = first["lockstep"][1]
    tokens = sum(e.num_policy_tokens for e in ref)
    print(
        f"{'engine':>9} {'util':>6} {'row-steps':>9} {'s/rollout':>9} {'tok/s':>7} "
        f"{'speedup':>8} {'first s':>8} {'same episodes':>13}"
    )
    rows = {}
    for name, _ in engines:
        first_s, eps, stats = first[name]
        best = min(times[name])
        util = tokens / stats["decode_row_steps"]
        same = [e.tokens() for e in eps] == [e.tokens() for e in ref]
        speedup = min(times["lockstep"]) / best
        rows[name] = (util, speedup, same)
        print(
            f"{name:>9} {util:>6.1%} {stats['decode_row_steps']:>9} {best:>9.2f} "
            f"{tokens / best:>7.0f} {speedup:>7.2f}x {first_s:>8.1f} {same!s:>13}"
        )
    best_name = max((name for name, _ in engines[2:]), key=lambda k: rows[k][1])
    util, speedup, _ = rows[best_name]
    print(
        f"bench_multiturn_slots: utilisation_lockstep={rows['lockstep'][0]:.3f} "
        f"utilisation_slots={util:.3f} slots={best_name.split(':')[1]} speedup={speedup:.2f} "
        f"utilisation_compact={rows['compact'][0]:.3f} speedup_compact={rows['compact'][1]:.2f} "
        f"same_episodes={all(r[2] for r in rows.values())}"
    )


if __name__ == "__main__":
    main()
