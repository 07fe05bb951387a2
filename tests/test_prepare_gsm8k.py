"""experiments/tools/prepare_gsm8k.py: GSM8K's official JSONL (question, answer ending "#### N")
into grpojax's prompt schema, read back by `load_prompt_dataset`."""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib

import pytest

from grpojax.data import load_prompt_dataset
from grpojax.rewards import math_answer_reward, numeric_answer_reward

ROOT = pathlib.Path(__file__).resolve().parents[1]
_PATH = ROOT / "experiments" / "tools" / "prepare_gsm8k.py"
_spec = importlib.util.spec_from_file_location("prepare_gsm8k", _PATH)
prepare = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(prepare)

# Rows in GSM8K's format: worked solution with calculator annotations, then "#### N".
GSM8K_ROWS = [
    {
        "question": "Natalia sold clips to 48 of her friends in April, and then she sold half "
        "as many clips in May. How many clips did Natalia sell altogether in April and May?",
        "answer": "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n"
        "Natalia sold 48+24 = <<48+24=72>>72 clips altogether in April and May.\n#### 72",
    },
    {
        "question": "A farm has 1,000 hens laying 1.5 eggs a day each. How many eggs in a day?",
        "answer": "1,000 * 1.5 = <<1000*1.5=1500>>1500 eggs a day.\n#### 1,500",
    },
    {
        "question": "The temperature was 4 degrees and fell by 7 degrees. What is it now?",
        "answer": "4 - 7 = <<4-7=-3>>-3 degrees.\n#### -3",
    },
]


def _write(path: pathlib.Path, rows) -> pathlib.Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_converts_gsm8k_rows_to_the_prompt_schema(tmp_path):
    src = _write(tmp_path / "train.jsonl", GSM8K_ROWS)
    dst = tmp_path / "out" / "train.jsonl"
    assert prepare.main([str(src), str(dst)]) == 0
    rows = [json.loads(line) for line in dst.read_text().splitlines()]
    assert [r["answer"] for r in rows] == ["72", "1500", "-3"]  # commas gone, sign kept
    assert rows[0]["prompt"] == GSM8K_ROWS[0]["question"]
    assert rows[0]["solution"] == (
        "Natalia sold 48/2 = 24 clips in May.\nNatalia sold 48+24 = 72 clips altogether in "
        "April and May."
    )
    assert set(rows[2]) == {"prompt", "answer", "solution"}
    # The file loads as a grpojax dataset, and the built-in rewards read its `answer`.
    data = load_prompt_dataset(dst)
    assert len(data) == 3 and data[1]["prompt"].startswith("A farm has 1,000 hens")
    answers = [data[i]["answer"] for i in range(3)]
    prompts = [data[i]["prompt"] for i in range(3)]
    completions = ["So the answer is 72.", "\\boxed{1500}", "It is -3"]
    assert math_answer_reward(prompts, completions, answer=answers) == [1.0, 1.0, 1.0]
    assert numeric_answer_reward(prompts, ["72", "1,500", "-3"], answer=answers) == [1.0, 0.0, 1.0]


def test_final_answer_variants():
    assert prepare.final_answer("x\n#### 1,234,567") == "1234567"
    assert prepare.final_answer("x\n#### -1,050") == "-1050"
    assert prepare.final_answer("x\n####  +5 ") == "5"
    assert prepare.final_answer("x\n#### 0.25") == "0.25"
    with pytest.raises(ValueError, match="no final"):
        prepare.final_answer("just text")
    with pytest.raises(ValueError, match="is not a number"):
        prepare.final_answer("x\n#### seven")


def test_bad_rows_are_one_error_naming_file_and_line(tmp_path, capsys):
    src = _write(tmp_path / "bad.jsonl", [GSM8K_ROWS[0], {"question": "q", "answer": "no end"}])
    dst = tmp_path / "out.jsonl"
    with pytest.raises(prepare.FormatError, match=r"bad\.jsonl, line 2: the answer has no final"):
        prepare.convert_file(src, dst)
    assert not dst.exists()  # nothing written
    assert prepare.main([str(src), str(dst)]) == 2
    assert "bad.jsonl, line 2" in capsys.readouterr().err
    (tmp_path / "nojson.jsonl").write_text('{"question": "q"\n')
    with pytest.raises(prepare.FormatError, match=r"nojson\.jsonl, line 1:"):
        prepare.convert_file(tmp_path / "nojson.jsonl", dst)
    _write(tmp_path / "noq.jsonl", [{"answer": "#### 1"}])
    with pytest.raises(prepare.FormatError, match=r"line 1: the row needs a non-empty string"):
        prepare.convert_file(tmp_path / "noq.jsonl", dst)


def test_the_readme_gpu_command_after_its_preparation_passes_a_dry_run(tmp_path, capsys):
    """The README's Qwen2.5-0.5B GSM8K command, after its documented preparation step (the
    GSM8K files through this script into data/gsm8k/), gets past config and data loading on
    a fresh machine (`grpojax train --dry-run`: the YAML, the overrides, both files, the
    rewards' `answer` column; the Hub model is named, not fetched); without the preparation
    the raw files are one error naming the column the template needs."""
    from grpojax import cli

    readme = (ROOT / "README.md").read_text()
    line = next(x for x in readme.splitlines() if x.startswith("grpojax train --config exp"))
    argv = line.split()[1:]
    config = argv.index("--config") + 1
    argv[config] = str(ROOT / argv[config])  # run from another directory
    (tmp_path / "gsm8k").mkdir()
    for split in ("train", "test"):
        raw = _write(tmp_path / "gsm8k" / f"{split}.jsonl", GSM8K_ROWS)
        assert prepare.main([str(raw), str(tmp_path / "data" / "gsm8k" / f"{split}.jsonl")]) == 0
    capsys.readouterr()
    cwd = pathlib.Path.cwd()
    try:
        os.chdir(tmp_path)
        assert cli.main([*argv, "--dry-run"]) == 0
        out = capsys.readouterr().out
        assert "grpojax train --dry-run: config ok" in out and "held-out 3 rows" in out, out
        assert "Qwen/Qwen2.5-0.5B-Instruct (a Hub id" in out, out
        raw = [a.replace("data/gsm8k/", "gsm8k/") for a in argv]
        assert cli.main([*raw, "--dry-run"]) == 2
        assert "refers to column(s) ['prompt']" in capsys.readouterr().err
    finally:
        os.chdir(cwd)
