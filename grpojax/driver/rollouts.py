"""Moved below the driver: `grpojax.rollouts.strategy`."""

raise ImportError("grpojax.driver.rollouts moved to grpojax.rollouts (Rollouts, StepRollout)")
