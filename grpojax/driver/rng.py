"""Moved below the driver: `grpojax.rng`."""

raise ImportError("grpojax.driver.rng moved to grpojax.rng (run_key, run_seed, numpy_rng)")
