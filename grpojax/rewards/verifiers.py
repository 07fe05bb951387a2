"""Built-in verifiable rewards: math answers, format regexes, exact numbers, reasoning-gym.

Each follows the reward protocol of `grpojax.rewards.manager`:
`fn(prompts, completions, *, <columns>) -> list[float | None]`, is a module-level
function (so it pickles for the process pool), and takes its knobs as keywords
(customise with `functools.partial`). Heavy imports (math-verify, reasoning-gym)
happen inside the call, i.e. once per worker process.
"""

from __future__ import annotations

import functools
import re
import threading
from collections.abc import Sequence
from typing import Any

from grpojax.ops.checks import check_choice

# `<think>…</think>` then `<answer>…</answer>`, nothing else but whitespace; the bodies
# may not contain their own tags, so "<answer>1</answer><answer>2</answer>" does not match.
DEFAULT_FORMAT_PATTERN = (
    r"\s*<think>(?:(?!</?think>).)*</think>\s*<answer>(?:(?!</?answer>).)*</answer>\s*"
)
NUMERIC_MODES = ("first_number", "last_number", "strip")
EXTRACT_MODES = ("answer_tag", "full")
_NUMBER = re.compile(r"[-+]?\d+(?:\.\d+)?")
_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def _check_lengths(completions: Sequence[str], **cols: Sequence) -> None:
    for k, v in cols.items():
        if len(v) != len(completions):
            raise ValueError(f"column {k!r} has {len(v)} values for {len(completions)} completions")


@functools.lru_cache(maxsize=64)
def _compiled(pattern: str) -> re.Pattern:
    return re.compile(pattern, re.DOTALL)


def format_reward(
    prompts: Sequence[str], completions: Sequence[str], *, pattern: str = DEFAULT_FORMAT_PATTERN
) -> list[float]:
    """1.0 where the whole completion matches `pattern` (`re.fullmatch`, DOTALL), else 0.0.

    Customise with `functools.partial(format_reward, pattern=r"...")`.
    """
    rx = _compiled(pattern)
    return [1.0 if rx.fullmatch(c) else 0.0 for c in completions]


def extract_answer_tag(completion: str) -> str | None:
    """The stripped text of the last `<answer>…</answer>` in `completion`, or None."""
    found = _ANSWER_TAG.findall(completion)
    return found[-1].strip() if found else None


def numeric_answer_reward(
    prompts: Sequence[str],
    completions: Sequence[str],
    *,
    answer: Sequence[Any],
    mode: str = "first_number",
    eos_text: str | None = None,
) -> list[float]:
    """1.0 where the completion's answer equals the gold `answer` exactly (as strings), else 0.0.

    The completion's answer, by `mode`:
      "first_number": the first number (regex `[-+]?\\d+(\\.\\d+)?`) anywhere in the
                      completion; so " 46", "46<eos>" and "46 apples" give "46", while
                      "046" or "46.0" do not equal "46". No number gives 0.0.
      "last_number":  the last such number: a chat model's final answer ("12 + 34 = 46."
                      gives "46"; restating the problem, "12 + 34", gives "34").
      "strip":        the text before the first `eos_text` (when given), stripped.
    The gold answer is `str(answer).strip()`. Meant for procedural tasks such as the
    built-in arithmetic task ("12+34=" -> "46").
    """
    check_choice("mode", mode, NUMERIC_MODES)
    _check_lengths(completions, answer=answer)
    out = []
    for c, gold in zip(completions, answer):
        if mode in ("first_number", "last_number"):
            found = _NUMBER.findall(c)
            got = (found[0] if mode == "first_number" else found[-1]) if found else None
        else:
            got = (c.split(eos_text, 1)[0] if eos_text else c).strip()
        out.append(1.0 if got is not None and got == str(gold).strip() else 0.0)
    return out


def final_number_reward(
    prompts: Sequence[str], completions: Sequence[str], *, answer: Sequence[Any]
) -> list[float]:
    """1.0 where the last number in the completion is the gold `answer` exactly (as strings),
    else 0.0: `numeric_answer_reward` with mode "last_number", for chat models that answer in
    a sentence ("17 + 25 = 42.").

    Unlike `math_answer_reward`, which verifies symbolic equivalence, it does not reward an
    expression equal to the answer: math-verify scores "17 + 25" correct for 42, so a policy
    that restates an arithmetic question gets full reward.
    """
    return numeric_answer_reward(prompts, completions, answer=answer, mode="last_number")


def math_answer_reward(
    prompts: Sequence[str],
    completions: Sequence[str],
    *,
    answer: Sequence[Any],
    timeout_s: int = 5,
) -> list[float | None]:
    """1.0 where math-verify finds the completion's answer equal to the gold `answer`, else 0.0.

    Both sides go through `math_verify.parse` (LaTeX — `\\boxed{}`, `$…$`, fractions —
    and plain expressions/numbers) and `math_verify.verify(gold, pred)` (symbolic and
    numeric equivalence: `\\frac{1}{2}` == `0.5`). A gold answer math-verify cannot
    parse gives None (no opinion), as in TRL's accuracy reward. A completion holding an
    `<answer>...</answer>` tag is judged on the last tag's text (math-verify finds nothing
    inside the tags: `parse("<answer>72</answer>") == []`), one without on its whole text.

    math-verify bounds parse/verify time with `signal.alarm`, which only works in a
    process's main thread: in a worker process (the manager's default mode) calls run
    in the main thread and get the `timeout_s` limit; in a thread the internal timeout
    is switched off and the manager's per-call timeout is the only bound.
    """
    from math_verify import parse, verify

    _check_lengths(completions, answer=answer)
    t = timeout_s if threading.current_thread() is threading.main_thread() else None
    out: list[float | None] = []
    for c, gold in zip(completions, answer):
        gold_parsed = parse(str(gold), parsing_timeout=t)
        if not gold_parsed:
            out.append(None)
            continue
        tagged = extract_answer_tag(c)
        pred = parse(c if tagged is None else tagged, parsing_timeout=t)
        out.append(1.0 if pred and verify(gold_parsed, pred, timeout_seconds=t) else 0.0)
    return out


@functools.cache
def _rg_scorer(task: str):
    import reasoning_gym

    return reasoning_gym.get_score_answer_fn(task)


def reasoning_gym_reward(
    prompts: Sequence[str],
    completions: Sequence[str],
    *,
    entry: Sequence[dict],
    task: Sequence[str] | None = None,
    extract: str = "answer_tag",
) -> list[float]:
    """reasoning-gym's own score for each completion: `score_answer(answer, entry)` in [0, 1].

    Columns: `entry` (the reasoning-gym entry dict: question, answer, metadata) and
    optionally `task` (the dataset name; default `entry["metadata"]["source_dataset"]`).
    The scorer is `reasoning_gym.get_score_answer_fn(task)`, built once per task per process.
    The answer given to the scorer, by `extract`:
      "answer_tag": the stripped text of the last `<answer>…</answer>` (None if absent,
                    which the scorers score 0.0);
      "full":       the whole completion, stripped.
    """
    check_choice("extract", extract, EXTRACT_MODES)
    _check_lengths(completions, entry=entry)
    if task is not None:
        _check_lengths(completions, task=task)
    out = []
    for i, (c, e) in enumerate(zip(completions, entry)):
        name = task[i] if task is not None else e.get("metadata", {}).get("source_dataset")
        if not name:
            raise ValueError(
                "reasoning_gym_reward needs the task name: a `task` column or "
                "entry['metadata']['source_dataset']"
            )
        given = extract_answer_tag(c) if extract == "answer_tag" else c.strip()
        out.append(float(_rg_scorer(name)(given, e)))
    return out
