"""The code sandbox: rewards for passing/failing tests, and containment of an infinite
loop, a memory hog, a fork bomb, a huge print, a sleeper, network and file access.
Limits are small so every case ends within a couple of seconds."""

import functools
import os
import socket
import threading
import time

import numpy as np
import pytest

from grpojax.rewards import (
    RewardManager,
    SandboxLimits,
    code_execution_reward,
    extract_code,
    run_python_sandboxed,
    sandbox_capabilities,
)
from grpojax.rewards.sandbox import _UID_BASE, _UID_COUNT

FAST = SandboxLimits(cpu_s=1, wall_s=3.0, memory_mb=256, max_processes=8)
# A contained program ends; these bounds separate "stopped by a limit" from "ran on" (the
# programs below would run for minutes or forever) and leave room for process start-up,
# which alone took over 2 s on a loaded 2-core CI machine. Which limit fired is asserted
# separately (timed_out, output_limit_exceeded, MemoryError).
ENDS_S = 30.0
CAPS = sandbox_capabilities()
needs_nproc = pytest.mark.skipif(
    CAPS.is_root and not CAPS.drop_privileges,
    reason="running as root without a runnable unprivileged interpreter: RLIMIT_NPROC "
    "cannot bound a fork bomb here",
)


def sandbox_uid_processes(wait_s=2.0):
    """Live (non-zombie) processes of any sandbox uid, after up to `wait_s` for exits.

    Killed processes linger a moment until their exit completes and init reaps them.
    """
    deadline = time.monotonic() + wait_s
    while True:
        found = []
        for pid in os.listdir("/proc"):
            if not pid.isdigit():
                continue
            try:
                with open(f"/proc/{pid}/status") as f:
                    fields = dict(line.split(":", 1) for line in f if ":" in line)
            except OSError:
                continue
            uid = int(fields.get("Uid", "-1").split()[0])
            state = fields.get("State", "").split()[:1]
            if _UID_BASE <= uid < _UID_BASE + _UID_COUNT and state != ["Z"]:
                found.append(pid)
        if not found or time.monotonic() > deadline:
            return found
        time.sleep(0.05)


ADD_TESTS = ["assert add(1, 2) == 3", "assert add(-1, 1) == 0", "assert add(2, 2) == 4"]


def test_code_reward_fraction_of_tests():
    completions = [
        "def add(a, b):\n    return a + b\n",
        "Here:\n```python\ndef add(a, b):\n    return a * 2 if a == b else a + b + (a < 0)\n```",
        "def add(a, b):\n    return a - b\n",
        "def add(a, b) return",  # syntax error
        "def add(a, b):\n    return a + b\nif __name__ == '__main__':\n    input()\n",
    ]
    tests = [ADD_TESTS] * 5
    got = code_execution_reward([""] * 5, completions, tests=tests, limits=FAST)
    # By hand: right -> 3/3. Second: add(1,2)=3 ok, add(-1,1)=1 wrong, add(2,2)=4 ok -> 2/3.
    # a - b: 1-2, -1-1, 2-2 all wrong -> 0. Syntax error -> 0. The __main__ block does
    # not run (the solution's __name__ is "solution"), so its input() never blocks -> 3/3.
    np.testing.assert_allclose(got, [1.0, 2 / 3, 0.0, 0.0, 1.0], rtol=0, atol=1e-12)
    all_or_nothing = code_execution_reward(
        [""] * 2, completions[:2], tests=tests[:2], limits=FAST, partial_credit=False
    )
    assert all_or_nothing == [1.0, 0.0]


def test_code_reward_no_tests_is_none_and_single_string_test():
    got = code_execution_reward(
        ["", ""], ["x = 1", "x = 1"], tests=[[], "assert x == 1"], limits=FAST
    )
    assert got == [None, 1.0]


@pytest.mark.parametrize(
    "cheat",
    [
        "import os\nos._exit(0)\n",
        "import sys\nsys.exit(0)\n",
        "print('\\n0 0 pass\\n0 1 pass\\n0 2 pass')\nraise SystemExit(0)\n",
    ],
)
def test_early_exit_or_fake_report_passes_nothing(cheat):
    assert code_execution_reward([""], [cheat], tests=[ADD_TESTS], limits=FAST) == [0.0]


def test_extract_code():
    assert extract_code("a\n```python\nx = 1\n```\nb\n```py\ny = 2\n```") == "y = 2\n"
    assert extract_code("```\nz = 3\n```") == "z = 3\n"
    assert extract_code("```text\nnot code\n```\nplain = 1") == "```text\nnot code\n```\nplain = 1"


def test_infinite_loop_is_stopped_by_cpu_limit():
    t0 = time.monotonic()
    r = run_python_sandboxed("while True:\n    pass\n", limits=FAST)
    assert time.monotonic() - t0 < ENDS_S
    assert r.returncode != 0
    got = code_execution_reward(
        [""], ["def add(a, b):\n    while True:\n        pass\n"], tests=[ADD_TESTS], limits=FAST
    )
    assert got == [0.0]


def test_sleeper_is_stopped_by_wall_limit():
    limits = SandboxLimits(cpu_s=1, wall_s=1.0)
    t0 = time.monotonic()
    r = run_python_sandboxed("import time\ntime.sleep(600)\n", limits=limits)
    assert time.monotonic() - t0 < ENDS_S
    assert r.timed_out and r.returncode != 0


def test_memory_hog_is_refused():
    hogs = [
        "x = bytearray(4 * 1024**3)\n",
        "xs = []\nwhile True:\n    xs.append(bytearray(2**22))\n",
    ]
    for code in hogs:
        t0 = time.monotonic()
        r = run_python_sandboxed(code, limits=FAST)
        assert time.monotonic() - t0 < ENDS_S
        assert r.returncode != 0 and "MemoryError" in r.stderr
    got = code_execution_reward(
        [""], [hogs[1] + "def add(a, b):\n    return a + b\n"], tests=[ADD_TESTS], limits=FAST
    )
    assert got == [0.0]


def test_huge_output_is_capped():
    limits = SandboxLimits(cpu_s=2, wall_s=5.0, max_output_bytes=4096)
    t0 = time.monotonic()
    r = run_python_sandboxed("while True:\n    print('x' * 1000)\n", limits=limits)
    assert time.monotonic() - t0 < ENDS_S
    assert r.output_limit_exceeded and not r.timed_out
    assert len(r.stdout) <= 4096
    got = code_execution_reward(
        [""],
        ["print('y' * 10**6)\ndef add(a, b):\n    return a + b\n"],
        tests=[ADD_TESTS],
        limits=limits,
    )
    assert got == [0.0]


def test_file_size_limit():
    limits = SandboxLimits(max_file_bytes=1000)
    r = run_python_sandboxed("open('big', 'w').write('z' * 10**6)\n", limits=limits)
    assert r.returncode != 0  # SIGXFSZ or an OSError


@needs_nproc
def test_fork_bomb_is_contained():
    bomb = (
        "import os, time\n"
        "while True:\n"
        "    try:\n"
        "        os.fork()\n"
        "    except OSError:\n"
        "        time.sleep(0.01)\n"
    )
    limits = SandboxLimits(cpu_s=1, wall_s=2.0, memory_mb=128, max_processes=8)
    t0 = time.monotonic()
    r = run_python_sandboxed(bomb, limits=limits)
    assert time.monotonic() - t0 < ENDS_S
    assert r.timed_out or r.returncode != 0
    if CAPS.drop_privileges:
        assert sandbox_uid_processes() == []  # every forked process was killed


@needs_nproc
def test_escaped_background_children_are_killed():
    # Children that leave the process group (setsid) and sleep are still swept.
    code = (
        "import os, time\n"
        "for _ in range(3):\n"
        "    if os.fork() == 0:\n"
        "        os.setsid()\n"
        "        time.sleep(1000)\n"
        "print('parent done')\n"
    )
    r = run_python_sandboxed(code, limits=FAST)
    assert "parent done" in r.stdout
    if CAPS.drop_privileges:
        assert sandbox_uid_processes() == []


@pytest.mark.skipif(not CAPS.network_isolation, reason="network namespaces not permitted here")
def test_network_is_unreachable():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    server.settimeout(1.0)
    port = server.getsockname()[1]
    accepted = []

    def accept():
        try:
            accepted.append(server.accept())
        except OSError:
            pass

    th = threading.Thread(target=accept, daemon=True)
    th.start()
    code = (
        "import socket\n"
        "try:\n"
        f"    socket.create_connection(('127.0.0.1', {port}), timeout=1)\n"
        "    print('CONNECTED')\n"
        "except OSError as e:\n"
        "    print('blocked', e)\n"
    )
    r = run_python_sandboxed(code, limits=FAST)
    th.join()
    server.close()
    assert "blocked" in r.stdout and "CONNECTED" not in r.stdout
    assert accepted == []


@pytest.mark.skipif(not CAPS.drop_privileges, reason="only when the sandbox drops privileges")
def test_files_outside_the_sandbox_are_not_writable():
    target = os.path.join(os.path.dirname(__file__), "_sandbox_should_not_exist")
    r = run_python_sandboxed(f"open({target!r}, 'w').write('x')\n", limits=FAST)
    assert "PermissionError" in r.stderr
    assert not os.path.exists(target)


def test_code_reward_in_the_process_pool():
    completions = ["def add(a, b):\n    return a + b\n", "while True:\n    pass\n"]
    fn = functools.partial(code_execution_reward, limits=FAST)
    with RewardManager([fn], names=["code"], num_workers=2, timeout_s=20.0, chunk_size=1) as mgr:
        res = mgr.compute(["", ""], completions, tests=[ADD_TESTS, ADD_TESTS])
    assert res.valid_n.all(), res.errors
    np.testing.assert_array_equal(res.total_n, [1.0, 0.0])


def test_bad_limits():
    with pytest.raises(ValueError, match="cpu_s"):
        SandboxLimits(cpu_s=0)
    with pytest.raises(ValueError, match="memory_mb must be >= 64"):
        SandboxLimits(memory_mb=16)
    with pytest.raises(ValueError, match="wall_s"):
        SandboxLimits(wall_s=0)
