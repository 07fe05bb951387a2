"""Rewards: the reward-function protocol, a worker pool to run them, built-in verifiers.

    fn(prompts: list[str], completions: list[str], **columns) -> list[float | None]

`RewardManager` runs several weighted functions in worker processes with a per-call
timeout and returns the weighted total, a validity mask and per-function stats
(`manager`). Built-ins: `math_answer_reward` (math-verify), `format_reward` (regex),
`numeric_answer_reward` (exact number), `final_number_reward` (a chat reply's last number),
`reasoning_gym_reward` (reasoning-gym's
scorers) in `verifiers`; `code_execution_reward` (sandboxed subprocess) in `sandbox`;
`RewardModelScorer` (a learned reward head, in-process JAX) in `reward_model`,
imported lazily so worker processes do not import Flax for it.
"""

from grpojax.rewards.manager import (
    RewardFn,
    RewardManager,
    RewardResult,
    RewardSpec,
    check_picklable,
    resolve_reward_function,
    reward_columns,
)
from grpojax.rewards.sandbox import (
    SandboxCapabilities,
    SandboxIsolationError,
    SandboxLimits,
    SandboxResult,
    check_sandbox_isolation,
    code_execution_reward,
    extract_code,
    run_python_sandboxed,
    sandbox_capabilities,
)
from grpojax.rewards.verifiers import (
    DEFAULT_FORMAT_PATTERN,
    extract_answer_tag,
    final_number_reward,
    format_reward,
    math_answer_reward,
    numeric_answer_reward,
    reasoning_gym_reward,
)

__all__ = [
    "DEFAULT_FORMAT_PATTERN",
    "RewardFn",
    "RewardManager",
    "RewardModelScorer",
    "RewardResult",
    "RewardSpec",
    "SandboxCapabilities",
    "SandboxIsolationError",
    "SandboxLimits",
    "SandboxResult",
    "check_picklable",
    "check_sandbox_isolation",
    "code_execution_reward",
    "extract_answer_tag",
    "extract_code",
    "final_number_reward",
    "format_reward",
    "math_answer_reward",
    "numeric_answer_reward",
    "reasoning_gym_reward",
    "resolve_reward_function",
    "reward_columns",
    "run_python_sandboxed",
    "sandbox_capabilities",
]


def __getattr__(name):
    if name == "RewardModelScorer":
        from grpojax.rewards.reward_model import RewardModelScorer

        return RewardModelScorer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
