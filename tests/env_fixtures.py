"""Shared by the environment tests (no download): a tokenizer with a chat template (the
built-in character tokenizer with ChatML special tokens, Qwen2.5's single-token <tool_call>
tags and a Qwen2.5-style template written for these tests), a random model's episodes, and
the exactness check every rollout test makes (the trainer's logprobs equal the sampler's)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from grpojax.envs import episode_batch, rollout_episodes
from grpojax.models.tokenizer import PAD_ID, builtin_tokenizer
from grpojax.sampling import SamplingConfig
from grpojax.train.common import policy_logprobs

ATOL = 1e-5  # float32 multi-turn rollouts: the cache's attention sums over its slots

# A Qwen2.5-style template (ChatML turns; tools in the system message; `tool` messages as a
# user turn of <tool_response> blocks), written for these tests.
QWEN_STYLE_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    '{{- \'\\n</tools>\\nCall a tool as <tool_call>\\n{"name": ..., "arguments": ...}\\n'
    "</tool_call><|im_end|>\\n' }}"
    "{%- elif messages[0].role == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}"
    "{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + m.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}"
    "{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- elif m.role != 'system' or not loop.first %}"
    "{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def chatml_tokenizer():
    """The character tokenizer with ChatML special tokens, single-token <tool_call> tags (as
    Qwen2.5 has) and the template above; EOS = <|im_end|>."""
    tok = builtin_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.add_tokens(["<tool_call>", "</tool_call>"])
    tok.eos_token = "<|im_end|>"
    tok.chat_template = QWEN_STYLE_TEMPLATE
    return tok


def random_episodes(model, runner, *, stop_ids, key=0, **engine):
    """`runner`'s episodes sampled from `model` at temperature 1, turns of at most 8 ids that
    also end at any of `stop_ids` (so a random model's turns end after a few ids); `engine`:
    `rollout_episodes`' engine arguments (slots, compact, stats)."""
    return rollout_episodes(
        model,
        runner,
        key=jax.random.key(key),
        max_turn_tokens=8,
        sampling=SamplingConfig(temperature=1.0),
        stop_ids=tuple(stop_ids),
        pad_id=PAD_ID,
        **engine,
    )


def assert_trainer_matches_sampler(model, episodes, atol=ATOL):
    """The trainer's logprobs on the episodes' rows equal the sampler's on every policy id
    within `atol` (the rest of the row carries none)."""
    batch = episode_batch(episodes, pad_id=PAD_ID)
    tokens, mask, policy = (jnp.asarray(x) for x in batch[:3])
    logp, _ = policy_logprobs(model, tokens, mask, policy)
    np.testing.assert_allclose(
        np.where(policy, logp, 0.0), batch.sampler_logp_nt, atol=atol, rtol=0
    )
