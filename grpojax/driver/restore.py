"""Moved: `grpojax.jobs.restore` (the commands a user runs sit above the driver)."""

raise ImportError(
    "grpojax.driver.restore moved to grpojax.jobs.restore (open_run, restore_trainer)"
)
