"""User code named in a config by a path "package.module:attribute".

Reward functions (`rewards.functions`, `grpojax.rewards.manager.resolve_reward_function`)
and the GRPO step's objectives (`grpo.policy_loss`, `grpo.advantage_estimator`,
`grpojax.train.objectives`) are both given as such paths. Each caller checks the path's
form and the object's signature against its own contract; the import and the walk down a
dotted attribute are here, once, so a failure reads the same in both. Like `errors.py`,
this module imports nothing from grpojax, so any layer may use it.
"""

from __future__ import annotations

import importlib

__all__ = ["import_object"]


def import_object(field: str, spec: str, *, hint: str = "") -> object:
    """The object `spec` names: "module:attr" or "module:attr.sub...", the module imported
    with `importlib.import_module` (so it must be on `sys.path`). The caller has checked the
    form: exactly one ":" with a non-empty module and attribute on either side.

    Args:
      field: the config field, first in every message.
      spec: the path.
      hint: appended to the import-failure message (e.g. where the module is looked for).

    Raises:
      ValueError: one line, for a module that does not import (whatever it raised: its type
        and the first line of its message), or a missing attribute along the dotted path.
    """
    module_name, _, attr = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # whatever fails in the user's module is reported
        lines = str(e).strip().splitlines()
        why = f"{type(e).__name__}: {lines[0]}" if lines else type(e).__name__
        raise ValueError(
            f"{field}: cannot import module {module_name!r} of {spec!r} ({why}){hint}"
        ) from None
    obj: object = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"{field}: module {module_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    return obj
