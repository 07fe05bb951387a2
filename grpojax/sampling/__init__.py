"""Jitted generation (prefill + early-stopping decode loop), the sampling transforms, and
stop strings (a host-side cut after decoding)."""

from grpojax.sampling.generate import Rollout, bucket_width, generate, generate_trace_count
from grpojax.sampling.stop import decode_completions, stopped_completions, truncate_at_stop_strings
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
    "decode_completions",
    "generate",
    "generate_trace_count",
    "keep_mask_from_count",
    "keep_mask_from_threshold",
    "kept_logprobs",
    "sample_tokens",
    "stopped_completions",
    "truncate_at_stop_strings",
]
