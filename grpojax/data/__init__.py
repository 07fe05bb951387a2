"""Data for the driver: built-in procedural tasks, reasoning-gym tasks, user files, and a
checkpointable prompt source that tokenizes batches and skips over-budget prompts.

Row convention: every source yields dicts with a `prompt` string; every other column (e.g.
`answer`, `task`, `entry`, `completion`) is passed through to the reward functions.
"""

from grpojax.data.arithmetic import ARITHMETIC_PRESETS, ArithmeticTask, arithmetic_task
from grpojax.data.files import FILE_FORMATS, load_prompt_dataset, load_rows
from grpojax.data.gym import ReasoningGymRows, reasoning_gym_rows, reasoning_gym_split
from grpojax.data.source import (
    MIN_PROMPT_WIDTH,
    PROMPT_BUCKET,
    PromptBatch,
    PromptCompletionBatch,
    PromptSource,
    PromptTooLongWarning,
    encode_prompts,
    encode_sft,
    encode_texts,
    pad_id_of,
    pad_token_ids,
    padded_width,
    prompt_width,
    stop_ids_of,
)
from grpojax.data.templates import FormattedRows, PromptFormatter

__all__ = [
    "ARITHMETIC_PRESETS",
    "FILE_FORMATS",
    "MIN_PROMPT_WIDTH",
    "PROMPT_BUCKET",
    "ArithmeticTask",
    "FormattedRows",
    "PromptBatch",
    "PromptCompletionBatch",
    "PromptFormatter",
    "PromptSource",
    "PromptTooLongWarning",
    "ReasoningGymRows",
    "arithmetic_task",
    "encode_prompts",
    "encode_sft",
    "encode_texts",
    "load_prompt_dataset",
    "load_rows",
    "pad_id_of",
    "pad_token_ids",
    "padded_width",
    "prompt_width",
    "reasoning_gym_rows",
    "reasoning_gym_split",
    "stop_ids_of",
]
