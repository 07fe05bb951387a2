"""The vLLM side of `grpojax.sampling.vllm_engine`: a script run by the Python of vLLM's own virtual
environment (it imports vllm and torch, nothing of grpojax), driven over stdin/stdout.

    python vllm_worker.py '{"model": DIR, "dtype": "float32", ...}'

It starts a `vllm.LLM` in this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`: no engine
process of its own, so a dead worker leaves nothing behind), answers `{"ready": true}`, then
one JSON reply line per JSON request line:

    {"op": "generate", "prompts": [[id, ...], ...], "n": G, "seeds": [s_b, ...],
     "temperature": t, "top_k": k, "top_p": p, "min_p": m, "max_tokens": T,
     "stop_ids": [...], "max_tokens_n": [T_n, ...] (optional: per-row budgets; then one
     request a row, "seeds" one a row)}
        -> {"tokens": [[...]] (N = B*G, prompt-major), "logprobs": [[...]],
            "stopped": [bool]}
    {"op": "load", "path": DIR}   -> {"seconds": s}    weights of DIR's safetensors, in place
    {"op": "probe", "ids": [...]} -> {"logprobs": [...]}  log p(ids[i] | ids[:i]), i >= 1
    {"op": "exit"}

Token ids in and out (no tokenizer: `skip_tokenizer_init`); each prompt's G samples draw from
its own seed (reproducible across calls and restarts; chunked prefill is off, since a
seeded prompt whose prefill is split stops vLLM's CPU engine); the logprobs are vLLM's
"processed" ones, those of the distribution each token was drawn from (after temperature
and truncation). After a weight load a tied output layer is pointed at the new embedding
(`_retie_head`) and the prefix cache is reset (its blocks hold keys and values of the old
weights). The replies go to the process's original stdout; anything vLLM
prints goes to stderr. An error answers {"error": "<type>: <message>"} and the worker goes on.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback


def _retie_head(model) -> bool:
    """After an in-place weight reload, the output layer of a model with tied embeddings
    (`tie_word_embeddings` with an `lm_head`: SmolLM2, Qwen2.5-0.5B, Llama 3.2 1B) back on
    the new embedding. vLLM's reload processes the layers it loaded; the head, loaded under
    no name of its own, is not processed again, and on the CPU it kept computing with the
    packed copy of the weights made at start: measured on SmolLM2-135M after 60 GRPO steps,
    its logprobs of the sync's probe 4.2e-3 from the policy's, against 1.6e-4 after a fresh
    start. Points the head's weight at the embedding's and re-runs its post-load
    processing (which repacks it). Returns whether the model's head is tied."""
    config = getattr(model, "config", None)
    head = getattr(model, "lm_head", None)
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    if not getattr(config, "tie_word_embeddings", False) or head is None or embed is None:
        return False
    head.weight = embed.weight
    method = getattr(head, "quant_method", None)
    if method is not None:
        method.process_weights_after_loading(head)
    return True


def _serve(args: dict, out) -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(
        model=args["model"],
        dtype=args.get("dtype", "float32"),
        skip_tokenizer_init=True,
        seed=int(args.get("seed", 0)),
        enforce_eager=bool(args.get("enforce_eager", True)),
        max_model_len=int(args["max_model_len"]),
        max_num_seqs=int(args.get("max_num_seqs", 256)),
        max_num_batched_tokens=max(int(args["max_model_len"]), 2048),
        enable_chunked_prefill=False,
        enable_prefix_caching=bool(args.get("prefix_caching", True)),
        kv_cache_memory_bytes=int(args.get("kv_cache_bytes", 256 * 2**20)),
        logprobs_mode="processed_logprobs",
        block_size=32,
    )

    def reply(obj: dict) -> None:
        out.write(json.dumps(obj) + "\n")
        out.flush()

    reply({"ready": True, "vllm": __import__("vllm").__version__})
    for line in sys.stdin:
        req = json.loads(line)
        op = req.get("op")
        try:
            if op == "exit":
                reply({"bye": True})
                return
            if op == "generate":
                n = int(req["n"])
                greedy = float(req["temperature"]) == 0.0  # vLLM draws a greedy sample once
                budgets = req.get("max_tokens_n")  # per-row budgets: one request a row
                rows = [list(p) for p in req["prompts"]]
                if budgets is not None:
                    rows = [r for r in rows for _ in range(n)]
                prompts = [TokensPrompt(prompt_token_ids=r) for r in rows]
                params = [
                    SamplingParams(
                        n=1 if greedy or budgets is not None else n,
                        temperature=float(req["temperature"]),
                        top_k=int(req.get("top_k", 0)),
                        top_p=float(req.get("top_p", 1.0)),
                        min_p=float(req.get("min_p", 0.0)),
                        max_tokens=int(req["max_tokens"] if budgets is None else budgets[i]),
                        stop_token_ids=list(req["stop_ids"]),
                        ignore_eos=True,  # the caller's stop ids are the ones that stop
                        logprobs=0,  # the sampled token's only
                        seed=int(seed),
                    )
                    for i, seed in enumerate(req["seeds"])
                ]
                if budgets is not None:
                    n = 1
                tokens, logprobs, stopped = [], [], []
                for o in llm.generate(prompts, params, use_tqdm=False):
                    outputs = sorted(o.outputs, key=lambda c: c.index)
                    for c in outputs * n if greedy else outputs:
                        ids = list(c.token_ids)
                        tokens.append(ids)
                        logprobs.append([d[t].logprob for t, d in zip(ids, c.logprobs or [])])
                        stopped.append(c.finish_reason == "stop")
                reply({"tokens": tokens, "logprobs": logprobs, "stopped": stopped})
            elif op == "load":
                t0 = time.perf_counter()
                llm.collective_rpc("reload_weights", kwargs={"weights_path": req["path"]})
                llm.apply_model(_retie_head)
                llm.reset_prefix_cache()
                reply({"seconds": time.perf_counter() - t0})
            elif op == "probe":
                params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
                o = llm.generate(
                    [TokensPrompt(prompt_token_ids=req["ids"])], params, use_tqdm=False
                )
                ids = req["ids"]
                given = o[0].prompt_logprobs[1:]  # position 0 has no logprob
                reply({"logprobs": [d[t].logprob for t, d in zip(ids[1:], given)]})
            else:
                reply({"error": f"ValueError: unknown op {op!r}"})
        except Exception as e:  # the caller decides; the worker stays up
            traceback.print_exc(file=sys.stderr)
            reply({"error": f"{type(e).__name__}: {e}"})


def main() -> None:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    out = os.fdopen(os.dup(1), "w")  # the protocol's channel
    os.dup2(2, 1)  # vLLM's own prints go to stderr
    sys.stdout = sys.stderr
    try:
        _serve(json.loads(sys.argv[1]), out)
    except Exception as e:
        traceback.print_exc(file=sys.stderr)
        out.write(json.dumps({"error": f"{type(e).__name__}: {e}"}) + "\n")
        out.flush()
        sys.exit(1)


if __name__ == "__main__":
    main()
