"""Moved: the run's configuration is `grpojax.config` (a layer of its own, read by the
driver and the command)."""

raise ImportError(
    "grpojax.driver.config moved to grpojax.config (RunConfig, load_config, ...; "
    "grpojax.driver still exports them)"
)
