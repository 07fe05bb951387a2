"""The `grpojax` command. Subcommands arrive with the driver (train, eval, sft, rm)."""

from __future__ import annotations

import argparse
import sys


def _parser() -> argparse.ArgumentParser:
    from grpojax import __version__

    p = argparse.ArgumentParser(
        prog="grpojax",
        description="PPO and GRPO fine-tuning of language models in JAX.",
    )
    p.add_argument("--version", action="version", version=f"grpojax {__version__}")
    p.add_subparsers(dest="command", title="commands", metavar="COMMAND")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command is None:
        _parser().print_help()
        return 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
