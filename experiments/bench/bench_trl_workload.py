"""TRL's GRPOTrainer reference workload, timed in grpojax (and, with --trl, in TRL itself).

    python experiments/bench/bench_trl_workload.py --model-dir /tmp/qwen2-tiny [--trl] [--steps 20]

Workload (the same on both sides):
  - a tiny random Qwen2 checkpoint in --model-dir (vocab 512, D 256, intermediate 688,
    4 layers, 4 heads, 2 kv heads, tied embeddings, float32), built here with
    `transformers` when the directory is empty or missing, with the built-in character
    tokenizer saved beside it (its ids fit in the 512-entry vocabulary), loaded on both sides
    with `grpojax.models.load_tokenizer` (runs before 2026-11-26 loaded it on both sides with
    transformers 5's `AutoTokenizer`, which made it a `Qwen2Tokenizer` that drops spaces:
    both saw "Whatis1+2?Answer:", so the comparison held, but not this workload);
  - 512 prompts "What is {a}+{b}? Answer:" (a, b in 0..99);
  - reward 1.0 when the completion contains the correct sum as a whole number, else 0.0;
  - 4 prompts x 8 completions per step, 32 new tokens, temperature 1, top-p 1;
  - beta 0.04 (k3 KL to the reference), epsilon 0.2, mu 1 (one update per step), token-mean
    loss (TRL's default "dapo" loss type), group-normalised advantages;
  - AdamW lr 1e-6, gradient clipping at 1.0.

JAX runs on its default backend and TRL's torch on CUDA when it has it, else on the CPU;
float32 matmuls are exact on both (no TF32 on a GPU). TRL's `GRPOConfig` turns bf16 autocast
on by default (`bf16=True` unless fp16; accelerate wraps the model's forward in it): here it
is off, so TRL computes in float32 as the workload says. TRL is timed twice: with its default
gradient checkpointing and without it (faster when memory allows); the speedup is reported
against each.

A grpojax step is the driver's full step (`grpojax.driver.loop.train`): generation,
reward, reference logprobs, the jitted update (whose forward gives the policy logprobs),
metrics and logging. The first steps compile
and are excluded; the median of the rest is reported. The last line is

    grpojax grpo median_step_s=<x> completions_per_step=32 steps=<n>

and with --trl, before it, TRL's median step times and the speedups.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import statistics
import sys
import tempfile
import time

NUM_PROMPTS = 512
PROMPTS_PER_STEP = 4
GROUP = 8
NEW_TOKENS = 32


def prompt_rows() -> list[dict]:
    import random

    rng = random.Random(0)
    rows = []
    for _ in range(NUM_PROMPTS):
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        rows.append({"prompt": f"What is {a}+{b}? Answer:", "answer": str(a + b)})
    return rows


def contains_sum_reward(prompts, completions, *, answer, **_):
    """1.0 if the completion contains the correct sum as a whole number, else 0.0."""
    return [
        1.0 if re.search(rf"(?<!\d){re.escape(str(a))}(?!\d)", c) else 0.0
        for c, a in zip(completions, answer)
    ]


def run_grpojax(model_dir: pathlib.Path, steps: int, warmup: int) -> list[float]:
    from grpojax.config import load_config
    from grpojax.driver.loop import train
    from grpojax.rewards import RewardSpec

    with tempfile.TemporaryDirectory() as tmp:
        data = pathlib.Path(tmp) / "prompts.jsonl"
        data.write_text("".join(json.dumps(r) + "\n" for r in prompt_rows()))
        cfg = load_config(
            None,
            [
                f"model.source={model_dir}",
                "data.kind=file",
                f"data.path={data}",
                "data.max_prompt_tokens=64",
                f"total_steps={steps + warmup}",
                f"rollout.prompts_per_step={PROMPTS_PER_STEP}",
                f"rollout.max_new_tokens={NEW_TOKENS}",
                f"grpo.group_size={GROUP}",
                "sampling.temperature=1.0",
                "sampling.top_p=1.0",
                "grpo.beta=0.04",
                "grpo.clip_low=0.2",
                "grpo.clip_high=0.2",
                "grpo.num_epochs=1",
                "grpo.aggregation=token-mean",
                "optimizer.learning_rate=1e-6",
                "optimizer.max_grad_norm=1.0",
                "sft.steps=0",
                f"log.run_dir={tmp}/run",
                "log.tensorboard=false",
                "log.plot=false",
                f"checkpoint.every={steps + warmup + 1}",
                "checkpoint.keep=1",
            ],
        )
        spec = RewardSpec(contains_sum_reward, name="contains_sum", mode="inline")
        # The update computes the policy logprobs it trains on (mu = 1: old = stop_gradient of
        # the same forward, as TRL does); the driver's extra policy pass that only feeds the
        # sampler-vs-trainer metric is left out of the timed step.
        train(
            cfg,
            reward_specs=[spec],
            show_progress=False,
            print_fn=lambda s: None,
            policy_metrics_every=0,
        )
        records = [json.loads(x) for x in (pathlib.Path(tmp) / "run" / "metrics.jsonl").open()]
    timed = [r for r in records if "step_time_s" in r][warmup:]
    phases = ("generate", "reward", "logprobs", "update")
    parts = {k: statistics.median(r[f"time/{k}"] for r in timed) for k in phases}
    print("grpojax phases (median s): " + " ".join(f"{k}={v:.4f}" for k, v in parts.items()))
    return [r["step_time_s"] for r in timed]


def run_trl(
    model_dir: pathlib.Path, steps: int, warmup: int, gradient_checkpointing: bool
) -> list[float]:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from grpojax.models import load_tokenizer

    class Timer(TrainerCallback):
        def __init__(self):
            self.times, self._t = [], None

        def on_step_begin(self, args, state, control, **kw):
            self._t = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            self.times.append(time.perf_counter() - self._t)

    def reward(prompts, completions, answer, **_):
        return contains_sum_reward(prompts, completions, answer=answer)

    torch.manual_seed(0)
    tok = load_tokenizer(model_dir)  # as saved (see the module docstring)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    timer = Timer()
    with tempfile.TemporaryDirectory() as tmp:
        args = GRPOConfig(
            output_dir=tmp,
            per_device_train_batch_size=PROMPTS_PER_STEP * GROUP,
            num_generations=GROUP,
            max_completion_length=NEW_TOKENS,
            temperature=1.0,
            top_p=1.0,
            beta=0.04,
            epsilon=0.2,
            num_iterations=1,
            learning_rate=1e-6,
            max_grad_norm=1.0,
            max_steps=steps + warmup,
            use_cpu=not torch.cuda.is_available(),
            report_to="none",
            logging_steps=1000,
            save_strategy="no",
            seed=0,
            bf16=False,  # TRL's default is True: bf16 autocast around the forward
            fp16=False,
            gradient_checkpointing=gradient_checkpointing,  # TRL's default is True
        )
        trainer = GRPOTrainer(
            model=model,
            reward_funcs=reward,
            args=args,
            train_dataset=Dataset.from_list(prompt_rows()),
            processing_class=tok,
            callbacks=[timer],
        )
        trainer.train()
    return timer.times[warmup:]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-dir", required=True, type=pathlib.Path)
    p.add_argument("--steps", type=int, default=20, help="timed steps (after warm-up)")
    p.add_argument("--warmup", type=int, default=3, help="untimed first steps (compilation)")
    p.add_argument("--trl", action="store_true", help="also run TRL's GRPOTrainer")
    args = p.parse_args(argv)
    # TRL's torch may share the accelerator: JAX (not started yet) takes memory as needed.
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    from benchlib import exact_float32_matmuls, machine

    print(f"machine: {machine()}; {exact_float32_matmuls()}", flush=True)
    if not (args.model_dir / "config.json").is_file():
        from benchlib import build_tiny_qwen2

        from grpojax.models import builtin_tokenizer

        build_tiny_qwen2(args.model_dir, tokenizer=builtin_tokenizer())
        print(f"built a tiny random Qwen2 checkpoint in {args.model_dir}", flush=True)
    ours = statistics.median(run_grpojax(args.model_dir, args.steps, args.warmup))
    print(f"grpojax: median {ours:.4f} s/step over {args.steps} steps", flush=True)
    if args.trl:
        version = __import__("trl").__version__
        for ckpt in (True, False):
            theirs = statistics.median(run_trl(args.model_dir, args.steps, args.warmup, ckpt))
            label = f"trl {version} float32, gradient_checkpointing={ckpt}"
            print(f"{label}: median_step_s={theirs:.4f} speedup={theirs / ours:.2f}x", flush=True)
    print(
        f"grpojax grpo median_step_s={ours:.4f} completions_per_step={PROMPTS_PER_STEP * GROUP} "
        f"steps={args.steps}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
