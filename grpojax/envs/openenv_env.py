"""OpenEnv environments as environments (`pip install "grpojax[openenv]"`, openenv-core 0.2.1):

- `env.name=openenv:package.module:EnvClass`: an OpenEnv server-side `Environment` subclass,
  one instance an episode (`EnvClass()`, as OpenEnv's server makes them), in this process;
- `env.name=openenv:http://127.0.0.1:8000`: a running OpenEnv server, one session of
  openenv's own `GenericEnvClient` (a WebSocket) an episode, so the server must take as many
  sessions at once as a round has episodes (`create_app(..., max_concurrent_envs=N)`).

Both play the same way. `reset` resets the env, with `seed=` the row's `seed` where its
`reset` takes one, and the observation's text is the prompt. Each policy turn is the env's
Action: the action model's one required field, which must be a string (in its JSON schema,
what the server's `/schema` serves), holds the decoded turn; other fields keep their
defaults, and an action model with no or more required fields is refused. The step's
observation as OpenEnv sends it (`serialize_observation`: its fields but done, reward and
metadata) is the answer: a single string field as it is, else one `name: value` line a
field (strings as they are, other values as JSON). `done` ends the episode (its observation
is dropped). The episode's reward is the sum of its steps' rewards (None counts 0; the
reset's is not counted); a turn the action model or the env refuses ends the episode as an
error (reward 0). Rows (`data.kind=env`): `{"prompt": "<spec> #<seed>", "seed": seed}`
(`registry.seed_rows`), split into train and held-out by content as the built-ins' are.
"""

from __future__ import annotations

import inspect
import json
import threading
import typing
import urllib.parse
import weakref
from collections.abc import Mapping
from typing import Any

from grpojax.envs.base import Environment, Step
from grpojax.errors import UserError
from grpojax.user_code import import_object, is_import_path

__all__ = ["PREFIX", "OpenEnvEnv", "observation_text", "openenv_environment"]

PREFIX = "openenv:"
TESTED_VERSION = "0.2.1"
ALLOWED = (
    f"'{PREFIX}package.module:EnvClass' (an OpenEnv Environment subclass) or "
    f"'{PREFIX}http://HOST:PORT' (a running OpenEnv server)"
)
# An observation's fields that are not its text (OpenEnv's `serialize_observation` leaves them
# out of what it sends).
NOT_TEXT = ("done", "reward", "metadata")
_LOOPBACK = ("localhost", "127.0.0.1", "::1")
# EnvClient.connect sets and restores NO_PROXY around each connection to loopback; one at a
# time, so concurrent episodes do not leave it changed.
_CONNECT_LOCK = threading.Lock()


def _openenv() -> None:
    try:
        import openenv.core  # noqa: F401
    except ImportError:
        raise UserError(
            f'env.name {PREFIX}...: openenv-core is not installed; pip install "grpojax[openenv]" '
            f"(openenv-core {TESTED_VERSION})"
        ) from None


def observation_text(fields: Mapping[str, Any]) -> str:
    """An observation's fields (done, reward and metadata left out) as text: a single string
    field as it is, else one `name: value` line a field (a string as it is, else JSON)."""
    shown = {k: v for k, v in fields.items() if k not in NOT_TEXT}
    if len(shown) == 1 and isinstance(only := next(iter(shown.values())), str):
        return only
    return "\n".join(
        f"{k}: {v if isinstance(v, str) else json.dumps(v, ensure_ascii=False)}"
        for k, v in shown.items()
    )


def _schema_type(prop: Mapping[str, Any]) -> str:
    if "type" in prop:
        return str(prop["type"])
    alts = [str(p.get("type", p.get("$ref", "?"))) for p in prop.get("anyOf", [])]
    return " | ".join(alts) if alts else "?"


def _action_field(spec: str, schema: Mapping[str, Any]) -> str:
    """The one required field of the action's JSON schema, which must be a string."""
    props = schema.get("properties", {})
    required = list(schema.get("required", []))
    if len(required) == 1 and props.get(required[0], {}).get("type") == "string":
        return str(required[0])
    fields = ", ".join(
        f"{n}: {_schema_type(p)}{'' if n in required else ' (optional)'}"
        for n, p in props.items()
        if n != "metadata"
    )
    raise UserError(
        f"env.name {PREFIX}{spec}: the action {schema.get('title', '?')} must have one required "
        f"field, a string, to hold the policy's turn; its fields: {fields or 'none'}"
    )


class OpenEnvEnv(Environment):
    """One OpenEnv episode (module docstring). Subclasses (`openenv_environment`) set `spec`
    and `action_field` and implement `_reset` and `_step` on OpenEnv's wire format
    (`{"observation": fields, "reward": ..., "done": ...}`)."""

    spec: str = ""
    action_field: str = ""

    def _reset(self, seed: int | None) -> Mapping[str, Any]:
        raise NotImplementedError

    def _step(self, action: dict[str, Any]) -> Mapping[str, Any]:
        raise NotImplementedError

    def _close(self) -> None:
        """End the episode's env or session (once; `_reset` registers `_finalizer`)."""
        if hasattr(self, "_finalizer"):
            self._finalizer()

    def reset(self) -> str:
        self.total = 0.0
        seed = self.row.get("seed")
        payload = self._reset(None if seed is None else int(seed))
        return observation_text(payload.get("observation") or {})

    def step(self, completion: str) -> Step:
        try:
            payload = self._step({self.action_field: completion})
        except BaseException:
            self._close()
            raise
        reward = payload.get("reward")
        self.total += 0.0 if reward is None else float(reward)
        if payload.get("done"):
            self._close()
            return Step(done=True)
        return Step(observation=observation_text(payload.get("observation") or {}) or None)

    def reward(self) -> float:
        self._close()
        return self.total


class _InProcess(OpenEnvEnv):
    env_cls: Any = None
    action_cls: Any = None
    takes_seed: bool = False

    def _reset(self, seed: int | None) -> Mapping[str, Any]:
        self.env = self.env_cls()
        self._finalizer = weakref.finalize(self, self.env.close)
        kwargs = {} if seed is None or not self.takes_seed else {"seed": seed}
        return _payload(self.env.reset(**kwargs))

    def _step(self, action: dict[str, Any]) -> Mapping[str, Any]:
        from openenv.core.env_server.serialization import deserialize_action

        return _payload(self.env.step(deserialize_action(action, self.action_cls)))


def _payload(observation: Any) -> dict[str, Any]:
    """An OpenEnv Observation as its server sends it (`serialize_observation`, as JSON)."""
    from openenv.core.env_server.serialization import serialize_observation
    from pydantic_core import to_jsonable_python

    return dict(to_jsonable_python(serialize_observation(observation)))


class _Remote(OpenEnvEnv):
    url: str = ""

    def _reset(self, seed: int | None) -> Mapping[str, Any]:
        from openenv.core.generic_client import GenericEnvClient

        self.client = GenericEnvClient(base_url=self.url)
        self._finalizer = weakref.finalize(self, self.client.close)
        with _CONNECT_LOCK:
            self.client.connect()
        try:  # the server passes `seed` on only where the env's reset takes it
            result = self.client.reset(**({} if seed is None else {"seed": seed}))
        except RuntimeError as e:
            if "CAPACITY_REACHED" in str(e):
                raise RuntimeError(
                    f"{e}; the server takes fewer sessions at once than the round has "
                    "episodes: serve it with create_app(..., max_concurrent_envs=N)"
                ) from None
            raise
        return {"observation": result.observation, "reward": result.reward, "done": result.done}

    def _step(self, action: dict[str, Any]) -> Mapping[str, Any]:
        result = self.client.step(action)
        return {"observation": result.observation, "reward": result.reward, "done": result.done}


def _action_class(env_cls: Any) -> Any:
    """The Action subclass an OpenEnv Environment class takes: its `step`'s `action`
    annotation, else its first type argument (`Environment[MyAction, MyObservation, State]`)."""
    from openenv.core.env_server.interfaces import Environment as OpenEnvBase
    from openenv.core.env_server.types import Action

    def is_action(x: Any) -> bool:
        return isinstance(x, type) and issubclass(x, Action) and x is not Action

    try:
        hint = typing.get_type_hints(env_cls.step).get("action")
    except Exception:  # an annotation that does not resolve: try the type arguments
        hint = None
    if is_action(hint):
        return hint
    for klass in env_cls.__mro__:
        for base in getattr(klass, "__orig_bases__", ()):
            origin, args = typing.get_origin(base), typing.get_args(base)
            if isinstance(origin, type) and issubclass(origin, OpenEnvBase) and args:
                if is_action(args[0]):
                    return args[0]
    return None


def _in_process(spec: str) -> type[OpenEnvEnv]:
    from openenv.core.env_server.interfaces import Environment as OpenEnvBase

    if not is_import_path(spec):
        raise UserError(f"env.name {PREFIX}{spec}: env.name must be {ALLOWED}")
    obj = import_object("env.name", spec)
    if not (isinstance(obj, type) and issubclass(obj, OpenEnvBase)):
        what = f"the class {obj.__name__}" if isinstance(obj, type) else f"a {type(obj).__name__}"
        raise UserError(
            f"env.name {PREFIX}{spec}: {what} is not an OpenEnv Environment subclass; "
            f"env.name must be {ALLOWED}"
        )
    if inspect.isabstract(obj):
        missing = ", ".join(sorted(getattr(obj, "__abstractmethods__", ())))
        raise UserError(f"env.name {PREFIX}{spec}: {obj.__name__} does not implement {missing}")
    action_cls = _action_class(obj)
    if action_cls is None:
        raise UserError(
            f"env.name {PREFIX}{spec}: cannot tell {obj.__name__}'s Action class; annotate "
            "step(self, action: MyAction) or subclass Environment[MyAction, MyObservation, State]"
        )
    env_cls: Any = obj
    params = inspect.signature(env_cls.reset).parameters.values()
    takes_seed = any(p.name == "seed" or p.kind == p.VAR_KEYWORD for p in params)
    attrs = {
        "spec": spec,
        "action_field": _action_field(spec, action_cls.model_json_schema()),
        "env_cls": obj,
        "action_cls": action_cls,
        "takes_seed": takes_seed,
    }
    return type(f"OpenEnv_{obj.__name__}", (_InProcess,), attrs)


def _remote(spec: str) -> type[OpenEnvEnv]:
    import requests

    url = spec.rstrip("/")
    parts = urllib.parse.urlsplit(url)
    try:
        host, _ = parts.hostname, parts.port
    except ValueError:
        host = None
    if not host:
        raise UserError(f"env.name {PREFIX}{spec}: env.name must be {ALLOWED}")
    try:
        with requests.Session() as session:
            session.trust_env = host not in _LOOPBACK  # no proxy for loopback, as EnvClient
            response = session.get(f"{url}/schema", timeout=10)
    except requests.RequestException as e:
        raise UserError(
            f"env.name {PREFIX}{spec}: no server answers at {url} ({type(e).__name__}); "
            f"start the OpenEnv server first, or name its class: env.name must be {ALLOWED}"
        ) from None
    try:
        response.raise_for_status()
        schema = response.json()["action"]
        if not isinstance(schema, Mapping):
            raise TypeError(type(schema).__name__)
    except Exception as e:
        raise UserError(
            f"env.name {PREFIX}{spec}: {url}/schema is not an OpenEnv server's schema "
            f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); env.name "
            f"must be {ALLOWED}"
        ) from None
    attrs = {"spec": spec, "action_field": _action_field(spec, schema), "url": url}
    return type("OpenEnv_server", (_Remote,), attrs)


def openenv_environment(spec: str) -> type[OpenEnvEnv]:
    """The `OpenEnvEnv` subclass of `spec` (what follows "openenv:"): a URL "http(s)://..."
    (the server's `/schema` read once, so it must be running) or "package.module:EnvClass"
    (imported and checked)."""
    _openenv()
    if spec.startswith(("http://", "https://")):
        return _remote(spec)
    return _in_process(spec)
