"""Moved below the driver: `grpojax.rollouts.pipeline`."""

raise ImportError("grpojax.driver.pipeline moved to grpojax.rollouts.pipeline (RolloutPipeline)")
