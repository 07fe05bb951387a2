"""GGUF files as a model source, on tiny checkpoints written at test time (`gguf_fixtures`):
the weights against the transformers model they were written from and against transformers'
own GGUF loader (Llama with permuted query/key rows, Qwen2 with biases, Qwen3 with qk-norm;
float32 and block-quantized), the config against transformers', the tokenizer and chat
template from the file, the export round trip, and every malformed file one `UserError`
naming it."""

from __future__ import annotations

import json
import shutil

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from gguf_fixtures import CHATML, VOCAB, bad_gguf_files, hf_model, write_gguf

from grpojax.data import stop_ids_of
from grpojax.errors import MissingPathError, UserError
from grpojax.models import (
    forward_logits,
    from_pretrained,
    gguf_io,
    load_config,
    load_tokenizer,
    save_pretrained,
)
from grpojax.models.hub import resolve_checkpoint

TEXTS = ["What is 12 + 34? Reply with only the number.", "The lazy dog.", "red, green"]
# float32 logits over 2 layers: grpojax's and transformers' sums in other orders.
ATOL = 1e-4


def _batch(tokenizer):
    rows = [tokenizer(t)["input_ids"] for t in TEXTS]
    width = max(map(len, rows))
    ids = np.full((len(rows), width), 2, np.int64)
    mask = np.zeros_like(ids)
    for i, r in enumerate(rows):  # left-padded
        ids[i, width - len(r) :], mask[i, width - len(r) :] = r, 1
    return ids, mask


def _torch_logits(model, ids, mask):
    positions = np.maximum(np.cumsum(mask, 1) - 1, 0)
    with torch.no_grad():
        out = model(
            input_ids=torch.tensor(ids),
            attention_mask=torch.tensor(mask),
            position_ids=torch.tensor(positions),
        )
    return out.logits.numpy()


def _ours(path, ids, mask):
    model = from_pretrained(path)
    return np.asarray(forward_logits(model, jnp.asarray(ids, jnp.int32), jnp.asarray(mask, bool)))


def _log_softmax(x):
    x = x.astype(np.float64)
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def _max_diff(a, b, mask):
    return float(np.abs(_log_softmax(a) - _log_softmax(b))[mask.astype(bool)].max())


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_float32_gguf_gives_the_source_models_logits(arch, tie, tmp_path):
    """A float32 GGUF holds the source model's weights exactly: the logits are those of
    the transformers model it was written from (the permuted Llama rows restored by
    grpojax's own code, not transformers')."""
    hf = hf_model(arch, tie=tie)
    path = write_gguf(tmp_path / "m.gguf", hf, arch)
    tok = load_tokenizer(path)
    ids, mask = _batch(tok)
    diff = _max_diff(_ours(path, ids, mask), _torch_logits(hf, ids, mask), mask)
    assert diff <= ATOL, diff


# Not qwen3: transformers' GGUF reader leaves a Qwen3's head_dim at its config's default (128)
# whatever the file's attention.key_length (16 here).
@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_1", "F16"])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_quantized_gguf_matches_transformers_gguf_loader(arch, qtype, tmp_path):
    """Block-quantized weights dequantize to what transformers' GGUF loader makes of them
    (both through gguf.quants), and differ from the unquantized source's."""
    hf = hf_model(arch, seed=1)
    write_gguf(tmp_path / "m.gguf", hf, arch, qtype=qtype)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, gguf_file="m.gguf", dtype=torch.float32
    ).eval()
    ids, mask = _batch(load_tokenizer(tmp_path / "m.gguf"))
    ours = _ours(tmp_path / "m.gguf", ids, mask)
    assert _max_diff(ours, _torch_logits(theirs, ids, mask), mask) <= ATOL
    assert _max_diff(ours, _torch_logits(hf, ids, mask), mask) > 10 * ATOL  # really quantized


def test_config_is_transformers_reading_of_the_metadata(tmp_path):
    hf = hf_model("qwen2")
    path = write_gguf(tmp_path / "m.gguf", hf, "qwen2")
    theirs = transformers.AutoConfig.from_pretrained(tmp_path, gguf_file="m.gguf")
    ours = load_config(path)
    assert ours.model_type == theirs.model_type == "qwen2"
    assert ours.qkv_bias and ours.tie_word_embeddings == theirs.tie_word_embeddings
    for mine, key in [
        ("vocab_size", "vocab_size"),
        ("hidden_size", "hidden_size"),
        ("intermediate_size", "intermediate_size"),
        ("num_layers", "num_hidden_layers"),
        ("num_heads", "num_attention_heads"),
        ("num_kv_heads", "num_key_value_heads"),
        ("rms_norm_eps", "rms_norm_eps"),
    ]:
        assert getattr(ours, mine) == pytest.approx(getattr(theirs, key)), mine
    assert ours.rope_theta == theirs.rope_parameters["rope_theta"]
    assert ours.eos_token_id == 2 and ours.bos_token_id == 1


def test_tokenizer_and_chat_template_come_from_the_file(tmp_path):
    hf = hf_model("llama")
    write_gguf(tmp_path / "m.gguf", hf, "llama")
    tok = load_tokenizer(tmp_path)  # a directory holding one GGUF file
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file="m.gguf")
    assert tok.get_vocab() == theirs.get_vocab() and len(tok) == VOCAB
    assert tok.chat_template == CHATML
    text = tok.apply_chat_template(
        [{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True
    )
    assert text == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert tok.decode(tok(TEXTS[0])["input_ids"]) == TEXTS[0]
    assert stop_ids_of(tok) == (2,) and tok.eos_token == "<|im_end|>"


def test_eos_ids_include_end_of_turn_ids(tmp_path):
    hf = hf_model("llama")
    path = write_gguf(tmp_path / "m.gguf", hf, "llama", metadata=lambda w: w.add_eot_token_id(0))
    assert gguf_io.eos_ids(path) == (0, 2)
    assert stop_ids_of(load_tokenizer(path)) == (0, 2)


def test_export_round_trip_keeps_weights_template_and_eos(tmp_path):
    """save_pretrained of a GGUF-loaded model, with its tokenizer: transformers loads the
    export with the GGUF's logits, chat template and EOS."""
    hf = hf_model("llama", seed=2)
    path = write_gguf(tmp_path / "m.gguf", hf, "llama", qtype="Q8_0")
    model, tok = from_pretrained(path), load_tokenizer(path)
    out = tmp_path / "hf"
    save_pretrained(model, out, tokenizer=tok)
    ids, mask = _batch(tok)
    exported = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    ours = np.asarray(forward_logits(model, jnp.asarray(ids, jnp.int32), jnp.asarray(mask, bool)))
    assert _max_diff(ours, _torch_logits(exported, ids, mask), mask) <= ATOL
    back = transformers.AutoTokenizer.from_pretrained(out)
    assert back.chat_template == tok.chat_template == CHATML
    assert back.get_vocab() == tok.get_vocab()
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == 2
    assert stop_ids_of(load_tokenizer(out)) == stop_ids_of(tok)


def test_find_gguf_and_resolve(tmp_path):
    hf = hf_model("llama")
    (tmp_path / "one").mkdir()
    path = write_gguf(tmp_path / "one" / "m.gguf", hf, "llama")
    assert gguf_io.find_gguf(tmp_path / "one") == path
    assert gguf_io.find_gguf(path) == path
    assert resolve_checkpoint(str(path)) == path
    with pytest.raises(UserError, match="local file; a revision"):
        resolve_checkpoint(str(path), "main")
    with pytest.raises(MissingPathError, match="GGUF file not found"):
        resolve_checkpoint(str(tmp_path / "nope.gguf"))
    shutil.copy(path, tmp_path / "one" / "n.gguf")
    with pytest.raises(UserError, match=r"holds 2 GGUF files \(m.gguf, n.gguf\)"):
        gguf_io.find_gguf(tmp_path / "one")
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text("{}")
    shutil.copy(path, tmp_path / "hf" / "m.gguf")
    assert gguf_io.find_gguf(tmp_path / "hf") is None  # a HF directory first


def test_malformed_files_are_one_user_error_naming_the_file(tmp_path):
    for name, (path, must) in bad_gguf_files(tmp_path).items():
        for load in (load_config, from_pretrained, load_tokenizer):
            with pytest.raises(UserError) as e:
                load(path)
            message = str(e.value)
            assert "\n" not in message, (name, message)
            assert path.name in message and all(m in message for m in must), (name, message)


@pytest.mark.slow
def test_grpojax_train_on_a_gguf_source_exports_a_transformers_checkpoint(tmp_path, capsys):
    """`grpojax train` with model.source a GGUF file, the chat template from the file and
    the recipe's reward: the run's export loads in transformers with the trained weights'
    logits, the file's chat template and EOS."""
    from grpojax import cli

    hf = hf_model("llama", seed=3)
    path = write_gguf(tmp_path / "tiny.gguf", hf, "llama", qtype="Q8_0")
    run = tmp_path / "run"
    args = [
        f"model.source={path}", f"log.run_dir={run}", "data.kind=arithmetic", "data.name=add2",
        "data.template='What is {question}?'", "data.chat_template=true", "data.size=50",
        "data.max_prompt_tokens=64",
        "rewards.names=[final_number]", "rewards.mode=thread", "rollout.prompts_per_step=2",
        "rollout.max_new_tokens=6", "grpo.group_size=2", "total_steps=2",
        "optimizer.learning_rate=1e-3", "optimizer.warmup_steps=1", "eval.heldout_size=2",
        "eval.batch_size=2", "eval.k=1", "checkpoint.async_save=false",
    ]  # fmt: skip
    assert cli.main(["train", "--no-progress", *args]) == 0
    assert f"run_dir={run}" in capsys.readouterr().out.strip().splitlines()[-1]
    out = run / "hf"
    exported = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    tok = load_tokenizer(out)
    assert tok.chat_template == CHATML and stop_ids_of(tok) == (2,)
    ids, mask = _batch(tok)
    trained = _ours(out, ids, mask)
    assert _max_diff(trained, _torch_logits(exported, ids, mask), mask) <= ATOL
    assert _max_diff(trained, _ours(path, ids, mask), mask) > 10 * ATOL  # it trained
