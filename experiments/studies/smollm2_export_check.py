"""A trained SmolLM2 policy's export, loaded back: grpojax, transformers and vLLM's CPU build
on the same Hugging Face directory, and the export's chat template and EOS against the GGUF
it was trained from.

    python experiments/studies/smollm2_export_check.py RUN_DIR [--gguf FILE] [--vllm-python PATH]

RUN_DIR is a finished `grpojax train --config experiments/configs/smollm2_135m_grpo.yaml` run; its
`hf/` is the export (`log.export_hf`). On eight chat rows (a question in the chat template
and the policy's greedy reply), float32:

- transformers' `AutoModelForCausalLM.from_pretrained(hf)` against grpojax's
  `from_pretrained(hf)`: max |logit difference| and max |log-softmax difference| over the
  whole vocabulary at every real position; and each against transformers in float64 (the
  same weights, the exact value to float32's eyes), so a difference between the two float32
  implementations reads against their own rounding;
- vLLM (`VLLMEngine.load_pretrained(hf)`, the export's own files) against grpojax: max
  |logprob difference| of every token of the rows given the ones before (vLLM's prompt
  logprobs);
- the export's tokenizer: its chat template and vocabulary equal to the GGUF's, its
  `generation_config.json` EOS the GGUF's;
- the trained policy's greedy replies to the first rows, decoded (for the eye).

Last line: `smollm2_export_check: transformers_logit_diff=.. transformers_logsoftmax_diff=..
grpojax_vs_float64=.. transformers_vs_float64=.. vllm_logprob_diff=.. template_equal=..
eos_equal=..`
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "bench"))  # bench_smollm2
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tools"))  # fetch_smollm2

from bench_smollm2 import EOS, chat_prompts
from fetch_smollm2 import DEFAULT_DIR, fetch

QUESTIONS = [
    "What is 47 + 38? Reply with only the number.",
    "What is 9 + 73? Reply with only the number.",
    "What is 66 + 66? Reply with only the number.",
    "What is 15 + 4? Reply with only the number.",
    "What is 17 + 25?",
    "Explain how a rainbow forms.",
    "Name three colors.",
    "Write a haiku about the sea.",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=pathlib.Path)
    parser.add_argument("--gguf", default=None, help="default: fetch_smollm2.py's file")
    parser.add_argument("--vllm-python", default=None)
    parser.add_argument("--new", type=int, default=24, help="greedy reply tokens")
    args = parser.parse_args()

    import jax
    import jax.numpy as jnp
    import numpy as np
    import torch
    import transformers

    from grpojax.models import forward_logits, from_pretrained, load_tokenizer
    from grpojax.ops.logprobs import token_logprobs
    from grpojax.sampling import SamplingConfig, generate
    from grpojax.sampling.vllm_engine import VLLMEngine

    gguf = pathlib.Path(args.gguf) if args.gguf else fetch(DEFAULT_DIR)
    hf = args.run_dir / "hf"
    model, tok = from_pretrained(hf), load_tokenizer(hf)
    source_tok = load_tokenizer(gguf)
    template_equal = tok.chat_template == source_tok.chat_template
    vocab_equal = tok.get_vocab() == source_tok.get_vocab()
    gen = json.loads((hf / "generation_config.json").read_text())
    eos = gen["eos_token_id"]
    eos_equal = sorted(eos if isinstance(eos, list) else [eos]) == list(
        source_tok.grpojax_model_eos_ids
    )

    prompts, lengths = chat_prompts(tok, QUESTIONS)
    r = generate(
        model, prompts, lengths, key=jax.random.key(0), max_new_tokens=args.new,
        sampling=SamplingConfig(temperature=0.0), eos_ids=(EOS,), pad_id=EOS,
    )  # fmt: skip
    tokens, mask, _ = r.sequences()
    ids, mask = np.asarray(tokens), np.asarray(mask)
    for i in range(4):
        reply = np.asarray(r.tokens_nt)[i, : int(np.asarray(r.lengths_n)[i])]
        print(f"{QUESTIONS[i]!r} -> {tok.decode(reply, skip_special_tokens=True)!r}")

    ours = np.asarray(forward_logits(model, jnp.asarray(ids), jnp.asarray(mask)), np.float64)
    torch.set_num_threads(2)
    pos = np.maximum(np.cumsum(mask, 1) - 1, 0)

    def transformers_logits(dtype):
        m = transformers.AutoModelForCausalLM.from_pretrained(hf, dtype=dtype).eval()
        with torch.no_grad():
            out = m(
                input_ids=torch.tensor(ids, dtype=torch.long),
                attention_mask=torch.tensor(mask.astype(np.int64)),
                position_ids=torch.tensor(pos),
            )
        return out.logits.double().numpy()

    def log_softmax(x):
        x = x - x.max(-1, keepdims=True)
        return x - np.log(np.exp(x).sum(-1, keepdims=True))

    theirs, exact = transformers_logits(torch.float32), transformers_logits(torch.float64)
    logit_diff = float(np.abs(ours - theirs)[mask].max())
    lsm_diff = float(np.abs(log_softmax(ours) - log_softmax(theirs))[mask].max())
    ours_err = float(np.abs(ours - exact)[mask].max())
    theirs_err = float(np.abs(theirs - exact)[mask].max())
    print(
        f"transformers vs grpojax on the export ({int(mask.sum())} positions x "
        f"{ours.shape[-1]} ids): max |logit diff| {logit_diff:.2e}, "
        f"max |log-softmax diff| {lsm_diff:.2e}; against transformers in float64: "
        f"grpojax {ours_err:.2e}, transformers float32 {theirs_err:.2e}"
    )

    python = args.vllm_python
    if python is None:
        sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "tests"))
        from user_cache import user_cache_dir

        from grpojax.jobs.vllm_env import create_vllm_env

        python = str(create_vllm_env(user_cache_dir("vllm-env"), print_fn=lambda s: None))
    engine = VLLMEngine(python=python, max_model_len=ids.shape[1], kv_cache_mb=64, max_num_seqs=8)
    vllm_diff = 0.0
    try:
        engine.load_pretrained(hf)
        lp = np.asarray(token_logprobs(jnp.asarray(ours[:, :-1], jnp.float32), ids[:, 1:]))
        for i in range(len(ids)):
            row = ids[i][mask[i]]
            theirs_row = engine.probe_logprobs(row)
            real = mask[i, :-1] & mask[i, 1:]  # logprob j scores ids[j + 1]: both real
            vllm_diff = max(vllm_diff, float(np.abs(lp[i][real] - theirs_row).max()))
    finally:
        engine.close()
    print(f"vLLM vs grpojax on the export: max |token logprob diff| {vllm_diff:.2e}")
    print(
        f"export's chat template equal to the GGUF's: {template_equal}; vocabulary equal: "
        f"{vocab_equal}; generation_config eos {eos} vs the GGUF's "
        f"{list(source_tok.grpojax_model_eos_ids)}"
    )
    print(
        f"smollm2_export_check: transformers_logit_diff={logit_diff:.2e} "
        f"transformers_logsoftmax_diff={lsm_diff:.2e} grpojax_vs_float64={ours_err:.2e} "
        f"transformers_vs_float64={theirs_err:.2e} vllm_logprob_diff={vllm_diff:.2e} "
        f"template_equal={template_equal and vocab_equal} eos_equal={eos_equal}"
    )


if __name__ == "__main__":
    main()
