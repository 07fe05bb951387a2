"""The vLLM side of `grpojax.sampling.vllm_engine`: a script run by the Python of vLLM's own virtual
environment (it imports vllm and torch, nothing of grpojax), driven over stdin/stdout.

    python vllm_worker.py '{"model": DIR, "dtype": "float32", ...}'

It imports vllm and answers `{"vllm": version}` (or `{"error": ..., "importable": false}`
and exits), waits for `{"op": "start"}` (the engine checks the version first; anything else
ends the worker), starts a `vllm.LLM` in this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`:
no engine process of its own, so a dead worker leaves nothing behind; with
`tensor_parallel_size` > 1 vLLM starts its worker processes, which a push reaches through
`collective_rpc`) with `llm_kwargs`'s settings for a CPU or a GPU, answers
`{"ready": true}`, then one JSON reply line per JSON request line (one line in flight at a
time, each way):

    {"op": "generate", "prompts": [[id, ...], ...], "n": G, "seeds": [s_b, ...],
     "temperature": t, "top_k": k, "top_p": p, "min_p": m, "max_tokens": T,
     "stop_ids": [...], "max_tokens_n": [T_n, ...] (optional: per-row budgets; then one
     request a row, "seeds" one a row)}
        -> {"tokens": [[...]] (N = B*G, prompt-major), "logprobs": [[...]],
            "stopped": [bool]}
    {"op": "load", "path": DIR}   -> {"seconds": s}    weights of DIR's safetensors, in place
    {"op": "push", "path": FILE, "dtype": "float32", "bucket": 0, "buckets": K,
     "tensors": [[name, shape, strides, offset], ...]}
        -> {"next": 1}, then {"op": "push", "bucket": 1, ...} -> ... -> {"seconds": s}
        weights from a shared-memory file in K buckets (`grpojax.sampling.weight_push`),
        loaded in place by one `reload_weights` over them
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


class _Mapped:
    """The trainer's shared-memory weight buffer (`grpojax.sampling.weight_push`), mapped
    once per file and size: `flat(path, dtype)` is the whole buffer as one torch tensor."""

    def __init__(self):
        self.key, self.map, self.tensor = None, None, None

    def flat(self, path: str, dtype: str):
        import mmap

        import torch

        size = os.path.getsize(path)
        if self.key != (path, size, dtype):
            with open(path, "r+b") as f:
                self.map = mmap.mmap(f.fileno(), size)
            self.tensor = torch.frombuffer(self.map, dtype=getattr(torch, dtype))
            self.key = (path, size, dtype)
        return self.tensor


def _pushed(first: dict, mapped: _Mapped, reply):
    """(name, tensor) of a push's buckets for vLLM's `reload_weights`: each tensor a view of
    the shared buffer (`torch.as_strided`, elements), which the model's loader copies into
    place. Between buckets it answers {"next": k} (bucket k - 1 consumed: every layer it
    held is loaded, since buckets end between decoder layers) and reads bucket k's request
    from stdin, so the trainer never overwrites tensors still to be read."""
    import torch

    req = first
    for k in range(int(first["buckets"])):
        if k > 0:
            reply({"next": k})
            req = json.loads(sys.stdin.readline() or "{}")
            if req.get("op") != "push" or req.get("bucket") != k:
                raise ValueError(f"expected bucket {k} of the push, got {str(req)[:80]}")
        flat = mapped.flat(req["path"], req["dtype"])
        for name, shape, strides, offset in req["tensors"]:
            yield name, torch.as_strided(flat, shape, strides, offset)


def _reload_from_shared(worker, req: dict) -> None:
    """A one-bucket push loaded by one of vLLM's worker processes (tensor parallelism:
    `collective_rpc` runs it in each; every process maps the buffer itself)."""
    worker.model_runner.reload_weights(weights_iterator=_pushed(req, _Mapped(), None))


def llm_kwargs(args: dict, *, on_cpu: bool | None = None) -> dict:
    """`vllm.LLM`'s arguments from the worker's start arguments. On a CPU: eager (vLLM's
    CPU build runs its model eagerly by default too), the KV cache `kv_cache_bytes`; on a
    GPU: CUDA graphs unless `enforce_eager` is true, vLLM's whole share of the GPU
    `gpu_memory_utilization` (weights, activations and the KV cache in what is left),
    `tensor_parallel_size` GPUs. `on_cpu` None: vLLM's platform says."""
    if on_cpu is None:
        from vllm.platforms import current_platform

        on_cpu = current_platform.is_cpu()
    eager = args.get("enforce_eager")
    kwargs = dict(
        model=args["model"],
        dtype=args.get("dtype", "float32"),
        skip_tokenizer_init=True,
        seed=int(args.get("seed", 0)),
        enforce_eager=bool(on_cpu if eager is None else eager),
        max_model_len=int(args["max_model_len"]),
        max_num_seqs=int(args.get("max_num_seqs", 256)),
        max_num_batched_tokens=max(int(args["max_model_len"]), 2048),
        enable_chunked_prefill=False,
        enable_prefix_caching=bool(args.get("prefix_caching", True)),
        tensor_parallel_size=int(args.get("tensor_parallel_size", 1)),
        logprobs_mode="processed_logprobs",
        block_size=32,
    )
    if on_cpu:
        kwargs["kv_cache_memory_bytes"] = int(args.get("kv_cache_bytes", 256 * 2**20))
    else:
        kwargs["gpu_memory_utilization"] = float(args.get("gpu_memory_utilization", 0.2))
    return kwargs


def _serve(args: dict, out) -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(**llm_kwargs(args))

    def reply(obj: dict) -> None:
        out.write(json.dumps(obj) + "\n")
        out.flush()

    reply({"ready": True, "vllm": __import__("vllm").__version__})
    mapped = _Mapped()
    while line := sys.stdin.readline():
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
            elif op == "push":
                if req.get("bucket") != 0:
                    raise ValueError(f"a push starts at bucket 0, got {req.get('bucket')}")
                t0 = time.perf_counter()
                if int(args.get("tensor_parallel_size", 1)) > 1:  # worker processes
                    if int(req["buckets"]) != 1:
                        raise ValueError("with tensor_parallel_size > 1 a push is one bucket")
                    llm.collective_rpc(_reload_from_shared, args=(req,))
                else:
                    weights = _pushed(req, mapped, reply)
                    llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
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
        import vllm
    except Exception as e:  # not vLLM's environment, or a broken one
        traceback.print_exc(file=sys.stderr)
        out.write(json.dumps({"error": f"{type(e).__name__}: {e}", "importable": False}) + "\n")
        out.flush()
        sys.exit(1)
    out.write(json.dumps({"vllm": vllm.__version__}) + "\n")
    out.flush()
    if json.loads(sys.stdin.readline() or "{}").get("op") != "start":
        return  # the engine refused this vLLM, or went away
    try:
        _serve(json.loads(sys.argv[1]), out)
    except Exception as e:
        traceback.print_exc(file=sys.stderr)
        out.write(json.dumps({"error": f"{type(e).__name__}: {e}"}) + "\n")
        out.flush()
        sys.exit(1)


if __name__ == "__main__":
    main()
