"""grpojax: PPO and GRPO fine-tuning of language models in JAX.

The ops (logprobs, advantages, losses, KL estimators, aggregation, masks) are the
public API for research code: `import grpojax as gj; gj.policy_loss(...)`. The layers
above them (`gj.models`, `gj.sampling`, `gj.train`, `gj.rewards`, `gj.data`,
`gj.driver`) are imported on first use, so `import grpojax` stays light.
"""

import importlib

from grpojax.ops import *  # noqa: F403
from grpojax.ops import __all__ as _ops_all

__version__ = "0.1.0"
_SUBPACKAGES = ("models", "sampling", "train", "rewards", "data", "driver", "errors")
__all__ = ["__version__", *_ops_all]


def __getattr__(name: str):
    if name in _SUBPACKAGES:
        return importlib.import_module(f"grpojax.{name}")
    raise AttributeError(f"module 'grpojax' has no attribute {name!r}")
