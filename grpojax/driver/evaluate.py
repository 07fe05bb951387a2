"""Held-out evaluation: pass@1 (greedy), mean@k and pass@j (k samples per prompt) of a policy.

    pass@1 = (1/P) sum_p score(greedy completion of p)
    mean@k = (1/(P k)) sum_p sum_{i<k} score(sample i of p)      (samples at `temperature`)
    pass@j = (1/P) sum_p [1 - C(k - c_p, j) / C(k, j)]           (2 <= j <= k)

with score in [0, 1] (for a 0/1 verifier: the success rate) and c_p the number of the k
samples of p that are correct (score 1). pass@j is the unbiased estimator of "at least one
of j samples is correct" (Chen et al. 2021, "Evaluating Large Language Models Trained on
Code"): the fraction of the C(k, j) j-subsets of the k samples that hold a correct one.
For a 0/1 verifier mean@k is the same estimator at j = 1. Prompts are generated in
batches of a fixed size (the last batch is padded by repeating rows, whose results are
dropped), so every batch reuses one compiled sampler program.

Multi-turn runs (`env.name` set) are evaluated on episodes (`evaluate_episodes`): a
prompt's greedy and sampled "completions" are whole episodes against fresh environments,
the score is the episode's return clipped to [0, 1], and `tool_use` (the share of greedy
episodes that called a tool) and `turns` (their mean policy turns) are reported besides.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import jax
import numpy as np

from grpojax.config import RunConfig
from grpojax.data import encode_prompts, pad_id_of, stop_ids_of
from grpojax.distributed import gather_rows, is_primary, owned_rows, rows_to_host
from grpojax.driver.metrics import progress
from grpojax.ops.checks import check_int
from grpojax.rewards import RewardManager
from grpojax.rng import run_key
from grpojax.rollouts.episodes import EpisodeSampler, episode_return
from grpojax.sampling import SamplingConfig, generate, stopped_completions
from grpojax.sampling.generate import DECODE_LOOPS

__all__ = [
    "evaluate",
    "evaluate_episodes",
    "heldout_evaluator",
    "pass_at_k",
    "pass_at_k_values",
]


def pass_at_k(correct_pn: np.ndarray, k: int) -> float:
    """Unbiased pass@k of `correct_pn` `[P, n]` bool (n samples per prompt, k <= n):
    mean over prompts of 1 - C(n - c, k) / C(n, k), c the prompt's correct samples.

    C(n - c, k) / C(n, k) = prod_{i = n-c+1}^{n} (1 - k / i) (Chen et al. 2021), a product
    of at most n factors in [0, 1], so no binomial coefficient overflows.
    """
    correct_pn = np.asarray(correct_pn, bool)
    if correct_pn.ndim != 2:
        raise ValueError(f"correct_pn must be [P, n], got shape {correct_pn.shape}")
    n = correct_pn.shape[1]
    if not (isinstance(k, int) and 1 <= k <= n):
        raise ValueError(f"k must be an int in [1, {n}] (the samples per prompt), got {k!r}")
    values = []
    for c in correct_pn.sum(axis=1):
        if n - c < k:
            values.append(1.0)
        else:
            values.append(1.0 - float(np.prod(1.0 - k / np.arange(n - c + 1, n + 1))))
    return float(np.mean(values))


def pass_at_k_values(k: int) -> list[int]:
    """The j reported as pass@j with k samples per prompt: 2, 4, 8, ... below k, and k
    (pass@1 is the greedy score; mean@k is the sampled pass@1)."""
    js, j = [], 2
    while j < k:
        js.append(j)
        j *= 2
    return [*js, k] if k >= 2 else js


def _padded_batches(rows: Sequence, batch_size: int) -> list[tuple[list[dict], int]]:
    """The held-out rows (as dicts) in batches of `batch_size`, each with its number of real
    rows: with more rows than one batch holds, the last is padded to `batch_size` by repeating
    its last row (one compiled program for every batch; the padding's results are dropped)."""
    n = len(rows)
    all_rows = [dict(rows[i]) for i in range(n)]
    out = []
    for start in range(0, n, batch_size):
        chunk = all_rows[start : start + batch_size]
        real = len(chunk)
        out.append((chunk + [chunk[-1]] * (batch_size - real) if n > batch_size else chunk, real))
    return out


def _scores(
    play: Callable[..., np.ndarray],
    rows: Sequence,
    *,
    k: int,
    temperature: float,
    batch_size: int,
    key: jax.Array,
    desc: str,
    show_progress: bool,
) -> tuple[dict[str, float], list[int]]:
    """(pass@1, mean@k, pass@j and num_prompts; the batches' real rows): `play(chunk, key,
    g, sampling, greedy=)` scores g completions of each row of a batch (`[len(chunk) * g]`,
    row r's at r*g ... r*g + g - 1), once greedy (g = 1) and once sampled (g = k, at
    `temperature`), batch i with `fold_in(key, i)`."""
    check_int("k", k)
    check_int("batch_size", batch_size)
    if len(rows) == 0:
        raise ValueError(f"{desc}: the evaluation needs at least one held-out row")
    scores: dict[str, list[np.ndarray]] = {"greedy": [], "sample": []}
    batches = _padded_batches(rows, batch_size)
    bar = progress(
        len(batches), desc, keys=(("pass@1", "pass@1", ".3f"),), disable=not show_progress
    )
    for bi, (chunk, real) in enumerate(batches):
        for mode, g in (("greedy", 1), ("sample", k)):
            sampling = SamplingConfig(temperature=0.0 if mode == "greedy" else temperature)
            got = play(chunk, jax.random.fold_in(key, bi), g, sampling, greedy=mode == "greedy")
            scores[mode].append(np.asarray(got).reshape(len(chunk), g)[:real])
        bar.update({"pass@1": float(np.concatenate(scores["greedy"]).mean())})
    bar.close()
    greedy, sampled = np.concatenate(scores["greedy"]), np.concatenate(scores["sample"])
    return {
        "pass@1": float(greedy.mean()),
        f"mean@{k}": float(sampled.mean()),
        **{f"pass@{j}": pass_at_k(sampled >= 1.0, j) for j in pass_at_k_values(k)},
        "num_prompts": float(len(rows)),
    }, [real for _, real in batches]


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
    stop_strings: Sequence[str] = (),
    decode_loops: int = DECODE_LOOPS,
    engine: str = "static",
    slots: int | None = None,
    external=None,
) -> dict[str, float]:
    """pass@1 (greedy), mean@k and pass@j (`pass_at_k_values(k)`) of `model` on the held-out
    `rows`.

    Args:
      model: a decoder (the sampler's contract).
      tokenizer: its tokenizer (prompts encoded as `grpojax.data.encode_prompts` does).
      rows: held-out rows with a `prompt` string; the other columns go to `score_fn`.
      score_fn: `(prompts, completions, columns) -> [M]` scores in [0, 1] (M completions;
        columns: name -> list of M values); a sample is correct for pass@j when its score
        is 1.
      max_new_tokens: completion budget T.
      k: samples per prompt for mean@k and pass@j (k = 1 still reports mean@1 from one
        sample, and no pass@j).
      temperature: sampling temperature of the k samples.
      batch_size: prompts per generate call.
      key: `jax.random` key of the sampled completions (the greedy pass needs none).
      mesh: optional mesh for `generate`.
      desc, show_progress: the progress bar.
      add_special_tokens: passed to the prompt encoding (None: the rows' own setting,
        True when they have none).
      stop_strings: completions are cut after the first one, as in training
        (`grpojax.sampling.stopped_completions`).
      decode_loops, engine, slots: `generate`'s decode arguments (the run's `rollout`
        settings, `RolloutSpec.engine_kwargs`).
      external: an external engine holding `model`'s weights (`VLLMEngine`, synced), which
        then samples instead of `generate`.

    Returns:
      {"pass@1": float, f"mean@{k}": float, **{f"pass@{j}": float}, "num_prompts": float}.
    """
    if add_special_tokens is None:
        add_special_tokens = bool(getattr(rows, "add_special_tokens", True))
    stop_ids, pad_id = stop_ids_of(tokenizer), pad_id_of(tokenizer)
    if external is not None:
        decode = functools.partial(external.generate, vocab_size=model.config.vocab_size)
    else:
        decode = functools.partial(
            generate, model, decode_loops=decode_loops, engine=engine, slots=slots
        )

    def play(chunk, key, g, sampling, greedy: bool) -> np.ndarray:
        prompts = [r["prompt"] for r in chunk]
        tokens, lengths = encode_prompts(
            tokenizer, prompts, add_special_tokens=add_special_tokens, pad_id=pad_id
        )
        columns = {c: [r.get(c) for r in chunk] for c in chunk[0] if c != "prompt"}
        ro = decode(
            tokens,
            lengths,
            key=key,
            max_new_tokens=max_new_tokens,
            group_size=g,
            sampling=sampling,
            eos_ids=stop_ids,
            pad_id=pad_id,
            mesh=mesh,
        )
        # This process scores its own rows; every process then holds every score.
        mine = owned_rows(ro.tokens_nt)
        host = [rows_to_host(x, mine) for x in (ro.tokens_nt, ro.lengths_n, ro.eos_found_n)]
        texts, _, _ = stopped_completions(tokenizer, *host, stop_strings)
        cols = {c: [vals[r // g] for r in mine] for c, vals in columns.items()}
        own = [prompts[r // g] for r in mine]
        scores = np.asarray(score_fn(own, texts, cols) if len(mine) else [], np.float64)
        return gather_rows({"s": scores}, mine, ro.tokens_nt.shape[0])["s"]

    scores, _ = _scores(
        play,
        rows,
        k=k,
        temperature=temperature,
        batch_size=batch_size,
        key=key,
        desc=desc,
        show_progress=show_progress,
    )
    return scores


def evaluate_episodes(
    model,
    sampler: EpisodeSampler,
    rows: Sequence,
    *,
    k: int = 1,
    temperature: float = 1.0,
    batch_size: int = 64,
    key: jax.Array,
    desc: str = "eval",
    show_progress: bool = True,
) -> dict[str, float]:
    """`evaluate`'s scores on multi-turn episodes (module docstring): each held-out row
    plays one greedy episode and k sampled ones (at `temperature`) with `sampler`'s
    environment, in batches of `batch_size` rows (the last padded by repeating rows).

    A game of several seats (self-play) scores 1 where a seat won it (its best seat's
    return, clipped): the rate of games played out to a win by the rules, not a strength
    against an opponent outside the policy.

    Returns:
      {"pass@1", f"mean@{k}", pass@j..., "num_prompts", "tool_use", "turns"}: floats.
    """
    greedy_episodes: list = []  # each batch's, S seats per row

    def play(chunk, key, g, sampling, greedy: bool) -> np.ndarray:
        runner, episodes = sampler.play(model, chunk, key=key, group_size=g, sampling=sampling)
        seats = runner.envs[0].seats  # episodes (b*S + s)*g + j: seat s of row b's game j
        if greedy:
            greedy_episodes.append((episodes, seats))
        returns = np.clip([episode_return(e) for e in episodes], 0.0, 1.0)
        return returns.reshape(len(chunk), seats, g).max(axis=1).reshape(-1)

    scores, reals = _scores(
        play,
        rows,
        k=k,
        temperature=temperature,
        batch_size=batch_size,
        key=key,
        desc=desc,
        show_progress=show_progress,
    )
    played = [
        e
        for (episodes, seats), real in zip(greedy_episodes, reals, strict=True)
        for e in episodes[: real * seats]
    ]
    return {
        **scores,
        "tool_use": float(np.mean([e.counters.get("tool_calls", 0) > 0 for e in played])),
        "turns": float(np.mean([e.num_turns for e in played])),
    }


def heldout_evaluator(
    cfg: RunConfig,
    tokenizer,
    heldout,
    manager: RewardManager | None,
    *,
    mesh,
    show_progress=True,
    engine=None,
):
    """`run_eval(model, tag, version=0) -> scores | None`: held-out pass@1, mean@k and
    pass@j as `cfg.eval` sets them, scored by the run's first reward function (a failed
    score counts as 0), with the run's "eval" key, so every evaluation of a run sees the
    same samples. Returns None when the data has no held-out split. Multi-turn runs
    (`env.name` set) are scored by their environment (`evaluate_episodes`; `manager` is
    not used). `engine`: the run's external engine (`rollout.engine=vllm`), given `model`'s
    weights as `version` (the RL steps they have taken) and sampling in place of the
    built-in engine, the seconds of that push (when there was one) in the scores'
    "weight_sync"; None: the built-in engine (`RolloutSpec.engine_kwargs`)."""
    key = run_key(cfg.seed, "eval")
    if cfg.env.enabled:
        sampler = EpisodeSampler(cfg, tokenizer, None, mesh, engine)

        def run_episodes(model, tag: str, version: int = 0) -> dict | None:
            if heldout is None:
                return None
            synced = None if engine is None else engine.sync(model, version)
            scores = evaluate_episodes(
                model,
                sampler,
                heldout,
                k=cfg.eval.k,
                temperature=cfg.eval.temperature,
                batch_size=cfg.eval.batch_size,
                key=key,
                desc=f"eval {tag}",
                show_progress=show_progress and is_primary(),
            )
            return _with_sync(scores, synced)

        return run_episodes
    if manager is None:
        raise ValueError("heldout_evaluator needs the run's RewardManager (env.name unset)")
    name = manager.names[0]

    def score_fn(prompts, completions, columns):
        res = manager.compute(prompts, completions, **columns)
        return np.nan_to_num(res.per_fn[name], nan=0.0)

    def run_eval(model, tag: str, version: int = 0) -> dict | None:
        if heldout is None:
            return None
        synced = None if engine is None else engine.sync(model, version)
        scores = evaluate(
            model,
            tokenizer,
            heldout,
            score_fn=score_fn,
            max_new_tokens=cfg.rollout.max_new_tokens,
            stop_strings=cfg.rollout.stop_strings,
            **cfg.rollout.engine_kwargs(),
            k=cfg.eval.k,
            temperature=cfg.eval.temperature,
            batch_size=cfg.eval.batch_size,
            key=key,
            mesh=mesh,
            desc=f"eval {tag}",
            show_progress=show_progress and is_primary(),
            external=engine,
        )
        return _with_sync(scores, synced)

    return run_eval


def _with_sync(scores: dict, synced: float | None) -> dict:
    """An evaluation's scores, with "weight_sync": the seconds the external engine took to
    take the evaluated weights, when it was given them (logged as eval/weight_sync)."""
    return scores if synced is None else {**scores, "weight_sync": synced}
