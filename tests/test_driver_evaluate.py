"""Held-out evaluation: the unbiased pass@k estimator against enumeration of every k-subset,
and `evaluate`'s pass@j against that enumeration on the scores it was handed."""

import itertools
import zlib

import jax
import numpy as np
import pytest
from flax import nnx

from grpojax.driver.evaluate import evaluate, pass_at_k, pass_at_k_values
from grpojax.models import Decoder, builtin_tokenizer, tiny_config


def _enumerated(correct_pn: np.ndarray, k: int) -> float:
    """pass@k by definition: per prompt, the fraction of the C(n, k) k-subsets of its n
    samples holding at least one correct sample; averaged over prompts."""
    per_prompt = []
    for row in correct_pn:
        subsets = list(itertools.combinations(range(len(row)), k))
        per_prompt.append(sum(any(row[i] for i in s) for s in subsets) / len(subsets))
    return float(np.mean(per_prompt))


def test_pass_at_k_equals_enumeration_of_k_subsets():
    rng = np.random.default_rng(0)
    for n in range(1, 9):
        correct = rng.random((6, n)) < rng.random((6, 1))  # per-prompt success rates
        correct[0] = False  # a prompt with no correct sample
        correct[1] = True  # and one with every sample correct
        for k in range(1, n + 1):
            # A product of <= 8 float64 factors: 1e-12 absolute.
            assert abs(pass_at_k(correct, k) - _enumerated(correct, k)) < 1e-12, (n, k)


def test_pass_at_1_is_the_success_rate_and_pass_at_n_any_success():
    correct = np.array([[1, 0, 0, 0], [0, 0, 0, 0], [1, 1, 0, 1]], bool)
    assert pass_at_k(correct, 1) == pytest.approx(correct.mean(), abs=1e-12)
    assert pass_at_k(correct, 4) == pytest.approx(2 / 3, abs=1e-12)


def test_pass_at_k_rejects_k_outside_the_samples():
    with pytest.raises(ValueError, match=r"k must be an int in \[1, 3\]"):
        pass_at_k(np.ones((2, 3), bool), 4)
    with pytest.raises(ValueError, match="correct_pn must be"):
        pass_at_k(np.ones(3, bool), 1)


def test_reported_j():
    assert pass_at_k_values(1) == []
    assert pass_at_k_values(2) == [2]
    assert pass_at_k_values(6) == [2, 4, 6]
    assert pass_at_k_values(8) == [2, 4, 8]


def test_evaluate_reports_pass_at_j_of_the_sampled_scores():
    """pass@j from `evaluate` equals the enumeration over the very scores its score_fn
    returned for the sampled completions (rows in prompt order, k samples each)."""
    cfg = tiny_config(
        hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16
    )
    model, tok = Decoder(cfg, rngs=nnx.Rngs(0)), builtin_tokenizer()
    rows = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a, b in [(1, 2), (3, 4), (5, 1)]]
    k, calls = 4, []

    def score_fn(prompts, completions, columns):
        # A deterministic score of the text: about half the samples are "correct".
        scores = np.array([float(zlib.crc32(c.encode()) % 2) for c in completions])
        calls.append(scores)
        return scores

    out = evaluate(
        model,
        tok,
        rows,
        score_fn=score_fn,
        max_new_tokens=5,
        k=k,
        temperature=1.0,
        batch_size=8,
        key=jax.random.key(0),
        show_progress=False,
    )
    greedy, sampled = calls  # one batch: the greedy pass, then the k samples of each prompt
    correct = sampled.reshape(len(rows), k) >= 1.0
    assert set(out) == {"pass@1", f"mean@{k}", "pass@2", "pass@4", "num_prompts"}
    assert out["pass@1"] == pytest.approx(greedy.mean(), abs=1e-12)
    assert out[f"mean@{k}"] == pytest.approx(sampled.mean(), abs=1e-12)
    for j in (2, 4):
        assert out[f"pass@{j}"] == pytest.approx(_enumerated(correct, j), abs=1e-12)
    assert 0 < sampled.sum() < sampled.size  # the check above saw both outcomes
