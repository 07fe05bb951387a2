"""Moved below the driver: `grpojax.rollouts.sampler`."""

raise ImportError(
    "grpojax.driver.rollout moved to grpojax.rollouts.sampler (Sampler, collect, DriverState)"
)
