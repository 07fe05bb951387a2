"""`grpojax rm`: a Bradley-Terry reward model on preference pairs (a file's, or synthetic
pairs from the built-in arithmetic task).

    loss = -log sigmoid(r(chosen) - r(rejected))          (`grpojax.train.reward_model`)
"""

from __future__ import annotations

import json
import pathlib
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from grpojax.config import RunConfig
from grpojax.data import arithmetic_task, encode_prompts, load_rows, pad_id_of, stop_ids_of
from grpojax.driver.metrics import MetricsLogger, progress
from grpojax.driver.setup import build_mesh, build_model, check_run_dir, make_run_dir
from grpojax.errors import UserError
from grpojax.models import RewardModel, save_sequence_classifier
from grpojax.rng import numpy_rng, run_key, run_seed
from grpojax.train import (
    OptimizerConfig,
    PreferenceBatch,
    RewardModelConfig,
    create_train_state,
    make_optimizer,
    make_reward_model_step,
    make_schedule,
    shard_train_state,
)
from grpojax.train.reward_model import pair_rewards

__all__ = ["preference_pairs", "reward_model_job"]


def preference_pairs(cfg: RunConfig, *, num_pairs: int, split: str, seed: int) -> list[dict]:
    """Synthetic preference pairs from the built-in arithmetic task: for each problem the
    chosen response is the right answer and the rejected one a wrong number near it."""
    if cfg.data.kind != "arithmetic":
        raise UserError(
            "synthetic preference pairs come from the built-in arithmetic task "
            f"(data.kind='arithmetic'), got data.kind={cfg.data.kind!r}: pass --pairs FILE"
        )
    task = arithmetic_task(cfg.data.name)
    rows = task.rows(split, num_pairs, seed=run_seed(seed, "data"), unique=split == "heldout")
    rng = numpy_rng(seed, "preference_pairs")
    pairs = []
    for r in rows:
        right = int(r["answer"])
        offset = int(rng.choice([-3, -2, -1, 1, 2, 3]))
        wrong = right + offset if right + offset >= 0 else right - offset
        pairs.append({"prompt": r["prompt"], "chosen": str(right), "rejected": str(wrong)})
    return pairs


def reward_model_job(
    cfg: RunConfig,
    *,
    steps: int = 200,
    batch_size: int = 32,
    learning_rate: float = 3e-4,
    pairs_path: str | None = None,
    heldout_pairs: int = 200,
    print_fn: Callable[[str], None] = print,
    run_root: str | pathlib.Path = "runs",
    show_progress: bool = True,
) -> dict:
    """`grpojax rm`: Bradley-Terry reward-model training on preference pairs.

    Pairs (`prompt`, `chosen`, `rejected` strings) come from a local JSONL/Parquet file
    (`pairs_path`; the last `heldout_pairs` rows are held out) or are synthesised from the
    built-in arithmetic task (`preference_pairs`). The model is `cfg.model`'s decoder under
    a scalar head (`grpojax.models.RewardModel`). The trained model is saved to
    `<run_dir>/hf/` as a Hugging Face `*ForSequenceClassification` checkpoint with the
    tokenizer (`transformers.AutoModelForSequenceClassification` loads it; so does
    `grpojax.models.load_reward_model`, and `rewards.reward_model=<run_dir>/hf` uses it as an
    RL reward). Returns train/held-out pairwise accuracy and the `hf` directory.
    """
    for name, v in (("steps", steps), ("batch_size", batch_size), ("heldout_pairs", heldout_pairs)):
        if not (isinstance(v, int) and v >= 1):
            raise UserError(f"{name} must be an int >= 1, got {v!r}")
    run_dir = make_run_dir(cfg, root=run_root, kind="rm")
    check_run_dir(run_dir)
    if pairs_path is not None:
        rows = [dict(r) for r in load_rows(pairs_path)]
        for col in ("prompt", "chosen", "rejected"):
            if col not in rows[0]:
                raise UserError(
                    f"{pairs_path}: preference rows need a {col!r} column (columns: "
                    f"{sorted(rows[0])})"
                )
        if len(rows) <= heldout_pairs:
            raise UserError(
                f"{pairs_path} has {len(rows)} pairs; need more than heldout_pairs={heldout_pairs}"
            )
        train_pairs, test_pairs = rows[:-heldout_pairs], rows[-heldout_pairs:]
    else:
        train_pairs = preference_pairs(
            cfg, num_pairs=steps * batch_size, split="train", seed=cfg.seed
        )
        test_pairs = preference_pairs(cfg, num_pairs=heldout_pairs, split="heldout", seed=cfg.seed)
    mesh = build_mesh(cfg)
    backbone, tokenizer = build_model(cfg, mesh=mesh)
    run_dir.mkdir(parents=True, exist_ok=True)
    model = RewardModel(backbone, rngs=nnx.Rngs(run_key(cfg.seed, "reward_head")))
    opt = OptimizerConfig(learning_rate=learning_rate, warmup_steps=min(10, steps // 10))
    tx = make_optimizer(opt)
    graphdef, state = create_train_state(model, tx, rng=run_key(cfg.seed, "train_state"))
    state, shardings = shard_train_state(state, tx, mesh)
    pad = pad_id_of(tokenizer)
    stop = stop_ids_of(tokenizer)

    def encode(pairs):
        def side(key):
            texts = [p["prompt"] + p[key] for p in pairs]
            tokens, lengths = encode_prompts(tokenizer, texts, pad_id=pad)
            if stop:  # score the sequence as the policy ends it
                tokens = np.concatenate([tokens, np.full((len(pairs), 1), stop[0], np.int32)], 1)
                lengths = lengths + 1
            width = tokens.shape[1]
            mask = np.arange(width)[None, :] >= (width - lengths)[:, None]
            return tokens, mask

        (ct, cm), (rt, rm) = side("chosen"), side("rejected")
        width = max(ct.shape[1], rt.shape[1])

        def left(x, fill):
            return np.pad(x, ((0, 0), (width - x.shape[1], 0)), constant_values=fill)

        return PreferenceBatch(
            jnp.asarray(left(ct, pad)),
            jnp.asarray(left(cm, False)),
            jnp.asarray(left(rt, pad)),
            jnp.asarray(left(rm, False)),
        )

    logger = MetricsLogger(run_dir, tensorboard=True)
    steps_fns = {}
    bar = progress(
        steps,
        "rm",
        keys=(("accuracy", "acc", ".2f"), ("loss", "loss", ".3f")),
        disable=not show_progress,
    )
    order = numpy_rng(cfg.seed, "rm_order").permutation(len(train_pairs))
    m = {}
    for i in range(steps):
        idx = [order[(i * batch_size + j) % len(order)] for j in range(batch_size)]
        batch = encode([train_pairs[j] for j in idx])
        shape = batch.chosen_tokens_ns.shape
        if shape not in steps_fns:
            steps_fns[shape] = make_reward_model_step(
                graphdef,
                tx,
                RewardModelConfig(),
                mesh=mesh,
                state_shardings=shardings,
                batch=batch,
                schedule=make_schedule(opt),
            )
        state, m = steps_fns[shape](state, batch)
        m = {k: float(v) for k, v in m.items()}
        logger.log(i + 1, {f"rm/{k}": v for k, v in m.items()})
        bar.update(m)
    bar.close()
    test = encode(test_pairs)
    # The held-out pairs' scores, jitted once here: one forward at the end of the job.
    with jax.set_mesh(mesh):
        rc, rr = jax.jit(lambda p, b: pair_rewards(nnx.merge(graphdef, p), b))(state.params, test)
    heldout_acc = float(np.mean(np.asarray(rc) > np.asarray(rr)))
    logger.log(steps, {"rm/heldout_accuracy": heldout_acc})
    logger.close()
    hf_dir = run_dir / "hf"
    model = nnx.merge(graphdef, state.params)
    # The Bradley-Terry loss sees only reward differences, so the head's bias is not part of
    # the model (its gradient is rounding noise, which Adam still turns into steps). It is
    # saved as 0: transformers' bias-free score layer then gives the same scores.
    model.head.b.set_value(jnp.zeros_like(model.head.b[...]))
    save_sequence_classifier(model, hf_dir, tokenizer=tokenizer)
    out = {
        "train_accuracy": m.get("accuracy"),
        "heldout_accuracy": heldout_acc,
        "steps": steps,
        "hf": str(hf_dir),
        "run_dir": str(run_dir),
    }
    (run_dir / "summary.json").write_text(json.dumps(out, indent=2))
    print_fn(
        f"grpojax rm: train_accuracy={out['train_accuracy']:.3f} "
        f"heldout_accuracy={heldout_acc:.3f} steps={steps} model={hf_dir} run_dir={run_dir}"
    )
    return out
