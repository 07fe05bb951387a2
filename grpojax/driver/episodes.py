"""Moved below the driver: `grpojax.rollouts.episodes`."""

raise ImportError(
    "grpojax.driver.episodes moved to grpojax.rollouts.episodes (EpisodeSampler, ...)"
)
