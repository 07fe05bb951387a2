"""The built-in tiny tokenizer: character level, made locally (no download).

One token per character over digits, letters, space, newline, arithmetic symbols and
punctuation, plus `<pad>`, `<bos>`, `<eos>` and `<unk>`. It is a `tokenizers`
WordLevel model behind a `transformers.PreTrainedTokenizerFast`, so it saves and
loads with `save_pretrained` / `AutoTokenizer.from_pretrained` like any HF tokenizer.
`tiny_config()` uses its vocabulary size and special ids.
"""

from __future__ import annotations

import functools
import string

PAD_TOKEN, BOS_TOKEN, EOS_TOKEN, UNK_TOKEN = "<pad>", "<bos>", "<eos>", "<unk>"
SPECIAL_TOKENS = (PAD_TOKEN, BOS_TOKEN, EOS_TOKEN, UNK_TOKEN)
PAD_ID, BOS_ID, EOS_ID, UNK_ID = 0, 1, 2, 3
# Printable ASCII minus the other whitespace; newline kept (multi-line prompts/answers).
CHARACTERS = "".join(c for c in string.printable if c not in "\t\r\x0b\x0c")


@functools.cache
def builtin_vocab() -> dict[str, int]:
    """Token -> id: the four special tokens first, then one id per character."""
    tokens = list(SPECIAL_TOKENS) + list(CHARACTERS)
    return {tok: i for i, tok in enumerate(tokens)}


def builtin_tokenizer():
    """A fresh `PreTrainedTokenizerFast` over `builtin_vocab()` (character level).

    `encode` adds no special tokens (prompts decide where BOS goes); decoding joins
    characters without spaces, so `decode(encode(s)) == s` for text in the alphabet.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(vocab=dict(builtin_vocab()), unk_token=UNK_TOKEN))
    # Split into single characters, keeping every character (spaces included) as a token.
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token=PAD_TOKEN,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        unk_token=UNK_TOKEN,
        clean_up_tokenization_spaces=False,
    )
