"""Rehearsal of `experiments/configs/qwen2_5_0_5b_gsm8k.yaml` without the real checkpoint: a
random-weight model with Qwen2.5-0.5B-Instruct's exact architecture goes through
`grpojax train` and back out to `transformers`. Not run in CI (minutes and ~10 GB here).

Phases, each timed:

1. tokenizer: a byte-level BPE trained locally with `tokenizers` on generated arithmetic
   word problems (nothing is downloaded), with Qwen's pre-tokenizer split pattern, its
   special tokens `<|endoftext|>` (pad), `<|im_start|>`, `<|im_end|>` (eos) and a ChatML
   chat template in Qwen2.5's layout (default system prompt included). Its vocabulary is
   small (`--bpe-vocab`), so the special tokens' ids are not Qwen's 151643..151645; the
   model's embedding keeps Qwen's 151,936 rows (ids past the tokenizer decode to nothing).
2. checkpoint: `transformers.Qwen2Config` with Qwen2.5-0.5B-Instruct's config.json numbers
   (D 896, F 4864, 24 layers, 14 heads, 2 kv heads, head_dim 64, V 151936, tied
   embeddings, rope_theta 1e6, q/k/v bias), `Qwen2ForCausalLM` at random init (seed 0),
   saved in bfloat16: 494,032,768 parameters.
3. data: GSM8K-style rows in the official format, converted by `prepare_gsm8k.py`.
4. train: `grpojax train --config experiments/configs/qwen2_5_0_5b_gsm8k.yaml` in a subprocess,
   with overrides pointing at the above and shrinking the run to fit this CPU (see
   `_overrides`: 2 prompts x 4 samples, 16 new tokens, 1 mini-batch, `--steps` RL steps,
   no held-out evaluation); bf16 compute and full remat as in the YAML.
5. export: `grpojax export RUN_DIR --out DIR` writes the newest RL checkpoint's policy as a
   Hugging Face checkpoint; the same checkpoint is restored here for the comparison.
6. compare: `transformers` reloads the export (float32) and its logits on a chat prompt
   are compared with grpojax's forward of the restored policy (its parameters upcast to
   float32, float32 compute), so the difference measures the export, not bf16 rounding.

The last line: `rehearsal: params=<n> peak_rss_mb=<m> step_s=<s>
export_max_abs_logit_diff=<d>` (peak RSS over this process and the train subprocess;
step_s the median `step_time_s` of the RL steps after the first, which compiles).

`--tiny` runs the same pipeline with a 2-layer, 64-wide Qwen2 of the same vocabulary (a
quick check); `--dry-run` stops after building everything and loading the run config
with its overrides (what the test runs). Usage:
`python experiments/studies/rehearse_qwen2_5_0_5b.py [--tiny] [--dry-run] [--steps 3] [--keep DIR]`.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time

REPO = pathlib.Path(__file__).resolve().parents[2]
YAML = REPO / "experiments" / "configs" / "qwen2_5_0_5b_gsm8k.yaml"

# Qwen2.5-0.5B-Instruct's config.json (architecture fields).
QWEN2_5_0_5B = dict(
    vocab_size=151936,
    hidden_size=896,
    intermediate_size=4864,
    num_hidden_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
    max_position_embeddings=32768,
    max_window_layers=21,
    rope_theta=1000000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
    use_sliding_window=False,
    sliding_window=32768,
    hidden_act="silu",
    attention_dropout=0.0,
    initializer_range=0.02,
)
TINY = dict(
    QWEN2_5_0_5B,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    max_window_layers=2,
)

SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
# Qwen2's pre-tokenizer split (then byte-level without its own regex).
SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
    r"\s*[\r\n]+|\s+(?!\S)|\s+"
)
# ChatML in Qwen2.5's layout (without its tool-calling branches).
CHAT_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful "
    "assistant.<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if not (message['role'] == 'system' and loop.first) %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

NAMES = ("Ava", "Ben", "Chen", "Dara", "Eli", "Fatima", "Goran", "Hana", "Ivan", "Jun")
ITEMS = ("apples", "marbles", "books", "stickers", "coins", "pencils", "cookies", "shells")


def make_problem(rng: random.Random) -> dict:
    """One GSM8K-style row: `question` and the final number as `answer`."""
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    a, b, c = rng.randint(2, 60), rng.randint(2, 30), rng.randint(2, 6)
    kind = rng.randrange(3)
    if kind == 0:
        q = f"{name} has {a} {item} and buys {b} more. How many {item} does {name} have now?"
        ans = a + b
    elif kind == 1:
        q = f"{name} has {a + b} {item} and gives {b} of them away. How many {item} are left?"
        ans = a
    else:
        q = f"{name} buys {c} boxes of {item} with {b} {item} in each box. How many {item}?"
        ans = b * c
    return dict(question=q, answer=str(ans))


def corpus(rng: random.Random, n: int):
    """Text to train the BPE on: problems, worked answers in the YAML's format, chat turns."""
    for _ in range(n):
        row = make_problem(rng)
        yield row["question"]
        yield (
            f"<think>The numbers are in the question; compute step by step.</think> "
            f"<answer>{row['answer']}</answer>"
        )
        # The YAML's template and the chat template's default system turn, so that a
        # formatted prompt is tens of tokens, not hundreds of single bytes.
        yield (
            "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful "
            "assistant.<|im_end|>\n<|im_start|>user\n" + row["question"] + "\nThink step by "
            "step inside <think></think>, then give the final number inside "
            "<answer></answer>.<|im_end|>\n<|im_start|>assistant\n"
        )


def build_tokenizer(out: pathlib.Path, *, vocab: int, seed: int):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=list(SPECIALS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(random.Random(seed), 4000), trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>"],
        chat_template=CHAT_TEMPLATE,
        model_max_length=32768,
    )
    fast.save_pretrained(out)
    return fast


def build_checkpoint(out: pathlib.Path, tokenizer, *, tiny: bool) -> int:
    import torch
    import transformers

    arch = TINY if tiny else QWEN2_5_0_5B
    config = transformers.Qwen2Config(
        **arch,
        bos_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"),
        eos_token_id=tokenizer.eos_token_id,
        dtype="bfloat16",
    )
    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(config).to(torch.bfloat16)
    n = sum(p.numel() for p in model.parameters())
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    del model
    return n


def write_data(out: pathlib.Path, *, seed: int) -> tuple[pathlib.Path, pathlib.Path]:
    """Train and held-out rows in GSM8K's official format (`question`, `answer` ending in
    "#### <number>"), converted by experiments/tools/prepare_gsm8k.py as a user would."""
    from prepare_gsm8k import convert_file

    rng = random.Random(seed + 1)
    paths = out / "train.jsonl", out / "test.jsonl"
    for path, n in zip(paths, (256, 32), strict=True):
        raw = out / f"gsm8k_{path.name}"
        with open(raw, "w") as f:
            for _ in range(n):
                row = make_problem(rng)
                worked = f"Work it out step by step.\n#### {row['answer']}"
                f.write(json.dumps({"question": row["question"], "answer": worked}) + "\n")
        convert_file(raw, path)
    return paths


def _overrides(ckpt, train, test, run_dir, steps: int) -> list[str]:
    """What the rehearsal shrinks (YAML value in the comment)."""
    return [
        f"model.source={ckpt}",
        f"data.path={train}",
        f"data.eval_path={test}",
        f"log.run_dir={run_dir}",
        f"total_steps={steps}",  # 500
        "rollout.prompts_per_step=2",  # 32
        "grpo.group_size=4",  # 8
        "rollout.max_new_tokens=16",  # 512
        "data.max_prompt_tokens=128",  # 256
        "grpo.num_minibatches=1",  # 4
        "grpo.num_microbatches=1",  # 2
        "eval.heldout_size=2",  # 500
        "eval.k=1",  # 4
        "eval.every=1000",  # 50: before/after only
        "eval.batch_size=2",  # 64
        "rewards.num_workers=1",  # 8
        f"checkpoint.every={steps}",  # 50
        "checkpoint.async_save=false",
        "log.tensorboard=false",
    ]


def _children_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024


def _self_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def restore_and_export(run_dir: pathlib.Path, export_dir: pathlib.Path, env: dict):
    """`grpojax export RUN_DIR --out export_dir` (a subprocess, as a user runs it), then the
    same newest RL checkpoint restored here for the comparison; returns (policy, tokenizer,
    step)."""
    from grpojax.driver.setup import build_tokenizer
    from grpojax.jobs.restore import open_run, restore_trainer

    cmd = [sys.executable, "-m", "grpojax.cli", "export", str(run_dir), "--out", str(export_dir)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"grpojax export failed (rc={proc.returncode}):\n" + proc.stderr[-3000:])
    print("export: " + proc.stdout.strip().splitlines()[-1])
    cfg, ckpt_dir = open_run(run_dir, purpose="compare")
    tokenizer = build_tokenizer(cfg)
    _, trainer, step = restore_trainer(cfg, ckpt_dir, tokenizer)
    return trainer.policy(), tokenizer, step


def compare_logits(policy, tokenizer, export_dir: pathlib.Path) -> float:
    """max |logits_grpojax - logits_transformers| on a chat prompt, both float32."""
    import dataclasses

    import jax
    import jax.numpy as jnp
    import numpy as np
    import torch
    import transformers
    from flax import nnx

    from grpojax.models import Decoder, forward_logits

    cfg32 = dataclasses.replace(policy.config, dtype="float32", param_dtype="float32")
    graphdef = nnx.split(nnx.eval_shape(lambda: Decoder(cfg32, rngs=nnx.Rngs(0))))[0]
    params = nnx.state(policy, nnx.Param)
    params32 = jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), params)
    model32 = nnx.merge(graphdef, params32)
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": make_problem(random.Random(7))["question"]}],
        tokenize=False,
        add_generation_prompt=True,
    )
    ids = tokenizer(text)["input_ids"]
    ours = np.asarray(forward_logits(model32, jnp.asarray([ids], jnp.int32)), np.float32)
    hf = transformers.AutoModelForCausalLM.from_pretrained(export_dir, dtype=torch.float32)
    with torch.no_grad():
        theirs = hf(torch.tensor([ids])).logits.float().numpy()
    return float(np.max(np.abs(ours - theirs)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="2-layer, 64-wide Qwen2 instead")
    parser.add_argument("--dry-run", action="store_true", help="build and check, do not train")
    parser.add_argument("--steps", type=int, default=3, help="RL steps")
    parser.add_argument("--bpe-vocab", type=int, default=2048, help="BPE vocabulary size")
    parser.add_argument("--keep", metavar="DIR", help="work here and keep it (default: temp)")
    args = parser.parse_args()

    from benchlib import machine

    times: dict[str, float] = {}
    work = pathlib.Path(args.keep) if args.keep else pathlib.Path(tempfile.mkdtemp("rehearsal"))
    work.mkdir(parents=True, exist_ok=True)
    ckpt, run_dir, export_dir = work / "ckpt", work / "run", work / "export"

    t0 = time.perf_counter()
    tokenizer = build_tokenizer(ckpt, vocab=args.bpe_vocab, seed=0)
    times["tokenizer"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    n_params = build_checkpoint(ckpt, tokenizer, tiny=args.tiny)
    times["checkpoint"] = time.perf_counter() - t0
    train, test = write_data(work, seed=0)
    overrides = _overrides(ckpt, train, test, run_dir, args.steps)
    cmd = [sys.executable, "-m", "grpojax.cli", "train", "--no-progress", "--config", str(YAML)]
    cmd += overrides

    # The run config must load (the overrides are valid) before anything slow starts.
    from grpojax.cli import load_run_config

    cfg = load_run_config(str(YAML), overrides)
    print(f"machine: {machine()}")
    print(f"work dir: {work}")
    print(
        f"model: Qwen2 {'tiny' if args.tiny else '0.5B'} params={n_params:,} "
        f"(compute {cfg.model.dtype}, params {cfg.model.param_dtype}, remat {cfg.model.remat}); "
        f"tokenizer: byte-level BPE, {len(tokenizer)} tokens, eos {tokenizer.eos_token_id}"
    )
    print("train command: grpojax train --no-progress --config " + str(YAML) + " \\")
    print("    " + " ".join(overrides))
    if args.dry_run:
        print(
            f"rehearsal: params={n_params} peak_rss_mb={_self_rss_mb():.0f} step_s=nan "
            "export_max_abs_logit_diff=nan"
        )
        return

    t0 = time.perf_counter()
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    proc = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True)
    times["train"] = time.perf_counter() - t0
    (work / "train.log").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        sys.exit(
            f"grpojax train failed (rc={proc.returncode}); log: {work / 'train.log'}\n"
            + proc.stderr[-3000:]
        )
    print("train: " + proc.stdout.strip().splitlines()[-1])
    rows = [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines()]
    step_times = [r["step_time_s"] for r in rows if "step_time_s" in r]
    step_s = statistics.median(step_times[1:] or step_times)

    t0 = time.perf_counter()
    policy, tokenizer, step = restore_and_export(run_dir, export_dir, env)
    times["export"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    diff = compare_logits(policy, tokenizer, export_dir)
    times["compare"] = time.perf_counter() - t0

    peak = max(_self_rss_mb(), _children_rss_mb())
    print(f"RL step times (s): {', '.join(f'{t:.1f}' for t in step_times)} (first compiles)")
    print(f"{'phase':<10} {'seconds':>8}")
    for k, v in times.items():
        print(f"{k:<10} {v:>8.1f}")
    print(
        f"peak RSS: this process {_self_rss_mb():.0f} MB, train subprocess "
        f"{_children_rss_mb():.0f} MB; exported RL step {step} to {export_dir}"
    )
    print(
        f"rehearsal: params={n_params} peak_rss_mb={peak:.0f} step_s={step_s:.2f} "
        f"export_max_abs_logit_diff={diff:.3g}"
    )


if __name__ == "__main__":
    for room in ("bench", "tools"):  # benchlib, prepare_gsm8k
        sys.path.insert(0, str(REPO / "experiments" / room))
    main()
