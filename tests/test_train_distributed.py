"""The GRPO step on 8 fake devices (fsdp x tensor, data) and on 2 processes equals 1 device."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest
from multidevice import child_env, free_port, run_with_devices

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
def test_grpo_step_with_context_parallelism_matches_one_device():
    """Context parallelism (each sequence's tokens over the `context` axis, attention on
    whole sequences with heads over tensor x context) gives one device's GRPO step: on 8
    fake devices with the context axis 2, 4 and 8, composed with fsdp, tensor and data,
    on padded rows (left-padded prompts, right-padded completions of 4 + 12 columns),
    packed rows (bins of 16), the shared-prompt layout and a sliding-window model: loss
    metrics within 1e-5 relative and SGD-updated parameters within 1e-5 (the 8-device
    test's bounds), and the trainer's logprob pass (policy logp, entropy, reference logp)
    agrees with one device's within 1e-5; the forward's hidden states leave with their
    tokens split over context, q|k|v moved by all-to-all (the layout is really split)."""
    out = run_with_devices(
        """
        import jax, jax.numpy as jnp, numpy as np
        jax.config.update("jax_default_matmul_precision", "highest")
        from jax.sharding import NamedSharding, PartitionSpec as P
        from grpojax.models import make_mesh
        from grpojax.train.common import make_logprob_pass
        from train_distributed_worker import grpo_step_state, _flat_global
        from train_helpers import FORWARD, random_grpo_batch, small_model
        from flax import nnx
        one = make_mesh(fsdp=1, devices=jax.devices()[:1])
        shape = dict(p=4, t=12)
        cases = [
            ("padded", dict(fsdp=4, context=2), dict()),
            ("packed", dict(fsdp=1, context=8), dict(pack_width=16)),
            ("shared", dict(fsdp=2, context=4), dict(share_prompt=True)),
            ("window", dict(data=2, tensor=2, fsdp=1, context=2),
             dict(model_overrides=dict(sliding_window=5))),
        ]
        for name, sizes, kw in cases:
            m1, s1 = grpo_step_state(one, shape=shape, **kw)
            m8, s8 = grpo_step_state(make_mesh(**sizes), shape=shape, **kw)
            for k in ("first_loss", "loss", "pg_loss", "kl_loss"):
                np.testing.assert_allclose(
                    m8[k], m1[k], rtol=1e-5, atol=1e-6, err_msg=f"{name} {k}"
                )
            p1, p8 = _flat_global(s1.params), _flat_global(s8.params)
            np.testing.assert_allclose(p8, p1, rtol=0, atol=1e-5, err_msg=name)
            print(name, sizes, "max param diff", np.abs(p8 - p1).max())

        # the logprob pass, context 8: whole rows of 16 tokens, 2 tokens a device
        batch = random_grpo_batch(32, n=16, **shape)
        graphdef, params = nnx.split(small_model(31))
        rows = (batch.tokens_ns, batch.mask_ns, batch.completion_mask_nt)
        outs = {}
        for name, mesh in (("one", one), ("context8", make_mesh(fsdp=1, context=8))):
            put = lambda x: jax.device_put(x, NamedSharding(mesh, P()))
            fn = make_logprob_pass(graphdef, FORWARD, mesh, group_size=1)
            ps = put(params)
            outs[name] = [np.asarray(x) for x in fn(ps, ps, *map(put, rows))[:3]]
        diffs = [np.abs(a - b).max() for a, b in zip(outs["one"], outs["context8"])]
        assert max(diffs) <= 1e-5, diffs
        print("logprob pass max diff", max(diffs))

        # the forward's program on fsdp 4 x context 2 (4 query / 2 kv heads: both split):
        # hidden states leave with their tokens over context; q|k|v move by all-to-all
        mesh = make_mesh(fsdp=4, context=2)
        put = lambda x: jax.device_put(x, NamedSharding(mesh, P()))
        def hidden(params, tokens, mask):
            return nnx.merge(graphdef, params)(tokens, mask_nt=mask)[0]
        with jax.set_mesh(mesh):
            c = jax.jit(hidden).lower(put(params), put(rows[0]), put(rows[1])).compile()
        spec = tuple(c.output_shardings.spec)
        assert spec[:2] == ("fsdp", "context"), spec
        assert c.as_text().count("all-to-all(") >= 1
        print("hidden", spec, "all-to-alls", c.as_text().count("all-to-all("))
        """,
        n_devices=8,
    )
    assert out.count("max param diff") == 4 and "logprob pass max diff" in out, out


@pytest.mark.slow
def test_every_policy_loss_and_lora_8_devices_matches_one_device():
    """The losses that reach across tokens give the same step on a (data 2, fsdp 2,
    tensor 2) mesh as on one device: GMPO (one loss per sequence) and Clip-Cov / KL-Cov
    (tokens ranked over the whole mini-batch, here split over 2 micro-batches and 8
    devices); metrics within 1e-5 relative, SGD-updated parameters within 1e-5 (the
    8-device GRPO test's bounds). Each runs with advantages computed inside the step by an
    estimator that takes more than the rewards (GDPO: `[N, R]` per-function rewards, ReMax:
    greedy rewards, OPO: lengths), so those sharded inputs are covered at no extra compile.
    The token-wise losses (CISPO, SAPO, DPPO) and the other estimators are compared sharded
    against unsharded as ops in test_ops_sharding.py; PPO-clip by the test above.

    In the same child (one process launch): a LoRA GRPO step (rank 4 on every target, the
    reference = the base with adapters off) on the same mesh equals one device: metrics and
    updated adapters within the same bounds, the SGD-momentum trace within 1e-4 (the
    adapter bound over the learning rate 0.1, as the update is lr x trace). Its adapters and
    their optimizer state are sharded as the base weights' rules say (A: the base's input
    axes, B: its output axes, the rank axis replicated)."""
    out = run_with_devices(
        """
        import time
        import jax, numpy as np
        jax.config.update("jax_default_matmul_precision", "highest")
        from grpojax.models import make_mesh
        from grpojax.models.lora import TARGETS
        from grpojax.train.state import trainable_split
        from train_distributed_worker import grpo_step_result, lora_grpo_step_result
        from train_helpers import random_grpo_batch
        one = make_mesh(fsdp=1, devices=jax.devices()[:1])
        eight = make_mesh(data=2, fsdp=2, tensor=2)
        rng = np.random.default_rng(3)
        rewards = (rng.random(16) < 0.5).astype(np.float32)
        rewards[:4] = [1, 0, 0, 0]
        valid = np.arange(16) != 6
        cmask = np.asarray(random_grpo_batch(32, n=16).completion_mask_nt)
        fields = dict(
            advantages=None, rewards_n=rewards, valid_n=valid,
            lengths_n=cmask.sum(1).astype(np.int32),
            greedy_rewards_n=np.repeat(rng.random(4), 4).astype(np.float32),
            rewards_nr=np.stack([rewards, rng.normal(size=16)], 1).astype(np.float32),
        )
        for loss, estimator in (("gmpo", "gdpo"), ("clip_cov", "remax"), ("kl_cov", "opo")):
            kw = dict(policy_loss=loss, advantage_estimator=estimator, group_size=4,
                      num_minibatches=1, clip_cov_ratio=0.1, kl_cov_ratio=0.1)
            m1, p1 = grpo_step_result(one, batch_fields=fields, **kw)
            m8, p8 = grpo_step_result(eight, batch_fields=fields, **kw)
            assert set(m8) == set(m1), loss
            for k in m1:
                np.testing.assert_allclose(
                    m8[k], m1[k], rtol=1e-5, atol=1e-6, err_msg=f"{loss} {k}"
                )
            np.testing.assert_allclose(p8, p1, rtol=0, atol=1e-5, err_msg=loss)
            assert m1["pg_loss"] != 0.0, loss  # the estimator's advantages are not all 0
            print(loss, estimator, "max param diff", np.abs(p8 - p1).max())

        t0 = time.perf_counter()
        m1, a1, o1, s1 = lora_grpo_step_result(one)
        m8, a8, o8, s8 = lora_grpo_step_result(eight)
        assert set(m8) == set(m1) and m1["kl_ref"] > 0 and m1["skipped_total"] == 0
        for k in m1:
            np.testing.assert_allclose(m8[k], m1[k], rtol=1e-5, atol=1e-6, err_msg=f"lora {k}")
        np.testing.assert_allclose(a8, a1, rtol=0, atol=1e-5, err_msg="lora adapters")
        np.testing.assert_allclose(o8, o1, rtol=0, atol=1e-4, err_msg="lora momentum")
        assert a1.size == o1.size and np.abs(o1).max() > 0  # one trace per adapter entry

        adapters, base = trainable_split(s8.params)
        def spec(var):  # the PartitionSpec padded to the array's rank
            s = tuple(var[...].sharding.spec)
            return s + (None,) * (var[...].ndim - len(s))

        trace = s8.opt_state[1][0].trace
        sharded = 0
        for t, target in TARGETS.items():
            w = spec(base["layers"][target.base])
            a, b = spec(adapters["lora"][f"{t}_a"]), spec(adapters["lora"][f"{t}_b"])
            assert a == (*w[: 1 + target.n_in], None), (t, w, a)
            assert b == (w[0], None, *w[1 + target.n_in :]), (t, w, b)
            assert spec(trace["lora"][f"{t}_a"]) == a and spec(trace["lora"][f"{t}_b"]) == b, t
            sharded += sum(x is not None for x in a + b)
        assert sharded >= len(TARGETS), sharded  # the adapters really are split over the mesh
        print("lora max adapter diff", np.abs(a8 - a1).max(), "max momentum diff",
              np.abs(o8 - o1).max(), "loss", m8["loss"], f"({time.perf_counter() - t0:.1f}s)")
        """,
        n_devices=8,
    )
    assert out.count("max param diff") == 3 and "lora max adapter diff" in out, out


def _env(n_devices: int, cache) -> dict:
    env = child_env(n_devices)
    env["JAX_DEFAULT_MATMUL_PRECISION"] = "highest"
    # This test's own compilation cache, every program in it, so the rerun finds it warm.
    env["JAX_COMPILATION_CACHE_DIR"] = str(cache)
    env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    env["GRPOJAX_HEARTBEAT_S"] = "120"  # a healthy run: no process lost to a stalled machine
    root = HERE.parent
    env["PYTHONPATH"] = os.pathsep.join([str(root), str(HERE), env.get("PYTHONPATH", "")])
    return env


def _two_processes(out, cache) -> list[str]:
    """The worker's GRPO step in 2 processes x 2 CPU devices (gloo); their logs."""
    port = free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), str(out), str(i), "2", str(port)],
            env=_env(2, cache),
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
            logs.append(p.communicate(timeout=300)[0])
        finally:
            if p.poll() is None:
                p.kill()
    assert all(p.returncode == 0 for p in procs), "\n".join(logs)
    return logs


@pytest.mark.slow
def test_grpo_step_two_processes_matches_one_process(tmp_path):
    """The step on a (data 2, fsdp 2) mesh over 2 processes equals 1 device: metrics within
    1e-5 relative, parameters within 1e-5. Run twice on one compilation cache: the second
    run would find process 0's programs there while process 1 compiles its own, and such a
    mix hung in gloo (grpojax.distributed._no_cache_across_cpu_processes), so the
    processes join with the cache off and the rerun gives the same result."""
    cache = tmp_path / "cache"
    single = tmp_path / "single.npz"
    subprocess.run(
        [sys.executable, str(WORKER), str(single)],
        env=_env(1, cache),
        check=True,
        timeout=600,
        cwd=HERE.parent,
        capture_output=True,
    )
    a = np.load(single)
    for run in ("fresh", "rerun"):
        multi = tmp_path / f"multi_{run}.npz"
        logs = _two_processes(multi, cache)
        assert all("compilation cache" in log and "off for" in log for log in logs), logs
        b = np.load(multi)
        for k in KEYS:
            np.testing.assert_allclose(b[k], a[k], rtol=1e-5, atol=1e-6, err_msg=f"{run} {k}")
        np.testing.assert_allclose(b["params"], a["params"], rtol=0, atol=1e-5, err_msg=run)
