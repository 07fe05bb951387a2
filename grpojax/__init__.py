"""grpojax: PPO and GRPO fine-tuning of language models in JAX.

The ops (logprobs, advantages, losses, KL estimators, aggregation, masks) are the
public API for research code: `import grpojax as gj; gj.policy_loss(...)`.
"""

from grpojax.ops import *  # noqa: F403
from grpojax.ops import __all__ as _ops_all

__version__ = "0.1.0"
__all__ = ["__version__", *_ops_all]
