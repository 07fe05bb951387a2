"""On-policy distillation's gradient: the exact full-vocabulary reverse KL against the
sampled-token estimators the peers use.

The student samples completions; at each completion position t (context fixed: the student's
own sample, teacher-forced) the objective is KL(p_t || q_t), p the student's next-token
distribution and q the teacher's. Three gradient estimates of grad sum_t KL(p_t || q_t)
(token mean over the batch's completion ids):

- exact: `gj.divergence_from_hidden(..., divergence="reverse_kl")`, the sum over the whole
  vocabulary (no sampling at the positions: zero variance given the contexts);
- k1 (score function, the per-token reverse-KL "advantage" of on-policy distillation
  recipes): one id x_t ~ p_t per position, loss sg(log p(x_t) - log q(x_t)) log p(x_t); its
  expectation is the exact gradient;
- k3 (pathwise, GRPO's KL penalty as a loss): q(x_t)/p(x_t) - 1 - log(q(x_t)/p(x_t)) at the
  same draw; its expectation is the gradient of the *forward* KL, -sum_v q_v grad log p_v,
  not of the reverse one.

For `--draws` M independent draws at every position (the same contexts and parameters), with
G the exact gradient (all parameters flattened): relative bias |mean g - G| / |G|, relative
variance E|g - mean g|^2 / |G|^2, relative MSE E|g - G|^2 / |G|^2 and the mean cosine
similarity of g and G, per estimator; and the draws a k1 average needs for the exact one's
error (0) to within 10% relative RMS error: variance / 0.01.

Student: the built-in tiny model (random init, seed 0); teacher: the same architecture, seed 1,
its LM head scaled by `--teacher-scale` (a sharper distribution than the student's, as a
trained teacher's is). Float32 on this machine's CPU.

Last line: `distill_grad_variance: rel_mse_k1=.. rel_mse_k3=.. rel_bias_k3=.. cos_k1=..
cos_k3=.. draws_for_10pct_k1=..`.

    python experiments/studies/distill_grad_variance.py [--rows 16] [--tokens 32] [--draws 64]
"""

from __future__ import annotations

import argparse
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "bench"))  # benchlib

from benchlib import exact_float32_matmuls, machine


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--draws", type=int, default=64)
    parser.add_argument("--teacher-scale", type=float, default=3.0)
    args = parser.parse_args()

    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from grpojax.models import Decoder, tiny_config
    from grpojax.ops import divergence_from_hidden
    from grpojax.sampling import SamplingConfig, generate

    precision = exact_float32_matmuls()
    config = tiny_config(num_layers=2)
    student = Decoder(config, rngs=nnx.Rngs(0))
    teacher = Decoder(config, rngs=nnx.Rngs(1))
    # Sharpen the teacher: scale its (untied, `[D, V]`) LM head.
    teacher.lm_head[...] = teacher.lm_head[...] * args.teacher_scale

    rng = np.random.default_rng(0)
    p = 8
    prompts = rng.integers(3, config.vocab_size, (args.rows, p)).astype(np.int32)
    out = generate(
        student, prompts, np.full(args.rows, p, np.int32), key=jax.random.key(0),
        max_new_tokens=args.tokens, sampling=SamplingConfig(temperature=1.0),
    )  # fmt: skip
    tokens = jnp.concatenate([jnp.asarray(out.prompt_tokens_bp), out.tokens_nt], axis=1)
    mask = jnp.concatenate([jnp.ones((args.rows, p), bool), out.mask_nt], axis=1)
    positions = jnp.maximum(jnp.cumsum(mask, axis=1) - 1, 0)
    comp = out.mask_nt  # the loss positions: the student's next-token distributions there
    count = jnp.maximum(comp.sum(), 1)

    def hidden_of(model):
        h, _ = model(tokens, positions_nt=positions, mask_nt=mask)
        return h[:, p - 1 : -1]  # position t predicts completion id t

    t_hidden, t_head = hidden_of(teacher), teacher.lm_head_dv()
    logq = jax.nn.log_softmax(t_hidden @ t_head, axis=-1)
    graphdef, params = nnx.split(student)

    def flat(tree):
        return jnp.concatenate([jnp.ravel(x) for x in jax.tree.leaves(tree)])

    def exact_loss(params, divergence="reverse_kl"):
        model = nnx.merge(graphdef, params)
        kl = divergence_from_hidden(
            hidden_of(model), model.lm_head_dv(), t_hidden, t_head, comp,
            divergence=divergence, chunk_size=64, vocab_chunk_size=32,
        )  # fmt: skip
        return jnp.sum(kl) / count

    def sampled_losses(params, key):
        model = nnx.merge(graphdef, params)
        logp = jax.nn.log_softmax(model.logits(hidden_of(model)), axis=-1)
        x = jax.random.categorical(key, jax.lax.stop_gradient(logp))
        lp = jnp.take_along_axis(logp, x[..., None], -1)[..., 0]
        lq = jnp.take_along_axis(logq, x[..., None], -1)[..., 0]
        k1 = jax.lax.stop_gradient(lp - lq) * lp
        k3 = jnp.exp(lq - lp) - 1.0 - (lq - lp)
        return jnp.sum(jnp.where(comp, k1, 0.0)) / count, jnp.sum(jnp.where(comp, k3, 0.0)) / count

    exact_value, g_exact = jax.value_and_grad(exact_loss)(params)
    g_exact = flat(g_exact)
    # k3's expected gradient, exactly: the forward KL's.
    g_forward = np.asarray(
        flat(jax.grad(lambda q: exact_loss(q, "forward_kl"))(params)), np.float64
    )

    @jax.jit
    def sampled_grads(key):
        g1 = jax.grad(lambda q: sampled_losses(q, key)[0])(params)
        g3 = jax.grad(lambda q: sampled_losses(q, key)[1])(params)
        return flat(g1), flat(g3)

    draws = {"k1": [], "k3": []}
    for key in jax.random.split(jax.random.key(1), args.draws):
        g1, g3 = sampled_grads(key)
        draws["k1"].append(np.asarray(g1, np.float64))
        draws["k3"].append(np.asarray(g3, np.float64))
    g = np.asarray(g_exact, np.float64)
    norm2 = float(g @ g)

    print(f"machine: {machine()}")
    print(
        f"jax {jax.__version__} ({jax.default_backend()}); student and teacher: tiny, "
        f"D={config.hidden_size} L={config.num_layers} V={config.vocab_size}, float32; "
        f"{precision}"
    )
    print(
        f"workload: {args.rows} student samples x {args.tokens} ids ({int(comp.sum())} loss "
        f"positions), teacher head x{args.teacher_scale}; mean reverse KL "
        f"{float(exact_value):.3f} nats; {args.draws} draws per estimator; "
        f"{g.size:,} parameters"
    )
    print(
        f"{'estimator':>9} {'true bias':>9} {'rel bias':>9} {'rel var':>9} {'rel MSE':>9} "
        f"{'cosine':>7}"
    )
    print(f"{'exact':>9} {0.0:>9.3f} {0.0:>9.3f} {0.0:>9.3f} {0.0:>9.3f} {1.0:>7.3f}")
    true_bias = {"k1": 0.0, "k3": float(np.linalg.norm(g_forward - g) / np.sqrt(norm2))}
    stats = {}
    for name, gs in draws.items():
        a = np.stack(gs)
        mean = a.mean(0)
        bias = float(np.linalg.norm(mean - g) / np.sqrt(norm2))
        var = float(((a - mean) ** 2).sum(1).mean() / norm2)
        mse = float(((a - g) ** 2).sum(1).mean() / norm2)
        cos = float(np.mean(a @ g / (np.linalg.norm(a, axis=1) * np.sqrt(norm2))))
        stats[name] = (true_bias[name], var, mse, cos)
        print(f"{name:>9} {true_bias[name]:>9.3f} {bias:>9.3f} {var:>9.3f} {mse:>9.3f} {cos:>7.3f}")
    need = stats["k1"][1] / 0.01
    print(
        "true bias: |E g - G| / |G| exactly (k1: 0, an unbiased estimator; k3: its expectation "
        "is the forward KL's gradient, computed exactly); rel bias: the same from the draws' "
        f"mean (sampling noise about sqrt(rel var / {args.draws}) included)"
    )
    print(
        f"k1 needs about {need:.0f} draws per position (averaged) for a 10% relative RMS "
        "error; k3's bias does not average out"
    )
    print(
        f"distill_grad_variance: rel_mse_k1={stats['k1'][2]:.3f} rel_mse_k3={stats['k3'][2]:.3f} "
        f"rel_bias_k3={stats['k3'][0]:.3f} cos_k1={stats['k1'][3]:.3f} "
        f"cos_k3={stats['k3'][3]:.3f} draws_for_10pct_k1={need:.0f}"
    )


if __name__ == "__main__":
    main()
