"""`PythonToolEnv`: its `python` tool runs the policy's code in the code reward's sandbox
(two sandboxed runs in all). Where writes cannot be confined here (no Landlock ABI >= 3),
weaker isolation is accepted for the run, as in test_rewards_sandbox.py, and the refusal
itself is checked without starting a process."""

import json

import pytest

from grpojax.envs import EpisodeRunner, PythonToolEnv, builtin
from grpojax.models.tokenizer import builtin_tokenizer
from grpojax.rewards import SandboxIsolationError, SandboxLimits, sandbox_capabilities

CAPS = sandbox_capabilities()
LIMITS = SandboxLimits(
    cpu_s=2, wall_s=10.0, memory_mb=256, accept_weak_isolation=not CAPS.filesystem_isolation
)


def tool_call(code):
    return (
        f"<tool_call>\n{json.dumps({'name': 'python', 'arguments': {'code': code}})}\n</tool_call>"
    )


def test_python_tool_runs_code_in_the_sandbox_and_the_answer_is_scored():
    tok = builtin_tokenizer()
    row = {"question": "What is 123 * 456? Use python.", "answer": 56088}
    runner = EpisodeRunner([PythonToolEnv(row, limits=LIMITS)], tok, max_episode_tokens=4000)
    assert '"name": "python"' in tok.decode(runner.prompt_ids()[0])
    # One turn, two calls: a program that prints, and one that fails after printing.
    turn = tool_call("print(123 * 456)") + tool_call("print('so far')\nraise SystemExit(3)")
    ids = tok(turn, add_special_tokens=False)["input_ids"]
    (answer,) = runner.advance([0], [ids], [[0.0] * len(ids)])
    text = tok.decode(answer)
    first, second = text.split("</tool_response>\n<tool_response>")
    assert first == "\n<tool_response>\n56088\n"
    assert second == "\nso far\n(exit code 3)\n</tool_response>\n"
    final = [*tok("Answer: 56088", add_special_tokens=False)["input_ids"], tok.eos_token_id]
    assert runner.advance([0], [final], [[0.0] * len(final)]) == [None]
    (ep,) = runner.episodes
    assert ep.final_reward == 1.0 and ep.done_reason == "done"
    assert ep.counters["tool_calls"] == 2 and "tool_errors" not in ep.counters


def test_python_tool_env_refuses_where_the_sandbox_cannot_confine_writes(monkeypatch):
    def refuse(limits=None):
        raise SandboxIsolationError("sandbox: cannot confine writes here")

    monkeypatch.setattr(builtin, "check_sandbox_isolation", refuse)
    with pytest.raises(SandboxIsolationError, match="cannot confine"):
        PythonToolEnv({"question": "q", "answer": 1})
