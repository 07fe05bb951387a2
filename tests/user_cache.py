"""Where the suite keeps what should outlive a checkout (a fresh clone on a machine that ran
the suite before starts warm): `$XDG_CACHE_HOME/grpojax/<name>`, `~/.cache/grpojax/<name>`
without it."""

from __future__ import annotations

import os
import pathlib


def user_cache_dir(name: str) -> pathlib.Path:
    base = os.environ.get("XDG_CACHE_HOME") or pathlib.Path.home() / ".cache"
    return pathlib.Path(base, "grpojax", name)
