"""Held-out evaluation: pass@1 (greedy) and mean@k (k samples per prompt) of a policy.

    pass@1 = (1/P) sum_p score(greedy completion of p)
    mean@k = (1/(P k)) sum_p sum_{j<k} score(sample j of p)      (samples at `temperature`)

with score in [0, 1] (for a 0/1 verifier: the success rate). Prompts are generated in
batches of a fixed size (the last batch is padded by repeating rows, whose results are
dropped), so every batch reuses one compiled sampler program.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import numpy as np

from grpojax.ops.masks import padded_width
from grpojax.sampling import SamplingConfig, generate

__all__ = ["decode_completions", "evaluate", "evaluate_run", "prompt_width"]


def prompt_width(length: int, *, min_width: int = 8) -> int:
    """Padded prompt width P for a longest prompt of `length` tokens ("compact" buckets)."""
    return padded_width(length, bucket="compact", min_width=min_width)


def decode_completions(tokenizer, tokens_nt, lengths_n, eos_found_n) -> list[str]:
    """Completion texts: the tokens before the stop token (the stop token itself dropped)."""
    tokens, lengths, eos = (
        np.asarray(x) for x in jax.device_get((tokens_nt, lengths_n, eos_found_n))
    )
    ids = [row[: int(n) - int(e)].tolist() for row, n, e in zip(tokens, lengths, eos)]
    return tokenizer.batch_decode(ids, skip_special_tokens=False)


def evaluate(
    model,
    tokenizer,
    rows: Sequence,
    *,
    score_fn: Callable[[list[str], list[str], dict], np.ndarray],
    max_new_tokens: int,
    k: int = 1,
    temperature: float = 1.0,
    batch_size: int = 64,
    key: jax.Array,
    mesh=None,
    desc: str = "eval",
    show_progress: bool = True,
    add_special_tokens: bool | None = None,
    min_prompt_width: int = 16,
) -> dict[str, float]:
    """pass@1 (greedy) and mean@k of `model` on the held-out `rows`.

    Args:
      model: a decoder (the sampler's contract).
      tokenizer: its tokenizer (prompts encoded as `grpojax.data.encode_prompts` does).
      rows: held-out rows with a `prompt` string; the other columns go to `score_fn`.
      score_fn: `(prompts, completions, columns) -> [M]` scores in [0, 1] (M completions;
        columns: name -> list of M values).
      max_new_tokens: completion budget T.
      k: samples per prompt for mean@k (k = 1 still reports mean@1 from one sample).
      temperature: sampling temperature of the k samples.
      batch_size: prompts per generate call.
      key: `jax.random` key of the sampled completions (the greedy pass needs none).
      mesh: optional mesh for `generate`.
      desc, show_progress: the progress bar.
      add_special_tokens: passed to the prompt encoding (None: the rows' own setting,
        True when they have none).
      min_prompt_width: smallest padded prompt width (power-of-two buckets above it).

    Returns:
      {"pass@1": float, f"mean@{k}": float, "num_prompts": float}.
    """
    from grpojax.data import encode_prompts
    from grpojax.driver.metrics import progress

    if not (isinstance(k, int) and k >= 1):
        raise ValueError(f"k must be an int >= 1, got {k!r}")
    if not (isinstance(batch_size, int) and batch_size >= 1):
        raise ValueError(f"batch_size must be an int >= 1, got {batch_size!r}")
    n = len(rows)
    if n == 0:
        raise ValueError("evaluate needs at least one held-out row")
    if add_special_tokens is None:
        add_special_tokens = bool(getattr(rows, "add_special_tokens", True))
    eos = tokenizer.eos_token_id
    stop_ids = () if eos is None else (tuple(eos) if isinstance(eos, list | tuple) else (int(eos),))
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (eos or 0)
    all_rows = [dict(rows[i]) for i in range(n)]
    greedy_scores, sample_scores = [], []
    num_batches = -(-n // batch_size)
    bar = progress(
        num_batches, desc, keys=(("pass@1", "pass@1", ".3f"),), disable=not show_progress
    )
    for bi in range(num_batches):
        chunk = all_rows[bi * batch_size : (bi + 1) * batch_size]
        real = len(chunk)
        chunk = chunk + [chunk[-1]] * (batch_size - real) if n > batch_size else chunk
        prompts = [r["prompt"] for r in chunk]
        tokens, lengths = encode_prompts(
            tokenizer,
            prompts,
            add_special_tokens=add_special_tokens,
            pad_id=pad_id,
            min_width=min_prompt_width,
        )
        columns = {c: [r.get(c) for r in chunk] for c in chunk[0] if c != "prompt"}
        width = prompt_width(int(np.max(lengths)), min_width=min_prompt_width)
        for mode, g, store in (("greedy", 1, greedy_scores), ("sample", k, sample_scores)):
            sampling = SamplingConfig(temperature=0.0 if mode == "greedy" else temperature)
            if mode == "sample" and temperature == 0.0:
                sampling = SamplingConfig(temperature=0.0)
            ro = generate(
                model,
                tokens,
                lengths,
                key=jax.random.fold_in(key, bi),
                max_new_tokens=max_new_tokens,
                group_size=g,
                sampling=sampling,
                eos_ids=stop_ids,
                pad_id=int(pad_id),
                bucket=width,
                mesh=mesh,
            )
            texts = decode_completions(tokenizer, ro.tokens_nt, ro.lengths_n, ro.eos_found_n)
            rep_cols = {c: [v for v in vals for _ in range(g)] for c, vals in columns.items()}
            rep_prompts = [p for p in prompts for _ in range(g)]
            scores = np.asarray(score_fn(rep_prompts, texts, rep_cols), np.float64)
            store.append(scores.reshape(len(chunk), g)[:real])
        bar.update({"pass@1": float(np.concatenate(greedy_scores).mean())})
    bar.close()
    greedy = np.concatenate(greedy_scores)
    sampled = np.concatenate(sample_scores)
    return {
        "pass@1": float(greedy.mean()),
        f"mean@{k}": float(sampled.mean()),
        "num_prompts": float(n),
    }


def evaluate_run(
    run_dir,
    *,
    step: int | None = None,
    overrides: Sequence[str] = (),
    show_progress: bool = True,
) -> dict[str, float]:
    """Evaluate a run's checkpoint on its held-out prompts (pass@1 and mean@k).

    Reads `<run_dir>/config.yaml` (with `key=value` overrides, e.g. `eval.k=8`), rebuilds
    the model, restores checkpoint `step` (default: the newest readable one) and runs
    `evaluate`. Returns the scores plus `step`, and writes them to
    `<run_dir>/eval-<step>.json`.
    """
    import json
    import pathlib

    from grpojax.driver.checkpoint import Checkpointer
    from grpojax.driver.config import load_config
    from grpojax.driver.loop import (
        Trainer,
        build_datasets,
        build_model,
        build_reward_manager,
        heldout_evaluator,
    )
    from grpojax.models import make_mesh

    run_dir = pathlib.Path(run_dir)
    if not (run_dir / "config.yaml").is_file():
        raise FileNotFoundError(f"{run_dir} is not a run directory (no config.yaml)")
    cfg = load_config(run_dir / "config.yaml", list(overrides))
    mesh = make_mesh(data=cfg.mesh.data, fsdp=cfg.mesh.fsdp, tensor=cfg.mesh.tensor)
    model, tokenizer = build_model(cfg, mesh=mesh)
    _, heldout = build_datasets(cfg, tokenizer)
    if heldout is None:
        raise ValueError("this run's data has no held-out split (set data.eval_path)")
    ckpt_dir = pathlib.Path(cfg.checkpoint.dir) if cfg.checkpoint.dir else run_dir / "checkpoints"
    ckpt = Checkpointer(ckpt_dir, async_save=False)
    trainer = Trainer(cfg, model, mesh)
    abstract = {"train": trainer.state, "sample_key": jax.random.key(0)}
    from jax.sharding import NamedSharding, PartitionSpec

    shardings = {"train": trainer.shardings, "sample_key": NamedSharding(mesh, PartitionSpec())}
    if step is None:
        restored = ckpt.restore_latest(abstract, shardings=shardings)
        if restored is None:
            raise FileNotFoundError(f"no checkpoint in {ckpt_dir}")
    else:
        restored = ckpt.restore(step, abstract, shardings=shardings)
    ckpt.close()
    trainer.state = restored.state["train"]
    manager = build_reward_manager(cfg, tokenizer)
    evaluator = heldout_evaluator(
        cfg, tokenizer, heldout, manager, mesh=mesh, show_progress=show_progress
    )
    try:
        scores = evaluator(trainer.policy(), f"step {restored.step}")
    finally:
        manager.close()
    scores["step"] = float(restored.step)
    (run_dir / f"eval-{restored.step}.json").write_text(json.dumps(scores, indent=2))
    return scores
