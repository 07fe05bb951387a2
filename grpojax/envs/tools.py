"""Tools as plain Python functions: their JSON schemas, the tool-call format, and an
environment that runs the calls a policy turn makes.

A tool is a function with type hints and a Google-style docstring (its `Args:` section
describes each parameter); `tool_schema` turns it into the JSON schema chat templates take
as `tools=` (`transformers.utils.get_json_schema`). The policy calls tools in the
Qwen2.5 / Hermes format, one JSON object per call:

    <tool_call>
    {"name": "calculator", "arguments": {"expression": "12 * 34"}}
    </tool_call>

and each result comes back in a `<tool_response>` block, several calls' blocks joined by a
newline:

    <tool_response>
    408
    </tool_response>

Rendered as a user message, that is token for token what Qwen2.5's chat template makes of
`tool` messages (it wraps their content in those tags inside a user turn), so
`ToolEnvironment.observation_role` is "user" and the same text serves tokenizers without a
chat template. A turn without a tool call is the final answer.
"""

from __future__ import annotations

import collections
import dataclasses
import inspect
import json
import threading
import types
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

from grpojax.envs.base import Environment, Prompt, Step
from grpojax.errors import UserError

__all__ = [
    "ParseError",
    "ToolCall",
    "ToolEnvironment",
    "call_with_timeout",
    "has_chat_template",
    "parse_tool_calls",
    "plain_tools_listing",
    "template_supports_tools",
    "tool_schema",
    "tools_prompt",
]

TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
TOOL_RESPONSE_OPEN, TOOL_RESPONSE_CLOSE = "<tool_response>", "</tool_response>"


@dataclasses.dataclass(frozen=True)
class ToolCall:
    """One parsed call: the tool's `name` and its keyword `arguments`."""

    name: str
    arguments: Mapping[str, Any]


@dataclasses.dataclass(frozen=True)
class ParseError:
    """Why a turn's tool calls could not be parsed; `message` is one line for the policy.

    kind: "json" (not valid JSON), "not_object" (JSON, but not an object), "name" (no
      non-empty string "name"), "arguments" ("arguments" is not an object), "unclosed" (no
      `</tool_call>` right after the JSON).
    """

    kind: Literal["json", "not_object", "name", "arguments", "unclosed"]
    message: str


def parse_tool_calls(text: str) -> list[ToolCall] | ParseError:
    """The tool calls in `text`, in order, or the first reason one is malformed.

    Each call is `<tool_call>`, one JSON object {"name": str, "arguments": object} (a missing
    "arguments" means no arguments), then `</tool_call>`, with any whitespace between. The
    object is read with `json.JSONDecoder.raw_decode`, so nested objects and strings holding
    "</tool_call>" are read whole. Text outside the tags is ignored; no `<tool_call>` gives
    []. One malformed call makes the whole turn a `ParseError` (no call of it runs).
    """
    decoder = json.JSONDecoder()
    calls: list[ToolCall] = []
    pos = 0
    while (start := text.find(TOOL_CALL_OPEN, pos)) >= 0:
        k = len(calls) + 1
        j = _skip_space(text, start + len(TOOL_CALL_OPEN))
        try:
            obj, end = decoder.raw_decode(text, j)
        except json.JSONDecodeError as e:
            return ParseError(
                "json", f"tool call {k} is not valid JSON: {e.msg} (at char {e.pos - j})"
            )
        end = _skip_space(text, end)
        if not text.startswith(TOOL_CALL_CLOSE, end):
            return ParseError(
                "unclosed", f"tool call {k}: expected {TOOL_CALL_CLOSE} right after its JSON object"
            )
        pos = end + len(TOOL_CALL_CLOSE)
        if not isinstance(obj, dict):
            return ParseError(
                "not_object",
                f'tool call {k} must be a JSON object {{"name": ..., "arguments": {{...}}}}, '
                f"got {type(obj).__name__}",
            )
        name = obj.get("name")
        if not isinstance(name, str) or not name:
            return ParseError("name", f'tool call {k} needs a "name" string, got {name!r}')
        arguments = obj.get("arguments", {})
        if not isinstance(arguments, dict):
            return ParseError(
                "arguments",
                f'tool call {k} ({name}): "arguments" must be a JSON object, got '
                f"{type(arguments).__name__}",
            )
        calls.append(ToolCall(name, arguments))
    return calls


def _skip_space(text: str, i: int) -> int:
    while i < len(text) and text[i].isspace():
        i += 1
    return i


def tool_schema(fn: Callable[..., Any], *, name: str | None = None) -> dict[str, Any]:
    """The JSON schema of tool `fn`: {"type": "function", "function": {"name", "description",
    "parameters", ...}} from its signature and Google-style docstring
    (`transformers.utils.get_json_schema`), named `name` when given (else `fn.__name__`).

    Raises:
      UserError: naming the tool, where the docstring or a type hint cannot be read.
    """
    from transformers.utils import get_json_schema

    label = name or getattr(fn, "__name__", repr(fn))
    try:
        schema = get_json_schema(fn)
    except Exception as e:  # DocstringParsingException, TypeHintParsingException
        raise UserError(
            f"tool {label!r}: cannot make its JSON schema ({type(e).__name__}: {e}); give every "
            "parameter a type hint and describe it in a Google-style docstring 'Args:' section"
        ) from None
    if name is not None:
        schema["function"]["name"] = name
    return schema


def plain_tools_listing(schemas: Sequence[Mapping[str, Any]]) -> str:
    """The tools and the call format as plain text, for prompts without a tool-aware chat
    template: one JSON schema per line (ASCII, so the built-in character tokenizer reads it)."""
    lines = [
        "You may call these tools. To call one, write",
        f'{TOOL_CALL_OPEN}\n{{"name": <tool name>, "arguments": <JSON object>}}\n{TOOL_CALL_CLOSE}',
        f"and its result comes back in {TOOL_RESPONSE_OPEN}...{TOOL_RESPONSE_CLOSE}. "
        "Reply without a tool call to give your final answer.",
        "Tools:",
    ]
    lines += [json.dumps(s.get("function", s)) for s in schemas]
    return "\n".join(lines)


def _messages(prompt: Prompt) -> list[dict[str, Any]]:
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    if (
        isinstance(prompt, list)
        and prompt
        and all(isinstance(m, Mapping) and "role" in m and "content" in m for m in prompt)
    ):
        return [dict(m) for m in prompt]
    raise UserError(
        f"env reset() must return text or a list of {{'role', 'content'}} messages, got "
        f"{type(prompt).__name__}"
    )


def has_chat_template(tokenizer: Any) -> bool:
    """Whether `tokenizer` is not None and carries a chat template."""
    return tokenizer is not None and bool(getattr(tokenizer, "chat_template", None))


def template_supports_tools(tokenizer: Any) -> bool:
    """Whether the tokenizer's chat template reads a `tools` variable (Qwen2.5's does)."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, Mapping):
        return "tool_use" in template or any("tools" in str(t) for t in template.values())
    return isinstance(template, str) and "tools" in template


def tools_prompt(
    tokenizer: Any,
    tools: Mapping[str, Callable[..., Any]] | Sequence[Mapping[str, Any]],
    prompt: Prompt,
    *,
    chat: bool | None = None,
    generation_prompt: bool = True,
) -> str:
    """The first prompt's text with `tools` offered in it (no tools: the prompt alone);
    `generation_prompt` False leaves the chat template's assistant header off.

    tools: name -> function (schemas by `tool_schema`) or the schemas themselves.
    chat: render through the tokenizer's chat template (None: where it has one). Then text is
      the user message, the generation prompt is added, and the tools go
        - into the template's `tools=` argument where the template reads it, else
        - as `plain_tools_listing` text at the head of the system message (one is added).
    Without the chat template (or `tokenizer` None): the listing, a newline, then the prompt
    text (messages' contents joined by newlines). Single newlines only: the built-in character
    tokenizer has no token for a run of them.
    """
    if isinstance(tools, Mapping):
        schemas = [tool_schema(fn, name=name) for name, fn in tools.items()]
    else:
        schemas = [dict(s) for s in tools]
    use_chat = has_chat_template(tokenizer) if chat is None else chat
    messages = _messages(prompt)
    if not use_chat:
        text = "\n".join(str(m["content"]) for m in messages)
        return f"{plain_tools_listing(schemas)}\n{text}" if schemas else text
    if not has_chat_template(tokenizer):
        raise UserError("chat=True but the tokenizer has no chat_template")
    if schemas and template_supports_tools(tokenizer):
        return tokenizer.apply_chat_template(
            messages, tools=schemas, add_generation_prompt=generation_prompt, tokenize=False
        )
    if schemas:
        listing = plain_tools_listing(schemas)
        if messages[0]["role"] == "system":
            messages[0]["content"] = f"{listing}\n\n{messages[0]['content']}"
        else:
            messages.insert(0, {"role": "system", "content": listing})
    return tokenizer.apply_chat_template(
        messages, add_generation_prompt=generation_prompt, tokenize=False
    )


def call_with_timeout(
    fn: Callable[..., Any], kwargs: Mapping[str, Any], timeout_s: float
) -> tuple[Literal["ok", "error", "timeout"], Any]:
    """Call fn(**kwargs) in a daemon thread: ("ok", value), ("error", exception) or
    ("timeout", None) after `timeout_s` (the thread is abandoned: Python cannot kill it, and
    being a daemon it does not keep the process alive)."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = fn(**kwargs)
        except BaseException as e:  # a tool may raise anything, SystemExit included
            box["error"] = e

    thread = threading.Thread(target=run, daemon=True, name="grpojax-tool")
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        return "timeout", None
    if "error" in box:
        return "error", box["error"]
    return "ok", box.get("value")


def _one_line(text: str) -> str:
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else ""


class ToolEnvironment(Environment):
    """An environment whose policy calls `tools` until it answers without a tool call.

    step(turn): parse the turn's calls (`parse_tool_calls`);
      - none: the turn is the final answer (`final_answer`), the episode is done;
      - malformed: the observation is one `<tool_response>` block "Error: <why>";
      - else each call runs in order and the observation is its results' blocks (an unknown
        tool, arguments the function's signature cannot bind, an exception, a timeout: an
        "Error: ..." line as that call's result; output over `max_output_chars` is cut).
    Each event is counted in the Step's info: tool_calls, parse_errors, unknown_tools,
    bad_arguments, tool_errors (exceptions), tool_timeouts, output_truncations,
    final_answers.

    Attributes (class defaults; keywords of the same name override them per instance):
      tools: name -> function (plain functions with type hints and a Google docstring).
      max_output_chars: characters of one tool result kept.
      tool_timeout_s: wall-clock seconds one call may take (the runner's per-step timeout
        should cover the calls a turn may make).
      list_tools: offer the tools in the first prompt (`tool_schemas`); False for a policy
        that knows them from its warm start (e.g. SFT on the environment's demonstrations),
        which saves the listing's tokens on every sample. The tools answer calls either way.
    Subclasses implement `reset` and `reward` (reading `final_answer` and `turns`).
    """

    tools: Mapping[str, Callable[..., Any]] = types.MappingProxyType({})
    stop_strings: tuple[str, ...] = (TOOL_CALL_CLOSE,)
    max_output_chars: int = 2000
    tool_timeout_s: float = 10.0
    list_tools: bool = True

    def __init__(
        self,
        row: Mapping[str, Any],
        *,
        tools: Mapping[str, Callable[..., Any]] | None = None,
        max_output_chars: int | None = None,
        tool_timeout_s: float | None = None,
        list_tools: bool | None = None,
        **kwargs: Any,
    ):
        super().__init__(row, **kwargs)
        if tools is not None:
            self.tools = tools
        if not isinstance(self.tools, Mapping) or not all(
            isinstance(k, str) and k and callable(v) for k, v in self.tools.items()
        ):
            raise UserError(
                f"env tools must be a mapping of tool name -> function, got {self.tools!r}"
            )
        self.tools = dict(self.tools)
        if max_output_chars is not None:
            self.max_output_chars = max_output_chars
        if tool_timeout_s is not None:
            self.tool_timeout_s = tool_timeout_s
        if list_tools is not None:
            self.list_tools = list_tools
        if not isinstance(self.list_tools, bool):
            raise UserError(f"env list_tools must be true or false, got {self.list_tools!r}")
        m = self.max_output_chars
        if isinstance(m, bool) or not isinstance(m, int) or m < 1:
            raise UserError(f"env max_output_chars must be an int >= 1, got {m!r}")
        t = self.tool_timeout_s
        if isinstance(t, bool) or not isinstance(t, int | float) or not t > 0:
            raise UserError(f"env tool_timeout_s must be a number > 0, got {t!r}")
        self.final_answer: str | None = None
        self.turns: list[str] = []

    def tool_schemas(self) -> list[dict[str, Any]]:
        if not self.list_tools:
            return []
        return [tool_schema(fn, name=name) for name, fn in self.tools.items()]

    def step(self, completion: str) -> Step:
        self.turns.append(completion)
        parsed = parse_tool_calls(completion)
        if isinstance(parsed, ParseError):
            return Step(
                observation=self.format_results([f"Error: {parsed.message}"]),
                info={"parse_errors": 1},
            )
        if not parsed:
            self.final_answer = completion
            return Step(done=True, info={"final_answers": 1})
        info: collections.Counter[str] = collections.Counter()
        results = [self.call_tool(call, info) for call in parsed]
        return Step(observation=self.format_results(results), info=dict(info))

    def call_tool(self, call: ToolCall, info: collections.Counter[str]) -> str:
        """Run one call; its result text (or one "Error: ..." line), counting into `info`."""
        info["tool_calls"] += 1
        fn = self.tools.get(call.name)
        if fn is None:
            info["unknown_tools"] += 1
            return f"Error: unknown tool {call.name!r}; available: {', '.join(self.tools)}"
        try:
            inspect.signature(fn).bind(**call.arguments)
        except TypeError as e:
            info["bad_arguments"] += 1
            return f"Error: bad arguments for {call.name!r}: {e}"
        except ValueError:  # no signature to check (a builtin): the call will tell
            pass
        status, value = call_with_timeout(fn, call.arguments, self.tool_timeout_s)
        if status == "timeout":
            info["tool_timeouts"] += 1
            return f"Error: {call.name!r} timed out after {self.tool_timeout_s:g} s"
        if status == "error":
            info["tool_errors"] += 1
            why = _one_line(str(value))
            return f"Error: {type(value).__name__}" + (f": {why}" if why else "")
        text = value if isinstance(value, str) else _to_text(value)
        if len(text) > self.max_output_chars:
            info["output_truncations"] += 1
            cut = len(text) - self.max_output_chars
            text = f"{text[: self.max_output_chars]}... ({cut} more characters cut)"
        return text

    def format_results(self, results: Sequence[str]) -> str:
        """The observation for a turn's results: one `<tool_response>` block each."""
        return "\n".join(f"{TOOL_RESPONSE_OPEN}\n{r}\n{TOOL_RESPONSE_CLOSE}" for r in results)


def _to_text(value: Any) -> str:
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return str(value)
