"""The built-in rollout engines against vLLM's CPU build on the one real checkpoint,
SmolLM2-135M-Instruct (GGUF, dequantized to float32), chat prompts with natural stops.

Workload: B chat-templated questions (`--prompts`, 16) x G samples (`--group`, 8),
temperature 1, no truncation, up to T new tokens (`--max-new-tokens`, 384), each row ending
at the model's EOS (<|im_end|>) or at T. Both sides run the same float32 weights: vLLM loads
the policy as `rollout.engine=vllm` gives it (`VLLMEngine.sync`: `save_pretrained` of the
GGUF-loaded model). The engines draw their own samples (the built-in ones all the same for
the same key; vLLM its own), so each figure is its own generated tokens over its own wall
time; each side's token count is printed.

vLLM is given its best setting: on x86 its CPU worker keeps one core for its scheduler by
default (`VLLM_CPU_NUM_OF_RESERVED_CPU` unset), and `VLLM_CPU_NUM_OF_RESERVED_CPU=0` gives
it both (grpojax's worker leaves vLLM's OpenMP threads unpinned, `VLLM_CPU_OMP_THREADS_BIND=
nobind`, and on the 2-core machine the two measured the same). Both are measured, eager (as
`rollout.engine=vllm` runs it), and with `--vllm-compile` also compiled on both cores
(`enforce_eager=False`: torch.compile); the ratio is against the fastest. Each engine is
warmed up (compiled; vLLM: its first call), then timed `--calls` times; the figure is the
fastest call.

Measure on a quiet machine (nothing else running). Last line:

    bench_smollm2: builtin_tok_s=.. vllm_tok_s=.. ratio=.. best_engine=.. vllm_setting=..

    python experiments/tools/fetch_smollm2.py && python experiments/bench/bench_smollm2.py
"""

from __future__ import annotations

import argparse
import contextlib
import os
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tools"))  # fetch_smollm2

from benchlib import exact_float32_matmuls, machine, wall_times
from fetch_smollm2 import DEFAULT_DIR, fetch

QUESTIONS = [
    "What is 17 + 25?",
    "Write a short story about a robot who learns to paint.",
    "Explain how a rainbow forms.",
    "List five fruits and describe each in one sentence.",
    "Why is the sky blue?",
    "Describe a day in the life of a lighthouse keeper.",
    "What are the benefits of regular exercise?",
    "Give me three tips for learning a new language.",
    "What is the capital of France?",
    "Write a haiku about autumn.",
    "How do plants make their food?",
    "Summarize the plot of Cinderella in two sentences.",
    "What is 12 times 11?",
    "Name three famous scientists and what they discovered.",
    "How does a bicycle stay upright?",
    "Translate 'good morning' into Spanish and French.",
]
EOS = 2  # <|im_end|>


def chat_prompts(tokenizer, questions):
    """(ids `[B, W]` left-padded, lengths `[B]`) of the chat-templated questions."""
    import numpy as np

    texts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True
        )
        for q in questions
    ]
    rows = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    width = max(map(len, rows))
    out = np.full((len(rows), width), EOS, np.int32)
    for i, r in enumerate(rows):
        out[i, width - len(r) :] = r
    return out, np.array([len(r) for r in rows], np.int32)


@contextlib.contextmanager
def environ(**values):
    """Set environment variables (None: unset) for the block."""
    old = {k: os.environ.get(k) for k in values}
    for k, v in values.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gguf", default=None, help="default: fetch_smollm2.py's file")
    parser.add_argument("--vllm-python", default=None)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=384)
    parser.add_argument("--calls", type=int, default=2)
    engines = ["static", "continuous:32", "continuous:64", "compact"]
    parser.add_argument("--engines", nargs="+", default=engines)
    parser.add_argument("--no-vllm", action="store_true", help="the built-in engines only")
    parser.add_argument(
        "--vllm-compile", action="store_true", help="also vLLM compiled (enforce_eager=False)"
    )
    args = parser.parse_args()

    import jax
    import jax.numpy as jnp
    import numpy as np

    from grpojax.models import from_pretrained, load_tokenizer
    from grpojax.sampling import SamplingConfig, generate
    from grpojax.sampling.vllm_engine import VLLMEngine

    path = pathlib.Path(args.gguf) if args.gguf else fetch(DEFAULT_DIR)
    precision = exact_float32_matmuls()
    model, tokenizer = from_pretrained(path), load_tokenizer(path)
    config = model.config
    questions = [QUESTIONS[i % len(QUESTIONS)] for i in range(args.prompts)]
    prompts, plens = chat_prompts(tokenizer, questions)
    b, g, t = args.prompts, args.group, args.max_new_tokens
    n = b * g
    p = prompts.shape[1]
    print(f"machine: {machine()}")
    print(
        f"jax {jax.__version__} ({jax.default_backend()}); model {path.name}: "
        f"L={config.num_layers} D={config.hidden_size} V={config.vocab_size}, float32; "
        f"{precision}"
    )
    print(
        f"workload: N={n} rows (B {b} x G {g}), prompts {plens.min()}-{plens.max()} tokens, "
        f"temperature 1, up to {t} new tokens, natural stops (EOS {EOS}); fastest of "
        f"{args.calls} calls after a warm-up"
    )
    common = dict(
        key=jax.random.key(1),
        max_new_tokens=t,
        group_size=g,
        sampling=SamplingConfig(temperature=1.0),
        eos_ids=(EOS,),
        pad_id=EOS,
    )
    rate, tokens_of, ended = {}, {}, {}
    for name in args.engines:
        engine, _, slots = name.partition(":")
        kw = dict(engine=engine, slots=int(slots)) if slots else dict(engine=engine)

        def call(kw=kw):
            out = generate(model, jnp.asarray(prompts), jnp.asarray(plens), **common, **kw)
            jax.block_until_ready(out.tokens_nt)
            return out

        out = call()  # compiles
        tokens_of[name] = int(np.asarray(out.lengths_n).sum())
        ended[name] = float(np.asarray(out.eos_found_n).mean())
        rate[name] = tokens_of[name] / min(wall_times(call, args.calls))
        print(f"  {name}: {rate[name]:.1f} tok/s", flush=True)

    if not args.no_vllm:
        python = args.vllm_python
        if python is None:
            sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "tests"))
            from user_cache import user_cache_dir

            from grpojax.jobs.vllm_env import create_vllm_env

            python = str(create_vllm_env(user_cache_dir("vllm-env"), print_fn=lambda s: None))
        per_token = 2 * config.num_layers * config.num_kv_heads * config.head_dim * 4
        kv_mb = max(64, int(1.25 * n * (p + t) * per_token / 2**20))
        settings = [("both cores", "0", True), ("default binding", None, True)]
        if args.vllm_compile:
            settings += [("both cores, compiled", "0", False)]
        for setting, reserved, eager in settings:
            with environ(VLLM_CPU_NUM_OF_RESERVED_CPU=reserved):
                engine = VLLMEngine(
                    python=python, max_model_len=p + t, kv_cache_mb=kv_mb, max_num_seqs=n,
                    enforce_eager=eager, start_timeout_s=1800.0,
                )  # fmt: skip
                try:
                    t0 = time.perf_counter()
                    engine.sync(model, 0)
                    print(f"  vLLM ({setting}) start {time.perf_counter() - t0:.1f} s", flush=True)

                    def vcall(engine=engine):
                        return engine.generate(
                            prompts, plens, **common, vocab_size=config.vocab_size
                        )

                    out = vcall()
                    name = f"vllm ({setting})"
                    tokens_of[name] = int(np.asarray(out.lengths_n).sum())
                    ended[name] = float(np.asarray(out.eos_found_n).mean())
                    rate[name] = tokens_of[name] / min(wall_times(vcall, args.calls))
                    print(f"  {name}: {rate[name]:.1f} tok/s", flush=True)
                finally:
                    engine.close()

    builtin = {k: v for k, v in rate.items() if not k.startswith("vllm")}
    vllm = {k: v for k, v in rate.items() if k.startswith("vllm")}
    best = max(builtin, key=builtin.get)
    base = max(vllm, key=vllm.get) if vllm else best
    print(f"{'engine':>24} {'tokens':>7} {'ended':>6} {'tok/s':>8} {'vs ' + base:>28}")
    for name, r in rate.items():
        print(
            f"{name:>24} {tokens_of[name]:>7} {ended[name]:>6.2f} {r:>8.1f} "
            f"{r / rate[base]:>27.2f}x"
        )
    vllm_rate = rate[base] if vllm else float("nan")
    print(
        f"bench_smollm2: builtin_tok_s={builtin[best]:.1f} vllm_tok_s={vllm_rate:.1f} "
        f"ratio={builtin[best] / vllm_rate:.2f} best_engine={best} "
        f"vllm_setting={base.removeprefix('vllm (').removesuffix(')').replace(' ', '_')}"
    )


if __name__ == "__main__":
    main()
