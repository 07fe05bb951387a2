"""PromptSource and the tokenization helpers: left padding to a bucket, masks from lengths,
per-epoch shuffling, exact resume from `state()` (JSON and Orbax), over-budget prompts skipped
and counted, clear errors for empty / all-too-long sources, SFT layout."""

from __future__ import annotations

import json
import warnings

import numpy as np
import pytest

from grpojax.data import (
    PromptCompletionBatch,
    PromptSource,
    PromptTooLongWarning,
    encode_prompts,
    encode_sft,
    padded_width,
)
from grpojax.models.tokenizer import BOS_ID, EOS_ID, PAD_ID, builtin_tokenizer, builtin_vocab

VOCAB = builtin_vocab()


@pytest.fixture(scope="module")
def tok():
    return builtin_tokenizer()


def _rows(n, seed=0, long_every=None):
    """n rows with ragged prompt lengths; every `long_every`-th prompt is 40 characters."""
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(n):
        k = 40 if long_every and i % long_every == 0 else int(rng.integers(1, 12))
        rows.append({"prompt": f"{i}:" + "x" * k, "answer": str(i), "extra": [i, i]})
    return rows


def _ids(text, bos=False):
    """Reference encoding for the character-level tokenizer: one id per character."""
    return ([BOS_ID] if bos else []) + [VOCAB[c] for c in text]


def _stream(src, sizes):
    return [src.next_batch(b) for b in sizes]


def _same(a, b):
    assert a.prompts == b.prompts
    assert a.columns == b.columns
    np.testing.assert_array_equal(a.tokens_bp, b.tokens_bp)
    np.testing.assert_array_equal(a.lengths_b, b.lengths_b)
    np.testing.assert_array_equal(a.indices_b, b.indices_b)


@pytest.mark.parametrize(
    "length, bucket, min_width, expect",
    [(1, "pow2", 1, 1), (5, "pow2", 1, 8), (8, "pow2", 1, 8), (9, "pow2", 16, 16),
     (17, "pow2", 16, 32), (5, 4, 1, 8), (8, 4, 1, 8), (3, 4, 6, 8), (10, 1, 1, 10),
     (1, "compact", 1, 8), (9, "compact", 1, 16), (64, "compact", 1, 64),
     (65, "compact", 1, 128), (3, "compact", 12, 16)],
)  # fmt: skip
def test_padded_width(length, bucket, min_width, expect):
    assert padded_width(length, bucket=bucket, min_width=min_width) == expect


def test_padded_width_rejects_bad_bucket():
    for bad in ("linear", 0, True, -3):
        with pytest.raises(
            ValueError, match="bucket must be 'pow2', 'compact' or an int >= 1, got"
        ):
            padded_width(4, bucket=bad)


def test_batch_is_left_padded_with_masks_from_lengths(tok):
    rows = _rows(9)
    src = PromptSource(rows, tok, seed=0, prepend_bos=True, min_width=4)
    batch = src.next_batch(5)
    b, p = batch.tokens_bp.shape
    assert b == 5 and batch.tokens_bp.dtype == np.int32 and batch.lengths_b.dtype == np.int32
    longest = max(len(_ids(t, bos=True)) for t in batch.prompts)
    assert p == max(4, 1 << (longest - 1).bit_length())
    for i, text in enumerate(batch.prompts):
        expect = _ids(text, bos=True)
        assert batch.lengths_b[i] == len(expect)
        np.testing.assert_array_equal(batch.tokens_bp[i, p - len(expect) :], expect)
        assert (batch.tokens_bp[i, : p - len(expect)] == PAD_ID).all()
        row = rows[batch.indices_b[i]]
        assert text == row["prompt"]
        assert batch.columns["answer"][i] == row["answer"]
        assert batch.columns["extra"][i] == row["extra"]
    # The mask is built from lengths: a prompt token equal to the pad id would still count.
    mask = np.zeros((b, p), bool)
    for i, n in enumerate(batch.lengths_b):
        mask[i, p - n :] = True
    np.testing.assert_array_equal(batch.mask_bp(), mask)
    assert "prompt" not in batch.columns


def test_encode_prompts_matches_reference_and_source(tok):
    texts = ["1+2=", "12+345=", "7"]
    tokens, lengths = encode_prompts(tok, texts, bucket=4, min_width=1, pad_id=PAD_ID)
    assert tokens.shape == (3, 8)
    for i, t in enumerate(texts):
        np.testing.assert_array_equal(tokens[i, 8 - len(t) :], _ids(t))
    np.testing.assert_array_equal(lengths, [len(t) for t in texts])
    with pytest.raises(ValueError, match="at least one prompt"):
        encode_prompts(tok, [])
    with pytest.raises(ValueError, match="zero tokens"):
        encode_prompts(tok, ["", "a"])


def test_each_epoch_visits_every_row_once_in_a_new_order(tok):
    n = 11
    src = PromptSource(_rows(n), tok, seed=5)
    seen = np.concatenate([b.indices_b for b in _stream(src, [3] * 11)])  # 33 = 3 epochs
    epochs = seen.reshape(3, n)
    for e in epochs:
        assert sorted(e) == list(range(n))
    assert not (epochs[0] == epochs[1]).all()
    assert src.epoch == 2
    # The same seed gives the same stream; another seed another one; no shuffle = file order.
    again = np.concatenate(
        [b.indices_b for b in _stream(PromptSource(_rows(n), tok, seed=5), [3] * 11)]
    )
    np.testing.assert_array_equal(seen, again)
    other = np.concatenate(
        [b.indices_b for b in _stream(PromptSource(_rows(n), tok, seed=6), [3] * 4)]
    )
    assert not (other == seen[:12]).all()
    plain = PromptSource(_rows(n), tok, shuffle=False)
    np.testing.assert_array_equal(plain.next_batch(n + 2).indices_b, [*range(n), 0, 1])


@pytest.mark.parametrize("k", [1, 2, 3, 5])
def test_resume_equals_uninterrupted_across_epoch_boundary(tok, k):
    n, b = 7, 3  # batches of 3 over 7 rows straddle every epoch boundary
    rows = _rows(n, seed=1)
    uninterrupted = PromptSource(rows, tok, seed=11)
    full = _stream(uninterrupted, [b] * (k + 6))
    first = PromptSource(rows, tok, seed=11)
    _stream(first, [b] * k)
    saved = json.loads(json.dumps(first.state()))  # survives a JSON round trip
    assert set(saved) == {"seed", "epoch", "index", "skipped", "num_rows"}
    fresh = PromptSource(rows, tok, seed=999)  # the saved seed wins
    fresh.restore(saved)
    for got, want in zip(_stream(fresh, [b] * 6), full[k:]):
        _same(got, want)
    assert fresh.state() == uninterrupted.state()
    assert uninterrupted.epoch == (b * (k + 6) - 1) // n  # several epoch boundaries crossed


def test_resume_through_an_orbax_checkpoint(tok, tmp_path):
    import orbax.checkpoint as ocp

    rows = _rows(5, seed=2)
    full = _stream(PromptSource(rows, tok, seed=3), [2] * 6)
    src = PromptSource(rows, tok, seed=3)
    _stream(src, [2] * 3)
    with ocp.CheckpointManager(tmp_path / "ckpt") as mngr:
        mngr.save(3, args=ocp.args.Composite(data=ocp.args.JsonSave(src.state())))
        mngr.wait_until_finished()
    with ocp.CheckpointManager(tmp_path / "ckpt") as mngr:
        state = mngr.restore(3, args=ocp.args.Composite(data=ocp.args.JsonRestore()))["data"]
    fresh = PromptSource(rows, tok, seed=3)
    fresh.restore(state)
    for got, want in zip(_stream(fresh, [2] * 3), full[3:]):
        _same(got, want)


def test_restore_refuses_a_mismatched_state(tok):
    src = PromptSource(_rows(6), tok)
    state = src.state()
    with pytest.raises(ValueError, match="saved over 6 rows; this dataset has 5"):
        PromptSource(_rows(5), tok).restore(state)
    with pytest.raises(ValueError, match="lacks keys"):
        src.restore({"seed": 0, "epoch": 0})
    with pytest.raises(ValueError, match="out of range"):
        src.restore(state | {"index": 7})


def test_over_budget_prompts_are_skipped_and_counted(tok):
    n = 12
    rows = _rows(n, long_every=4)  # rows 0, 4, 8 are over budget
    long_rows = {i for i, r in enumerate(rows) if len(r["prompt"]) > 20}
    assert long_rows == {0, 4, 8}
    src = PromptSource(rows, tok, seed=0, max_prompt_tokens=20)
    with pytest.warns(PromptTooLongWarning, match="max_prompt_tokens=20") as record:
        batches = _stream(src, [3, 3, 3])  # exactly the 9 short rows of epoch 0
    assert len(record) == 3 and src.skipped == 3
    got = np.concatenate([b.indices_b for b in batches])
    assert sorted(got) == sorted(set(range(n)) - long_rows)
    assert all(len(_ids(p)) <= 20 for b in batches for p in b.prompts)
    assert src.state()["skipped"] == 3
    # Later epochs skip the same rows again: counted every time, warned only once per row.
    with warnings.catch_warnings(record=True) as again:
        warnings.simplefilter("always")
        _stream(src, [9])
    assert src.skipped == 6
    assert not [w for w in again if issubclass(w.category, PromptTooLongWarning)]
    # The count is part of the position: a restored source keeps counting from it.
    fresh = PromptSource(rows, tok, max_prompt_tokens=20)
    fresh.restore(src.state())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PromptTooLongWarning)
        fresh.next_batch(9)
    assert fresh.skipped == 9


def test_every_prompt_over_budget_is_a_clear_error(tok):
    rows = [{"prompt": "x" * 30}, {"prompt": "y" * 25}]
    src = PromptSource(rows, tok, max_prompt_tokens=10, name="toy-set")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PromptTooLongWarning)
        with pytest.raises(ValueError, match="'toy-set': every one of its 2 prompts is longer"):
            src.next_batch(1)


def test_empty_dataset_and_bad_arguments(tok):
    with pytest.raises(ValueError, match="'my-data' is empty"):
        PromptSource([], tok, name="my-data")
    src = PromptSource(_rows(3), tok)
    with pytest.raises(ValueError, match=r"^batch_size must be an int >= 1, got 0$"):
        src.next_batch(0)
    with pytest.raises(ValueError, match="max_prompt_tokens"):
        PromptSource(_rows(3), tok, max_prompt_tokens=0)
    with pytest.raises(ValueError, match="seed"):
        PromptSource(_rows(3), tok, seed=-1)
    with pytest.raises(ValueError, match="no column 'question'"):
        PromptSource(_rows(3), tok, prompt_column="question").next_batch(1)


def test_encode_sft_layout(tok):
    prompts, completions = ["12+34=", "5+5="], ["46", "10"]
    batch = encode_sft(tok, prompts, completions, prepend_bos=True, min_width=8)
    assert isinstance(batch, PromptCompletionBatch)
    p = batch.prompt_tokens_np.shape[1]
    t = batch.completion_tokens_nt.shape[1]
    assert p == 8 and t == 4  # longest prompt 7 (with BOS) -> 8; completion "46"+EOS -> 4
    tokens, mask = batch.sequences()
    assert tokens.shape == mask.shape == (2, p + t)
    for i, (pr, co) in enumerate(zip(prompts, completions)):
        want_p, want_c = _ids(pr, bos=True), [*_ids(co), EOS_ID]
        np.testing.assert_array_equal(tokens[i, p - len(want_p) : p], want_p)
        np.testing.assert_array_equal(tokens[i, p : p + len(want_c)], want_c)
        row_mask = np.zeros(p + t, bool)
        row_mask[p - len(want_p) : p + len(want_c)] = True
        np.testing.assert_array_equal(mask[i], row_mask)
        np.testing.assert_array_equal(batch.completion_mask_nt()[i], row_mask[p:])
    # The SFT prompt encoding is exactly the RL one (same boundary the sampler sees).
    rl = PromptSource(
        [{"prompt": q} for q in prompts], tok, shuffle=False, prepend_bos=True, min_width=8
    )
    np.testing.assert_array_equal(rl.next_batch(2).tokens_bp, batch.prompt_tokens_np)
    fixed = encode_sft(tok, prompts, completions, completion_width=6)
    assert fixed.completion_tokens_nt.shape == (2, 6)
    with pytest.raises(ValueError, match="more than completion_width=2"):
        encode_sft(tok, prompts, completions, completion_width=2)
    with pytest.raises(ValueError, match="2 prompts but 1 completions"):
        encode_sft(tok, prompts, completions[:1])
