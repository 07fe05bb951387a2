"""User code named in a config by a path "package.module:attribute".

Reward functions (`rewards.functions`, `grpojax.rewards.manager.resolve_reward_function`)
and the GRPO step's objectives (`grpo.policy_loss`, `grpo.advantage_estimator`,
`grpojax.train.objectives`) are both given as such paths. Each caller checks the path's
form and the object against its own contract (`is_import_path`, then its own message); the
import and the walk down a dotted attribute are here, once, so a failure reads the same
everywhere. Like `errors.py`, whose `UserError` it raises, this module imports nothing else
from grpojax, so any layer may use it.
"""

from __future__ import annotations

import importlib
from typing import Any

from grpojax.errors import UserError

__all__ = ["import_object", "is_import_path"]

SYS_PATH_HINT = "; is it on sys.path / PYTHONPATH?"


def is_import_path(spec: Any) -> bool:
    """Whether `spec` has the form of an import path: a str with exactly one ":" and a
    non-empty module and attribute on either side ("package.module:attr.sub")."""
    return isinstance(spec, str) and spec.count(":") == 1 and all(spec.partition(":")[::2])


def import_object(field: str, spec: str, *, hint: str = SYS_PATH_HINT) -> object:
    """The object `spec` names: "module:attr" or "module:attr.sub...", the module imported
    with `importlib.import_module` (so it must be on `sys.path`). The caller has checked the
    form (`is_import_path`).

    Args:
      field: the config field, first in every message.
      spec: the path.
      hint: appended to the import-failure message (where the module is looked for).

    Raises:
      UserError (a ValueError): one line, for a module that does not import (whatever it
        raised: its type and the first line of its message), or a missing attribute along
        the dotted path.
    """
    module_name, _, attr = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # whatever fails in the user's module is reported
        lines = str(e).strip().splitlines()
        why = f"{type(e).__name__}: {lines[0]}" if lines else type(e).__name__
        raise UserError(
            f"{field}: cannot import module {module_name!r} of {spec!r} ({why}){hint}"
        ) from None
    obj: object = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise UserError(f"{field}: module {module_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    return obj
