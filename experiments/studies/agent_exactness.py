"""How exact are episodes played through the OpenAI-compatible endpoint, on a real model?

SmolLM2-135M-Instruct (the GGUF of `experiments/tools/fetch_smollm2.py`, float32) plays
`calc_agent.solve` (an agent of the OpenAI client alone: a two-digit sum, an `add` tool
offered) through `grpojax.envs.agent`'s endpoint with the built-in multi-turn sampler, B
questions x G samples at temperature 1. Then, per episode:

- the trainer's logprobs on the episode's row (`policy_logprobs`) against the sampler's,
  over every policy id: max and mean |difference|;
- what a trainer that re-tokenised the transcript would train on: the chat template applied
  to the agent's last request plus the last reply as text (`tools_prompt`, as the prompt was
  rendered), its ids against the recorded ones (the prompt, then the sampled ids and the
  answers): episodes whose ids differ, and the policy ids that are not where the sampler
  put them (the recorded ids from the first difference on, counted over policy ids).

Usage: `python experiments/studies/agent_exactness.py [--questions 16] [--group 4]`. The
last line is `agent_exactness: episodes=.. turns=.. logprob_diff_max=.. logprob_diff_mean=..
retokenised_differ=.. policy_ids_moved=..`.
"""

from __future__ import annotations

import argparse
import pathlib
import sys

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tools"))  # fetch_smollm2

import numpy as np  # noqa: E402
from fetch_smollm2 import DEFAULT_DIR, fetch  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--questions", type=int, default=16)
    parser.add_argument("--group", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    import jax
    import jax.numpy as jnp
    from calc_agent import TOOLS, solve

    from grpojax.data import stop_ids_of
    from grpojax.envs import (
        EpisodeRunner,
        agent_environment,
        episode_batch,
        make_environments,
        rollout_episodes,
    )
    from grpojax.envs.tools import tools_prompt
    from grpojax.models import from_pretrained, load_tokenizer
    from grpojax.sampling import SamplingConfig
    from grpojax.train.common import policy_logprobs

    gguf = fetch(DEFAULT_DIR)
    model, tok = from_pretrained(gguf, dtype="float32"), load_tokenizer(gguf)
    rng = np.random.default_rng(args.seed)
    rows = []
    for a, b in rng.integers(10, 100, (args.questions, 2)):
        rows.append({"prompt": f"What is {a} + {b}? Reply with only the number.", "answer": a + b})
    envs = make_environments(agent_environment(solve), rows, group_size=args.group, max_turns=3)
    runner = EpisodeRunner(envs, tok, max_episode_tokens=160)
    episodes = rollout_episodes(
        model,
        runner,
        key=jax.random.key(args.seed),
        max_turn_tokens=48,
        sampling=SamplingConfig(temperature=1.0),
        stop_ids=stop_ids_of(tok),
        pad_id=tok.pad_token_id or 0,
    )
    batch = episode_batch(episodes, pad_id=tok.pad_token_id or 0)
    tokens, mask, policy = (jnp.asarray(x) for x in batch[:3])
    logp, _ = policy_logprobs(model, tokens, mask, policy)
    diff = np.abs(np.where(policy, np.asarray(logp), 0.0) - batch.sampler_logp_nt)[policy]

    differ = moved = 0
    for env, ep in zip(envs, episodes):
        recorded = list(ep.tokens())
        last = [s for s in ep.segments if s.kind == "policy"][-1]
        reply = tok.decode(last.ids, skip_special_tokens=True)
        messages = [*env.transcript[-1], {"role": "assistant", "content": reply}]
        text = tools_prompt(tok, TOOLS, messages, chat=True)
        again = tok(text, add_special_tokens=False)["input_ids"][: len(recorded)]
        if again != recorded:
            differ += 1
            first = next(
                (i for i, (x, y) in enumerate(zip(again, recorded)) if x != y),
                min(len(again), len(recorded)),
            )
            kinds = [k for s in ep.segments for k in [s.kind] * len(s.ids)]
            moved += sum(k == "policy" for k in kinds[max(0, first - len(ep.prompt_ids)) :])
    turns = sum(e.num_turns for e in episodes)
    print(f"SmolLM2-135M-Instruct (float32), {len(episodes)} episodes through the endpoint")
    later = runner.metrics().get("agent_requests", 0)
    print(f"  turns: {turns} ({later} requests after an episode's first: tool results)")
    print(f"  reward mean: {np.mean([e.final_reward for e in episodes]):.3f}")
    print(f"  trainer vs sampler logprobs over {diff.size} policy ids: max {diff.max():.2e}, "
          f"mean {diff.mean():.2e}")  # fmt: skip
    print(f"  re-tokenised transcript differs from the recorded ids: {differ} of {len(episodes)} "
          f"episodes, {moved} policy ids from the first difference on")  # fmt: skip
    print(
        f"agent_exactness: episodes={len(episodes)} turns={turns} "
        f"logprob_diff_max={diff.max():.2e} logprob_diff_mean={diff.mean():.2e} "
        f"retokenised_differ={differ} policy_ids_moved={moved}"
    )


if __name__ == "__main__":
    main()
