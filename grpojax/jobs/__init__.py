"""The commands a user runs, each a whole job built on the driver (`grpojax.driver`):

    main_job         `grpojax train` with no arguments: the embedded default run
    sft_job          `grpojax sft`: supervised fine-tuning alone, pass@1 before and after
    reward_model_job `grpojax rm`: a Bradley-Terry reward model on preference pairs
    evaluate_run     `grpojax eval`: a run's checkpoint on its held-out prompts
    export_run       `grpojax export`: a run's checkpoint as Hugging Face checkpoints

(`grpojax train CONFIG` is the driver's `grpojax.driver.loop.train` itself.) A job reads a
config or a run directory, calls the driver, and writes its figures; the training loop
never calls a job. Each is imported from its module (`from grpojax.jobs.rm import
reward_model_job`): the package re-exports nothing, so a job's name never hides its module.
"""
