"""What the benchmark scripts share: the machine line and the issues' tiny Qwen2 checkpoint."""

from __future__ import annotations

import os
import pathlib
import platform


def machine() -> str:
    """'<CPU model> (<arch>), <n> cores, jax <version>' for the table header."""
    import jax

    cpu = platform.processor() or "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{cpu} ({platform.machine()}), {os.cpu_count()} cores, jax {jax.__version__}"


def build_tiny_qwen2(path: str | os.PathLike, *, tokenizer=None) -> None:
    """The random Qwen2 both benchmarks name, saved as safetensors with `transformers`.

    vocab 512, D 256, intermediate 688, 4 layers, 4 heads, 2 kv heads, tied embeddings,
    float32, seed 0. `tokenizer` (saved alongside) also sets the bos/eos/pad ids.
    """
    import torch
    import transformers

    ids = {}
    if tokenizer is not None:
        ids = dict(
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
    config = transformers.Qwen2Config(
        vocab_size=512,
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        rope_theta=10000.0,
        torch_dtype="float32",
        **ids,
    )
    torch.manual_seed(0)
    path = pathlib.Path(path)
    path.mkdir(parents=True, exist_ok=True)
    transformers.Qwen2ForCausalLM(config).to(torch.float32).save_pretrained(path)
    if tokenizer is not None:
        tokenizer.save_pretrained(path)
