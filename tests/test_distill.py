"""On-policy distillation: the GRPO step with a `Teacher` reference and `grpojax train
algo=distill`.

The step's loss against a teacher of another architecture (wider, deeper, other heads) is
checked against a float64 NumPy computation from both models' full `[N, T, V]` logits, and
its gradient against autodiff of a plain-`jnp` full-logits loss (1e-5 of the largest entry,
float32 sums over a vocabulary of 64 and widths <= 96); the RL term enters linearly by
`pg_coef`; the compiled step's scratch memory grows with the vocabulary by far less than
one `[N, T, V]` float32 array (the divergence runs in vocabulary tiles). Then the driver:
a run with a teacher checkpoint, its resume bit for bit (checkpoints leave the teacher
out), a LoRA student (the teacher, not the base weights, is the reference), and the errors
for a teacher of another vocabulary or tokenizer.
"""

from __future__ import annotations

import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from test_logprobs import divergence_of
from train_helpers import full_logits_logp, grad_recorder, random_grpo_batch, small_model

import grpojax.models as gm
from grpojax.driver.checkpoint import host_copy
from grpojax.errors import UserError
from grpojax.train import GRPOConfig, create_train_state, grpo_update
from grpojax.train.common import ForwardConfig
from grpojax.train.state import Teacher, split_params

RTOL = 1e-5
FORWARD = ForwardConfig(chunk_size=16, vocab_chunk_size=24)  # several tiles, a ragged last


def _teacher_model(seed=7, vocab=None):
    """A teacher unlike the policy (`small_model`: 2 layers of width 64, 4/2 heads): 3 layers
    of width 96, 6/3 heads of 16, tied embeddings."""
    extra = {} if vocab is None else {"vocab_size": vocab}
    return small_model(
        seed,
        num_layers=3,
        hidden_size=96,
        intermediate_size=160,
        num_heads=6,
        num_kv_heads=3,
        tie_word_embeddings=True,
        **extra,
    )


def _completion_log_softmax(model, batch):
    """`[N, T, V]` float32 log-softmax at the completion positions (plain jnp)."""
    mask = batch.mask_ns
    positions = jnp.maximum(jnp.cumsum(mask, axis=1) - 1, 0)
    hidden, _ = model(batch.tokens_ns, positions_nt=positions, mask_nt=mask)
    t, s = batch.completion_mask_nt.shape[1], batch.tokens_ns.shape[1]
    return jax.nn.log_softmax(model.logits(hidden)[:, s - t - 1 : s - 1], axis=-1)


def _distill_config(divergence="reverse_kl", **extra):
    base = dict(
        beta=1.0,
        kl_estimator="full",
        kl_divergence=divergence,
        kl_jsd_beta=0.3,
        pg_coef=0.0,
        aggregation="token-mean",
        shuffle=False,
        forward=FORWARD,
    )
    base.update(extra)
    return GRPOConfig(**base)


def _state(model, teacher, tx):
    graphdef, state = create_train_state(model, tx, rng=jax.random.key(0))
    return graphdef, state.replace(ref_params=Teacher(*split_params(teacher)))


@pytest.mark.parametrize("divergence", ["reverse_kl", "forward_kl", "jsd"])
def test_loss_and_gradient_equal_the_full_vocabulary_definition(divergence):
    model, teacher = small_model(0), _teacher_model()
    batch = random_grpo_batch(3, n=8, p=4, t=6, vocab=60)
    config = _distill_config(divergence)
    tx = grad_recorder()
    graphdef, state = _state(model, teacher, tx)
    update = jax.jit(functools.partial(grpo_update, graphdef=graphdef, tx=tx, config=config))
    new, metrics = update(state, batch)

    mask = np.asarray(batch.completion_mask_nt).astype(bool)
    _, logsm = full_logits_logp(model, batch)
    _, ref_logsm = full_logits_logp(teacher, batch)
    div = divergence_of(logsm, ref_logsm, divergence, 0.3)
    assert div[mask].mean() > 1e-3  # the teacher is another distribution
    # The JSD (0.007 here) is a sum of terms that cancel to ~1e-7 of float32 rounding: an
    # absolute error, held to 1e-6 as in tests/test_train_objectives.py; the KLs to RTOL.
    atol = 1e-6 if divergence == "jsd" else 0.0
    for name in ("first_loss", "kl_ref"):
        np.testing.assert_allclose(float(metrics[name]), div[mask].mean(), rtol=RTOL, atol=atol)

    ref = jax.lax.stop_gradient(_completion_log_softmax(teacher, batch))

    def reference_loss(params):
        d = divergence_of(
            _completion_log_softmax(nnx.merge(graphdef, params), batch), ref, divergence, 0.3, jnp
        )
        return jnp.sum(jnp.where(mask, d, 0.0)) / mask.sum()

    want = jax.grad(reference_loss)(state.params)
    got = new.opt_state  # the recorder's state: the update's gradient
    for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(got), strict=True):
        scale = float(jnp.max(jnp.abs(a)))
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=0, atol=RTOL * scale)


def test_the_rl_term_enters_by_pg_coef():
    """loss(c) = loss(0) + c * (loss(1) - loss(0)): `distill.rl_coef` weighs GRPO's term."""
    model, teacher = small_model(0), _teacher_model()
    batch = random_grpo_batch(4, n=8, vocab=60)
    tx = optax.sgd(0.0)
    losses = {}
    for c in (0.0, 0.5, 1.0):
        graphdef, state = _state(model, teacher, tx)
        config = _distill_config(pg_coef=c)
        _, m = grpo_update(state, batch, graphdef=graphdef, tx=tx, config=config)
        losses[c] = float(m["first_loss"])
    assert abs(losses[1.0] - losses[0.0]) > 1e-3  # the RL term is not negligible here
    np.testing.assert_allclose(
        losses[0.5], losses[0.0] + 0.5 * (losses[1.0] - losses[0.0]), rtol=RTOL
    )


def test_a_teacher_is_read_by_the_exact_divergence_only():
    model, teacher = small_model(0), _teacher_model()
    batch = random_grpo_batch(5, n=8, vocab=60)
    tx = optax.sgd(0.0)
    graphdef, state = _state(model, teacher, tx)
    for bad in (dict(kl_estimator="k3", kl_divergence="reverse_kl"), dict(beta=0.0)):
        with pytest.raises(ValueError, match=r"^a Teacher reference \(another model\) is read"):
            grpo_update(state, batch, graphdef=graphdef, tx=tx, config=_distill_config(**bad))


def test_step_memory_does_not_grow_with_the_vocabulary_like_logits():
    """The compiled distillation step (student and teacher forwards, the divergence and its
    gradient) at V = 256 and V = 2,048: its scratch grows by the vocabulary-sized parameters'
    gradients and moments, not by the [N, T, V] logits of either model (60 MB more of them
    per array here, from 14,336 completion positions)."""
    n, t = 16, 896

    def temp_bytes(vocab):
        model = small_model(0, vocab_size=vocab)
        teacher = _teacher_model(vocab=vocab)
        batch = random_grpo_batch(6, n=n, p=8, t=t, vocab=vocab)
        config = _distill_config(forward=ForwardConfig(chunk_size=512, vocab_chunk_size=256))
        tx = optax.adam(1e-3)
        graphdef, state = _state(model, teacher, tx)
        fn = jax.jit(functools.partial(grpo_update, graphdef=graphdef, tx=tx, config=config))
        return fn.lower(state, batch).compile().memory_analysis().temp_size_in_bytes

    small, large = temp_bytes(256), temp_bytes(2048)
    logits_growth = n * t * (2048 - 256) * 4
    print(f"temp bytes: V 256 {small / 2**20:.1f} MiB, V 2048 {large / 2**20:.1f} MiB")
    assert large - small < logits_growth / 4, (small, large, logits_growth)


# ----------------------------------------------------------------------------- the driver


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory):
    """A 2-layer, width-64 teacher (the policy, `small_model_dir`, is 1 layer of 32) with
    the built-in tokenizer."""
    path = tmp_path_factory.mktemp("teacher")
    cfg = gm.tiny_config(
        hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2
    )
    gm.save_pretrained(gm.Decoder(cfg, rngs=nnx.Rngs(5)), path, tokenizer=gm.builtin_tokenizer())
    return path


def _cfg(model_dir, run_dir, teacher, **extra):
    from test_driver_loop import _overrides

    from grpojax.config import load_config

    extra = {"algo": "distill", "distill.teacher": str(teacher), **extra}
    return load_config(None, _overrides(model_dir, run_dir, total_steps=2, **extra))


def _rl_rows(run_dir):
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "reward_mean" in r]


QUIET = dict(show_progress=False, print_fn=lambda s: None)


EXTRA = {"grpo.num_minibatches": 2}


@pytest.fixture(scope="module")
def distilled(small_model_dir, teacher_dir, tmp_path_factory):
    """(result, run directory) of two uninterrupted steps of `algo=distill` (reverse KL
    alone, two updates a step)."""
    from grpojax.driver.loop import train

    run_dir = tmp_path_factory.mktemp("distilled")
    return train(_cfg(small_model_dir, run_dir, teacher_dir, **EXTRA), **QUIET), run_dir


def test_grpojax_train_distills_and_resumes_exactly(
    small_model_dir, teacher_dir, distilled, tmp_path, monkeypatch
):
    """Two steps of `algo=distill` (reverse KL alone): the loss is the divergence to the
    teacher; stopped after one step and resumed equals the uninterrupted run bit for bit
    (the teacher is rebuilt from distill.teacher, not read from the checkpoint); the
    teacher's files are checked once a run (by `start_run`; the trainer takes its directory),
    and a resume with another teacher (same shapes, other weights) is refused."""
    from grpojax.driver import setup
    from grpojax.driver.loop import train

    checks = []
    check = setup.check_teacher
    monkeypatch.setattr(setup, "check_teacher", lambda *a, **k: checks.append(1) or check(*a, **k))

    extra = EXTRA
    full, run_dir = distilled
    rows = _rl_rows(run_dir)
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert r["kl"] > 0 and np.isfinite(r["grad_norm"]) and r["grad_norm"] > 0
        np.testing.assert_allclose(r["loss"], r["kl_loss"], rtol=1e-6)  # rl_coef 0: no pg
    # The checkpoint's tree (orbax's metadata) holds no teacher arrays under ref_params.
    meta = json.loads((run_dir / "checkpoints" / "2" / "state" / "_METADATA").read_text())
    paths = list(meta["tree_metadata"])
    assert any("'params', 'embed'" in p for p in paths)
    assert not any("'ref_params'," in p for p in paths)

    resume = {**extra, "checkpoint.resume": "true"}
    stopped = train(
        _cfg(small_model_dir, tmp_path / "b", teacher_dir, **extra), stop_after=1, **QUIET
    )
    assert stopped.steps == 1
    again = train(_cfg(small_model_dir, tmp_path / "b", teacher_dir, **resume), **QUIET)
    assert again.steps == 2
    assert len(checks) == 2  # one per invocation (the stopped one and the resumed one)
    # The same architecture with other weights: the checkpoint's teacher fingerprint refuses it.
    other = tmp_path / "other_teacher"
    cfg = json.loads((teacher_dir / "config.json").read_text())
    gm.save_pretrained(
        gm.Decoder(gm.load_config(teacher_dir), rngs=nnx.Rngs(6)),
        other,
        tokenizer=gm.builtin_tokenizer(),
    )
    assert json.loads((other / "config.json").read_text()) == cfg
    with pytest.raises(UserError, match="is not the teacher this run was trained with"):
        train(_cfg(small_model_dir, tmp_path / "b", other, **resume), **QUIET)
    a, b = host_copy(full.trainer.state), host_copy(again.trainer.state)
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_lora_student_distills_from_the_teacher_not_its_base(
    small_model_dir, teacher_dir, distilled, tmp_path
):
    """A LoRA student starts as its base (B = 0): its first divergence is the full student's
    to the teacher (`distilled`'s first step), not 0 (the base with adapters off would be
    GRPO's reference)."""
    from grpojax.driver.loop import train

    lora = {**EXTRA, "lora.rank": 2, "lora.targets": "[q,v]"}
    result = train(_cfg(small_model_dir, tmp_path / "lora", teacher_dir, **lora), **QUIET)
    full, adapted = _rl_rows(distilled[1]), _rl_rows(tmp_path / "lora")
    # first_loss: the first update's, at the initial parameters (rl_coef 0: the divergence)
    assert adapted[0]["first_loss"] > 1e-3
    np.testing.assert_allclose(adapted[0]["first_loss"], full[0]["first_loss"], rtol=1e-5)
    assert {"lora.q_a", "lora.v_b"} <= set(result.trainer.policy().named_params())


def test_a_teacher_of_another_vocabulary_or_tokenizer_is_named(small_model_dir, tmp_path):
    from grpojax.driver.loop import train

    other = tmp_path / "other_vocab"
    cfg = gm.tiny_config(hidden_size=32, intermediate_size=64, num_layers=1, vocab_size=96)
    gm.save_pretrained(gm.Decoder(cfg, rngs=nnx.Rngs(0)), other)
    with pytest.raises(
        UserError,
        match=r"distill.teacher='.*other_vocab' has a vocabulary of 96 ids, the policy "
        r"\(model.source='.*'\) \d+",
    ):
        train(_cfg(small_model_dir, tmp_path / "a", other), **QUIET)

    swapped = tmp_path / "swapped_tokenizer"
    tok = gm.builtin_tokenizer()
    vocab = tok.get_vocab()
    a, b = sorted(vocab)[5:7]
    gm.save_pretrained(
        gm.Decoder(
            gm.tiny_config(hidden_size=32, intermediate_size=64, num_layers=1), rngs=nnx.Rngs(0)
        ),
        swapped,
        tokenizer=tok,
    )
    tj = json.loads((swapped / "tokenizer.json").read_text())
    tj["model"]["vocab"][a], tj["model"]["vocab"][b] = vocab[b], vocab[a]
    (swapped / "tokenizer.json").write_text(json.dumps(tj))
    with pytest.raises(
        UserError, match=r"its tokenizer is not the policy's .*2 tokens map to other ids"
    ):
        train(_cfg(small_model_dir, tmp_path / "b", swapped), **QUIET)


def test_distill_config_errors_name_the_field(teacher_dir, tmp_path):
    from grpojax.config import ConfigError, algo_grpo_config, load_config

    with pytest.raises(ConfigError, match=r"^algo 'distill' needs distill.teacher"):
        load_config(None, ["algo=distill"])
    with pytest.raises(ConfigError, match=r"grpo.kl_estimator must be 'full', got 'k3'"):
        load_config(
            None, ["algo=distill", f"distill.teacher={teacher_dir}", "grpo.kl_estimator=k3"]
        )
    with pytest.raises(ConfigError, match=r"distill.divergence must be one of"):
        load_config(
            None, ["algo=distill", f"distill.teacher={teacher_dir}", "distill.divergence=tv"]
        )
    cfg = load_config(
        None,
        [
            "algo=distill",
            f"distill.teacher={teacher_dir}",
            "distill.rl_coef=0.3",
            "distill.divergence=forward_kl",
        ],
    )
    step = cfg.step_config  # derived from the distill section; the grpo section as given
    assert (step.pg_coef, step.kl_divergence, step.beta) == (0.3, "forward_kl", 1.0)
    assert cfg.grpo == algo_grpo_config("distill")


@pytest.mark.slow
def test_distillation_step_on_8_devices_equals_one_device():
    """The distillation step (reverse KL to a teacher of another shape, sharded by its own
    parameters' rules on the same mesh) on fsdp 4 x tensor 2 fake devices equals one
    device: metrics within 1e-5 relative and SGD-updated parameters within 1e-5 (the
    8-device GRPO test's bounds)."""
    from multidevice import run_with_devices

    out = run_with_devices(
        """
        import jax, numpy as np, optax
        jax.config.update("jax_default_matmul_precision", "highest")
        from grpojax.models import make_mesh
        from grpojax.train import make_grpo_step, shard_train_state
        from test_distill import _distill_config, _state, _teacher_model
        from train_helpers import random_grpo_batch, small_model
        from train_distributed_worker import _flat_global

        def run(mesh):
            tx = optax.sgd(0.1)
            graphdef, state = _state(small_model(0), _teacher_model(), tx)
            state, shardings = shard_train_state(state, tx, mesh)
            batch = random_grpo_batch(9, n=16, vocab=60)
            config = _distill_config(num_minibatches=2)
            step = make_grpo_step(
                graphdef, tx, config, mesh=mesh, state_shardings=shardings, batch=batch
            )
            state, metrics = step(state, batch)
            scalars = {k: float(metrics[k]) for k in ("first_loss", "kl_ref")}
            return scalars, _flat_global(state.params)

        m1, p1 = run(make_mesh(fsdp=1, devices=jax.devices()[:1]))
        m8, p8 = run(make_mesh(fsdp=4, tensor=2))
        for k in m1:
            np.testing.assert_allclose(m8[k], m1[k], rtol=1e-5, err_msg=k)
        np.testing.assert_allclose(p8, p1, rtol=0, atol=1e-5)
        print("max param diff", np.abs(p8 - p1).max(), "kl", m8["kl_ref"])
        """,
        n_devices=8,
    )
    assert "max param diff" in out, out
