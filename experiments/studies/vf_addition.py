"""A verifiers v1 taskset (the `verifiers` package's own classes, no grpojax import): the
SmolLM2 recipe's task, 2-digit sums asked in plain English, for `env.name=verifiers:vf_addition`
(`experiments/studies/smollm2_seeds.py --variant verifiers` trains SmolLM2-135M-Instruct on
it through grpojax's endpoint; the script puts this folder on PYTHONPATH).

Tasks: every pair of operands 0-99 (10,000), asked "What is 47 + 38? Reply with only the
number." as the one user message (the model's chat template adds its own system prompt, as
in the recipe). Reward `correct`: 1 when the reply's last number is the sum, else 0 (the
recipe's `final_number`).
"""

from __future__ import annotations

import re

import verifiers.v1 as vf

__all__ = ["AdditionTaskset"]

NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


class AdditionData(vf.TaskData):
    a: int
    b: int


class AdditionTask(vf.Task[AdditionData, vf.State, vf.TaskConfig]):
    @vf.reward
    async def correct(self, task: AdditionData, trace: vf.Trace) -> float:
        numbers = NUMBER.findall(trace.last_reply or "")
        return float(bool(numbers) and float(numbers[-1]) == task.a + task.b)


class AdditionTaskset(vf.Taskset[AdditionTask, vf.TasksetConfig]):
    def load(self):
        for a in range(100):
            for b in range(100):
                prompt = f"What is {a} + {b}? Reply with only the number."
                yield AdditionTask(AdditionData(prompt=prompt, a=a, b=b), self.config.task)
