"""Moving arrays between device sets across processes (split placement's weight transfer,
`grpojax.models.sharding.move_to_mesh`) and the host gathers that stay off the sampler's
devices (`grpojax.distributed.host_allgather`), or on them (`on_primary` over
`process_devices(rollout_mesh)`, as split placement's episodes send the environments'
results): 2 processes x 4 fake CPU devices (gloo), against the host values every process
knows."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
from multidevice import ROOT, child_env, free_port

WORKER = textwrap.dedent(
    """
    import sys
    import jax
    import numpy as np
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(sys.argv[1], 2, int(sys.argv[2]))
    from jax.sharding import NamedSharding, PartitionSpec as P
    from grpojax.distributed import gather_rows, host_allgather, on_primary, process_devices
    from grpojax.models.sharding import make_mesh, move_to_mesh

    me = jax.process_index()
    devs = jax.devices()  # process 0's 4, then process 1's 4
    # Training: each process's first 2 devices (tensor 2 within a process, fsdp 2 across);
    # sampling: each process's last 2 (tensor 2 within, data 2 across): split placement.
    train = make_mesh(data=1, fsdp=2, tensor=2, devices=[*devs[0:2], *devs[4:6]])
    rollout = make_mesh(data=2, fsdp=1, tensor=2, devices=[*devs[2:4], *devs[6:8]])
    rng = np.random.default_rng(0)
    host = {
        "w": rng.normal(size=(4, 6)).astype(np.float32),
        "v": rng.normal(size=(8,)).astype(np.float32),
        "b": np.arange(5, dtype=np.int32),
    }
    specs = {"w": P("fsdp", "tensor"), "v": P(("fsdp", "tensor")), "b": P()}
    on_train = {
        k: jax.make_array_from_callback(
            x.shape, NamedSharding(train, specs[k]), lambda i, x=x: x[i]
        )
        for k, x in host.items()
    }
    moved = move_to_mesh(on_train, rollout)
    for k, x in moved.items():
        assert x.sharding == NamedSharding(rollout, specs[k]), (k, x.sharding)
        assert len(x.addressable_shards) == 2, k
        for s in x.addressable_shards:
            assert s.device in devs[2:4] + devs[6:8], (k, s.device)
            np.testing.assert_array_equal(np.asarray(s.data), host[k][s.index], err_msg=k)
    # "v" over (fsdp, tensor) keeps only tensor on the rollout mesh: half of it a device.
    assert moved["v"].addressable_shards[0].data.shape == (4,)
    # A training mesh whose tensor pairs span the processes: a process's own training
    # devices lack shards its rollout devices need.
    crossed = make_mesh(data=1, fsdp=2, tensor=2, devices=[devs[0], devs[4], devs[1], devs[5]])
    x = jax.make_array_from_callback(
        (4, 6), NamedSharding(crossed, P(None, "tensor")), lambda i: host["w"][i]
    )
    try:
        move_to_mesh({"w": x}, rollout)
    except ValueError as e:
        assert "do not hold the shard" in str(e) and "['w']" in str(e), e
    else:
        raise AssertionError("a missing shard was not refused")
    got = host_allgather({"a": np.array([me, 7], np.int32), "f": np.float32(me) / 4})
    np.testing.assert_array_equal(got["a"], [[0, 7], [1, 7]])
    np.testing.assert_array_equal(got["f"], [0.0, 0.25])
    rows = gather_rows({"r": np.array([[me, 1.5]], np.float64)}, np.array([1 - me]), 2)
    np.testing.assert_array_equal(rows["r"], [[1, 1.5], [0, 1.5]])  # float64 kept exact
    # Over the rollout devices: each process's first one there (devices 2 and 6).
    ends = process_devices(rollout)
    assert ends == [devs[2], devs[6]], ends
    got = host_allgather({"a": np.array([me], np.int32)}, ends)
    np.testing.assert_array_equal(got["a"], [[0], [1]])
    calls = []
    value = on_primary(lambda: calls.append(me) or {"step": "answer", "from": me}, ends)
    assert value == {"step": "answer", "from": 0} and calls == ([0] if me == 0 else []), value
    try:
        on_primary(lambda: 1 / 0, ends)
    except RuntimeError as e:
        assert "ZeroDivisionError" in str(e), e
    else:
        raise AssertionError("process 0's failure was not sent")
    try:  # a mesh on one process's devices cannot carry a collective across the two
        process_devices(make_mesh(data=1, fsdp=2, tensor=2, devices=devs[0:4]))
    except ValueError as e:
        assert "processes [0]" in str(e), e
    else:
        raise AssertionError("a one-process mesh was taken")
    print("OK", me)
    """
)


@pytest.mark.slow
def test_move_to_mesh_and_host_gathers_across_two_processes(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    env = child_env(4)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    address = f"localhost:{free_port()}"
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), address, str(i)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        for i in range(2)
    ]
    logs = []
    for p in procs:
        try:
            logs.append(p.communicate(timeout=300)[0].decode())
        finally:
            if p.poll() is None:
                p.kill()
    for i, (p, log) in enumerate(zip(procs, logs)):
        assert p.returncode == 0 and f"OK {i}" in log, log[-4000:]
