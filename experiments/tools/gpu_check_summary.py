"""The summary of `run_on_gpu.sh gpu_check` (the accelerator issue's checks in one call).

Reads the job outputs in OUTDIR (`gpu_check_tests.txt`, `gpu_check_decode.txt`,
`gpu_check_attention.txt`, `gpu_check_update.txt`), prints one row per check with the file
it came from, and ends with

    gpu_check: card=.. decode_tok_s=.. decode_speedup=.. decode_vs_bound=..
               attention_speedup=.. update_mfu=.. tests=..   (one line)

- decode_tok_s: the compacting engine's tokens/s on the long tail (`bench_sampler_longtail
  --compact --bound`); decode_speedup: over the best continuous slot count, run in the same
  call (the engine `auto` takes on an accelerator); decode_vs_bound: the fastest engine's
  time over the memory bound (weights and live caches read once a step).
- attention_speedup: the fused backend's forward+backward speed over the blockwise one's at
  the longest length (`bench_attention`'s `fused_over_blockwise`).
- update_mfu: the GRPO update's fraction of the measured matmul peak (`bench_roofline`'s
  `update_frac`).
- tests: passed/failed of the GPU test subset.

A check whose output is missing or cut short reads "missing". `python
experiments/tools/gpu_check_summary.py OUTDIR [--card NAME]` (card: JAX's device kind when not
given).
"""

from __future__ import annotations

import argparse
import pathlib
import re

CHECKS = {  # key -> (file, the summary line's prefix, the field read from it)
    "decode_tok_s": ("gpu_check_decode.txt", "bench_sampler_longtail:", "compact_tok_s"),
    "decode_speedup": (
        "gpu_check_decode.txt",
        "bench_sampler_longtail:",
        "compact_over_continuous",
    ),
    "decode_vs_bound": ("gpu_check_decode.txt", "bench_sampler_longtail:", "best_vs_bound"),
    "attention_speedup": ("gpu_check_attention.txt", "bench_attention:", "fused_over_blockwise"),
    "update_mfu": ("gpu_check_update.txt", "bench_roofline:", "update_frac"),
}


def field(text: str, prefix: str, name: str) -> str:
    """`name=value` of the last line of `text` that starts with `prefix` ("missing": none)."""
    lines = [ln for ln in text.splitlines() if ln.startswith(prefix)]
    if not lines:
        return "missing"
    m = re.search(rf"(?:^|\s){re.escape(name)}=(\S+)", lines[-1])
    return m.group(1) if m else "missing"


def tests_result(text: str) -> str:
    """ "P passed F failed" of pytest's last summary line in `text` ("missing": none)."""
    found = re.findall(r"^=*\s*(.*\b(?:passed|failed|error)\b.*) in [\d.]+s", text, re.M)
    if not found:
        return "missing"
    counts = dict((k, v) for v, k in re.findall(r"(\d+) (passed|failed|error)", found[-1]))
    return f"{counts.get('passed', '0')}passed/{counts.get('failed', '0')}failed"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("outdir", type=pathlib.Path)
    parser.add_argument("--card", default=None)
    args = parser.parse_args()
    read = lambda name: (args.outdir / name).read_text() if (args.outdir / name).exists() else ""
    card = args.card
    if card is None:
        import jax

        card = jax.devices()[0].device_kind
    values = {"card": re.sub(r"\s+", "_", card)}
    print(f"{'check':<18} {'value':>10}  from")
    for key, (name, prefix, name_in_line) in CHECKS.items():
        values[key] = field(read(name), prefix, name_in_line)
        print(f"{key:<18} {values[key]:>10}  {name}")
    values["tests"] = tests_result(read("gpu_check_tests.txt"))
    print(f"{'tests':<18} {values['tests']:>10}  gpu_check_tests.txt")
    print("gpu_check: " + " ".join(f"{k}={v}" for k, v in values.items()))


if __name__ == "__main__":
    main()
