"""The GRPO step on 8 fake devices (fsdp x tensor, data) and on 2 processes equals 1 device."""

from __future__ import annotations

import os
import pathlib
import socket
import subprocess
import sys

import numpy as np
import pytest
from multidevice import run_with_devices

HERE = pathlib.Path(__file__).resolve().parent
WORKER = HERE / "train_distributed_worker.py"
KEYS = ("first_loss", "loss", "pg_loss", "kl_loss")


@pytest.mark.slow
def test_grpo_step_8_devices_matches_one_device():
    out = run_with_devices(
        """
        import jax, numpy as np
        jax.config.update("jax_default_matmul_precision", "highest")
        from grpojax.models import make_mesh
        from train_distributed_worker import grpo_step_result
        one = make_mesh(fsdp=1, devices=jax.devices()[:1])
        cases = [(False, dict(fsdp=4, tensor=2)), (False, dict(data=8, fsdp=1)),
                 (True, dict(fsdp=4, tensor=2))]
        ref = {share: grpo_step_result(one, share_prompt=share) for share in (False, True)}
        for share, sizes in cases:
            m1, p1 = ref[share]
            m8, p8 = grpo_step_result(make_mesh(**sizes), share_prompt=share)
            for k in ("first_loss", "loss", "pg_loss", "kl_loss"):
                np.testing.assert_allclose(m8[k], m1[k], rtol=1e-5, atol=1e-6, err_msg=k)
            np.testing.assert_allclose(p8, p1, rtol=0, atol=1e-5)
            print(sizes, share, "max param diff", np.abs(p8 - p1).max(), "loss", m8["loss"])
        """,
        n_devices=8,
    )
    assert out.count("max param diff") == 3, out


@pytest.mark.slow
def test_every_policy_loss_8_devices_matches_one_device():
    """The losses that reach across tokens give the same step on a (data 2, fsdp 2,
    tensor 2) mesh as on one device: GMPO (one loss per sequence) and Clip-Cov / KL-Cov
    (tokens ranked over the whole mini-batch, here split over 2 micro-batches and 8
    devices); metrics within 1e-5 relative, SGD-updated parameters within 1e-5 (the
    8-device GRPO test's bounds). The token-wise losses (CISPO, SAPO, DPPO) are compared
    sharded against unsharded as ops in test_ops_sharding.py; PPO-clip by the test above."""
    out = run_with_devices(
        """
        import jax, numpy as np
        jax.config.update("jax_default_matmul_precision", "highest")
        from grpojax.models import make_mesh
        from train_distributed_worker import grpo_step_result
        one = make_mesh(fsdp=1, devices=jax.devices()[:1])
        eight = make_mesh(data=2, fsdp=2, tensor=2)
        for loss in ("gmpo", "clip_cov", "kl_cov"):
            kw = dict(policy_loss=loss, num_minibatches=1, clip_cov_ratio=0.1, kl_cov_ratio=0.1)
            m1, p1 = grpo_step_result(one, **kw)
            m8, p8 = grpo_step_result(eight, **kw)
            assert set(m8) == set(m1), loss
            for k in m1:
                np.testing.assert_allclose(
                    m8[k], m1[k], rtol=1e-5, atol=1e-6, err_msg=f"{loss} {k}"
                )
            np.testing.assert_allclose(p8, p1, rtol=0, atol=1e-5, err_msg=loss)
            print(loss, "max param diff", np.abs(p8 - p1).max())
        """,
        n_devices=8,
    )
    assert out.count("max param diff") == 3, out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _env(n_devices: int) -> dict:
    env = dict(os.environ)
    env["XLA_FLAGS"] = (
        env.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={n_devices}"
    )
    env["JAX_PLATFORMS"] = "cpu"
    env["JAX_DEFAULT_MATMUL_PRECISION"] = "highest"
    root = HERE.parent
    env["PYTHONPATH"] = os.pathsep.join([str(root), str(HERE), env.get("PYTHONPATH", "")])
    return env


@pytest.mark.slow
def test_grpo_step_two_processes_matches_one_process(tmp_path):
    single = tmp_path / "single.npz"
    subprocess.run(
        [sys.executable, str(WORKER), str(single)],
        env=_env(1),
        check=True,
        timeout=600,
        cwd=HERE.parent,
        capture_output=True,
    )
    port = _free_port()
    multi = tmp_path / "multi.npz"
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), str(multi), str(i), "2", str(port)],
            env=_env(2),
            cwd=HERE.parent,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(2)
    ]
    logs = []
    for p in procs:
        try:
            logs.append(p.communicate(timeout=600)[0])
        finally:
            if p.poll() is None:
                p.kill()
    assert all(p.returncode == 0 for p in procs), "\n".join(logs)
    a, b = np.load(single), np.load(multi)
    for k in KEYS:
        np.testing.assert_allclose(b[k], a[k], rtol=1e-5, atol=1e-6, err_msg=k)
    np.testing.assert_allclose(b["params"], a["params"], rtol=0, atol=1e-5)
