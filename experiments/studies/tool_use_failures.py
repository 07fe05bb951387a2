"""Where a tool-use policy fails: its greedy held-out episodes on the calculator task, sorted.

    python experiments/studies/tool_use_failures.py RUN_DIR [--show 4]

RUN_DIR is a finished `grpojax train --config experiments/configs/tool_use.yaml` run (its
`config.yaml` and exported `hf/` policy). The held-out rows are the run's own (the same
seed, split and size). Each failed episode is put in the first class that fits:

  no call          the episode made no parseable calculator call
  operands         the call's expression is not "a * b" of the question
  answer           the call was right but the final answer is not the tool's result
  other            anything else (e.g. the token budget ran out)

Prints a table, a few failed episodes, and ends with one line
`tool_use_failures: correct=.. no_call=.. operands=.. answer=.. other=..` (counts).
"""

from __future__ import annotations

import argparse
import collections
import pathlib

import jax

from grpojax.config import load_config
from grpojax.envs.registry import environment_rows
from grpojax.models import from_pretrained, load_tokenizer
from grpojax.rng import run_seed
from grpojax.rollouts.episodes import EpisodeSampler, episode_return
from grpojax.sampling.transforms import SamplingConfig

CLASSES = ("correct", "no_call", "operands", "answer", "other")


def classify(row: dict, text: str, returned: float, calls: int) -> str:
    if returned >= 1.0:
        return "correct"
    if calls == 0:
        return "no_call"
    if f'"expression": "{row["a"]} * {row["b"]}"' not in text:
        return "operands"
    if f"Answer: {row['a'] * row['b']}" not in text:
        return "answer"
    return "other"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=pathlib.Path)
    parser.add_argument("--show", type=int, default=4, help="failed episodes to print")
    args = parser.parse_args()
    cfg = load_config(args.run_dir / "config.yaml")
    if cfg.env.name != "calculator":
        raise SystemExit(f"{args.run_dir}: env.name is {cfg.env.name!r}, not 'calculator'")
    tokenizer = load_tokenizer(args.run_dir / "hf")
    model = from_pretrained(args.run_dir / "hf")
    rows = environment_rows(
        "calculator", "heldout", cfg.eval.heldout_size, seed=run_seed(cfg.seed, "data")
    )
    sampler = EpisodeSampler(cfg, tokenizer, None, None)
    greedy = SamplingConfig(temperature=0.0)
    _, episodes = sampler.play(model, rows, key=jax.random.key(0), group_size=1, sampling=greedy)
    counts: collections.Counter[str] = collections.Counter()
    shown = 0
    for row, ep in zip(rows, episodes):
        text = tokenizer.decode([i for s in ep.segments for i in s.ids], skip_special_tokens=True)
        kind = classify(row, text, episode_return(ep), ep.counters.get("tool_calls", 0))
        counts[kind] += 1
        if kind != "correct" and shown < args.show:
            shown += 1
            print(f"--- {row['a']} * {row['b']} = {row['a'] * row['b']}: {kind}\n{text}\n")
    print(f"{args.run_dir}: {len(rows)} greedy held-out episodes (seed {cfg.seed})")
    print("| class | episodes | share |\n| --- | --- | --- |")
    for c in CLASSES:
        print(f"| {c} | {counts[c]} | {counts[c] / len(rows):.3f} |")
    print("tool_use_failures: " + " ".join(f"{c}={counts[c]}" for c in CLASSES))


if __name__ == "__main__":
    main()
