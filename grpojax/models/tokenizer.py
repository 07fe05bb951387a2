"""The built-in tiny tokenizer: character level, made locally (no download).

One token per character over digits, letters, space, newline, arithmetic symbols and
punctuation, plus `<pad>`, `<bos>`, `<eos>` and `<unk>`. It is a `tokenizers`
WordLevel model behind a `transformers.PreTrainedTokenizerFast`, so it saves and
loads with `save_pretrained` / `AutoTokenizer.from_pretrained` like any HF tokenizer.
`tiny_config()` uses its vocabulary size and special ids.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import pathlib
import string

from grpojax.errors import MissingPathError, UserError
from grpojax.models.gguf_io import eos_ids as gguf_eos_ids
from grpojax.models.gguf_io import find_gguf, open_gguf

PAD_TOKEN, BOS_TOKEN, EOS_TOKEN, UNK_TOKEN = "<pad>", "<bos>", "<eos>", "<unk>"
SPECIAL_TOKENS = (PAD_TOKEN, BOS_TOKEN, EOS_TOKEN, UNK_TOKEN)
PAD_ID, BOS_ID, EOS_ID = 0, 1, 2  # the ids of the first three SPECIAL_TOKENS
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

    with _quiet_transformers_import():
        from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(vocab=dict(builtin_vocab()), unk_token=UNK_TOKEN))
    # Split into single characters, keeping every character (spaces included) as a token;
    # newlines too ("." would not match them, and a run of them would be one unknown piece).
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token=PAD_TOKEN,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        unk_token=UNK_TOKEN,
        clean_up_tokenization_spaces=False,
    )


# Files one of which a Hugging Face directory's tokenizer is read from (without any,
# transformers builds an empty tokenizer instead of failing).
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "vocab.json",
    "vocab.txt",
    "spiece.model",
)


class _DropMessage(logging.Filter):
    def __init__(self, prefix: str):
        super().__init__()
        self.prefix = prefix

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.prefix)


@contextlib.contextmanager
def _quiet_transformers_import():
    """Import transformers without its "PyTorch was not found" advice: grpojax uses only its
    tokenizers, which need no PyTorch. The filter is on while grpojax imports it (the message
    is logged once, at first import) and drops that message only."""
    logger = logging.getLogger("transformers")
    quiet = _DropMessage("PyTorch was not found")
    logger.addFilter(quiet)
    try:
        yield
    finally:
        logger.removeFilter(quiet)


# `tokenizer_class` values of a tokenizer saved as its `tokenizer.json` alone (no model's
# own tokenizer class): the built-in one and any `PreTrainedTokenizerFast`.
GENERIC_TOKENIZER_CLASSES = ("PreTrainedTokenizerFast", "TokenizersBackend")


def _tokenizer_class(path: pathlib.Path) -> str | None:
    try:
        return json.loads((path / "tokenizer_config.json").read_text()).get("tokenizer_class")
    except (OSError, ValueError, AttributeError):
        return None


def load_tokenizer(path: str | os.PathLike):
    """`transformers.AutoTokenizer.from_pretrained(path)` for a local model directory, or
    the tokenizer (and chat template) a GGUF file holds (`path` a `.gguf` file or a
    directory holding one and no config.json: `gguf_io.find_gguf`).

    A tokenizer saved with a generic class (`GENERIC_TOKENIZER_CLASSES`: the built-in
    character tokenizer, any `PreTrainedTokenizerFast`) is loaded as that class, from its
    `tokenizer.json` as saved: transformers 5's `AutoTokenizer` maps a `config.json` of
    `model_type` qwen2 to `Qwen2Tokenizer`, which rebuilds it with Qwen2's pre-tokenizer
    and drops the spaces of the built-in tokenizer ("What is 1+2?" -> "Whatis1+2?").
    A missing directory, one without tokenizer files (`TOKENIZER_FILES`) or files that fail
    to load is a `grpojax.errors.UserError` naming the directory.
    """
    path = pathlib.Path(path)
    gguf_file = find_gguf(path)
    if gguf_file is not None:
        return _gguf_tokenizer(gguf_file)
    if not path.is_dir():
        raise MissingPathError(f"tokenizer directory not found: {path}")
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        raise MissingPathError(
            f"no tokenizer in {path}: expected one of {', '.join(TOKENIZER_FILES)} (save the "
            "tokenizer with the model, e.g. tokenizer.save_pretrained(DIR))"
        )
    with _quiet_transformers_import():
        from transformers import AutoTokenizer, PreTrainedTokenizerFast

    generic = _tokenizer_class(path) in GENERIC_TOKENIZER_CLASSES
    loader = PreTrainedTokenizerFast if generic else AutoTokenizer
    try:
        tokenizer = loader.from_pretrained(str(path))
    except Exception as e:  # transformers / tokenizers raise many types for a bad file
        raise UserError(f"cannot load the tokenizer in {path}: {type(e).__name__}: {e}") from None
    # Instruct checkpoints end a turn with ids the tokenizer does not call its eos (Qwen2.5
    # Instruct: <|im_end|> and <|endoftext|>); `grpojax.data.stop_ids_of` reads them here.
    setattr(tokenizer, MODEL_EOS_ATTR, model_eos_ids(path))
    return tokenizer


def _gguf_tokenizer(file: pathlib.Path):
    """transformers' conversion of the tokenizer in GGUF `file` (checked by `open_gguf`),
    with the file's turn-ending ids as its `MODEL_EOS_ATTR`."""
    open_gguf(file)  # not GGUF, truncated, unsupported or without a tokenizer: named
    with _quiet_transformers_import():
        from transformers import AutoTokenizer
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(file.parent), gguf_file=file.name)
    except Exception as e:  # transformers' conversion raises many types for a bad file
        raise UserError(f"cannot load the tokenizer of {file}: {type(e).__name__}: {e}") from None
    setattr(tokenizer, MODEL_EOS_ATTR, gguf_eos_ids(file))
    return tokenizer


# The attribute of a tokenizer from `load_tokenizer` holding its directory's EOS ids.
MODEL_EOS_ATTR = "grpojax_model_eos_ids"
EOS_FILES = ("config.json", "generation_config.json")


def model_eos_ids(path: str | os.PathLike) -> tuple[int, ...]:
    """Every `eos_token_id` a model directory declares, in `config.json` and
    `generation_config.json` (each an int, a list of ints, or absent), sorted, no repeats.

    A file that is not a JSON object or an id that is not an int is a `UserError` naming the
    file; a missing file declares nothing.
    """
    ids: set[int] = set()
    for name in EOS_FILES:
        file = pathlib.Path(path) / name
        if not file.is_file():
            continue
        try:
            data = json.loads(file.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise UserError(f"{file} is not valid JSON: {e}") from None
        if not isinstance(data, dict):
            raise UserError(f"{file} must hold a JSON object, got {type(data).__name__}")
        value = data.get("eos_token_id")
        values = value if isinstance(value, list) else [] if value is None else [value]
        for v in values:
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise UserError(
                    f"{file}: eos_token_id must be an id >= 0 or a list of them, got {value!r}"
                )
        ids.update(values)
    return tuple(sorted(ids))
