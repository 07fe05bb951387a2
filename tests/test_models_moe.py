"""Mixture of experts (Qwen3-MoE): the grouped-matmul MLP against a per-token NumPy loop,
routing replay, cached decode, expert sharding, LoRA's refusal, and a reduced `grpojax train`.

(Parity with transformers' Qwen3MoeForCausalLM and the HF round trip are cases of
`tests/test_models_hf.py`.)
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from model_fixtures import cached_decode_logits, model_config
from multidevice import run_with_devices

import grpojax.models as gm
from grpojax.models import moe

ATOL = 1e-5  # float32 against the float64 loop: sums of O(1) terms over D, F_e <= 32


def moe_config(**overrides) -> gm.ModelConfig:
    base = dict(
        model_type="qwen3_moe", num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16
    )
    return model_config(**{**base, **overrides})


def _numpy_moe(x, w_router, w_gate, w_up, w_down, k, norm, selected=None):
    """y for each token: the top-k experts (or `selected`) one token at a time, float64."""
    x, w_router, w_gate, w_up, w_down = (
        np.asarray(a, np.float64) for a in (x, w_router, w_gate, w_up, w_down)
    )
    logits = x @ w_router
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    y = np.zeros_like(x)
    ids = np.zeros((x.shape[0], k), np.int64)
    for m in range(x.shape[0]):
        chosen = np.argsort(-probs[m], kind="stable")[:k] if selected is None else selected[m]
        w = probs[m, chosen]
        if norm:
            w = w / w.sum()
        for weight, e in zip(w, chosen):
            g, u = x[m] @ w_gate[e], x[m] @ w_up[e]
            y[m] += weight * ((g / (1 + np.exp(-g)) * u) @ w_down[e])
        ids[m] = chosen
    return y, ids


def _weights(seed, d=12, e=6, f=10):
    ks = jax.random.split(jax.random.key(seed), 5)
    x = jax.random.normal(ks[0], (3, 5, d))
    w_router = jax.random.normal(ks[1], (d, e))
    experts = [
        0.3 * jax.random.normal(k_, s) for k_, s in zip(ks[2:], [(e, d, f)] * 2 + [(e, f, d)])
    ]
    return x, w_router, *experts


@pytest.mark.parametrize("k,norm", [(1, False), (2, True), (3, False)])
def test_grouped_matmul_mlp_equals_a_per_token_loop(k, norm):
    x, w_router, w_gate, w_up, w_down = _weights(k)
    y, ids, _ = moe.moe_mlp(x, w_router, w_gate, w_up, w_down, k=k, norm_topk_prob=norm)
    ref, ref_ids = _numpy_moe(x.reshape(-1, 12), w_router, w_gate, w_up, w_down, k, norm)
    np.testing.assert_array_equal(np.asarray(ids).reshape(-1, k), ref_ids)
    np.testing.assert_allclose(np.asarray(y).reshape(-1, 12), ref, atol=ATOL, rtol=0)
    # The ragged groups differ in size; at k 1 one expert gets no token (an empty group).
    counts = np.bincount(ref_ids.ravel(), minlength=6)
    assert len(set(counts)) > 1 and (k > 1 or 0 in counts)


def test_routing_replay_uses_the_given_experts_and_trains_the_router():
    x, w_router, w_gate, w_up, w_down = _weights(7)
    rng = np.random.default_rng(0)
    given = np.stack([rng.choice(6, 2, replace=False) for _ in range(15)]).reshape(3, 5, 2)
    y, ids, _ = moe.moe_mlp(
        x, w_router, w_gate, w_up, w_down, k=2, norm_topk_prob=True, selected_ntk=jnp.asarray(given)
    )
    np.testing.assert_array_equal(np.asarray(ids), given)
    ref, _ = _numpy_moe(
        x.reshape(-1, 12), w_router, w_gate, w_up, w_down, 2, True, given.reshape(-1, 2)
    )
    np.testing.assert_allclose(np.asarray(y).reshape(-1, 12), ref, atol=ATOL, rtol=0)
    free, _, _ = moe.moe_mlp(x, w_router, w_gate, w_up, w_down, k=2, norm_topk_prob=True)
    assert float(jnp.max(jnp.abs(free - y))) > 1e-2  # the replayed routing differs

    def loss(w_r):
        out, _, _ = moe.moe_mlp(
            x, w_r, w_gate, w_up, w_down, k=2, norm_topk_prob=True, selected_ntk=jnp.asarray(given)
        )
        return jnp.sum(out**2)

    assert float(jnp.max(jnp.abs(jax.grad(loss)(w_router)))) > 0  # the weights stay the router's


def test_cached_decode_equals_full_forward():
    model = gm.Decoder(moe_config(), rngs=nnx.Rngs(3))
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(3, 64, (3, 9)))
    mask = jnp.asarray(np.arange(9)[None] >= np.array([0, 3, 5])[:, None])
    full = gm.forward_logits(model, tokens, mask)
    cached, _ = cached_decode_logits(model, tokens, mask, prompt=5, cache_len=12)
    m = np.asarray(mask)
    np.testing.assert_allclose(np.asarray(cached)[m], np.asarray(full)[m], atol=1e-5, rtol=0)
    # and with the fused layer parameters the sampler decodes with (no dense gate|up to fuse)
    fused = model.layer_params(fuse=True)
    assert "wqkv" in fused and "w_gate_up" not in fused and "we_gate" in fused
    again, _ = cached_decode_logits(model, tokens, mask, prompt=5, cache_len=12, layer_params=fused)
    np.testing.assert_allclose(np.asarray(again)[m], np.asarray(full)[m], atol=1e-5, rtol=0)


def test_lora_refuses_expert_targets_and_adapts_attention():
    model = gm.Decoder(moe_config(), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"^lora.targets gate, up, down: this model has no dense"):
        gm.add_lora(model, gm.LoRAConfig(rank=2, alpha=4.0), rngs=nnx.Rngs(1))
    gm.add_lora(model, gm.LoRAConfig(rank=2, alpha=4.0, targets=("q", "v")), rngs=nnx.Rngs(1))
    assert {"lora.q_a", "lora.v_b"} <= set(model.named_params())


def test_experts_sharded_over_eight_devices_equal_one_device():
    """8 experts over fsdp 8 (one whole expert per device): logits and the gradient of every
    parameter equal the one-device forward's."""
    run_with_devices(
        """
        import jax, jax.numpy as jnp, numpy as np
        from flax import nnx
        import grpojax.models as gm
        from grpojax.models.sharding import make_mesh, param_shardings, shard_model
        from test_models_moe import moe_config

        model = gm.Decoder(moe_config(), rngs=nnx.Rngs(0))
        tokens = jax.random.randint(jax.random.key(1), (8, 6), 3, 64)

        def loss(m):
            return jnp.mean(gm.forward_logits(m, tokens) ** 2)

        ref_logits = gm.forward_logits(model, tokens)
        ref_grads = nnx.grad(loss)(model)
        mesh = make_mesh(fsdp=8)
        spec = param_shardings(model, mesh)["layers.we_gate"].spec
        assert spec[1] == "fsdp", spec  # the expert axis is the sharded one
        sharded = shard_model(gm.Decoder(moe_config(), rngs=nnx.Rngs(0)), mesh)
        with jax.set_mesh(mesh):
            logits = nnx.jit(gm.forward_logits)(sharded, tokens)
            grads = nnx.jit(nnx.grad(loss))(sharded)
        assert len(sharded.layers.we_gate[...].addressable_shards) == 8
        assert sharded.layers.we_gate[...].addressable_shards[0].data.shape[1] == 1
        np.testing.assert_allclose(logits, ref_logits, atol=1e-5, rtol=0)
        for (path, g), (_, r) in zip(nnx.to_flat_state(grads), nnx.to_flat_state(ref_grads)):
            np.testing.assert_allclose(g[...], r[...], atol=1e-6, rtol=1e-5, err_msg=str(path))
        print("ok")
        """,
        n_devices=8,
    )


@pytest.fixture(scope="module")
def moe_model_dir(tmp_path_factory):
    """A 1-layer Qwen3-MoE (4 experts, top 2) with the built-in tokenizer, as a local HF dir."""
    path = tmp_path_factory.mktemp("moe_model")
    cfg = gm.tiny_config(
        model_type="qwen3_moe",
        hidden_size=32,
        intermediate_size=64,
        num_layers=1,
        num_heads=2,
        num_kv_heads=1,
        head_dim=16,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        norm_topk_prob=True,
    )
    gm.save_pretrained(gm.Decoder(cfg, rngs=nnx.Rngs(0)), path, tokenizer=gm.builtin_tokenizer())
    return path


def _trainer_logp(model, rollout, routing=None):
    """Logprob `[N, T]` of each completion token under the full forward of prompt +
    completion (the trainer's pass), with the given routing replayed or recomputed."""
    tokens, mask, positions = rollout.sequences()
    hidden, _ = model(tokens, positions_nt=positions, mask_nt=mask, routing_ntlk=routing)
    logp = jax.nn.log_softmax(model.logits(hidden), axis=-1)
    p = rollout.prompt_tokens_bp.shape[1]
    logp = logp[:, p - 1 : -1]  # column p + t - 1 predicts completion token t
    return np.asarray(jnp.take_along_axis(logp, rollout.tokens_nt[..., None], -1)[..., 0])


def test_sampler_routing_replayed_in_the_trainer_near_a_router_tie():
    """A router tie (experts 0 and 1 share a router column, scaled to lead) that the trainer
    breaks the other way: its router is the sampler's plus 1e-4 on expert 1's column, as a
    stand-in for another engine's rounding. Recomputed routing then sends tokens to expert 1
    and the logprobs disagree; the sampler's recorded routing replayed restores them."""
    from grpojax.sampling import generate

    cfg = moe_config(num_experts=4, num_experts_per_tok=1, norm_topk_prob=True)
    sampler_model = gm.Decoder(cfg, rngs=nnx.Rngs(5))
    w = np.array(sampler_model.layers.w_router[...])
    w[:, :, 0] = w[:, :, 1] = 4.0 * w[:, :, 0]
    sampler_model.layers.w_router.set_value(jnp.asarray(w))
    # Experts of O(1) effect (init's 0.02 would make the choice of expert matter little).
    sampler_model.layers.we_down.set_value(10.0 * sampler_model.layers.we_down[...])
    rng = np.random.default_rng(0)
    prompts = jnp.asarray(rng.integers(3, 64, (2, 5)))
    r = generate(
        sampler_model,
        prompts,
        np.array([5, 3]),
        key=jax.random.key(0),
        max_new_tokens=6,
        group_size=2,
        record_routing=True,
    )
    tokens, seq_mask, positions = r.sequences()
    n, p = r.tokens_nt.shape[0], r.prompt_tokens_bp.shape[1]
    assert r.routing_nslk.shape == (n, p + 6, cfg.num_layers, 1)
    m = np.asarray(r.mask_nt)

    # The sampler recorded the routing the full forward computes (every token it fed), and
    # with the same weights recomputed and replayed routing give the sampler's logprobs.
    _, _, recomputed = sampler_model(
        tokens, positions_nt=positions, mask_nt=seq_mask, return_routing=True
    )
    recomputed = recomputed.experts_ntlk
    fed = np.array(seq_mask)
    fed[np.arange(n), p + np.asarray(r.lengths_n) - 1] = False  # the last token is never fed
    np.testing.assert_array_equal(np.asarray(recomputed)[fed], np.asarray(r.routing_nslk)[fed])
    for routing in (None, r.routing_nslk):
        got = _trainer_logp(sampler_model, r, routing)
        np.testing.assert_allclose(got[m], np.asarray(r.logp_nt)[m], atol=1e-5, rtol=0)

    trainer_model = nnx.clone(sampler_model)
    w2 = w.copy()
    w2[:, :, 1] += 1e-4 * rng.standard_normal(w2.shape[:2])
    trainer_model.layers.w_router.set_value(jnp.asarray(w2))
    recomputed = np.abs(_trainer_logp(trainer_model, r) - np.asarray(r.logp_nt))[m]
    replayed = np.abs(_trainer_logp(trainer_model, r, r.routing_nslk) - np.asarray(r.logp_nt))[m]
    print(
        f"max |trainer - sampler| logprob: recomputed {recomputed.max():.3g}, "
        f"replayed {replayed.max():.3g}"
    )
    assert recomputed.max() > 5e-2  # the tie broke the other way somewhere (0.15 measured)
    assert replayed.max() <= 1e-5  # k 1, renormalised: the weight is 1 whatever the router


def _run(model_dir, run_dir, **extra):
    from test_driver_loop import _overrides

    from grpojax.config import load_config
    from grpojax.driver.loop import train

    cfg = load_config(None, _overrides(model_dir, run_dir, total_steps=2, **extra))
    train(cfg, show_progress=False, print_fn=lambda s: None)
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "reward_mean" in r]


def test_grpojax_train_on_a_moe_model_with_and_without_routing_replay(
    moe_model_dir, tmp_path, monkeypatch
):
    """A reduced `grpojax train` on a tiny Qwen3-MoE (2 GRPO steps, a reference, two updates
    a step, the load-balancing loss on), routing anew and with `model.routing_replay=rollout`.
    Replay: the trainer's passes get the sampler's routing (a spy on the MoE layer sees
    replayed experts, traced in the logprob pass and the update) and its logprobs agree with
    the sampler's to float32 rounding. The two runs share their first rollout; from there the
    update's forwards route near-tied tokens differently (they part by rounding-sized
    amounts), so they are compared on the first step only."""
    calls = {"replayed": 0, "routed": 0}
    real = moe.moe_mlp

    def spy(*args, selected_ntk=None, **kwargs):
        calls["replayed" if selected_ntk is not None else "routed"] += 1
        return real(*args, selected_ntk=selected_ntk, **kwargs)

    monkeypatch.setattr(moe, "moe_mlp", spy)
    common = {"grpo.beta": 0.04, "grpo.num_minibatches": 2, "grpo.router_aux_coef": 0.01}
    off = _run(moe_model_dir, tmp_path / "off", **common)
    assert [r["step"] for r in off] == [1, 2] and calls["replayed"] == 0
    # The sampler's decode and the trainer's forward agree as on dense models here.
    assert max(r["logprob_diff_max"] for r in off) < 1e-4
    assert all(np.isfinite(r["grad_norm"]) and r["grad_norm"] > 0 for r in off)
    assert all(np.isfinite(r["router_aux_loss"]) and r["router_aux_loss"] > 0 for r in off)
    on = _run(moe_model_dir, tmp_path / "on", **common, **{"model.routing_replay": "rollout"})
    assert calls["replayed"] >= 2  # traced: the logprob pass and the update
    assert calls["routed"] > 0  # the reference, the sampler and evaluation route anew
    first = ("reward_mean", "completion_len_mean", "entropy")
    assert [off[0][k] for k in first] == [on[0][k] for k in first]
    assert max(r["logprob_diff_max"] for r in on) < 1e-5
    assert on[0]["logprob_diff_mean"] <= off[0]["logprob_diff_mean"]


def test_routing_replay_refusals(small_model_dir, tmp_path):
    from test_driver_loop import _overrides

    from grpojax.config import load_config
    from grpojax.driver.setup import build_model
    from grpojax.errors import UserError

    replay = {"model.routing_replay": "rollout"}
    with pytest.raises(
        ValueError,
        match=r"^model.routing_replay='rollout' is not supported with packing.mode='always', "
        r"rollout.max_staleness=1: ",
    ):
        load_config(
            None,
            _overrides(
                small_model_dir,
                tmp_path,
                **replay,
                **{"packing.mode": "always", "rollout.max_staleness": 1},
            ),
        )
    cfg = load_config(None, _overrides(small_model_dir, tmp_path, **replay))
    with pytest.raises(UserError, match=r"^model.routing_replay='rollout' replays .* is a dense"):
        build_model(cfg)


def test_load_balancing_loss_equals_transformers(tmp_path):
    """L_aux of a left-padded batch (real tokens only) == transformers' `aux_loss` of
    Qwen3MoeForCausalLM (`output_router_logits=True`), float32; and its floor, k, when every
    expert gets the same share of the assignments and of the probability."""
    import torch
    from test_models_hf import _batch, _hf_model

    hf = _hf_model(
        kind="qwen3_moe",
        num_experts=6,
        num_experts_per_tok=2,
        moe_intermediate_size=24,
        norm_topk_prob=True,
        seed=4,
    )
    hf.save_pretrained(tmp_path, safe_serialization=True)
    tokens, mask = _batch(seed=2)
    positions = np.maximum(np.cumsum(mask, axis=1) - 1, 0)
    with torch.no_grad():
        out = hf(
            input_ids=torch.tensor(tokens),
            attention_mask=torch.tensor(mask.astype(np.int64)),
            position_ids=torch.tensor(positions),
            output_router_logits=True,
        )
    model = gm.from_pretrained(tmp_path)
    _, _, routing = model(jnp.asarray(tokens), mask_nt=jnp.asarray(mask), return_routing=True)
    got = float(moe.load_balancing_loss(routing.load))
    assert routing.load.tokens == 2 * mask.sum()  # token-layers: 2 layers of real tokens
    np.testing.assert_allclose(got, float(out.aux_loss), rtol=1e-5, atol=0)
    assert got > 2.0  # above the uniform floor k (random routers are not balanced)
    uniform = moe.ExpertLoad(jnp.full((6,), 2.0), jnp.full((6,), 1.0), jnp.asarray(6.0))
    np.testing.assert_allclose(float(moe.load_balancing_loss(uniform)), 2.0, rtol=1e-6)


def test_router_aux_coef_adds_the_load_balancing_loss_to_the_grpo_loss():
    """`GRPOConfig.router_aux_coef` c: the loss grows by exactly c * L_aux of the policy's
    forward over the batch's real tokens, and its gradient reaches the router."""
    from train_helpers import random_grpo_batch

    from grpojax.train import GRPOConfig, grpo_loss

    model = gm.Decoder(moe_config(), rngs=nnx.Rngs(0))
    batch = random_grpo_batch(0, n=4, vocab=64)
    base = dict(group_size=2, beta=0.0, share_prompt=False)
    loss0, m0 = grpo_loss(model, batch, GRPOConfig(**base))
    loss1, m1 = grpo_loss(model, batch, GRPOConfig(**base, router_aux_coef=0.1), with_grads=True)
    _, _, routing = model(batch.tokens_ns, mask_nt=batch.mask_ns, return_routing=True)
    aux = float(moe.load_balancing_loss(routing.load))
    assert "router_aux_loss" not in m0["metrics"]
    np.testing.assert_allclose(float(m1["metrics"]["router_aux_loss"]), aux, rtol=1e-6)
    np.testing.assert_allclose(float(loss1) - float(loss0), 0.1 * aux, rtol=1e-5, atol=1e-7)
    router_grad = m1["grads"]["layers"]["w_router"]
    assert float(jnp.max(jnp.abs(router_grad[...]))) > 0
