"""The vLLM engine's settings for a CPU and a GPU, checked without vLLM: the arguments its
worker gives `vllm.LLM` (`vllm_worker.llm_kwargs`: eager and a sized KV cache on a CPU, CUDA
graphs, vLLM's share of the GPU and tensor parallelism on a GPU), what a run's config hands
the engine (`external_engine`), and the arithmetic of JAX's and vLLM's shares of a GPU
(`gpu_memory_shares`), whose sum must leave the headroom."""

from __future__ import annotations

import pytest

from grpojax.config import VllmSpec, load_config
from grpojax.rollouts.sampler import external_engine
from grpojax.sampling import vllm_engine as ve
from grpojax.sampling.vllm_worker import llm_kwargs

START = dict(model="/m", dtype="float32", max_model_len=64, kv_cache_bytes=2**24,
             tensor_parallel_size=2, gpu_memory_utilization=0.2, enforce_eager=None)  # fmt: skip


def test_the_worker_runs_eagerly_on_a_cpu_and_with_cuda_graphs_on_a_gpu():
    cpu = llm_kwargs(START, on_cpu=True)
    assert cpu["enforce_eager"] is True and cpu["kv_cache_memory_bytes"] == 2**24
    assert "gpu_memory_utilization" not in cpu
    gpu = llm_kwargs(START, on_cpu=False)
    assert gpu["enforce_eager"] is False  # CUDA graphs
    assert gpu["gpu_memory_utilization"] == 0.2 and "kv_cache_memory_bytes" not in gpu
    assert gpu["tensor_parallel_size"] == 2
    assert llm_kwargs({**START, "enforce_eager": True}, on_cpu=False)["enforce_eager"] is True
    assert llm_kwargs({**START, "enforce_eager": False}, on_cpu=True)["enforce_eager"] is False
    for kw in (cpu, gpu):  # what the engine's exactness rests on, on both
        assert kw["logprobs_mode"] == "processed_logprobs"
        assert kw["enable_chunked_prefill"] is False and kw["skip_tokenizer_init"] is True


def test_a_runs_settings_reach_the_engine(tmp_path):
    over = [
        "rollout.engine=vllm", "rollout.vllm.python=/usr/bin/python3",
        "rollout.vllm.weight_transfer=files", "rollout.vllm.bucket_mb=64",
        "rollout.vllm.enforce_eager=false", "rollout.vllm.tensor_parallel_size=2",
        f"checkpoint.dir={tmp_path}",
    ]  # fmt: skip
    engine = external_engine(load_config(None, over))
    try:
        assert engine.weight_transfer == "files"
        assert engine.bucket_bytes == 2**62  # tensor parallelism: one bucket, any size
        assert engine.args["enforce_eager"] is False
        assert engine.args["tensor_parallel_size"] == 2
    finally:
        engine.close()
    engine = external_engine(load_config(None, over[:2] + over[-1:]))
    try:  # the defaults: in memory, 1 GiB buckets, eager decided by the platform
        assert engine.weight_transfer == "memory" and engine.bucket_bytes == 2**30
        assert engine.args["enforce_eager"] is None
    finally:
        engine.close()


@pytest.mark.parametrize(
    "field, value",
    [("weight_transfer", "nfs"), ("bucket_mb", 0), ("tensor_parallel_size", 0),
     ("gpu_memory_utilization", 1.0), ("gpu_memory_utilization", 0.0),
     ("enforce_eager", "yes")],
)  # fmt: skip
def test_bad_engine_settings_are_refused_by_name(field, value):
    with pytest.raises(ValueError, match=f"^{field}"):
        VllmSpec(**{field: value})


def test_jax_and_vllm_share_a_gpu_within_its_memory():
    assert ve.gpu_memory_shares(None, {}) == pytest.approx((0.75, 0.20))
    assert ve.gpu_memory_shares(None, {"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.5"}) == (
        pytest.approx((0.5, 0.45))
    )
    assert ve.gpu_memory_shares(0.3, {"XLA_PYTHON_CLIENT_MEM_FRACTION": ".6"}) == (0.6, 0.3)
    assert ve.gpu_memory_shares(0.2, {}) == (0.75, 0.2)  # exactly the headroom left
    with pytest.raises(ve.VLLMEngineError, match=r"JAX takes 0.75 .* vLLM would take 0.3"):
        ve.gpu_memory_shares(0.3, {})
    with pytest.raises(ve.VLLMEngineError, match=r"JAX takes 0\.97"):
        ve.gpu_memory_shares(None, {"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.97"})
    with pytest.raises(ve.VLLMEngineError, match="ALLOCATOR=platform"):
        ve.gpu_memory_shares(0.2, {"XLA_PYTHON_CLIENT_ALLOCATOR": "platform"})
    with pytest.raises(ve.VLLMEngineError, match="is not a number"):
        ve.gpu_memory_shares(0.2, {"XLA_PYTHON_CLIENT_MEM_FRACTION": "lots"})
