"""How a run's samples are produced: the rollout side of the loop, below the driver.

    sampler.py   `Sampler`: single-turn rounds (prompts -> engine -> rewards -> groups),
                 `collect` (dynamic sampling's rounds and buffer), `DriverState`
    episodes.py  `EpisodeSampler`: multi-turn rounds of episodes in an environment
    pipeline.py  `RolloutPipeline`: rounds sampled up to `rollout.max_staleness` steps ahead
    partial.py   `PartialPipeline`: the same schedule with partial rollouts (`rollout.partial`):
                 k rounds in flight in decode slots that outlive the weight updates
    strategy.py  `Rollouts`: the one object the loop asks for each step's batch and for its
                 checkpoint state (engine, N, buffer, pending rounds and strategy, chosen
                 once from the config)

The engines themselves (static, continuous, compacting decode; vLLM) are
`grpojax.sampling`'s; this layer turns their `Rollout`s into scored groups and the trainer's
rows (`grpojax.train.rows`). The driver above it orchestrates: the loop, checkpoints,
signals, metrics.
"""

from grpojax.rollouts.episodes import EpisodeSampler, build_episode_runner, episode_return
from grpojax.rollouts.partial import PartialPipeline
from grpojax.rollouts.pipeline import RolloutPipeline
from grpojax.rollouts.sampler import DriverState, Sampler, collect
from grpojax.rollouts.strategy import Rollouts, StepRollout, rollout_arrays

__all__ = [
    "DriverState",
    "EpisodeSampler",
    "PartialPipeline",
    "RolloutPipeline",
    "Rollouts",
    "Sampler",
    "StepRollout",
    "build_episode_runner",
    "collect",
    "episode_return",
    "rollout_arrays",
]
