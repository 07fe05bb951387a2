"""The README's set-up commands are the ones CI runs (its other code blocks run in
tests/test_docs.py, with the docs')."""

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _readme_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    setup = text.split("## Set up", 1)[1].split("\n## ", 1)[0]
    return [c.strip() for c in re.findall(r"```(?:bash|sh)\n(.*?)```", setup, flags=re.S)]


def test_readme_has_exactly_two_setup_commands():
    cmds = _readme_commands()
    assert len(cmds) == 2, cmds
    assert all("\n" not in c for c in cmds), "each set-up command is one line"


def test_ci_runs_the_readme_test_command():
    ci = (ROOT / ".ci" / "run").read_text().strip().splitlines()
    test_cmd = _readme_commands()[1]
    assert ci[-1].strip() == test_cmd
