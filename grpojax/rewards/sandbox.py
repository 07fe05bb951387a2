"""Run untrusted generated Python in a sandboxed subprocess; the code-execution reward.

A sandboxed run is: a fresh temp directory (the working dir, HOME and TMPDIR), a
scrubbed environment, the interpreter in isolated mode (`python -I -S -B`: no
site-packages, no user site, no PYTHON* variables, no bytecode writes), and a small
launcher that sets the limits in the child *before* exec'ing the code:

  - filesystem writes: Landlock (the kernel's unprivileged sandboxing LSM, applied with
    `landlock_restrict_self` under `PR_SET_NO_NEW_PRIVS`) lets the program create, write,
    truncate, rename, link, remove and make directories, fifos, sockets or symlinks only
    beneath its temp directory (and write to /dev/null). Everywhere else such a call
    fails with EACCES (EXDEV for a link or rename across the boundary), whatever the
    path: /tmp, /dev/shm, HOME, the working tree, a symlink planted in the temp dir that
    points out of it, `/proc/self/cwd/..`, a hard link to an outside file (refused, so
    there is no writable alias). It binds root too, cannot be lifted, and is inherited
    by every process the program forks or execs (`sh -c 'echo > /tmp/x'` fails alike);
  - rlimits: CPU seconds (`RLIMIT_CPU`, then SIGXCPU/SIGKILL), address space
    (`RLIMIT_AS`), size of written files (`RLIMIT_FSIZE`), open files, no core dumps;
  - no network: a fresh, empty network namespace (`unshare(CLONE_NEWNET)`, root only;
    elsewhere a logged warning and the network stays reachable);
  - processes: running as root, the child drops to a dedicated unprivileged uid
    (61000 + k, one per concurrent run, reserved with a lock file) so that
    `RLIMIT_NPROC` applies — root ignores it — and file permissions apply to it; after
    the run every process of that uid is killed (`kill -KILL -1` as that uid, which also
    catches children that left the process group). Not root: the child gets
    `RLIMIT_NPROC` = the user's current process count + `max_processes`;
  - its own session / process group (killed as a whole) and `PR_SET_PDEATHSIG`, so it
    dies with the worker that started it;
  - a wall-clock limit and a cap on captured stdout/stderr (the run is killed when
    either is exceeded).
The launcher is a separate `python -c` (not `preexec_fn`, which is unsafe in a
multithreaded parent such as a JAX trainer in thread mode).

Not isolated: reading. The program can read and list whatever its uid may (system
files, world-readable files anywhere; run as a non-root user, all of that user's files).
Landlock does not mediate changes of metadata (chmod, chown, utime, xattrs): as root the
sandbox uid owns nothing outside its temp dir, so this reaches only the timestamps and
user xattrs of world-writable files; run as a non-root user, the modes and times of the
user's own files. Nor does it mediate connecting to a pathname UNIX socket, signals, or
(without root) the network. Signals follow the uid: as root the sandbox uid can signal
only its own processes (not its worker, nor any host process); run as a non-root user,
every process of that user, its worker included. POSIX shared memory and
`multiprocessing` locks, which need /dev/shm, fail.

Why Landlock: it needs no root, no setuid helper and no package (a few syscalls through
ctypes), binds root as well, is inherited across fork and exec and cannot be lifted. A
private mount namespace with read-only views (bubblewrap, nsjail) needs an external
binary plus CAP_SYS_ADMIN or unprivileged user namespaces, which containers often deny;
seccomp filters see paths only as pointers, so they cannot confine writes by location.

Filesystem isolation needs Landlock ABI >= 3 (Linux >= 6.2; ABI 1-2 cannot stop
`truncate(2)` of an outside file) and a sandbox that does not run as root. Where it is
missing, `sandbox_capabilities()` says so in a warning when it first probes, and every run
raises `SandboxIsolationError` unless `SandboxLimits(accept_weak_isolation=True)`: then it
runs with what there is (Landlock ABI 1-2 still applies) and warns once per process.

The interpreter must be runnable by the unprivileged uid (a Python under /root is
not): `sandbox_capabilities()` probes candidates once per process and reports what is
in force. Generated code sees only the standard library.
"""

from __future__ import annotations

import dataclasses
import fcntl
import functools
import json
import logging
import os
import re
import secrets
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence

from grpojax.ops.checks import check_int, check_number

log = logging.getLogger(__name__)

_UID_BASE, _UID_COUNT = 61000, 2000
_LOCK_DIR = os.path.join(tempfile.gettempdir(), "grpojax-sandbox-uids")
_RC_SETUP_FAILED = 97
_ISOLATED = ("-I", "-S", "-B")
# Landlock ABI that confines every kind of write: 3 adds LANDLOCK_ACCESS_FS_TRUNCATE.
_LANDLOCK_FULL_ABI = 3
_WEAK_KNOB = "SandboxLimits(accept_weak_isolation=True)"

# Runs as root (or the user) in the child, sets limits, drops privileges, confines
# writes to the temp dir `box` with Landlock, then execs. A setup failure is reported
# with the run's `tag`, which the exec'd program never sees, so it cannot fake one.
_LAUNCHER = r"""
import ctypes, os, resource as R, struct, sys
uid, netns, landlock, cpu, mem, fsize, nproc, nofile, ppid = (int(a) for a in sys.argv[1:10])
box, tag = sys.argv[10:12]
libc = ctypes.CDLL(None, use_errno=True)
sc = libc.syscall
sc.restype = ctypes.c_long
def fail(why):
    os.write(2, ("grpojax sandbox setup failed %s: %s\n" % (tag, why)).encode())
    os._exit(97)
def err(call):
    return "%s: %s" % (call, os.strerror(ctypes.get_errno()))
def confine_writes():
    # landlock_create_ruleset (444), _add_rule (445), _restrict_self (446): all arches.
    abi = sc(444, None, ctypes.c_size_t(0), ctypes.c_uint32(1))
    if abi < 1:
        fail(err("landlock_create_ruleset"))
    # WRITE_FILE, REMOVE_DIR/FILE, MAKE_CHAR/DIR/REG/SOCK/FIFO/BLOCK/SYM; REFER; TRUNCATE
    fs = 0x1FF2 | (0x2000 if abi >= 2 else 0) | (0x4000 if abi >= 3 else 0)
    rfd = sc(444, struct.pack("=Q", fs), ctypes.c_size_t(8), ctypes.c_uint32(0))
    if rfd < 0:
        fail(err("landlock_create_ruleset"))
    for path, allowed in ((box, fs), ("/dev/null", fs & 0x4002)):
        pfd = os.open(path, os.O_PATH | os.O_CLOEXEC)
        if sc(445, ctypes.c_int(rfd), 1, struct.pack("=Qi", allowed, pfd), 0) != 0:
            fail(err("landlock_add_rule " + path))
        os.close(pfd)
    if libc.prctl(38, 1, 0, 0, 0) != 0:  # PR_SET_NO_NEW_PRIVS
        fail(err("prctl(PR_SET_NO_NEW_PRIVS)"))
    if sc(446, ctypes.c_int(rfd), 0) != 0:
        fail(err("landlock_restrict_self"))
    os.close(rfd)
if netns and libc.unshare(0x40000000) != 0:
    fail(err("unshare(CLONE_NEWNET)"))
R.setrlimit(R.RLIMIT_CORE, (0, 0))
R.setrlimit(R.RLIMIT_CPU, (cpu, cpu + 1))
R.setrlimit(R.RLIMIT_AS, (mem, mem))
R.setrlimit(R.RLIMIT_FSIZE, (fsize, fsize))
R.setrlimit(R.RLIMIT_NOFILE, (nofile, nofile))
if uid >= 0:
    os.setgroups([])
    os.setresgid(uid, uid, uid)
    os.setresuid(uid, uid, uid)
if nproc > 0:
    R.setrlimit(R.RLIMIT_NPROC, (nproc, nproc))
if landlock:
    confine_writes()
libc.prctl(1, 9)  # PR_SET_PDEATHSIG=SIGKILL, after setuid (which clears it)
if os.getppid() != ppid:
    os._exit(98)
os.execv(sys.argv[12], sys.argv[12:])
"""

# Runs the solution, then each test in a copy of its namespace; reports through a
# saved stdout with a per-run nonce read before the untrusted code starts, so a
# solution that exits early (sys.exit(0), os._exit(0)) or prints fake reports passes
# nothing. (Code that deliberately introspects the harness could forge a report.)
_HARNESS = r"""
import json, os, sys, traceback
_nonce = sys.stdin.readline().strip()
_out = os.dup(1)
with open("tests.json") as _f:
    _tests = json.load(_f)
with open("solution.py") as _f:
    _src = _f.read()
_ns = {"__name__": "solution", "__builtins__": __builtins__}
try:
    exec(compile(_src, "solution.py", "exec"), _ns)
    _ok = True
except BaseException:
    traceback.print_exc()
    _ok = False
for _i, _t in enumerate(_tests):
    _res = "fail"
    if _ok:
        try:
            exec(compile(_t, "test_%d" % _i, "exec"), dict(_ns))
            _res = "pass"
        except BaseException:
            traceback.print_exc()
    sys.stdout.flush()
    os.write(_out, ("\n%s %d %s\n" % (_nonce, _i, _res)).encode())
"""


@dataclasses.dataclass(frozen=True)
class SandboxLimits:
    """Limits of one sandboxed run.

    cpu_s: CPU seconds per process (RLIMIT_CPU); wall_s: wall-clock seconds for the run;
    memory_mb: address space per process (RLIMIT_AS); max_output_bytes: captured stdout
    and stderr, each; max_file_bytes: largest file it may write (RLIMIT_FSIZE);
    max_processes: processes of the sandbox uid (RLIMIT_NPROC); max_open_files:
    RLIMIT_NOFILE; isolate_network: run in an empty network namespace;
    accept_weak_isolation: run even where the sandbox cannot confine the program's writes
    to its temp directory (see the module docstring), with a warning, instead of raising
    `SandboxIsolationError`.
    """

    cpu_s: int = 2
    wall_s: float = 5.0
    memory_mb: int = 512
    max_output_bytes: int = 1 << 16
    max_file_bytes: int = 1 << 20
    max_processes: int = 16
    max_open_files: int = 64
    isolate_network: bool = True
    accept_weak_isolation: bool = False

    def __post_init__(self):
        for name in ("cpu_s", "max_output_bytes", "max_processes", "max_open_files"):
            check_int(name, getattr(self, name))
        check_int("memory_mb", self.memory_mb, minimum=64)  # what the interpreter needs
        check_int("max_file_bytes", self.max_file_bytes, minimum=0)
        for name in ("isolate_network", "accept_weak_isolation"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        check_number("wall_s", self.wall_s, minimum=0, strict=True, array_ok=False)


@dataclasses.dataclass(frozen=True)
class SandboxResult:
    """Outcome of a sandboxed run. returncode < 0: killed by that signal (-24 SIGXCPU)."""

    returncode: int | None
    stdout: str
    stderr: str
    timed_out: bool
    output_limit_exceeded: bool
    duration_s: float


@dataclasses.dataclass(frozen=True)
class SandboxCapabilities:
    """What containment is in force on this machine (probed once per process)."""

    interpreter: str
    drop_privileges: bool  # runs as a dedicated uid, so RLIMIT_NPROC applies
    network_isolation: bool  # empty network namespace
    is_root: bool
    filesystem_isolation: bool  # writes confined to the temp dir (Landlock ABI >= 3, not root)
    landlock_abi: int  # the Landlock ABI applied to each run, 0 for none
    filesystem_note: str  # why filesystem_isolation is False ("" when it is True)


class SandboxIsolationError(RuntimeError):
    """The sandbox cannot confine writes here and weaker isolation was not accepted."""


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _sweep(uid: int) -> None:
    """Kill every process of `uid` (kill(-1) as that uid: atomic against forking)."""
    kill = shutil.which("kill") or "/bin/kill"
    for _ in range(2):
        subprocess.run(
            [kill, "-KILL", "-1"],
            user=uid,
            group=uid,
            extra_groups=[],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env={"PATH": "/usr/bin:/bin"},
            check=False,
        )


def _uid_processes(uid: int) -> int:
    n = 0
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/status") as f:
                for line in f:
                    if line.startswith("Uid:"):
                        n += int(line.split()[1]) == uid
                        break
        except OSError:
            continue
    return n


def _acquire_uid() -> tuple[int, int]:
    """Reserve a sandbox uid for this run with a lock file; returns (uid, lock fd)."""
    os.makedirs(_LOCK_DIR, mode=0o700, exist_ok=True)
    start = (os.getpid() * 31 + secrets.randbelow(_UID_COUNT)) % _UID_COUNT
    for k in range(_UID_COUNT):
        uid = _UID_BASE + (start + k) % _UID_COUNT
        fd = os.open(os.path.join(_LOCK_DIR, str(uid)), os.O_CREAT | os.O_RDWR, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return uid, fd
        except BlockingIOError:
            os.close(fd)
    raise RuntimeError(f"no free sandbox uid in [{_UID_BASE}, {_UID_BASE + _UID_COUNT})")


def _launch_argv(
    interp: str,
    uid: int,
    netns: bool,
    landlock: bool,
    box: str,
    tag: str,
    limits: SandboxLimits,
    nproc: int,
    script,
):
    return [
        interp,
        *_ISOLATED,
        "-c",
        _LAUNCHER,
        str(uid),
        str(int(netns)),
        str(int(landlock)),
        str(limits.cpu_s),
        str(limits.memory_mb << 20),
        str(limits.max_file_bytes),
        str(nproc),
        str(limits.max_open_files),
        str(os.getpid()),
        box,
        tag,
        interp,
        *_ISOLATED,
        *script,
    ]


_PROBE = "import json, math, re, collections, itertools, functools, socket, os; print('ok')"
# Run confined in `box`: a write beside it (argv[1], a world-writable sibling) must fail.
_PROBE_FS = r"""
import ctypes, os, sys
open("inside", "w").write("x")
try:
    open(os.path.join(sys.argv[1], "escaped"), "w").close()
    print("escaped")
except PermissionError:
    sc = ctypes.CDLL(None, use_errno=True).syscall
    sc.restype = ctypes.c_long
    print("confined", sc(444, None, ctypes.c_size_t(0), ctypes.c_uint32(1)))
"""


def _probe_run(interp: str, uid: int, netns: bool, landlock: bool, script: list[str]):
    """Run `script` in a fresh probe box; (returncode, stdout, stderr), rc None on error."""
    base = tempfile.mkdtemp(prefix="grpojax-sandbox-probe-")
    try:
        os.chmod(base, 0o755)
        box, outside = os.path.join(base, "box"), os.path.join(base, "outside")
        os.mkdir(box)
        os.mkdir(outside)
        os.chmod(outside, 0o777)
        if uid >= 0:
            os.chown(box, uid, uid)
        script = [a.replace("{outside}", outside) for a in script]
        tag = secrets.token_hex(8)
        argv = _launch_argv(interp, uid, netns, landlock, box, tag, SandboxLimits(), 0, script)
        r = subprocess.run(argv, cwd=box, env=_env(box), capture_output=True, timeout=30)
        return r.returncode, r.stdout.decode(errors="replace"), r.stderr.decode(errors="replace")
    except (OSError, subprocess.SubprocessError) as e:
        return None, "", repr(e)
    finally:
        shutil.rmtree(base, ignore_errors=True)


def _probe(interp: str, uid: int, netns: bool) -> bool:
    rc, out, _ = _probe_run(interp, uid, netns, False, ["-c", _PROBE])
    return rc == 0 and out.strip() == "ok"


def _probe_filesystem(interp: str, uid: int, netns: bool) -> tuple[int, str]:
    """(Landlock ABI that confined a probe's writes, 0 if none; "" or why that is not enough)."""
    rc, out, err = _probe_run(interp, uid, netns, True, ["-c", _PROBE_FS, "{outside}"])
    words = out.split()
    if rc == 0 and len(words) == 2 and words[0] == "confined" and words[1].isdigit():
        abi = int(words[1])
        if abi < _LANDLOCK_FULL_ABI:
            return abi, (
                f"Landlock ABI {abi} cannot stop truncate(2) of files outside the temp dir "
                f"(ABI {_LANDLOCK_FULL_ABI}, Linux >= 6.2, can)"
            )
        return abi, ""
    if rc == _RC_SETUP_FAILED and "grpojax sandbox setup failed" in err:
        why = err.split(": ", 1)[-1].strip()
        return 0, f"Landlock is unavailable: {why} (it needs Linux >= 5.13 with landlock enabled)"
    if rc == 0 and words == ["escaped"]:
        return 0, "Landlock was applied but a probe still wrote outside its temp dir"
    tail = " ".join(err.split())[-300:]
    return 0, f"the Landlock probe failed (returncode {rc}: {tail})"


@functools.cache
def sandbox_capabilities() -> SandboxCapabilities:
    """Probe once: an interpreter the sandbox uid can run, whether netns works, and
    whether Landlock confines writes to the temp dir (warns about what is missing)."""
    is_root = os.geteuid() == 0
    candidates = []
    for c in (
        sys.executable,
        getattr(sys, "_base_executable", None),
        "/usr/bin/python3",
        shutil.which("python3"),
    ):
        if c and os.path.exists(c) and os.path.realpath(c) not in candidates:
            candidates.append(os.path.realpath(c))
    found = None
    if is_root:
        uid, fd = _acquire_uid()
        try:
            found = next(
                ((i, n) for i in candidates for n in (True, False) if _probe(i, uid, n)), None
            )
            if found is not None:
                abi, note = _probe_filesystem(found[0], uid, found[1])
            _sweep(uid)
        finally:
            os.close(fd)
        if found is None:
            log.warning(
                "sandbox: no interpreter is runnable by an unprivileged uid (tried %s); "
                "generated code runs as root, contained only by rlimits, its process group "
                "and the wall-clock limit (a fork bomb is not bounded by RLIMIT_NPROC)",
                candidates,
            )
    if found is None:
        interp = candidates[0]
        netns = _probe(interp, -1, True)
        abi, note = _probe_filesystem(interp, -1, netns)
        if is_root and not note:
            note = (
                "generated code would run as root (no interpreter is runnable by an "
                "unprivileged uid), and Landlock does not stop root's chmod and chown"
            )
    else:
        interp, netns = found
    caps = SandboxCapabilities(
        interpreter=interp,
        drop_privileges=found is not None,
        network_isolation=netns,
        is_root=is_root,
        filesystem_isolation=not note,
        landlock_abi=abi,
        filesystem_note=note,
    )
    if not caps.network_isolation:
        log.warning(
            "sandbox: network namespaces are not permitted here (unshare(CLONE_NEWNET) "
            "failed); generated code can reach the network"
        )
    if not caps.filesystem_isolation:
        log.warning(
            "sandbox: NO FILESYSTEM ISOLATION: %s. Generated code could write outside its "
            "temp directory, so sandboxed runs refuse to start unless %s",
            note,
            _WEAK_KNOB,
        )
    return caps


_weak_warned = False


def check_sandbox_isolation(limits: SandboxLimits | None = None) -> SandboxCapabilities:
    """The sandbox's capabilities, once weak filesystem isolation is refused or accepted.

    Raises `SandboxIsolationError` (one line, naming the knob) where the program's writes
    cannot be confined to its temp dir and `limits.accept_weak_isolation` is False; with
    it True, warns once per process and returns. Every run calls it; call it at start-up
    to fail before any work is done.
    """
    global _weak_warned
    limits = limits or SandboxLimits()
    caps = sandbox_capabilities()
    if caps.filesystem_isolation:
        return caps
    if not limits.accept_weak_isolation:
        raise SandboxIsolationError(
            f"sandbox: generated code's writes cannot be confined to its temp directory "
            f"here ({caps.filesystem_note}); refusing to run it. Set {_WEAK_KNOB} to accept "
            f"weaker isolation."
        )
    if not _weak_warned:
        _weak_warned = True
        who = f"uid {_UID_BASE}+k" if caps.drop_privileges else f"uid {os.getuid()}"
        log.warning(
            "sandbox: running generated code WITHOUT FILESYSTEM ISOLATION "
            "(accept_weak_isolation=True): %s; it can write wherever %s may (Landlock ABI "
            "applied: %d)",
            caps.filesystem_note,
            who,
            caps.landlock_abi,
        )
    return caps


def _env(tmp: str) -> dict[str, str]:
    return {"PATH": "/usr/bin:/bin", "HOME": tmp, "TMPDIR": tmp, "LANG": "C.UTF-8"}


def run_python_sandboxed(
    code: str,
    *,
    stdin: str = "",
    files: Mapping[str, str] | None = None,
    limits: SandboxLimits | None = None,
) -> SandboxResult:
    """Run `code` as `main.py` in a fresh sandbox (see the module docstring).

    `files` are extra text files written next to it; `stdin` is fed to it.
    """
    limits = limits or SandboxLimits()
    all_files = dict(files or {})
    all_files["main.py"] = code
    return _run(all_files, ["main.py"], stdin.encode(), limits)


def _run(files: Mapping[str, str], script: list[str], stdin: bytes, limits: SandboxLimits):
    caps = check_sandbox_isolation(limits)
    netns = limits.isolate_network and caps.network_isolation
    tag = secrets.token_hex(8)
    tmp = tempfile.mkdtemp(prefix="grpojax-sandbox-")
    uid, lock_fd, proc = -1, None, None
    try:
        if caps.drop_privileges:
            uid, lock_fd = _acquire_uid()
            os.chown(tmp, uid, uid)
            _sweep(uid)  # leftovers of a run whose worker was killed
            nproc = limits.max_processes
        elif caps.is_root:
            nproc = 0  # ignored for root anyway
        else:
            nproc = _uid_processes(os.getuid()) + limits.max_processes
        for name, text in files.items():
            path = os.path.join(tmp, name)
            with open(path, "w") as f:
                f.write(text)
            os.chmod(path, 0o644)
        landlock = caps.landlock_abi > 0
        argv = _launch_argv(caps.interpreter, uid, netns, landlock, tmp, tag, limits, nproc, script)
        t0 = time.monotonic()
        proc = subprocess.Popen(
            argv,
            cwd=tmp,
            env=_env(tmp),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )
        out, err, timed_out, over = _collect(proc, stdin, limits, t0)
        _kill_group(proc.pid)
        if uid >= 0:
            _sweep(uid)
        rc = proc.wait()
        marker = f"grpojax sandbox setup failed {tag}: ".encode()
        if rc == _RC_SETUP_FAILED and marker in err:
            why = err.split(marker, 1)[1].split(b"\n", 1)[0].decode(errors="replace")
            raise RuntimeError(f"sandbox: setting up the run failed: {why}")
        cap = limits.max_output_bytes
        return SandboxResult(
            returncode=rc,
            stdout=bytes(out[:cap]).decode("utf-8", "replace"),
            stderr=bytes(err[:cap]).decode("utf-8", "replace"),
            timed_out=timed_out,
            output_limit_exceeded=over,
            duration_s=time.monotonic() - t0,
        )
    finally:
        if proc is not None and proc.returncode is None:
            _kill_group(proc.pid)
            if uid >= 0:
                _sweep(uid)
            proc.wait()
        for stream in (proc.stdin, proc.stdout, proc.stderr) if proc is not None else ():
            if stream is not None:
                stream.close()
        shutil.rmtree(tmp, ignore_errors=True)
        if lock_fd is not None:
            os.close(lock_fd)


def _collect(proc, stdin: bytes, limits: SandboxLimits, t0: float):
    """Feed stdin and read stdout/stderr until EOF, the wall limit or the output cap."""
    sel = selectors.DefaultSelector()
    bufs = {proc.stdout.fileno(): bytearray(), proc.stderr.fileno(): bytearray()}
    for fd in bufs:
        os.set_blocking(fd, False)
        sel.register(fd, selectors.EVENT_READ)
    pending = memoryview(stdin)
    win = proc.stdin.fileno()
    os.set_blocking(win, False)
    sel.register(win, selectors.EVENT_WRITE)
    open_fds = set(bufs)
    deadline = t0 + limits.wall_s
    exited_at = None
    timed_out = over = False
    while open_fds:
        now = time.monotonic()
        if now >= deadline:
            timed_out = True
            break
        if exited_at is None and proc.poll() is not None:
            exited_at = now
        if exited_at is not None and now - exited_at > 0.5:
            break  # children still hold the pipes; the sweep ends them
        for key, _ in sel.select(timeout=min(deadline - now, 0.1)):
            fd = key.fd
            if fd == win:
                try:
                    k = os.write(win, pending[:65536])
                    pending = pending[k:]
                except (BrokenPipeError, BlockingIOError):
                    pending = pending[:0]
                if not pending:
                    sel.unregister(win)
                    proc.stdin.close()
                continue
            try:
                data = os.read(fd, 65536)
            except BlockingIOError:
                continue
            if not data:
                sel.unregister(fd)
                open_fds.discard(fd)
                continue
            bufs[fd] += data
            if len(bufs[fd]) > limits.max_output_bytes:
                over = True
                open_fds.clear()
                break
    sel.close()
    return bufs[proc.stdout.fileno()], bufs[proc.stderr.fileno()], timed_out, over


_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[^\n]*\n(.*?)```", re.DOTALL)


def extract_code(completion: str) -> str:
    """The last ```python (or ```py, or untagged) fenced block, else the whole completion."""
    blocks = _FENCE.findall(completion)
    py = [body for lang, body in blocks if lang.lower() in ("python", "py", "python3", "")]
    return py[-1] if py else completion


def code_execution_reward(
    prompts: Sequence[str],
    completions: Sequence[str],
    *,
    tests: Sequence[Sequence[str] | str],
    limits: SandboxLimits | None = None,
    partial_credit: bool = True,
    from_markdown: bool = True,
) -> list[float | None]:
    """Fraction of `tests` passed by the completion's code, run in a sandbox (one run per sample).

    reward_n = (#tests passed) / (#tests) with `partial_credit`, else 1.0 iff all pass;
    None (no opinion) where a sample has no tests. `tests[n]` is a list of Python
    snippets (e.g. `"assert add(1, 2) == 3"`) or one snippet; each runs after the
    solution, in a copy of its namespace, in the same sandboxed process. The solution
    runs with `__name__ == "solution"` (its `if __name__ == "__main__":` block does not
    run). A solution that raises, exits, times out or breaks a limit passes nothing
    (tests reported before a later limit count). With `from_markdown`, the code is the
    last fenced python block of the completion (`extract_code`).

    Each sample can take up to `limits.wall_s` seconds (plus ~0.1 s of start-up): give
    the manager a `timeout_s` of at least chunk_size x wall_s.

    Raises `SandboxIsolationError` where the sandbox cannot confine writes to the temp
    dir, unless `limits.accept_weak_isolation`; under a `RewardManager` that fails every
    chunk, so call `check_sandbox_isolation(limits)` before training starts.
    """
    limits = limits or SandboxLimits()
    check_sandbox_isolation(limits)
    if len(tests) != len(completions):
        raise ValueError(
            f"column 'tests' has {len(tests)} values for {len(completions)} completions"
        )
    out: list[float | None] = []
    for c, t in zip(completions, tests):
        t = [t] if isinstance(t, str) else list(t)
        if not t:
            out.append(None)
            continue
        nonce = secrets.token_hex(16)
        files = {
            "main.py": _HARNESS,
            "solution.py": extract_code(c) if from_markdown else c,
            "tests.json": json.dumps(t),
        }
        res = _run(files, ["main.py"], (nonce + "\n").encode(), limits)
        passed = set()
        for line in res.stdout.splitlines():
            parts = line.split()
            if len(parts) == 3 and parts[0] == nonce and parts[2] == "pass":
                passed.add(int(parts[1]))
        frac = len(passed) / len(t)
        out.append(frac if partial_credit else float(frac == 1.0))
    return out
