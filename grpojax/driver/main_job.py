"""Moved: `grpojax.jobs.main_job` (the commands a user runs sit above the driver)."""

raise ImportError(
    "grpojax.driver.main_job moved to grpojax.jobs.main_job (main_job, DEFAULT_CONFIG, ...)"
)
