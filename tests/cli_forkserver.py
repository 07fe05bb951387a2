"""Run `grpojax` command lines as processes forked from one parent that imported it already.

A fresh `grpojax` process spends about 5 s of CPU importing jax, flax, orbax, transformers
and datasets before it reads its first argument; the CLI tests run dozens of command lines,
so they start them from a warm parent instead. `python tests/cli_forkserver.py` imports the
command's modules once (no JAX backend is created: each child makes its own), then reads
one JSON request a line on stdin and answers each with one JSON line on stdout:

    request  {"id": str, "argv": [...], "cwd": str, "env": {name: value},
              "stdout": path, "stderr": path}
    answer   {"id": str, "returncode": int (-N: killed by signal N), "cpu_s": float}

Each request runs as `grpojax <argv>` in a child forked from the parent, in a session (and
process group) of its own, with its stdout and stderr written to the two files and
`env` added to its environment (settings JAX read at import, such as the compilation
cache, are the parent's). `ForkServer` is the test side; requests run concurrently.
"""

from __future__ import annotations

import json
import os
import pathlib
import queue
import select
import subprocess
import sys
import tempfile
import threading
from typing import NamedTuple


def _child(request: dict) -> None:
    """In the forked child: become `grpojax <argv>` and exit with its status."""
    code = 1
    try:
        os.setsid()
        os.chdir(request["cwd"])
        os.environ.update(request.get("env", {}))
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        for fd, key in ((1, "stdout"), (2, "stderr")):
            out = os.open(request[key], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(out, fd)
            os.close(out)
        sys.argv = ["grpojax", *request["argv"]]
        from grpojax import cli

        try:
            code = cli.main(request["argv"])
        except SystemExit as e:  # argparse
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def serve() -> None:
    # What every command imports before its first step (not the JAX backend).
    import datasets  # noqa: F401
    import transformers  # noqa: F401
    from transformers import AutoTokenizer, PreTrainedTokenizerFast  # noqa: F401

    import grpojax.cli
    import grpojax.jobs.evaluate
    import grpojax.jobs.export
    import grpojax.jobs.main_job
    import grpojax.jobs.rm
    import grpojax.jobs.sft  # noqa: F401

    def answer(obj) -> None:
        sys.stdout.write(json.dumps(obj) + "\n")
        sys.stdout.flush()

    answer({"ready": True})
    children: dict[int, str] = {}
    buffer = b""
    stdin_open = True
    while stdin_open or children:
        readable = []
        if stdin_open:
            readable, _, _ = select.select([0], [], [], 0.02)
        else:
            select.select([], [], [], 0.02)
        if readable:
            chunk = os.read(0, 65536)
            if not chunk:
                stdin_open = False
            buffer += chunk
            *lines, buffer = buffer.split(b"\n")
            for line in lines:
                if line.strip():
                    request = json.loads(line)
                    sys.stdout.flush()
                    sys.stderr.flush()
                    pid = os.fork()
                    if pid == 0:
                        _child(request)
                    children[pid] = request["id"]
        while children:
            pid, status, usage = os.wait4(-1, os.WNOHANG)
            if pid == 0:
                break
            answer(
                {
                    "id": children.pop(pid),
                    "returncode": os.waitstatus_to_exitcode(status),
                    "cpu_s": usage.ru_utime + usage.ru_stime,
                }
            )


class Result(NamedTuple):
    """What one command line did."""

    returncode: int
    stdout: str
    stderr: str
    cpu_s: float


class ForkServer:
    """The test side: `run(argv, cwd=...)` runs one command line, `run_many` several at
    once; both return `Result`s."""

    def __init__(self, repo: pathlib.Path, *, env: dict[str, str] | None = None):
        self._tmp = tempfile.TemporaryDirectory(prefix="grpojax-forkserver-")
        self._next = 0
        self._done: dict[str, dict] = {}
        full_env = {**os.environ, "PYTHONPATH": str(repo), **(env or {})}
        self.proc = subprocess.Popen(
            [sys.executable, str(pathlib.Path(__file__).resolve())],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=full_env,
            cwd=str(repo),
            text=True,
        )
        self._answers: queue.Queue = queue.Queue()
        self._reader = threading.Thread(target=self._read_answers, daemon=True)
        self._reader.start()
        self._answer(timeout_s=300.0)  # {"ready": true}

    def _read_answers(self) -> None:
        for line in self.proc.stdout:
            self._answers.put(json.loads(line))
        self._answers.put(None)

    def _answer(self, timeout_s: float) -> dict:
        try:
            ans = self._answers.get(timeout=timeout_s)
        except queue.Empty:
            raise RuntimeError(f"the fork server gave no answer in {timeout_s} s") from None
        if ans is None:
            raise RuntimeError(f"the fork server exited ({self.proc.wait()})")
        return ans

    def start(self, argv, *, cwd, env: dict[str, str] | None = None) -> str:
        """Start `grpojax <argv>` in `cwd`; returns the id to `wait` for."""
        rid = str(self._next)
        self._next += 1
        base = pathlib.Path(self._tmp.name) / rid
        request = {
            "id": rid,
            "argv": [str(a) for a in argv],
            "cwd": str(cwd),
            "env": dict(env or {}),
            "stdout": f"{base}.out",
            "stderr": f"{base}.err",
        }
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        self._done[rid] = {"request": request}
        return rid

    def _finished(self, rid: str) -> bool:
        return "returncode" in self._done[rid]

    def wait(self, rid: str, timeout_s: float = 300.0) -> Result:
        while not self._finished(rid):
            ans = self._answer(timeout_s)
            self._done[ans["id"]].update(ans)
        entry = self._done.pop(rid)
        req = entry["request"]
        return Result(
            entry["returncode"],
            pathlib.Path(req["stdout"]).read_text(),
            pathlib.Path(req["stderr"]).read_text(),
            entry["cpu_s"],
        )

    def run(self, argv, *, cwd, env: dict[str, str] | None = None) -> Result:
        return self.wait(self.start(argv, cwd=cwd, env=env))

    def run_many(self, calls, *, parallel: int = 2) -> list[Result]:
        """`calls`: (argv, cwd, env) triples, run `parallel` at a time, results in order."""
        todo = list(enumerate(calls))[::-1]
        results: list[Result | None] = [None] * len(todo)
        running: dict[str, int] = {}
        while todo or running:
            if todo and len(running) < parallel:
                i, (argv, cwd, env) = todo.pop()
                running[self.start(argv, cwd=cwd, env=env)] = i
                continue
            ans = self._answer(timeout_s=300.0)
            self._done[ans["id"]].update(ans)
            if ans["id"] in running:
                results[running.pop(ans["id"])] = self.wait(ans["id"])
        return results

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)
        self._reader.join(timeout=60)  # it read to the end of the answers
        self.proc.stdout.close()
        self._tmp.cleanup()


if __name__ == "__main__":
    serve()
