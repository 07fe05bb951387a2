"""The run's RNG tree: every key and NumPy seed derives from `RunConfig.seed` by named purpose.

    key_p  = fold_in(key(seed), crc32(purpose) mod 2^31)
    seed_p = the last uint32 word of key_data(key_p)         (NumPy generators, datasets)

Two purposes never share a stream, adding a purpose changes no other stream, and no stream
is the seed plus an offset (which would make seed s's "sample" stream seed s+1's "eval").
The keys that evolve during a run (the sampler's key, the train state's shuffle key) are
checkpointed; this module only gives their starting points.

Purposes (`PURPOSES`):
  model_init       the built-in model's random weights
  critic_init      PPO's critic (value head or separate value model)
  lora_init        LoRA adapters' A matrices (`lora.rank` > 0)
  reward_head      the reward model's scalar head (`grpojax rm`)
  train_state      the RL train state's key (mini-batch shuffles)
  sft_state        the SFT train state's key
  sample           the sampler's key at RL step 0
  eval             held-out evaluation samples (the same for every evaluation of a run)
  data             dataset generation (built-in and reasoning-gym tasks)
  prompts          the prompt source's epoch shuffles
  sft_order        the SFT warm start's batch order (one generator per epoch)
  preference_pairs synthetic preference pairs of `grpojax rm`
  rm_order         `grpojax rm`'s batch order
  ptx_order        PPO-ptx's batch order of text rows (one generator per epoch)
"""

from __future__ import annotations

import zlib

import jax
import numpy as np

PURPOSES = (
    "model_init",
    "critic_init",
    "lora_init",
    "reward_head",
    "train_state",
    "sft_state",
    "sample",
    "eval",
    "data",
    "prompts",
    "sft_order",
    "preference_pairs",
    "rm_order",
    "ptx_order",
)

__all__ = ["PURPOSES", "numpy_rng", "run_key", "run_seed"]


def run_key(seed: int, purpose: str) -> jax.Array:
    """The typed `jax.random` key of `purpose` (one of `PURPOSES`) for run seed `seed`."""
    if purpose not in PURPOSES:
        raise ValueError(f"unknown RNG purpose {purpose!r}; allowed: {', '.join(PURPOSES)}")
    tag = zlib.crc32(purpose.encode()) & 0x7FFFFFFF
    return jax.random.fold_in(jax.random.key(seed), tag)


def run_seed(seed: int, purpose: str) -> int:
    """A non-negative int seed of `purpose`, for NumPy generators and dataset builders."""
    data = np.asarray(jax.random.key_data(run_key(seed, purpose)))
    return int(data.reshape(-1)[-1]) & 0x7FFFFFFF


def numpy_rng(seed: int, purpose: str, *stream: int) -> np.random.Generator:
    """`np.random.Generator` of `purpose`, optionally a numbered sub-stream (e.g. an epoch)."""
    return np.random.default_rng([run_seed(seed, purpose), *stream])
