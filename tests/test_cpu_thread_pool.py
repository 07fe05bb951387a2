"""XLA:CPU's thread pool holds every fake device's blocking collectives
(`grpojax.distributed.size_cpu_thread_pool`)."""

from __future__ import annotations

import os

import pytest
from multidevice import run_with_devices

from grpojax import cli
from grpojax.distributed import THREADS_PER_CPU_DEVICE, size_cpu_thread_pool

FLAG = "--xla_force_host_platform_device_count"


@pytest.mark.parametrize(
    "env, size",
    [
        ({}, None),
        ({"XLA_FLAGS": "--xla_backend_optimization_level=0"}, None),
        ({"XLA_FLAGS": f"{FLAG}=1"}, None),
        ({"XLA_FLAGS": f"{FLAG}=8", "PJRT_NPROC": "3"}, None),  # the user's choice stands
        ({"XLA_FLAGS": f"{FLAG}=x"}, None),  # not a count: XLA itself rejects it
        ({"XLA_FLAGS": f"--xla_backend_optimization_level=0 {FLAG}=8"}, max(os.cpu_count(), 32)),
        ({"XLA_FLAGS": f"{FLAG}=2 {FLAG}=64"}, max(os.cpu_count(), 256)),  # the last one wins
    ],
)
def test_pool_size_from_the_device_count(env, size):
    before = dict(env)
    assert size_cpu_thread_pool(env) == size
    assert env == (before if size is None else {**before, "PJRT_NPROC": str(size)})


def test_xla_makes_the_pool_that_size():
    """A child with 8 fake devices (its environment from `multidevice.child_env`) has
    max(cores, 4 x 8) XLA:CPU pool threads, where XLA alone makes max(cores, 8)."""
    out = run_with_devices(
        """
        import os
        import jax.numpy as jnp
        (jnp.ones((64, 64)) @ jnp.ones((64, 64))).block_until_ready()
        names = [open(f"/proc/self/task/{t}/comm").read() for t in os.listdir("/proc/self/task")]
        print("pool", sum("XLAEigen" in n for n in names), "PJRT_NPROC", os.environ["PJRT_NPROC"])
        """,
        n_devices=8,
    )
    size = max(os.cpu_count(), THREADS_PER_CPU_DEVICE * 8)
    assert f"pool {size} PJRT_NPROC {size}" in out, out


def test_the_cli_sets_the_pool_size(monkeypatch, tmp_path):
    monkeypatch.setenv("XLA_FLAGS", f"{FLAG}=4")
    monkeypatch.setenv("PJRT_NPROC", "")  # unset for the CLI; removed again after the test
    # Any command: this one fails on its missing run directory after the sizing.
    assert cli.main(["export", str(tmp_path / "missing"), "--out", str(tmp_path / "o")]) == 2
    assert os.environ["PJRT_NPROC"] == str(max(os.cpu_count(), 4 * THREADS_PER_CPU_DEVICE))
