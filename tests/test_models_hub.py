"""Checkpoints by Hub id (`grpojax.models.hub`), offline: the test writes a Hub cache in the
Hub's own layout (models--owner--name/{refs,snapshots}) and the resolver must find each
revision there, load it through the driver, and name what failed otherwise."""

import dataclasses
import re

import huggingface_hub
import numpy as np
import pytest
from flax import nnx

from grpojax.config import ModelSpec, RewardsSpec, RunConfig
from grpojax.driver.setup import build_model, check_reward_model
from grpojax.errors import MissingPathError, UserError
from grpojax.models import Decoder, builtin_tokenizer, save_pretrained, tiny_config
from grpojax.models.hub import is_hub_id, resolve_checkpoint

COMMITS = {"main": "1" * 40, "v2": "2" * 40}  # branch / tag -> the snapshot's commit


def small_config():
    return tiny_config(
        hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16
    )


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    """A Hub cache holding acme/tiny-qwen at two commits (different weights: seeds 0 and 1),
    "main" pointing at the first and the tag "v2" at the second; the Hub itself offline."""
    repo = tmp_path / "hub" / "models--acme--tiny-qwen"
    for seed, (ref, commit) in enumerate(COMMITS.items()):
        model = Decoder(small_config(), rngs=nnx.Rngs(seed))
        save_pretrained(model, repo / "snapshots" / commit, tokenizer=builtin_tokenizer())
        (repo / "refs").mkdir(parents=True, exist_ok=True)
        (repo / "refs" / ref).write_text(commit)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    return repo


def test_hub_ids_resolve_to_their_cached_snapshot_and_load(hub_cache):
    snap = hub_cache / "snapshots"
    assert resolve_checkpoint("acme/tiny-qwen") == snap / COMMITS["main"]
    assert resolve_checkpoint("acme/tiny-qwen", "v2") == snap / COMMITS["v2"]
    assert resolve_checkpoint("acme/tiny-qwen", COMMITS["v2"]) == snap / COMMITS["v2"]
    # The driver loads the pinned revision: the weights of the seed-1 model, not main's.
    base = RunConfig(total_steps=1)
    loaded = {}
    for rev in (None, "v2"):
        cfg = dataclasses.replace(base, model=ModelSpec(source="acme/tiny-qwen", revision=rev))
        model, _ = build_model(cfg)
        loaded[rev] = np.asarray(model.embed[...])
    for seed, rev in enumerate((None, "v2")):
        expected = Decoder(small_config(), rngs=nnx.Rngs(seed)).embed[...]
        np.testing.assert_array_equal(loaded[rev], np.asarray(expected))


def test_a_reward_model_by_hub_id_is_resolved_too(hub_cache):
    # The cached checkpoint is found (and then refused: a causal LM, not a classifier).
    rewards = RewardsSpec(names=("reward_model",), reward_model="acme/tiny-qwen")
    cfg = dataclasses.replace(RunConfig(total_steps=1), rewards=rewards)
    with pytest.raises(UserError, match=r"rewards\.reward_model: .*not a sequence-classification"):
        check_reward_model(cfg)


def test_a_local_directory_wins_over_a_hub_id_of_the_same_name(hub_cache, tmp_path, monkeypatch):
    local = tmp_path / "acme" / "tiny-qwen"
    local.mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    assert resolve_checkpoint("acme/tiny-qwen").resolve() == local
    with pytest.raises(UserError, match="is a local directory; a revision \\('v2'\\) only"):
        resolve_checkpoint("acme/tiny-qwen", "v2")


def test_hub_failures_name_the_id_the_revision_and_the_cause(hub_cache):
    with pytest.raises(
        UserError,
        match=re.escape(
            "model.source: 'acme/absent' is not a local directory, so it was read as a Hub "
            "id: it is not in the Hub cache, and the Hub cannot be reached"
        ),
    ):
        resolve_checkpoint("acme/absent")
    with pytest.raises(UserError, match="'acme/tiny-qwen' at revision 'v9'"):
        resolve_checkpoint("acme/tiny-qwen", "v9")
    missing = "checkpoint directory not found: /no/such/dir \\(nor is it a Hugging Face"
    with pytest.raises(MissingPathError, match=missing):
        resolve_checkpoint("/no/such/dir")
    assert is_hub_id("Qwen/Qwen2.5-0.5B-Instruct") and is_hub_id("gpt2")
    assert not any(map(is_hub_id, ("runs/a/hf", "./x", "a--b/c", "x/", "-x/y")))
    with pytest.raises(ValueError, match="revision applies to a Hub id"):
        ModelSpec(source="tiny", revision="v2")
