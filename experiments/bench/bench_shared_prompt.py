"""Benchmark: the trainer's passes with each group's prompt run once (`share_prompt`) vs a
full forward over every row, on the same model, batch and machine.

GRPO samples G completions per prompt, so a batch of N = B*G rows repeats each prompt G
times. `GRPOConfig(share_prompt=True)` (on in the driver) runs the B prompts once into a KV
cache and the N completions against it (`grpojax.models.shared_prefix_forward`): B*P + N*T
token positions instead of N*(P+T). Timed here, per prompt width P:

- `ref_logprobs`: the jitted no-gradient logprob pass (the reference / old-policy pass);
- `grpo_update`: one jitted GRPO step (forward, backward, AdamW), state not donated;
- `ppo_update`: one jitted PPO step (`PPOConfig(share_prompt=...)`, on in the driver too):
  its old pass and update, actor and a separate critic (a copy of the model), 1 epoch, the
  k1 KL against the batch's reference logprobs; state not donated.

Each cell is the median of `--repeats` calls after compilation; both variants alternate in
one process, so machine load affects them alike. `positions` is the token-position ratio
(B*P + N*T) / (N*(P+T)), the FLOP ratio of the matmuls. The model is the tiny Qwen2 of the
TRL workload (vocab 512, D 256, 4 layers), built in memory. Last line:

    bench_shared_prompt: update_speedup@P=<p>=<x> ... logprob_speedup@P=<p>=<x> ...
        ppo_update_speedup@P=<p>=<x> ...

Usage: `python experiments/bench/bench_shared_prompt.py [--prompt-widths 32 128 256] [--repeats 5]`.
"""

from __future__ import annotations

import argparse
import statistics
import time

from benchlib import grpo_batch, machine, tiny_qwen2_model


def _median_s(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompt-widths", type=int, nargs="+", default=[32, 128, 256])
    p.add_argument("--completion-width", type=int, default=32)
    p.add_argument("--prompts", type=int, default=4, help="B prompts per batch")
    p.add_argument("--group-size", type=int, default=8, help="G completions per prompt")
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()

    import dataclasses

    import jax
    from flax import nnx

    from grpojax.models import make_mesh
    from grpojax.train import (
        GRPOConfig,
        OptimizerConfig,
        create_train_state,
        make_optimizer,
        policy_logprobs,
    )
    from grpojax.train.grpo import make_grpo_step
    from grpojax.train.ppo import (
        PPOBatch,
        PPOConfig,
        create_ppo_state,
        init_critic,
        make_ppo_step,
        shard_ppo_state,
    )
    from grpojax.train.state import shard_train_state

    b, g, t = args.prompts, args.group_size, args.completion_width
    mesh = make_mesh()
    model = tiny_qwen2_model()
    tx = make_optimizer(OptimizerConfig(learning_rate=1e-6, max_grad_norm=1.0))
    graphdef, state = create_train_state(model, tx, rng=jax.random.key(0))
    state, shardings = shard_train_state(state, tx, mesh)
    base = GRPOConfig(group_size=g, beta=0.04, aggregation="token-mean")
    ppo_base = PPOConfig(critic="separate", group_size=g, num_epochs=1, kl_coef=0.05)
    critic = init_critic(tiny_qwen2_model(), mode="separate", rngs=nnx.Rngs(1))
    graphs, ppo_state = create_ppo_state(
        tiny_qwen2_model(), critic, tx, tx, config=ppo_base, rng=jax.random.key(1)
    )
    ppo_state, _ = shard_ppo_state(ppo_state, tx, tx, mesh)

    print(f"machine: {machine()}")
    print(f"B={b} prompts x G={g} completions, completion width T={t}, model D=256 L=4 V=512")
    header = (
        f"{'P':>5} {'positions':>9} | {'logp full s':>11} {'logp shared s':>13} {'speedup':>7}"
        f" | {'update full s':>13} {'update shared s':>15} {'speedup':>7}"
        f" | {'ppo full s':>10} {'ppo shared s':>12} {'speedup':>7}"
    )
    print(header)
    print("-" * len(header))
    summary = []
    for width in args.prompt_widths:
        batch = grpo_batch(b, g, width, t)
        ppo_batch = PPOBatch(
            batch.tokens_ns,
            batch.mask_ns,
            batch.completion_mask_nt,
            batch.advantages,
            batch.ref_logp_nt,
        )  # the advantages as the scores
        fns = {}
        for share in (False, True):
            cfg = dataclasses.replace(base, share_prompt=share)
            step = make_grpo_step(
                graphdef, tx, cfg, mesh=mesh, state_shardings=shardings, batch=batch, donate=False
            )
            group = g if share else 1

            @jax.jit
            def logp(params, batch, group=group):
                return policy_logprobs(
                    nnx.merge(graphdef, params),
                    batch.tokens_ns,
                    batch.mask_ns,
                    batch.completion_mask_nt,
                    group_size=group,
                )[0]

            fns[("logp", share)] = lambda f=logp, b=batch: jax.block_until_ready(f(state.params, b))
            fns[("update", share)] = lambda s=step, b=batch: jax.block_until_ready(s(state, b)[1])
            ppo_step = make_ppo_step(
                dataclasses.replace(ppo_base, share_prompt=share),
                graphs,
                tx,
                tx,
                mesh=mesh,
                state=ppo_state,
                batch=ppo_batch,
                donate=False,
            )
            fns[("ppo", share)] = lambda s=ppo_step, b=ppo_batch: jax.block_until_ready(
                s(ppo_state, b)[1]
            )
        for fn in fns.values():  # compile
            fn()
        times = {k: [] for k in fns}
        for _ in range(args.repeats):  # alternate, so load hits both alike
            for k, fn in fns.items():
                times[k].append(_median_s(fn, 1))
        med = {k: statistics.median(v) for k, v in times.items()}
        ratio = (b * width + b * g * t) / (b * g * (width + t))
        lsp = med[("logp", False)] / med[("logp", True)]
        usp = med[("update", False)] / med[("update", True)]
        psp = med[("ppo", False)] / med[("ppo", True)]
        print(
            f"{width:>5} {ratio:>9.3f} | {med[('logp', False)]:>11.4f} "
            f"{med[('logp', True)]:>13.4f} {lsp:>7.2f} | {med[('update', False)]:>13.4f} "
            f"{med[('update', True)]:>15.4f} {usp:>7.2f} | {med[('ppo', False)]:>10.4f} "
            f"{med[('ppo', True)]:>12.4f} {psp:>7.2f}"
        )
        summary.append((width, usp, lsp, psp))
    print(
        "bench_shared_prompt: "
        + " ".join(f"update_speedup@P={w}={u:.2f}" for w, u, _, _ in summary)
        + " "
        + " ".join(f"logprob_speedup@P={w}={lp:.2f}" for w, _, lp, _ in summary)
        + " "
        + " ".join(f"ppo_update_speedup@P={w}={x:.2f}" for w, _, _, x in summary)
    )


if __name__ == "__main__":
    main()
