"""Generation as instruct checkpoints need it: every EOS id the model directory declares,
stop strings (a host-side cut after decoding), chat-templated `messages` rows, and the cap
`eval.heldout_size` puts on `data.eval_path`."""

from __future__ import annotations

import json
import shutil

import jax
import numpy as np
import pytest

from grpojax.config import load_config
from grpojax.data import encode_prompts, load_prompt_dataset, stop_ids_of
from grpojax.data import source as data_source
from grpojax.driver.setup import build_datasets
from grpojax.errors import UserError
from grpojax.models import builtin_tokenizer, from_pretrained, load_tokenizer
from grpojax.models import tokenizer as model_tokenizer
from grpojax.sampling import SamplingConfig, generate, stopped_completions, truncate_at_stop_strings

# A small chat template in the style of Qwen's (ChatML).
CHATML = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def _set_eos(model_dir, *, config_eos, generation_eos):
    cfg = json.loads((model_dir / "config.json").read_text())
    cfg["eos_token_id"] = config_eos
    (model_dir / "config.json").write_text(json.dumps(cfg))
    (model_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": generation_eos}))


def test_stop_ids_are_every_eos_of_the_model_directory(small_model_dir, tmp_path):
    d = shutil.copytree(small_model_dir, tmp_path / "m")
    tok = load_tokenizer(d)
    assert stop_ids_of(tok) == (tok.eos_token_id,)  # config.json: the tokenizer's own eos
    # config.json lists two (as Qwen2.5-Instruct's does), generation_config.json an int.
    _set_eos(d, config_eos=[tok.eos_token_id, 40], generation_eos=41)
    assert stop_ids_of(load_tokenizer(d)) == tuple(sorted({tok.eos_token_id, 40, 41}))
    _set_eos(d, config_eos=tok.eos_token_id, generation_eos=[42, tok.eos_token_id])
    assert stop_ids_of(load_tokenizer(d)) == tuple(sorted({tok.eos_token_id, 42}))
    assert data_source._MODEL_EOS_ATTR == model_tokenizer.MODEL_EOS_ATTR
    (d / "generation_config.json").write_text('{"eos_token_id": "x"}')
    with pytest.raises(UserError, match=r"generation_config\.json: eos_token_id must be an id"):
        load_tokenizer(d)
    (d / "generation_config.json").write_text("{not json")
    with pytest.raises(UserError, match=r"generation_config\.json is not valid JSON"):
        load_tokenizer(d)


def test_sampler_stops_at_an_id_only_generation_config_declares(small_model_dir, tmp_path):
    """Greedy rows end at the first token that any declared EOS id matches, that token
    included in the length and the mask."""
    d = shutil.copytree(small_model_dir, tmp_path / "m")
    model, tok = from_pretrained(d), load_tokenizer(d)
    prompts, lengths = encode_prompts(tok, ["12+3=", "7*8="])
    kw = dict(key=jax.random.key(0), max_new_tokens=6, sampling=SamplingConfig(temperature=0.0))
    free = np.asarray(generate(model, prompts, lengths, **kw).tokens_nt)
    a, b = int(free[0, 1]), int(free[1, 2])  # tokens greedy decoding emits at steps 1 and 2
    _set_eos(d, config_eos=[tok.eos_token_id, b], generation_eos=[a, tok.eos_token_id])
    stop = stop_ids_of(load_tokenizer(d))
    assert {a, b, tok.eos_token_id} == set(stop)
    r = generate(model, prompts, lengths, eos_ids=stop, pad_id=0, **kw)
    for n in range(2):
        hits = np.flatnonzero(np.isin(free[n], stop))
        assert hits.size and int(r.lengths_n[n]) == hits[0] + 1
        assert bool(r.eos_found_n[n])
        np.testing.assert_array_equal(np.asarray(r.mask_nt[n]), np.arange(6) < hits[0] + 1)


# Multi-character tokens, so a stop string can span tokens or end inside one.
PIECES = {1: "<", 2: "/ans", 3: "wer>", 4: "x", 5: "wer>\n", 6: "y", 9: "<eos>"}


def _decode(ids):
    return "".join(PIECES[i] for i in ids)


def test_truncate_at_stop_strings_cuts_after_the_completing_token():
    tokens = np.array(
        [
            [4, 1, 2, 3, 6, 6],  # spans tokens 1..3: keep 4
            [4, 1, 2, 5, 6, 0],  # the completing token carries "\n" after it: keep 4
            [4, 6, 4, 6, 4, 6],  # no stop string: unchanged (truncated at T)
            [4, 9, 0, 0, 0, 0],  # ended by EOS, no stop string: unchanged
            [1, 2, 3, 1, 2, 9],  # stop string twice, then EOS: cut at the first
            [4, 1, 2, 9, 0, 0],  # "</ans" then EOS: no full stop string
        ]
    )
    lengths = np.array([6, 5, 6, 2, 6, 4])
    eos = np.array([False, False, False, True, True, True])
    new, stopped = truncate_at_stop_strings(_decode, tokens, lengths, eos, ["</answer>"])
    np.testing.assert_array_equal(new, [4, 4, 6, 2, 3, 4])
    np.testing.assert_array_equal(stopped, [True, True, False, False, True, False])
    # Several strings: the first one to complete wins.
    new, _ = truncate_at_stop_strings(_decode, tokens, lengths, eos, ["</answer>", "y"])
    np.testing.assert_array_equal(new[:3], [4, 4, 2])
    # No strings: nothing changes.
    same, none = truncate_at_stop_strings(_decode, tokens, lengths, eos, [])
    np.testing.assert_array_equal(same, lengths)
    assert not none.any()


def test_stopped_completions_text_is_the_decode_of_the_kept_tokens():
    tok = builtin_tokenizer()  # one token per character
    texts = ["<a>12</a>tail", "no stop here", "ab</a>"]
    ids = [tok.encode(t, add_special_tokens=False) for t in texts]
    width = max(map(len, ids)) + 1
    tokens = np.zeros((3, width), np.int32)
    for i, row in enumerate(ids):
        tokens[i, : len(row)] = row
    tokens[2, len(ids[2])] = tok.eos_token_id  # row 2 ends with EOS after the stop string
    lengths = np.array([len(ids[0]), len(ids[1]), len(ids[2]) + 1])
    eos = np.array([False, False, True])
    out, new_len, new_eos = stopped_completions(tok, tokens, lengths, eos, ["</a>"])
    assert out == ["<a>12</a>", "no stop here", "ab</a>"]
    np.testing.assert_array_equal(new_len, [len("<a>12</a>"), len(ids[1]), len("ab</a>")])
    np.testing.assert_array_equal(new_eos, [True, False, True])  # stopped rows have ended
    for i in range(3):  # exactly the kept tokens decode to the scored text
        assert tok.decode(tokens[i, : new_len[i]].tolist()) == out[i]


def test_driver_with_stop_strings_trains_on_the_kept_tokens(small_model_dir, tmp_path):
    """A short run where most completions are cut at a digit: each scored text ends at its
    first digit (or has none), and the trainer's recomputed logprobs over the kept tokens
    equal the sampler's (`logprob_diff_max`), so lengths, masks and tokens agree."""
    from grpojax.driver.loop import train
    from grpojax.rewards import RewardSpec

    seen: list[str] = []
    tok = builtin_tokenizer()

    def record(prompts, completions, **_):
        # The scored texts, and their token counts as the reward.
        seen.extend(completions)
        return [float(len(tok.encode(c, add_special_tokens=False))) for c in completions]

    run_dir = tmp_path / "run"
    overrides = {
        "model.source": str(small_model_dir),
        "log.run_dir": str(run_dir),
        "log.progress": "false",
        "log.tensorboard": "false",
        "log.plot": "false",
        "data.name": "chain3",
        "data.size": "50",
        "rollout.prompts_per_step": "2",
        "rollout.max_new_tokens": "8",
        "rollout.stop_strings": "['0','1','2','3','4','5','6','7','8','9']",
        "grpo.group_size": "4",
        "eval.heldout_size": "2",
        "eval.batch_size": "2",
        "eval.k": "1",
        "checkpoint.every": "10",
        "checkpoint.async_save": "false",
        "sft.steps": "0",
        "total_steps": "2",
        "rewards.mode": "thread",
    }
    cfg = load_config(None, [f"{k}={v}" for k, v in overrides.items()])
    specs = [RewardSpec(record, name="length", mode="thread")]
    train(cfg, reward_specs=specs, show_progress=False, print_fn=lambda s: None)
    rl = [
        r
        for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
        if "reward_mean" in r
    ]
    assert len(rl) == 2 and seen
    cut = 0
    for text in seen:
        digits = [i for i, c in enumerate(text) if c.isdigit()]
        assert not digits or digits[0] == len(text) - 1, text
        cut += bool(digits)
    assert cut > 0  # the cut happened (the random policy emits digits)
    for r in rl:
        assert r["logprob_diff_max"] < 1e-4
        # The reward is the scored text's token count; the step's lengths (kept tokens) are
        # those counts, plus 1 where an EOS id ended the row.
        assert r["reward_mean"] <= r["completion_len_mean"] <= r["reward_mean"] + 1
        assert r["completion_len_max"] <= 8


def test_messages_rows_are_rendered_with_the_chat_template(tmp_path):
    import jinja2  # a declared dependency: transformers' apply_chat_template needs it

    assert jinja2.__version__
    tok = builtin_tokenizer()
    tok.chat_template = CHATML
    messages = [
        {"role": "system", "content": "Answer in <answer></answer>."},
        {"role": "user", "content": "What is 2+2?"},
    ]
    path = tmp_path / "train.jsonl"
    path.write_text(json.dumps({"messages": messages, "answer": "4"}) + "\n")
    rows = load_prompt_dataset(path, tokenizer=tok, chat=True, prompt_column="messages")
    expected = (
        "<|system|>Answer in <answer></answer>.<|end|>\n<|user|>What is 2+2?<|end|>\n<|assistant|>"
    )
    assert rows[0]["prompt"] == expected
    assert rows[0]["answer"] == "4" and rows.add_special_tokens is False


def test_messages_rows_through_the_driver_config(small_model_dir, tmp_path):
    d = shutil.copytree(small_model_dir, tmp_path / "m")
    tok = load_tokenizer(d)
    tok.chat_template = CHATML
    tok.save_pretrained(str(d))  # the directory's tokenizer now carries the template
    path = tmp_path / "train.jsonl"
    messages = [{"role": "user", "content": "1+2?"}]
    path.write_text(json.dumps({"messages": messages, "answer": "3"}) + "\n")
    cfg = load_config(
        None,
        [
            f"model.source={d}",
            "data.kind=file",
            f"data.path={path}",
            "data.prompt_column=messages",
            "data.chat_template=true",
        ],
    )
    train_rows, _ = build_datasets(cfg, load_tokenizer(d))
    assert train_rows[0]["prompt"] == "<|user|>1+2?<|end|>\n<|assistant|>"


def test_heldout_size_caps_the_eval_file_to_its_first_rows(tmp_path):
    train = tmp_path / "train.jsonl"
    heldout = tmp_path / "heldout.jsonl"
    train.write_text(json.dumps({"prompt": "1+1=", "answer": "2"}) + "\n")
    heldout.write_text(
        "".join(json.dumps({"prompt": f"{i}+0=", "answer": str(i)}) + "\n" for i in range(10))
    )
    base = ["data.kind=file", f"data.path={train}", f"data.eval_path={heldout}"]
    tok = builtin_tokenizer()
    _, rows = build_datasets(load_config(None, [*base, "eval.heldout_size=3"]), tok)
    assert [r["answer"] for r in rows] == ["0", "1", "2"]
    _, rows = build_datasets(load_config(None, [*base, "eval.heldout_size=50"]), tok)
    assert len(rows) == 10
