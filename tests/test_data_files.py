"""User datasets from local JSONL / Parquet written at test time: prompt templates, the
tokenizer's chat template (plain and conversational rows), columns passed through, errors."""

from __future__ import annotations

import json

import datasets  # noqa: F401  (a hard dependency: never skip)
import numpy as np
import pytest

from grpojax.data import PromptFormatter, PromptSource, load_prompt_dataset
from grpojax.models.tokenizer import BOS_ID, builtin_tokenizer, builtin_vocab

ROWS = [
    {"question": "1+1", "answer": "2", "level": 1},
    {"question": "12+30", "answer": "42", "level": 2},
    {"question": "7+8", "answer": "15", "level": 1},
]
# A minimal chat template (Jinja, as in HF tokenizer configs); every character is in the
# built-in vocabulary, so the built-in tokenizer can carry it.
CHAT = (
    "{{ bos_token }}{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


def _chat_reference(messages):
    """What CHAT renders, written out by hand."""
    text = "<bos>" + "".join(f"<{m['role']}>{m['content']}\n" for m in messages)
    return text + "<assistant>"


@pytest.fixture
def jsonl(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    return path


@pytest.fixture
def parquet(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "data.parquet"
    pq.write_table(pa.Table.from_pylist(ROWS), path)
    return path


@pytest.fixture
def chat_tok():
    tok = builtin_tokenizer()
    tok.chat_template = CHAT
    return tok


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_template_and_passthrough(fmt, request, tmp_path):
    path = request.getfixturevalue(fmt)
    ds = load_prompt_dataset(path, template="Q: {question}\nA:", cache_dir=tmp_path / "hf")
    assert len(ds) == 3 and ds.add_special_tokens
    for i, want in enumerate(ROWS):
        row = ds[i]
        assert row["prompt"] == f"Q: {want['question']}\nA:"
        assert {k: row[k] for k in want} == want
    tok = builtin_tokenizer()
    batch = PromptSource(ds, tok, shuffle=False).next_batch(3)
    assert batch.prompts == [f"Q: {r['question']}\nA:" for r in ROWS]
    assert batch.columns == {
        "question": [r["question"] for r in ROWS],
        "answer": [r["answer"] for r in ROWS],
        "level": [r["level"] for r in ROWS],
    }


def test_jsonl_and_parquet_give_the_same_rows(jsonl, parquet, tmp_path):
    a = load_prompt_dataset(jsonl, template="{question}=", cache_dir=tmp_path / "hf")
    b = load_prompt_dataset(parquet, template="{question}=", cache_dir=tmp_path / "hf")
    assert [a[i] for i in range(3)] == [b[i] for i in range(3)]


def test_chat_template(jsonl, chat_tok, tmp_path):
    ds = load_prompt_dataset(
        jsonl,
        template="What is {question}?",
        tokenizer=chat_tok,
        chat=True,
        system_prompt="Be brief",
        cache_dir=tmp_path / "hf",
    )
    want = _chat_reference(
        [{"role": "system", "content": "Be brief"}, {"role": "user", "content": "What is 1+1?"}]
    )
    assert ds[0]["prompt"] == want
    assert ds[0]["answer"] == "2"
    # Chat-templated text already holds its BOS: the source must not add special tokens.
    assert not ds.add_special_tokens
    batch = PromptSource(ds, chat_tok, shuffle=False, min_width=1).next_batch(1)
    vocab = builtin_vocab()
    expect = [BOS_ID] + [vocab[c] for c in want[len("<bos>") :]]
    np.testing.assert_array_equal(batch.tokens_bp[0, -batch.lengths_b[0] :], expect)
    assert batch.lengths_b[0] == len(expect)


def test_conversational_rows_go_through_the_chat_template(tmp_path, chat_tok):
    path = tmp_path / "chat.jsonl"
    messages = [{"role": "user", "content": "2+2"}]
    path.write_text(json.dumps({"prompt": messages, "answer": "4"}) + "\n")
    ds = load_prompt_dataset(path, tokenizer=chat_tok, chat=True, cache_dir=tmp_path / "hf")
    assert ds[0]["prompt"] == _chat_reference(messages)
    assert ds[0]["answer"] == "4"


def test_prompt_column_used_as_is_without_template(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"prompt": "3+4=", "answer": "7"}) + "\n")
    ds = load_prompt_dataset(path, cache_dir=tmp_path / "hf")
    assert ds[0] == {"prompt": "3+4=", "answer": "7"}


def test_errors_are_clear(jsonl, tmp_path):
    with pytest.raises(ValueError, match=r"refers to column\(s\) \['query'\]"):
        load_prompt_dataset(jsonl, template="{query}", cache_dir=tmp_path / "hf")
    with pytest.raises(ValueError, match="no chat_template"):
        load_prompt_dataset(jsonl, template="{question}", tokenizer=builtin_tokenizer(), chat=True)
    with pytest.raises(ValueError, match="needs a tokenizer"):
        PromptFormatter("{question}", chat=True)
    with pytest.raises(ValueError, match="positional field"):
        PromptFormatter("{}")
    bad = tmp_path / "data.csv"
    bad.write_text("a\n1\n")
    with pytest.raises(ValueError, match=r"allowed suffixes \['.json', '.jsonl', '.parquet'\]"):
        load_prompt_dataset(bad)
    with pytest.raises(FileNotFoundError, match=r"missing\.jsonl"):
        load_prompt_dataset(tmp_path / "missing.jsonl")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(ValueError, match=r"empty\.jsonl.*is empty"):
        load_prompt_dataset(empty, cache_dir=tmp_path / "hf")
