"""Moved below the driver: `grpojax.distributed`."""

raise ImportError(
    "grpojax.driver.distributed moved to grpojax.distributed (is_primary, kill_point, ...)"
)
