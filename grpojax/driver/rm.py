"""Moved: `grpojax.jobs.rm` (the commands a user runs sit above the driver)."""

raise ImportError("grpojax.driver.rm moved to grpojax.jobs.rm (reward_model_job, preference_pairs)")
