"""Tokenizers with a chat template, shared by the environment tests (no download): the
built-in character tokenizer with ChatML special tokens, Qwen2.5's single-token
<tool_call> tags and a Qwen2.5-style template written for these tests."""

from __future__ import annotations

from grpojax.models.tokenizer import builtin_tokenizer

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
