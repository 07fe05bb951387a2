"""OpenEnv environments for the tests (openenv-core 0.2.1, nothing stubbed): the scaffold that
`openenv init` writes (an echo environment), a countdown environment written here on
OpenEnv's own base classes, and a server of either on loopback (OpenEnv's `create_app`
under uvicorn, in a thread)."""

from __future__ import annotations

import contextlib
import socket
import sys
import threading
import time
from pathlib import Path

import pytest
import uvicorn
from openenv.cli.commands.init import init
from openenv.core.env_server.http_server import create_app
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State
from pydantic import Field

# The scaffold's server module, named as its Docker image runs it: from the env's directory.
ECHO = "openenv:server.echo_env_environment:EchoEnvironment"
COUNTDOWN = "openenv:openenv_fixtures:CountdownEnvironment"


@contextlib.contextmanager
def echo_scaffold(base: Path):
    """`openenv init echo_env` into `base`; its directory on sys.path while the context
    lasts (the scaffold imports its own top-level `models` and `server`, which are unloaded
    after). Yields the env's directory."""
    with pytest.MonkeyPatch.context() as mp:
        # init runs `uv lock` (the network) where uv is on PATH; without it, it skips that.
        mp.setenv("PATH", "")
        init("echo_env", output_dir=str(base))
    env_dir = base / "echo_env"
    before = set(sys.modules)
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(env_dir))
        try:
            yield env_dir
        finally:
            for name in set(sys.modules) - before:
                if name.split(".")[0] in ("models", "server"):
                    del sys.modules[name]


class CountAction(Action):
    number: str = Field(..., description="The next number")


class CountObservation(Observation):
    text: str = Field(default="", description="What the player is told")


class CountdownEnvironment(Environment[CountAction, CountObservation, State]):
    """Count down from 2 + seed % 3 to 1, one number a step: each right one earns 1 (the last
    ends the episode); a wrong one ends it with no reward (None)."""

    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self):
        super().__init__()
        self._state = State(step_count=0)
        self.expected = 0

    def reset(self, seed=None, episode_id=None, **kwargs):
        self.expected = 2 + (seed or 0) % 3
        return CountObservation(text=f"Count down from {self.expected}.", reward=0.0)

    def step(self, action, timeout_s=None, **kwargs):
        self._state.step_count += 1
        if action.number.strip() != str(self.expected):
            return CountObservation(text="Wrong.", done=True, reward=None)
        self.expected -= 1
        return CountObservation(text="Right. Next?", done=self.expected == 0, reward=1.0)

    @property
    def state(self):
        return self._state


class NoteAction(Action):
    message: str
    note: str


class NoteEnvironment(CountdownEnvironment):
    """An env whose action has two required strings: not one field for a policy's turn."""

    def step(self, action: NoteAction, timeout_s=None, **kwargs):  # type: ignore[override]
        return CountObservation(text=action.message)


@contextlib.contextmanager
def serve(env_cls, action_cls, observation_cls, *, sessions: int = 16):
    """OpenEnv's app for the env (`create_app`, `sessions` WebSocket sessions at once) under
    uvicorn on 127.0.0.1 on a free port, in a thread. Yields its URL."""
    app = create_app(env_cls, action_cls, observation_cls, max_concurrent_envs=sessions)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the OpenEnv server did not start")
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()
