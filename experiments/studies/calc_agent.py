"""Agents that know only the OpenAI client (no grpojax import), for
`env.name=agent:calc_agent:<function>` (`experiments/studies/smollm2_seeds.py --variant agent`
or `--variant tool` trains SmolLM2-135M-Instruct through grpojax's endpoint with them).

`solve` asks the row's question (the arithmetic task's prompt, "What is 47 + 38? Reply with
only the number.") offering one tool, `add(a, b)`; `solve_product` asks "What is 347 * 29?
Reply with only the number." offering `multiply(a, b)` (rows: `write_product_rows`). Where a
reply calls the tool, the agent runs it and sends the result back as a tool message, then
asks again (at most `MAX_CALLS` requests); the reward is 1 when the last reply's last number
is the row's answer, else 0.

`expert` writes the demonstrations of an SFT warm start for `solve_product`
(`env.kwargs.expert=calc_agent:expert`): a hurried expert that calls `multiply` on a fixed
share of the questions (`EXPERT_TOOL_SHARE`, by a hash of the question) and copies its
result, and on the others answers at once with the factors rounded to tens multiplied
(wrong unless both end in 0), so that the warm start leaves RL the tool to learn.
"""

from __future__ import annotations

import json
import pathlib
import re
import zlib

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
PRODUCT_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "multiply",
            "description": "Multiply two numbers and return their product.",
            "parameters": TOOLS[0]["function"]["parameters"],
        },
    }
]
OPERATIONS = {"add": lambda a, b: a + b, "multiply": lambda a, b: a * b}
NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
EXPERT_TOOL_SHARE = 0.15


def _run_tool(name: str, arguments: str) -> str:
    if name not in OPERATIONS:
        return f"error: no tool {name!r}"
    try:
        args = json.loads(arguments or "{}")
        return str(OPERATIONS[name](float(args["a"]), float(args["b"]))).removesuffix(".0")
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
    return _solve(client, row, [{"role": "user", "content": row["prompt"]}], TOOLS)


def solve_shown(client, row) -> float:
    """`solve`, with a system message showing one call of the tool (`EXAMPLE`)."""
    messages = [{"role": "system", "content": EXAMPLE}, {"role": "user", "content": row["prompt"]}]
    return _solve(client, row, messages, TOOLS)


def solve_product(client, row) -> float:
    """Asks the row's question with the `multiply` tool offered."""
    return _solve(client, row, [{"role": "user", "content": row["prompt"]}], PRODUCT_TOOLS)


def _solve(client, row, messages, tools) -> float:
    content = ""
    for _ in range(MAX_CALLS):
        reply = client.chat.completions.create(model="policy", messages=messages, tools=tools)
        message = reply.choices[0].message
        content = message.content or ""
        if reply.choices[0].finish_reason == "length" or not message.tool_calls:
            break
        messages.append(message.model_dump(exclude_none=True))
        for call in message.tool_calls:
            result = _run_tool(call.function.name, call.function.arguments)
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    numbers = NUMBER.findall(content)
    return float(bool(numbers) and float(numbers[-1]) == float(row["answer"]))


def expert(request: dict, row: dict) -> str:
    """The hurried expert's reply to `request` (`solve_product`'s): after a tool message its
    content; else a `multiply` call on `EXPERT_TOOL_SHARE` of the questions (crc32 of the
    question / 2^32 below it), an estimate on the others (the factors rounded to tens,
    halves up, multiplied)."""
    last = request["messages"][-1]
    if last["role"] == "tool":
        return last["content"]
    a, b = int(row["a"]), int(row["b"])
    if zlib.crc32(row["question"].encode()) / 2**32 < EXPERT_TOOL_SHARE:
        call = {"name": "multiply", "arguments": {"a": a, "b": b}}
        return f"<tool_call>\n{json.dumps(call)}\n</tool_call>"
    return str((a + 5) // 10 * 10 * ((b + 5) // 10 * 10))


def write_product_rows(directory: str | pathlib.Path, heldout_every: int = 10) -> dict:
    """Write every product of a 3-digit and a 2-digit factor (100-999 x 10-99, 81,000 rows
    {question "347 * 29", answer, a, b}) to `directory`/products_train.jsonl and
    products_heldout.jsonl: a question is held out when crc32 of it (salted "heldout:") is 0
    modulo `heldout_every`, so the two files never share one; each file is shuffled by a
    hash of its questions. Returns the two paths."""
    directory = pathlib.Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    splits: dict[str, list] = {"train": [], "heldout": []}
    for a in range(100, 1000):
        for b in range(10, 100):
            question = f"{a} * {b}"
            held = zlib.crc32(f"heldout:{question}".encode()) % heldout_every == 0
            row = {"question": question, "answer": str(a * b), "a": a, "b": b}
            splits["heldout" if held else "train"].append(row)
    paths = {}
    for split, rows in splits.items():
        rows.sort(key=lambda r: zlib.crc32(f"order:{r['question']}".encode()))
        paths[split] = directory / f"products_{split}.jsonl"
        paths[split].write_text("".join(json.dumps(r) + "\n" for r in rows))
    return paths
