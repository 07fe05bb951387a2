"""Convert GSM8K, in its official file format, into grpojax's JSONL prompt schema.

GSM8K's files (`train.jsonl`, `test.jsonl` of openai/grade-school-math) hold one JSON object
a line with `question` and `answer`, where `answer` is the worked solution, with calculator
annotations `<<48/2=24>>`, ending in a line `#### 72` (the final number; it may carry
thousands separators, `#### 1,200`, or a sign, `#### -3`). Each output row is

    {"prompt": <question>, "answer": "72", "solution": <the worked solution>}

`answer` is the final number with the commas removed (what `math_answer` and
`numeric_answer` compare against); `solution` is the worked solution without its `####`
line and without the calculator annotations (for reading, or an SFT column). A row that is
not like that is an error naming the file and line.

    python experiments/tools/prepare_gsm8k.py gsm8k/train.jsonl data/gsm8k/train.jsonl
    python experiments/tools/prepare_gsm8k.py gsm8k/test.jsonl data/gsm8k/test.jsonl

then `grpojax train --config experiments/configs/qwen2_5_0_5b_gsm8k.yaml model.source=DIR
data.path=data/gsm8k/train.jsonl data.eval_path=data/gsm8k/test.jsonl`.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import re
import sys

_NUMBER = re.compile(r"[-+]?\d+(?:\.\d+)?")
_CALCULATOR = re.compile(r"<<[^<>]*>>")


class FormatError(ValueError):
    """A row that is not in GSM8K's format; the message names the file and line."""


def final_answer(solution: str) -> str:
    """The number after the last `####` of a GSM8K answer, commas removed ("1,200" ->
    "1200", "-3" -> "-3", "+5" -> "5"). A ValueError when there is none."""
    _, sep, tail = solution.rpartition("####")
    if not sep:
        raise ValueError("the answer has no final '#### <number>' line")
    text = tail.strip().replace(",", "")
    if not _NUMBER.fullmatch(text):
        raise ValueError(f"the final answer {tail.strip()!r} is not a number")
    return text.lstrip("+")


def convert_row(row: dict) -> dict:
    """One GSM8K row -> {"prompt", "answer", "solution"} (module docstring)."""
    if not isinstance(row, dict):
        raise ValueError(f"a row must be a JSON object, got {type(row).__name__}")
    for key in ("question", "answer"):
        if not isinstance(row.get(key), str) or not row[key].strip():
            raise ValueError(f"the row needs a non-empty string {key!r}")
    worked = row["answer"].rpartition("####")[0]
    return {
        "prompt": row["question"].strip(),
        "answer": final_answer(row["answer"]),
        "solution": _CALCULATOR.sub("", worked).strip(),
    }


def convert_file(src: str | pathlib.Path, dst: str | pathlib.Path) -> int:
    """Convert the GSM8K JSONL file `src` into `dst` (directories made); the row count.

    Raises:
      FormatError: naming `src` and the line of the first bad row (nothing is written).
    """
    src, dst = pathlib.Path(src), pathlib.Path(dst)
    out = []
    with src.open(encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                out.append(convert_row(json.loads(line)))
            except (ValueError, json.JSONDecodeError) as e:
                raise FormatError(f"{src}, line {lineno}: {e}") from None
    if not out:
        raise FormatError(f"{src} has no rows")
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.with_name(dst.name + ".tmp")
    tmp.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in out), "utf-8")
    tmp.replace(dst)
    return len(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("src", help="a GSM8K JSONL file (question, answer '... #### N')")
    parser.add_argument("dst", help="the output JSONL file (prompt, answer, solution)")
    args = parser.parse_args(argv)
    try:
        n = convert_file(args.src, args.dst)
    except (FormatError, OSError) as e:
        print(f"prepare_gsm8k: error: {e}", file=sys.stderr)
        return 2
    print(f"prepare_gsm8k: wrote {n} rows to {args.dst}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
