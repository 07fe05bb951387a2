"""verifiers environments as environments: `env.name=verifiers:<taskset id>`, e.g.
`verifiers:my_tasks` (`pip install "grpojax[verifiers]"`, verifiers 0.4.0, `verifiers.v1`).

The taskset id is what verifiers itself takes (`vf-eval <taskset id>`,
`vf.TasksetConfig(id=...)`): an importable top-level package or module (or one of
verifiers' own, `verifiers.v1.tasksets.<id>`) exporting exactly one `vf.Taskset` subclass
in its `__all__`, and optionally an `vf.Env` subclass (else `vf.SingleAgentEnv`).

What maps to what:

    taskset task   a data row `{"prompt": its prompt text, "key": task.key, "task": its
                   TaskData as JSON}` (`verifiers_rows`: the tasks in a seeded order), split
                   into train and held-out by content as the built-ins' are
    episode        the Env's episode of that task (`Env.run_episode`): verifiers' own
                   rollout (interception server, limits, @stop / @intercept hooks, the
                   Env's `run` and `finalize`), run by an `AgentEnvironment` agent whose
                   model is the run's policy: verifiers' eval client (`vf.EvalClientConfig`)
                   points at grpojax's endpoint with the episode's `X-Episode-Id` header
    policy's turn  one model call of the seat's harness, `PolicyHarness`: an in-process
                   chat program (verifiers' harnesses are programs run in a runtime; this
                   one sends the conversation so far as one chat completion, no tools)
    reward         the trace's reward as verifiers computes it: the task's @vf.reward
                   functions and judges, weighted, plus what the Env's `finalize` records

Refused, each in one line naming `env.name`: verifiers missing, an unknown id, an Env with
more than one agent seat (one episode is one policy conversation; a judge or best-of-n seat
would be another), a task that needs a container or serves MCP tools (not served here), an
infinite taskset, and a taskset config with required fields (the name carries only the id).
A verifiers episode that fails (its error) fails the grpojax episode: reward 0, counted as
a reward error. An episode grpojax ends (turn cap, token budget) is scored as it stands: the
harness takes the endpoint's refusal (HTTP 409) as the end of its conversation.
"""

from __future__ import annotations

import asyncio
import functools
import random
import sys
import types
from collections.abc import Mapping
from typing import Any

from grpojax.envs.agent import EPISODE_HEADER, AgentEnvironment
from grpojax.errors import UserError

__all__ = ["PREFIX", "VerifiersEnv", "verifiers_environment", "verifiers_rows"]

PREFIX = "verifiers:"
TESTED_VERSION = "0.4.0"
HARNESS_ID = "grpojax_policy_harness"  # the module name verifiers imports the harness by
API_KEY_VAR = "GRPOJAX_VERIFIERS_API_KEY"  # unset: verifiers sends "EMPTY"; the endpoint takes any


def _vf(spec: str = "...") -> Any:
    try:
        import verifiers.v1 as vf
    except ImportError:
        raise UserError(
            f"env.name {PREFIX}{spec}: verifiers is not installed; "
            f'pip install "grpojax[verifiers]" (verifiers {TESTED_VERSION})'
        ) from None
    return vf


def _why(e: BaseException) -> str:
    """`e` in one line: its type and first line (a validation error's first error)."""
    errors = getattr(e, "errors", None)
    if callable(errors) and errors():  # pydantic's ValidationError: say which field
        first = errors()[0]
        return f"{type(e).__name__}: {'.'.join(map(str, first['loc']))}: {first['msg']}"
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0]}" if lines else type(e).__name__


@functools.cache
def _register_harness() -> str:
    """Define `PolicyHarness` and make it importable as `HARNESS_ID` (verifiers loads a
    harness by importing a top-level module that exports it); returns the id."""
    vf = _vf()
    import httpx
    from verifiers.v1.dialects.chat import message_to_wire

    harness: Any = vf.Harness[vf.HarnessConfig]  # verifiers is optional: typed loosely

    class PolicyHarness(harness):
        """One chat completion a segment, in process: the system prompt, the prompt (or the
        conversation so far, on a resumed exchange) to the rollout's interception endpoint;
        no tools. A refusal (HTTP 409: grpojax ended the episode) ends the segment."""

        APPENDS_SYSTEM_PROMPT = True
        SUPPORTS_RESUME = True
        EXECUTES_CODE = False
        NEEDS_CONTAINER = False

        async def launch(self, ctx, trace, runtime, endpoint, secret, mcp_urls, data):
            system, prompt = self.resolve_prompt(data)
            messages = [{"role": "system", "content": system}] if system else []
            if isinstance(prompt, str):
                messages.append({"role": "user", "content": prompt})
            else:
                messages += [message_to_wire(m) for m in prompt or []]
            # Plain HTTP to the rollout's interception server: no TLS context to load (25 ms
            # and 0.8 MB a client otherwise).
            plain = endpoint.startswith("http://")
            async with httpx.AsyncClient(timeout=None, verify=not plain) as http:
                reply = await http.post(
                    f"{endpoint.rstrip('/')}/chat/completions",
                    json={"model": ctx.model, "messages": messages},
                    headers={"Authorization": f"Bearer {secret}"},
                )
            if reply.status_code == 409:
                return vf.ProgramResult(exit_code=0, stdout="", stderr=reply.text)
            if reply.status_code >= 400:
                return vf.ProgramResult(1, "", f"HTTP {reply.status_code}: {reply.text}")
            content = reply.json()["choices"][0]["message"].get("content") or ""
            return vf.ProgramResult(exit_code=0, stdout=content, stderr="")

    module = types.ModuleType(HARNESS_ID, "grpojax's in-process policy harness")
    module.PolicyHarness = PolicyHarness  # type: ignore[attr-defined]
    module.__all__ = ["PolicyHarness"]  # type: ignore[attr-defined]
    sys.modules.setdefault(HARNESS_ID, module)
    return HARNESS_ID


def _refuse(spec: str, what: str) -> UserError:
    return UserError(f"env.name {PREFIX}{spec}: {what}")


@functools.cache
def _env_config(spec: str) -> Any:
    """The verifiers env config of taskset `spec`, its one seat pinned to `PolicyHarness`
    in the subprocess runtime (checked: one seat, no container, no tools, finite)."""
    vf = _vf(spec)
    from verifiers.v1.configs.agent import agent_config_fields

    try:
        config = vf.resolve_env_config({"taskset": {"id": spec}})
        seats = list(agent_config_fields(config))
        if len(seats) != 1:
            raise _refuse(
                spec,
                f"its Env {vf.environment_class(spec).__name__} has agent seats {seats}; "
                "one seat only (one episode is one policy conversation)",
            )
        pin = {"harness": {"id": _register_harness()}, "runtime": {"type": "subprocess"}}
        config = vf.resolve_env_config({"taskset": {"id": spec}, seats[0]: pin})
        taskset = vf.load_taskset(config.taskset)
    except UserError:
        raise
    except Exception as e:  # whatever verifiers' loader raised: one line
        raise _refuse(
            spec,
            f"not a verifiers taskset taken by its id alone ({_why(e)}); a taskset id is a "
            "top-level module exporting one vf.Taskset subclass in __all__",
        ) from None
    task_cls = type(taskset).task_type()
    if task_cls.NEEDS_CONTAINER:
        raise _refuse(spec, f"{task_cls.__name__} needs a container; containers are not run")
    if task_cls.toolsets(taskset.config.task) or taskset.toolsets(taskset.config):
        raise _refuse(spec, "its tasks serve MCP tools; tasks without tools only")
    if not taskset.bounded:
        raise _refuse(spec, f"{type(taskset).__name__} is infinite; finite tasksets only")
    return config


@functools.cache
def _tasks(spec: str) -> dict[str, Any]:
    """The taskset's tasks by `task.key`, in `load()` order (loaded once a process)."""
    vf = _vf(spec)
    config = _env_config(spec)
    try:
        tasks = {task.key: task for task in vf.load_taskset(config.taskset)}
    except Exception as e:
        raise _refuse(spec, f"its taskset's load() raised {_why(e)}") from None
    if not tasks:
        raise _refuse(spec, "its taskset has no tasks")
    return tasks


def verifiers_rows(spec: str):
    """The row generator of taskset `spec`: `(n, seed) -> rows`, the tasks in the order of
    a `seed`-shuffle, repeated to n (a finite taskset's epochs)."""

    def rows(n: int, seed: int) -> list[dict[str, Any]]:
        tasks = list(_tasks(spec).values())
        order = list(range(len(tasks)))
        random.Random(seed).shuffle(order)
        out = []
        for k in range(n):
            task = tasks[order[k % len(order)]]
            data = task.data.model_dump(mode="json", exclude_none=True)
            out.append({"prompt": task.data.prompt_text, "key": task.key, "task": data})
        return out

    return rows


async def _episode(vf: Any, config: Any, task: Any, ctx: Any) -> Any:
    env = vf.load_environment(config)
    async with env.serving():
        return await env.run_episode(task, ctx)


class VerifiersEnv(AgentEnvironment):
    """An episode of verifiers taskset `spec`'s task `row["key"]` (module docstring); made
    by `verifiers_environment`."""

    spec: str = ""

    @classmethod
    def agent(cls, client: Any, row: Mapping[str, Any]) -> float:  # type: ignore[override]
        return _play(cls.spec, client, row)


def _play(spec: str, client: Any, row: Mapping[str, Any]) -> float:
    """Run the verifiers episode of `row`'s task against `client`'s endpoint and episode;
    its trace's reward."""
    vf = _vf(spec)
    config = _env_config(spec)
    task = _tasks(spec).get(str(row.get("key")))
    if task is None:
        raise _refuse(spec, f"no task with key {row.get('key')!r} (rows: data.kind=env)")
    endpoint = vf.EvalClientConfig(
        base_url=str(client.base_url).rstrip("/"),
        api_key_var=API_KEY_VAR,
        headers={EPISODE_HEADER: client.default_headers[EPISODE_HEADER]},
    )
    ctx = vf.ModelContext(model="policy", client=endpoint, sampling=vf.SamplingConfig())
    episode = asyncio.run(_episode(vf, config, task, ctx))
    if not episode.ok:
        errors = [*episode.errors, *(e for t in episode.traces for e in t.errors)]
        lines = str(errors[-1].message).strip().splitlines() if errors else []
        why = f"{errors[-1].type}: {lines[0] if lines else ''}" if errors else "not ok"
        raise _refuse(spec, f"task {task.data.idx} failed ({why})")
    if len(episode.traces) != 1:
        raise _refuse(spec, f"the episode ran {len(episode.traces)} agent runs; one only")
    return float(episode.traces[0].reward)


def verifiers_environment(spec: str) -> type[VerifiersEnv]:
    """The `VerifiersEnv` subclass of taskset `spec` (checked by loading its config)."""
    _env_config(spec)
    return type(f"Verifiers_{spec}", (VerifiersEnv,), {"spec": spec, "__module__": __name__})
