"""The thin stateful driver around the jitted steps and the rollouts (`grpojax.rollouts`):
checkpoints, graceful exit, metrics, progress and plots, and the run configuration (the
training loop builds on these)."""

from grpojax.config import (
    ALGOS,
    CheckpointSpec,
    ConfigError,
    DataSpec,
    EvalSpec,
    LogSpec,
    MeshSpec,
    ModelSpec,
    PtxSpec,
    RewardsSpec,
    RolloutSpec,
    RunConfig,
    SftSpec,
    algo_grpo_config,
    config_to_dict,
    load_config,
    save_config,
)
from grpojax.driver.checkpoint import (
    Checkpointer,
    CorruptCheckpointError,
    Restored,
    fingerprints,
    host_copy,
)
from grpojax.driver.metrics import (
    MetricsLogger,
    Progress,
    flatten_metrics,
    plot_before_after,
    plot_metrics,
    progress,
    read_jsonl,
)
from grpojax.driver.signals import GracefulExit

__all__ = [
    "ALGOS",
    "CheckpointSpec",
    "Checkpointer",
    "ConfigError",
    "CorruptCheckpointError",
    "DataSpec",
    "EvalSpec",
    "GracefulExit",
    "LogSpec",
    "MeshSpec",
    "MetricsLogger",
    "ModelSpec",
    "Progress",
    "PtxSpec",
    "Restored",
    "RewardsSpec",
    "RolloutSpec",
    "RunConfig",
    "SftSpec",
    "algo_grpo_config",
    "config_to_dict",
    "fingerprints",
    "flatten_metrics",
    "host_copy",
    "load_config",
    "plot_before_after",
    "plot_metrics",
    "progress",
    "read_jsonl",
    "save_config",
]
