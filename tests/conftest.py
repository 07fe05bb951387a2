"""Test session set-up: a persistent JAX compilation cache shared by every test process and
kept between runs."""

import gc
import os
import pathlib
import subprocess
import sys

from user_cache import user_cache_dir

# Compilation is about half of this suite's time (test_train_ppo.py and
# test_train_objectives.py in one process: 303 s on an empty cache, 153 s on a warm one), so
# the cache outlives the checkout: a user-level directory, as the CLI's
# (`grpojax.cli.enable_compilation_cache`) but its own, since the suite compiles with other
# XLA flags (below). A fresh clone on a machine that ran the suite before starts warm.
# Entries are keyed by the program, the flags and the JAX version, so one left by other code
# is never loaded for a program it does not match. Every program is cached, however short
# its compile: most of this suite's are well under a second.
_CACHE = user_cache_dir("jax-tests")
# The cache grows with every version of the code it has seen: at session start (in the
# pytest-xdist controller, before the workers) a directory over _CACHE_MAX_BYTES loses its
# oldest entries until it is under half of it. A run that misses a deleted entry compiles
# it again.
_CACHE_MAX_BYTES = 4 << 30
# Environment first, so child processes (multi-device tests, `grpojax` commands) inherit it.
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", str(_CACHE))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")


def _prune_cache(path: pathlib.Path, max_bytes: int) -> None:
    """Delete the oldest files of `path` until they total under max_bytes / 2, if they total
    over max_bytes."""
    entries = []
    for f in path.glob("*"):
        try:
            st = f.stat()
        except OSError:  # deleted meanwhile by another run
            continue
        if f.is_file():
            entries.append((st.st_mtime, st.st_size, f))
    total = sum(size for _, size, _ in entries)
    if total <= max_bytes:
        return
    for _, size, f in sorted(entries):
        if total <= max_bytes // 2:
            break
        f.unlink(missing_ok=True)
        total -= size


if "PYTEST_XDIST_WORKER" not in os.environ and os.environ["JAX_COMPILATION_CACHE_DIR"] == str(
    _CACHE
):
    _prune_cache(_CACHE, _CACHE_MAX_BYTES)
# Compile time is most of this suite's time; two XLA:CPU settings cut it, with the same
# numbers to the tolerances every test states:
# - LLVM -O0: about 40% less compile time; without fast-math LLVM may not reorder float
#   arithmetic at any level, and XLA emits its reductions' order itself.
# - the classic elemental fusion emitters instead of the newer MLIR ones: another 35-45%
#   less wall time on model and train-step tests (115 -> 58 s and 142 -> 95 s on two
#   subsets, fresh compilation cache, one process); the whole suite 2,235 -> 1,231 s.
#   The fused arithmetic may round differently (test_driver_objectives.USER_LOSS_ATOL).
# Child processes inherit them (their XLA_FLAGS append the device count to these).
# An XLA that does not know a flag aborts the process when its first backend starts (jax
# 0.11's has no --xla_cpu_use_fusion_emitters: every test process died at start-up on an
# H100 machine), so each flag is tried once in a child process first; pytest-xdist's
# workers inherit the outcome.
_FLAGS = ("--xla_backend_optimization_level=0", "--xla_cpu_use_fusion_emitters=false")
_CHECKED = "GRPOJAX_TEST_XLA_FLAGS_CHECKED"


def _xla_accepts(flag: str) -> bool:
    env = {**os.environ, "XLA_FLAGS": flag, "JAX_PLATFORMS": "cpu"}
    probe = [sys.executable, "-c", "import jax; jax.devices()"]
    return subprocess.run(probe, env=env, capture_output=True, timeout=300).returncode == 0


if os.environ.get(_CHECKED) != "1":
    for _flag in _FLAGS:
        if _flag.split("=")[0] not in os.environ.get("XLA_FLAGS", "") and _xla_accepts(_flag):
            os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _flag).strip()
    os.environ[_CHECKED] = "1"

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_compilation_cache_dir", os.environ["JAX_COMPILATION_CACHE_DIR"])
jax.config.update(
    "jax_persistent_cache_min_compile_time_secs",
    float(os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"]),
)


@pytest.fixture(scope="session")
def small_model_dir(tmp_path_factory):
    """A 1-layer, width-32 Qwen3 checkpoint with the built-in tokenizer, as a local HF dir:
    the driver runs on it exactly as on a real checkpoint, in a fraction of the tiny model's
    compile and step time."""
    from flax import nnx

    from grpojax.models import Decoder, builtin_tokenizer, save_pretrained, tiny_config

    path = tmp_path_factory.mktemp("small_model")
    cfg = tiny_config(
        hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16
    )
    save_pretrained(Decoder(cfg, rngs=nnx.Rngs(0)), path, tokenizer=builtin_tokenizer())
    return path


@pytest.fixture(scope="session")
def cli_server(tmp_path_factory):
    """`grpojax` command lines run as processes forked from one warm parent
    (`cli_forkserver.ForkServer`), with their own `datasets` cache."""
    from cli_forkserver import ForkServer

    cache = tmp_path_factory.mktemp("hf_datasets_cache")
    repo = pathlib.Path(__file__).resolve().parent.parent
    server = ForkServer(repo, env={"HF_DATASETS_CACHE": str(cache)})
    yield server
    server.close()


def pytest_collection_modifyitems(config, items):
    """Modules holding `slow` tests run first (each module's own order kept): the long
    multi-process tests then start at once instead of leaving one xdist worker busy at the
    end while the other idles."""
    slow_modules = {item.module.__name__ for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.module.__name__ not in slow_modules)


@pytest.fixture(scope="module", autouse=True)
def _release_compiled_programs():
    """Drop JAX's in-memory caches of compiled programs after each test module.

    Every XLA:CPU executable kept alive holds memory mappings of its code, and a pytest-xdist
    worker that runs hundreds of tests reached Linux's limit of 65,530 mappings per process
    (`vm.max_map_count`): the next compilation's mmap failed and the worker died with a
    segfault (in CI and here, in the sampler tests, at 65,335 mappings in the core dump).
    Two sampling test modules alone add about 15,000; released after each module, a worker
    stays near 600. A later module recompiles what it needs (the persistent cache above
    makes that a load).
    """
    yield
    jax.clear_caches()
    gc.collect()
