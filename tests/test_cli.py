import subprocess
import sys

from grpojax import cli


def test_help_exits_zero(capsys):
    assert cli.main([]) == 0
    assert "grpojax" in capsys.readouterr().out


def test_console_entry_point_help():
    out = subprocess.run(
        [sys.executable, "-m", "grpojax.cli", "--help"], capture_output=True, text=True, check=True
    )
    assert "usage: grpojax" in out.stdout
