"""Jitted generation (prefill + early-stopping decode loop) and the sampling transforms."""

from grpojax.sampling.generate import Rollout, bucket_width, generate, generate_trace_count
from grpojax.sampling.transforms import (
    SampleOutput,
    SamplingConfig,
    keep_mask_from_count,
    keep_mask_from_threshold,
    kept_logprobs,
    sample_tokens,
)

__all__ = [
    "Rollout",
    "SampleOutput",
    "SamplingConfig",
    "bucket_width",
    "generate",
    "generate_trace_count",
    "keep_mask_from_count",
    "keep_mask_from_threshold",
    "kept_logprobs",
    "sample_tokens",
]
