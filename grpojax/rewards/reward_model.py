"""A learned reward: score (prompt, completion) text with a `RewardModel` head, in-process.

`RewardModelScorer` follows the reward protocol, so it sits in a `RewardManager`
beside the verifiers; give it `mode="inline"` (it is JAX: it runs in the trainer's
process, not in a worker). Texts are tokenized with the model's tokenizer, cut to
the last `max_length` tokens (the score is read at the last real token), right-padded
to `max_length` and scored in fixed batches of `batch_size`, so the jitted scorer
compiles once.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from grpojax.data import pad_id_of
from grpojax.models.decoder import RewardModel
from grpojax.ops.checks import check_int
from grpojax.ops.masks import mask_from_lengths


class RewardModelScorer:
    """reward_n = RewardModel(tokens of template.format(prompt, completion))[n], float.

    Args:
      model: a `grpojax.models.RewardModel` (backbone + scalar head).
      tokenizer: a Hugging Face tokenizer for the model (`__call__` -> input_ids).
      max_length: T, the padded width; longer texts keep their last T tokens.
      batch_size: rows per jitted call (the last batch is padded with dummy rows).
      template: how prompt and completion are joined into the scored text.
      add_special_tokens: passed to the tokenizer.
      end_token_id: appended to every text's tokens when given (`grpojax rm` scores a
        response followed by the tokenizer's EOS, as the policy ends it).
    """

    __name__ = "reward_model"

    def __init__(
        self,
        model: RewardModel,
        tokenizer,
        *,
        max_length: int = 512,
        batch_size: int = 16,
        template: str = "{prompt}{completion}",
        add_special_tokens: bool = False,
        end_token_id: int | None = None,
    ):
        if not isinstance(model, RewardModel):
            raise ValueError(f"model must be a grpojax.models.RewardModel, got {type(model)}")
        check_int("max_length", max_length)
        check_int("batch_size", batch_size)
        self.tokenizer = tokenizer
        self.max_length = max_length
        self.batch_size = batch_size
        self.template = template
        self.add_special_tokens = add_special_tokens
        self.end_token_id = None if end_token_id is None else int(end_token_id)
        self.pad_id = pad_id_of(tokenizer)
        graphdef, self.state = nnx.split(model)

        def score(state, tokens_nt, lengths_n):
            m = nnx.merge(graphdef, state)
            mask_nt = mask_from_lengths(lengths_n, tokens_nt.shape[1])
            return m(tokens_nt, mask_nt=mask_nt).astype(jnp.float32)

        self._score = jax.jit(score)

    def update(self, model: RewardModel) -> None:
        """Use new weights (same structure and shapes, so no recompilation)."""
        self.state = nnx.state(model)

    def encode(self, prompts: Sequence[str], completions: Sequence[str]):
        """(tokens `[N, T]` int32 right-padded, lengths `[N]` int32), T = max_length."""
        texts = [self.template.format(prompt=p, completion=c) for p, c in zip(prompts, completions)]
        ids = self.tokenizer(texts, add_special_tokens=self.add_special_tokens)["input_ids"]
        n, t = len(texts), self.max_length
        tokens = np.full((n, t), self.pad_id, np.int32)
        lengths = np.zeros((n,), np.int32)
        for i, row in enumerate(ids):
            row = list(row) + ([] if self.end_token_id is None else [self.end_token_id])
            row = row[-t:]
            if not row:
                raise ValueError(f"sample {i} tokenizes to nothing; cannot read a reward")
            tokens[i, : len(row)] = row
            lengths[i] = len(row)
        return tokens, lengths

    def __call__(self, prompts: Sequence[str], completions: Sequence[str], **_) -> list[float]:
        tokens, lengths = self.encode(prompts, completions)
        n, b = len(lengths), self.batch_size
        out = []
        for s in range(0, n, b):
            tok, ln = tokens[s : s + b], lengths[s : s + b]
            k = len(ln)
            if k < b:  # dummy rows of one pad token keep the compiled shape
                tok = np.concatenate([tok, np.full((b - k, tok.shape[1]), self.pad_id, np.int32)])
                ln = np.concatenate([ln, np.ones((b - k,), np.int32)])
            out.append(np.asarray(self._score(self.state, tok, ln))[:k])
        return np.concatenate(out).astype(np.float64).tolist() if out else []
