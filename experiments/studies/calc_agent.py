"""An agent that knows only the OpenAI client (no grpojax import): two-digit sums with an
`add` tool, for `env.name=agent:calc_agent:solve` (`experiments/studies/smollm2_seeds.py
--variant agent` trains SmolLM2-135M-Instruct through grpojax's endpoint with it).

The agent asks the row's question (the arithmetic task's prompt, "What is 47 + 38? Reply
with only the number.") offering one tool, `add(a, b)`. Where a reply calls it, the agent
runs it and sends the result back as a tool message, then asks again (at most `MAX_CALLS`
requests); the reward is 1 when the last reply's last number is the row's answer, else 0.
"""

from __future__ import annotations

import json
import re

MAX_CALLS = 3
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two numbers and return their sum.",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
                "required": ["a", "b"],
            },
        },
    }
]
NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def _add(arguments: str) -> str:
    try:
        args = json.loads(arguments or "{}")
        return str(float(args["a"]) + float(args["b"])).removesuffix(".0")
    except (ValueError, KeyError, TypeError) as e:
        return f"error: {e}"


# `solve_shown`'s system message: one worked call, so that a small model that has never
# called a tool sees the format with numbers in it.
EXAMPLE = (
    "To add two numbers, call the add tool. For 12 + 30 you reply\n"
    '<tool_call>\n{"name": "add", "arguments": {"a": 12, "b": 30}}\n</tool_call>\n'
    "and the result comes back; then reply with only the number: 42"
)


def solve(client, row) -> float:
    """Asks the row's question with the `add` tool offered."""
    return _solve(client, row, [{"role": "user", "content": row["prompt"]}])


def solve_shown(client, row) -> float:
    """`solve`, with a system message showing one call of the tool (`EXAMPLE`)."""
    messages = [{"role": "system", "content": EXAMPLE}, {"role": "user", "content": row["prompt"]}]
    return _solve(client, row, messages)


def _solve(client, row, messages) -> float:
    content = ""
    for _ in range(MAX_CALLS):
        reply = client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
        message = reply.choices[0].message
        content = message.content or ""
        if reply.choices[0].finish_reason == "length" or not message.tool_calls:
            break
        messages.append(message.model_dump(exclude_none=True))
        for call in message.tool_calls:
            result = _add(call.function.arguments) if call.function.name == "add" else "no tool"
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    numbers = NUMBER.findall(content)
    return float(bool(numbers) and float(numbers[-1]) == float(row["answer"]))
