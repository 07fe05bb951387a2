"""Run a test body in a fresh Python process with N fake CPU devices.

JAX fixes its device count when it starts, so multi-device checks cannot share the
pytest process. `run_with_devices(code)` runs `code` in a child with
`XLA_FLAGS=--xla_force_host_platform_device_count=N` and fails the test with the
child's output if it exits non-zero. `free_port()` picks the coordinator port of
multi-process tests.
"""

from __future__ import annotations

import os
import pathlib
import socket
import subprocess
import sys
import textwrap

from grpojax.distributed import size_cpu_thread_pool

ROOT = pathlib.Path(__file__).resolve().parent.parent


def free_port() -> int:
    """A TCP port on localhost that is free now (for a multi-process run's coordinator)."""
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def xla_flags(n_devices: int) -> str:
    """XLA_FLAGS for a child process with `n_devices` fake CPU devices: this process's
    flags (the suite's compile settings, conftest) plus the device count."""
    kept = [f for f in os.environ.get("XLA_FLAGS", "").split() if "device_count=" not in f]
    return " ".join([*kept, f"--xla_force_host_platform_device_count={n_devices}"])


def child_env(n_devices: int) -> dict:
    """This process's environment for a child with `n_devices` fake CPU devices: its
    XLA_FLAGS and a thread pool large enough for their collectives
    (`grpojax.distributed.size_cpu_thread_pool`)."""
    env = dict(os.environ)
    env.pop("PJRT_NPROC", None)
    env["XLA_FLAGS"] = xla_flags(n_devices)
    env["JAX_PLATFORMS"] = "cpu"
    size_cpu_thread_pool(env)
    return env


def run_with_devices(code: str, *, n_devices: int = 8, timeout: float = 600) -> str:
    env = child_env(n_devices)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "tests"), env.get("PYTHONPATH", "")])
    prelude = (
        "import os, jax\n"
        "jax.config.update('jax_compilation_cache_dir', os.environ['JAX_COMPILATION_CACHE_DIR'])\n"
        f"assert jax.device_count() == {n_devices}, jax.devices()\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", prelude + textwrap.dedent(code)],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
    )
    if proc.returncode != 0:
        raise AssertionError(
            f"child with {n_devices} devices failed (rc={proc.returncode}):\n"
            f"--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}"
        )
    return proc.stdout
