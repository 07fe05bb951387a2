"""Agents that only know the OpenAI client, played as episodes with every sampled id recorded.

An agent is a plain function of an `openai.OpenAI` client and the episode's data row that
calls `client.chat.completions.create(...)` as often as it needs and returns the episode's
reward; it imports nothing of grpojax:

    def solve(client, row):
        messages = [{"role": "user", "content": row["prompt"]}]
        reply = client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
        ...                                   # run its tool calls, append the results, ask again
        return float(final_answer == row["answer"])

    env.name=agent:my_agents:solve             # the run config (`agent_environment`)

Each episode's client talks to a loopback HTTP server (`AgentEndpoint`, one a process,
started on first use) that serves `/v1/chat/completions` from the run's rollout engine with
the current weights. The agent's calls are the episode's turns (`AgentEnvironment`, an
`Environment`): its first request's messages (and `tools`) are the prompt, rendered through
the tokenizer's chat template once; the engine samples the assistant turn and the reply
carries its decoded text (and, where the request offered tools, its `<tool_call>` blocks as
OpenAI `tool_calls`); the messages of the agent's next request after that reply (tool
results, a user message) are the environment's answer, rendered once as ids after the
sampled ones (`grpojax.envs.render_observation`). So the training sequence is the ids the
engine sampled, with their behaviour logprobs, and the agent's messages between them,
masked: nothing is re-tokenised from the transcript. An agent that re-sends a conversation
whose history differs from what it was served (edited, trimmed, reordered) is counted
(`history_mismatches`); the recorded ids win.

`/v1/completions` (text in, text out) is served the same way, without the chat template: the
first request's `prompt` is the prompt, encoded as written (`RawText`); each later request's
prompt continues the text served so far (the prompt and every reply), and its remainder is
the environment's answer, encoded as written after the sampled ids. One episode speaks one
of the two.

Bounds, each a one-line outcome: `max_turns` requests an episode (the next one is refused
with HTTP 409, the episode ends "max_turns"); an agent that sends no request within
`request_wait_s` ends its episode (a failed step or reset, reward 0); a malformed request
is answered HTTP 400 naming the field; a conversation past the episode's token budget gets
`finish_reason: "length"` and the episode ends ("token_budget"); an agent that raises ends
with reward 0 (counted as a reward error). The run's sampling settings apply to every
request (a request's own temperature, top_p or max_tokens is not used: the samples are the
policy's); `n` > 1 and `stream` are refused.
"""

from __future__ import annotations

import copy
import dataclasses
import http.server
import itertools
import json
import queue
import sys
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from typing import Any

from grpojax.envs.base import Environment, Prompt, RawText, Step
from grpojax.envs.tools import ParseError, parse_tool_calls
from grpojax.errors import UserError
from grpojax.user_code import import_object, is_import_path

__all__ = ["AgentEndpoint", "AgentEnvironment", "agent_environment", "endpoint"]

EPISODE_HEADER = "X-Episode-Id"
CHAT_PATH = "/v1/chat/completions"
TEXT_PATH = "/v1/completions"
PATHS = {CHAT_PATH: "chat", TEXT_PATH: "text"}
MESSAGE_KEYS = ("role", "content", "name", "tool_calls", "tool_call_id")


class RequestError(Exception):
    """A request the endpoint answers with `status` and a one-line `message`."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


@dataclasses.dataclass
class _Call:
    """One agent request waiting for its reply: (HTTP status, JSON body)."""

    body: dict[str, Any]
    kind: str = "chat"  # "chat": /v1/chat/completions; "text": /v1/completions
    reply: queue.Queue = dataclasses.field(default_factory=lambda: queue.Queue(maxsize=1))

    def answer(self, status: int, body: dict[str, Any]) -> None:
        self.reply.put((status, body))

    def refuse(self, status: int, message: str) -> None:
        self.answer(status, {"error": {"message": message, "type": "invalid_request_error"}})


def _check_common(body: Any) -> None:
    """Raise `RequestError(400)` for what neither path serves: a body that is not an object,
    `n` > 1, `stream`."""
    if not isinstance(body, dict):
        raise RequestError(400, "the request body must be a JSON object")
    if body.get("n", 1) != 1:
        raise RequestError(400, f"n: 1 only (one sample a request), got {body.get('n')!r}")
    if body.get("stream"):
        raise RequestError(400, "stream: not served (set stream=false)")


def _check_text_request(body: dict[str, Any]) -> None:
    """Raise `RequestError(400)` naming the first field of a `/v1/completions` body the
    endpoint cannot serve; a one-string list prompt becomes the string."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        body["prompt"] = prompt = prompt[0]
    if not (isinstance(prompt, str) and prompt):
        raise RequestError(
            400, "prompt: one non-empty string (token ids and batches are not served)"
        )
    for field in ("echo", "suffix"):
        if body.get(field):
            raise RequestError(400, f"{field}: not served")
    if body.get("best_of", 1) != 1:
        raise RequestError(400, f"best_of: 1 only, got {body.get('best_of')!r}")


def _check_chat_request(body: dict[str, Any]) -> None:
    """Raise `RequestError(400)` naming the first field of a `/v1/chat/completions` body the
    endpoint cannot serve. As OpenAI's API, an assistant message with tool calls may leave
    its content out."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError(400, "messages: a non-empty list of {role, content} objects")
    for k, m in enumerate(messages):
        if not (isinstance(m, dict) and isinstance(m.get("role"), str)) or (
            "content" not in m and not (m["role"] == "assistant" and m.get("tool_calls"))
        ):
            raise RequestError(400, f"messages[{k}]: an object with a role and a content")
        if not (m.get("content") is None or isinstance(m["content"], str)):
            raise RequestError(400, f"messages[{k}].content: a string (parts are not served)")
    tools = body.get("tools", [])
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise RequestError(400, "tools: a list of OpenAI tool objects")


class _Handler(http.server.BaseHTTPRequestHandler):
    server: _Server

    def log_message(self, format: str, *args: Any) -> None:  # quiet: the run logs its own
        return

    def _send(self, status: int, body: Mapping[str, Any]) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _error(self, status: int, message: str) -> None:
        self._send(status, {"error": {"message": message, "type": "invalid_request_error"}})

    def do_GET(self) -> None:
        if self.path.rstrip("/") == "/v1/models":
            self._send(200, {"object": "list", "data": [{"id": "policy", "object": "model"}]})
        else:
            self._error(404, f"{self.path}: this endpoint serves POST {CHAT_PATH}, {TEXT_PATH}")

    def do_POST(self) -> None:
        try:
            kind = PATHS.get(self.path.rstrip("/"))
            if kind is None:
                raise RequestError(
                    404, f"{self.path}: this endpoint serves POST {CHAT_PATH}, {TEXT_PATH}"
                )
            length = int(self.headers.get("Content-Length") or 0)
            try:
                body = json.loads(self.rfile.read(length) or b"null")
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise RequestError(400, f"the request body is not JSON: {e}") from None
            _check_common(body)
            (_check_chat_request if kind == "chat" else _check_text_request)(body)
            episode = self.headers.get(EPISODE_HEADER) or body.get("user")
            status, reply = self.server.endpoint.submit(episode, body, kind)
        except RequestError as e:
            self._error(e.status, str(e))
            return
        self._send(status, reply)


class _Server(http.server.ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 1024  # every episode's agent may connect at once (listen backlog)
    endpoint: AgentEndpoint

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client that hung up before its reply (its own timeout) is its business, not
        a traceback on the run's stderr; anything else is reported as socketserver does."""
        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)


class AgentEndpoint:
    """An OpenAI-compatible HTTP server on loopback whose requests are routed, by episode id
    (the `X-Episode-Id` header, or the request's `user` field), to the open episodes.

    `open(id)` makes an episode's queue of requests (`_Call`s, each waiting for its reply
    until `reply_timeout_s`: a request nobody answers gets HTTP 504); `close(id)` refuses
    its later requests (HTTP 409). `url` is the base URL an OpenAI client takes. A reply
    waits for the engine's whole round (every episode's turn), so the timeout is a guard
    against a stalled round, not a bound on a long one: an hour by default.
    """

    def __init__(self, *, host: str = "127.0.0.1", port: int = 0, reply_timeout_s: float = 3600):
        self.reply_timeout_s = float(reply_timeout_s)
        self._episodes: dict[str, queue.Queue[_Call]] = {}
        self._closed: dict[str, str] = {}
        self._lock = threading.Lock()
        self._http: Any = None
        self._host = host
        self._server = _Server((host, port), _Handler)
        self._server.endpoint = self
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="grpojax-agent-endpoint", daemon=True
        )
        self._thread.start()

    @property
    def url(self) -> str:
        return f"http://{self._host}:{self._server.server_port}/v1"

    def http_client(self) -> Any:
        """The one `httpx.Client` every agent's OpenAI client of this endpoint shares:
        loopback, no proxy, no cap on connections at once. (An OpenAI client of its own
        loads the TLS certificates: 25 ms and about 0.8 MB an episode.)"""
        import httpx

        class Shared(httpx.Client):
            """Closed by `shutdown` only: an agent's `client.close()` (or `with client:`)
            must not close every other agent's connections."""

            closing = False

            def close(self) -> None:
                if self.closing:
                    super().close()

        with self._lock:
            if self._http is None:
                limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
                self._http = Shared(limits=limits, trust_env=False)
            return self._http

    def open(self, episode: str) -> queue.Queue[_Call]:
        with self._lock:
            if episode in self._episodes:
                raise ValueError(f"episode {episode!r} is open already")
            calls: queue.Queue[_Call] = queue.Queue()
            self._episodes[episode] = calls
            return calls

    def close(self, episode: str, why: str = "the episode is over") -> None:
        with self._lock:
            self._episodes.pop(episode, None)
            self._closed[episode] = why

    def submit(
        self, episode: str | None, body: dict[str, Any], kind: str = "chat"
    ) -> tuple[int, dict[str, Any]]:
        """Queue `body` (a request of `kind`, "chat" or "text") for `episode` and wait for its
        reply: (status, JSON body)."""
        with self._lock:
            calls = self._episodes.get(str(episode))
            closed = self._closed.get(str(episode))
        if calls is None:
            if closed is not None:
                raise RequestError(409, f"episode {episode}: {closed}; no more requests")
            raise RequestError(
                404, f"no open episode {episode!r} (send its id as the {EPISODE_HEADER} header)"
            )
        call = _Call(body, kind)
        calls.put(call)
        try:
            return call.reply.get(timeout=self.reply_timeout_s)
        except queue.Empty:
            raise RequestError(504, f"no reply within {self.reply_timeout_s:g} s") from None

    def shutdown(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        if self._http is not None:
            self._http.closing = True
            self._http.close()


_ENDPOINT: AgentEndpoint | None = None
_ENDPOINT_LOCK = threading.Lock()


def endpoint() -> AgentEndpoint:
    """This process's `AgentEndpoint`, started on first use (loopback, a free port)."""
    global _ENDPOINT
    with _ENDPOINT_LOCK:
        if _ENDPOINT is None:
            _ENDPOINT = AgentEndpoint()
        return _ENDPOINT


def _assistant_message(text: str, offered_tools: bool) -> tuple[dict[str, Any], str]:
    """The reply's message for a sampled turn's `text` and its finish reason: the text, and
    where the request offered tools its `<tool_call>` blocks as OpenAI `tool_calls` (the
    content is then the text before the first block; a malformed block stays text)."""
    calls = parse_tool_calls(text) if offered_tools else []
    if isinstance(calls, ParseError) or not calls:
        return {"role": "assistant", "content": text}, "stop"
    content = text[: text.find("<tool_call>")].strip() or None
    tool_calls = [
        {
            "id": f"call_{uuid.uuid4().hex[:12]}",
            "type": "function",
            "function": {"name": c.name, "arguments": json.dumps(c.arguments)},
        }
        for c in calls
    ]
    return {"role": "assistant", "content": content, "tool_calls": tool_calls}, "tool_calls"


def _comparable(message: Mapping[str, Any]) -> tuple:
    """A message as the history check compares it: role, content ("" for none), and its tool
    calls' names and parsed arguments."""
    calls = []
    for c in message.get("tool_calls") or ():
        f = c.get("function", {}) if isinstance(c, Mapping) else {}
        calls.append((f.get("name"), json.dumps(_arguments(f), sort_keys=True)))
    return message.get("role"), message.get("content") or "", tuple(calls)


def _template_message(message: Mapping[str, Any]) -> dict[str, Any]:
    """`message` with the keys a chat template reads, content "" for none, and tool calls'
    arguments as objects (Qwen's template writes them with `tojson`)."""
    out = {k: message[k] for k in MESSAGE_KEYS if k in message and message[k] is not None}
    out["content"] = message.get("content") or ""
    if "tool_calls" in out:
        out["tool_calls"] = [
            {**c, "function": {**c["function"], "arguments": _arguments(c["function"])}}
            for c in out["tool_calls"]
        ]
    return out


def _arguments(function: Mapping[str, Any]) -> Any:
    """A tool call's arguments as an object (as given where they are not JSON text)."""
    try:
        return json.loads(function.get("arguments") or "{}")
    except (TypeError, json.JSONDecodeError):
        return function.get("arguments")


class AgentEnvironment(Environment):
    """An episode played by `agent(client, row) -> reward` through the endpoint (module
    docstring). Subclass it with `agent_environment(fn)`; keyword arguments:

      request_wait_s: seconds to wait for the agent's next request (or its return) after a
        reply, > 0; keep it under the runner's step timeout (`env.step_timeout_s`).
      expert: the demonstrations' author (an SFT warm start, `sft.steps` > 0), a function
        `expert(request, row) -> str` or its import path "package.module:function"
        (`env.kwargs.expert`): given the request the agent sent (its JSON body: messages and
        tools, or a text episode's prompt) and the row, the reply's text as the policy would
        write it (a tool call as a `<tool_call>` block); served to the agent as a sampled
        turn is. None: no demonstrations.
      endpoint: the `AgentEndpoint` (None: this process's, `endpoint()`).

    The first request's path sets the episode's kind: chat (`/v1/chat/completions`) or
    text (`/v1/completions`: the prompt is `RawText`, each later prompt must continue the
    text served so far, and its remainder is the answer); a request of the other kind is
    refused (HTTP 400) and ends the episode. `transcript` holds every request's messages
    (text: its prompt) as received (for audits: what a re-tokenisation of the transcript
    would have given) and `history_mismatches` the requests whose history was not what
    they were served.
    """

    agent: Callable[[Any, Mapping[str, Any]], Any]
    observation_role = "user"

    def __init__(
        self,
        row: Mapping[str, Any],
        *,
        request_wait_s: float = 20.0,
        expert: Callable[[dict[str, Any], Mapping[str, Any]], str] | str | None = None,
        endpoint: AgentEndpoint | None = None,
        **budgets: Any,
    ):
        super().__init__(row, **budgets)
        if not (isinstance(request_wait_s, int | float) and request_wait_s > 0):
            raise UserError(f"env request_wait_s must be a number > 0, got {request_wait_s!r}")
        self.request_wait_s = float(request_wait_s)
        self.expert = None if expert is None else _function("env.kwargs.expert", expert)
        self._endpoint = endpoint
        self.episode = uuid.uuid4().hex
        self.transcript: list[Any] = []
        self.kind = "chat"
        self.history_mismatches = 0
        self._calls: queue.Queue[_Call] | None = None
        self._pending: _Call | None = None
        self._served: list[dict[str, Any]] = []  # the conversation as the agent was served
        self._served_text = ""  # a text episode's prompt and replies as served
        self._tools: list[dict[str, Any]] = []
        self._done = threading.Event()
        self._result: tuple[str, Any] = ("none", None)
        self._replies = itertools.count()

    # -- the agent's side ------------------------------------------------------------------

    def _run_agent(self, server: AgentEndpoint) -> None:
        import openai

        client = openai.OpenAI(
            base_url=server.url,
            api_key="grpojax",
            default_headers={EPISODE_HEADER: self.episode},
            max_retries=0,
            timeout=server.reply_timeout_s + 30,  # the endpoint's own 504 comes first
            http_client=server.http_client(),
        )
        try:
            self._result = ("ok", type(self).agent(client, self.row))
        except BaseException as e:  # the episode's outcome, reported by reward()
            self._result = ("error", e)
        finally:
            self._done.set()

    def _next_request(self) -> _Call | None:
        """The agent's next request, or None once it returned; RuntimeError past the wait."""
        assert self._calls is not None
        deadline = time.monotonic() + self.request_wait_s
        while True:
            try:
                return self._calls.get(timeout=0.01)
            except queue.Empty:
                if self._done.is_set() and self._calls.empty():
                    return None
                if time.monotonic() > deadline:
                    if self._endpoint is not None:
                        self._endpoint.close(self.episode, "the agent took too long")
                    raise RuntimeError(
                        f"the agent sent no request and did not return within "
                        f"{self.request_wait_s:g} s (env request_wait_s)"
                    ) from None

    # -- the Environment protocol ----------------------------------------------------------

    def reset(self) -> Prompt:
        server = self._endpoint or endpoint()
        self._endpoint = server
        self._calls = server.open(self.episode)
        threading.Thread(
            target=self._run_agent, args=(server,), name="grpojax-agent", daemon=True
        ).start()
        call = self._next_request()
        if call is None:
            raise RuntimeError(f"the agent returned before its first request: {self._outcome()}")
        self._pending = call
        self.kind = call.kind
        if call.kind == "text":
            self._served_text = call.body["prompt"]
            self.transcript.append(self._served_text)
            return RawText(self._served_text)
        messages = call.body["messages"]
        self.transcript.append(messages)
        self._tools = [dict(t) for t in call.body.get("tools") or []]
        self._served = [_template_message(m) for m in messages]
        return list(self._served)

    def tool_schemas(self) -> list[dict[str, Any]]:
        return list(self._tools)

    def _reply(self, text: str, finish: str | None = None) -> dict[str, Any]:
        """Answer the pending request with the sampled turn's `text`; the message served (a
        text episode: {"content": text})."""
        assert self._pending is not None
        head = {
            "created": int(time.time()),
            "model": str(self._pending.body.get("model") or "policy"),
        }
        n = next(self._replies)
        if self.kind == "text":
            message = {"content": text}
            choice = {"index": 0, "text": text, "finish_reason": finish or "stop"}
            body = {"id": f"cmpl-{self.episode[:12]}-{n}", "object": "text_completion", **head}
        else:
            message, reason = _assistant_message(text, bool(self._tools))
            choice = {"index": 0, "message": message, "finish_reason": finish or reason}
            body = {"id": f"chatcmpl-{self.episode[:12]}-{n}", "object": "chat.completion", **head}
        self._pending.answer(200, {**body, "choices": [{**choice, "logprobs": None}]})
        self._pending = None
        return message

    def step(self, completion: str) -> Step:
        served = self._reply(completion)
        made = {"tool_calls": len(served.get("tool_calls") or ())}  # the reply's, served
        call = self._next_request()
        if call is None:
            return Step(done=True, info=made)
        if call.kind != self.kind:
            path = CHAT_PATH if self.kind == "chat" else TEXT_PATH
            call.refuse(400, f"episode {self.episode} is a {self.kind} episode: {path} only")
            return Step(done=True, info={**made, "agent_requests": 1, "refused_requests": 1})
        self._pending = call
        if self.kind == "text":
            return self._text_step(call.body["prompt"], self._served_text + completion)
        expected = [*self._served, _template_message(served)]
        messages = call.body["messages"]
        self.transcript.append(messages)
        mismatch = len(messages) < len(expected) or any(
            _comparable(a) != _comparable(b) for a, b in zip(messages, expected)
        )
        self.history_mismatches += mismatch
        new = [_template_message(m) for m in messages[len(expected) :]]
        self._served = [*expected, *new]
        info = {**made, "agent_requests": 1, "history_mismatches": int(mismatch)}
        return Step(observation=new, info=info)

    def _text_step(self, prompt: str, expected: str) -> Step:
        """A text episode's next `prompt`: what follows the `expected` text (the served
        prompt and replies) is the answer, as written; a prompt that does not continue it is
        a history mismatch, and what lies past the expected text's length is taken."""
        self.transcript.append(prompt)
        mismatch = not prompt.startswith(expected)
        self.history_mismatches += mismatch
        new = prompt[len(expected) :]
        self._served_text = expected + new
        info = {"agent_requests": 1, "history_mismatches": int(mismatch)}
        return Step(observation=RawText(new), info=info)

    def demonstration(self, observation: str | None) -> str | None:
        """The expert's reply to the agent's waiting request (`expert`); ValueError where
        there is no expert or it raised."""
        if self.expert is None:
            raise ValueError(
                f"{type(self).__name__} has no expert: set env.kwargs.expert="
                "package.module:function (expert(request, row) -> the reply's text)"
            )
        assert self._pending is not None
        try:
            return self.expert(copy.deepcopy(self._pending.body), self.row)
        except Exception as e:
            first = str(e).splitlines()[0] if str(e) else ""
            raise ValueError(f"env.kwargs.expert raised {type(e).__name__}: {first}") from None

    def turn_truncated(self, completion: str) -> None:
        if self._pending is not None:
            self._reply(completion, finish="length")

    def reward(self) -> float:
        if self._pending is not None:
            self._pending.refuse(
                409, f"episode {self.episode} is over (its turn cap or token budget)"
            )
            self._pending = None
        if self._endpoint is not None:
            self._endpoint.close(self.episode)
        if not self._done.wait(self.request_wait_s):
            raise RuntimeError(f"the agent did not return within {self.request_wait_s:g} s")
        status, value = self._result
        if status != "ok":
            raise RuntimeError(f"the agent {self._outcome()}")
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise RuntimeError(f"the agent returned {value!r}, not a number (its reward)")
        return float(value)

    def _outcome(self) -> str:
        status, value = self._result
        if status == "error":
            return (
                f"raised {type(value).__name__}: {str(value).splitlines()[0] if str(value) else ''}"
            )
        return f"returned {value!r}"


def agent_environment(
    agent: Callable[[Any, Mapping[str, Any]], Any] | str,
) -> type[AgentEnvironment]:
    """The `AgentEnvironment` subclass whose episodes `agent` plays: a function
    `agent(client, row) -> reward`, or its import path "package.module:function" (what
    `env.name=agent:package.module:function` names)."""
    fn = _function("env.name", agent, "the agent must be a function (client, row) -> reward")
    name = getattr(fn, "__name__", "agent")
    return type(f"Agent_{name}", (AgentEnvironment,), {"agent": staticmethod(fn)})


def _function(field: str, spec: Any, what: str = "must be a function (request, row) -> str") -> Any:
    """`spec` where it is callable, else the object its import path "package.module:function"
    names (on sys.path); a UserError naming `field` for anything else."""
    fn = spec
    if isinstance(spec, str):
        if not is_import_path(spec):
            raise UserError(f"{field}: {what}, or its path 'package.module:function'; got {spec!r}")
        fn = import_object(field, spec)
    if not callable(fn):
        raise UserError(f"{field}: {what}, got {fn!r}")
    return fn
