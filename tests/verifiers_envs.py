"""A verifiers v1 taskset for the tests, built from the package's own classes (named
`env.name=verifiers:verifiers_envs`: verifiers imports a taskset by its top-level module,
here tests/, which pytest puts on sys.path): 2-digit additions, asked with a system prompt;
rewards: `correct` (the reply's last integer is the sum) and `brief` (weight 0.5, shorter
replies score more), so a random model's replies get rewards that differ."""

from __future__ import annotations

import re

import verifiers.v1 as vf

__all__ = ["AdditionTaskset"]

SYSTEM = "Answer with the number only."
PAIRS = [(10 + 7 * k % 90, 11 + 13 * k % 89) for k in range(30)]


def correct_score(reply: str, a: int, b: int) -> float:
    numbers = re.findall(r"-?\d+", reply)
    return float(bool(numbers) and int(numbers[-1]) == a + b)


def brief_score(reply: str) -> float:
    return 1.0 / (1.0 + len(reply.strip()))


class AdditionData(vf.TaskData):
    a: int
    b: int


class AdditionTask(vf.Task[AdditionData, vf.State, vf.TaskConfig]):
    @vf.reward
    async def correct(self, task: AdditionData, trace: vf.Trace) -> float:
        return correct_score(trace.last_reply, task.a, task.b)

    @vf.reward(weight=0.5)
    async def brief(self, trace: vf.Trace) -> float:
        return brief_score(trace.last_reply)


class AdditionTaskset(vf.Taskset[AdditionTask, vf.TasksetConfig]):
    def load(self):
        for a, b in PAIRS:
            data = AdditionData(prompt=f"What is {a} + {b}?", system_prompt=SYSTEM, a=a, b=b)
            yield AdditionTask(data, self.config.task)
