"""Stop strings: cut a completion right after the first token that completes a stop string.

Matching runs on the host, after the jitted decode loop, on decoded text. A stop string such
as "</answer>" is rarely one token and BPE can split it differently in every completion (or
glue it to the next characters), so a token-level match inside the loop would miss cases; the
text of the decoded tokens is what the reward functions read, so it is what decides. The cost
is decode time spent past the stop string (up to `max_new_tokens`); an EOS id still stops a
row inside the loop.

The cut only shortens `lengths_n`: a completion keeps its first k tokens, k the smallest
prefix whose decoded text contains a stop string (that token may carry characters after the
string, which stay in the text: the text scored is the decoded kept tokens, exactly). Tokens
and the sampler's logprobs are untouched, and masks come from lengths, so the trainer sees
exactly the kept tokens with their sampling logprobs; the later tokens are never attended to
by a kept one (causal attention).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import numpy as np

__all__ = ["decode_completions", "stopped_completions", "truncate_at_stop_strings"]


def truncate_at_stop_strings(
    decode: Callable[[list[int]], str],
    tokens_nt: np.ndarray,
    lengths_n: np.ndarray,
    eos_found_n: np.ndarray,
    stop_strings: Sequence[str],
) -> tuple[np.ndarray, np.ndarray]:
    """(lengths_n, stopped_n): completions cut right after the first stop string.

    Args:
      decode: token ids -> text (e.g. `tokenizer.decode`); a row's text is the decode of its
        tokens before its EOS (an ending EOS token is not searched).
      tokens_nt: `[N, T]` int completion tokens (host).
      lengths_n: `[N]` int completion lengths, the EOS token included when `eos_found_n`.
      eos_found_n: `[N]` bool, the row ended with an EOS id.
      stop_strings: the strings; empty: nothing changes.

    Returns:
      lengths_n: `[N]` int32, k for a row whose text contains a stop string (k the fewest
        tokens whose decode contains one), else the input length.
      stopped_n: `[N]` bool, the rows cut at a stop string (they end there: their last kept
        token is not an EOS, and they are not truncated by the budget).
    """
    lengths = np.asarray(lengths_n, np.int32).copy()
    eos = np.asarray(eos_found_n, bool)
    stopped = np.zeros(lengths.shape, bool)
    strings = [s for s in stop_strings if s]
    if not strings:
        return lengths, stopped

    def hit(ids: list[int]) -> bool:
        text = decode(ids)
        return any(s in text for s in strings)

    for n, row in enumerate(np.asarray(tokens_nt)):
        ids = row[: int(lengths[n]) - int(eos[n])].tolist()
        if not ids or not hit(ids):
            continue
        # The smallest k with a hit: a prefix's text only grows with k, so binary search.
        lo, hi = 1, len(ids)
        while lo < hi:
            mid = (lo + hi) // 2
            if hit(ids[:mid]):
                hi = mid
            else:
                lo = mid + 1
        lengths[n], stopped[n] = lo, True
    return lengths, stopped


def decode_completions(tokenizer, tokens_nt, lengths_n, eos_found_n) -> list[str]:
    """Completion texts of host rows: the tokens before the stop token (dropped)."""
    ids = [row[: int(n) - int(e)].tolist() for row, n, e in zip(tokens_nt, lengths_n, eos_found_n)]
    return tokenizer.batch_decode(ids, skip_special_tokens=False) if ids else []


def stopped_completions(
    tokenizer, tokens_nt, lengths_n, eos_found_n, stop_strings: Sequence[str] = ()
) -> tuple[list[str], np.ndarray, np.ndarray]:
    """(texts, lengths_n, eos_found_n) of host rows after the stop-string cut
    (`truncate_at_stop_strings`): a row cut at a stop string keeps the
    tokens up to the one completing it, its text is their decode (the string included), and
    it counts as ended (`eos_found_n` true: not truncated by the budget). Without stop
    strings: `decode_completions` and the inputs."""
    lengths = np.asarray(lengths_n, np.int32)
    eos = np.asarray(eos_found_n, bool)
    if stop_strings:
        decode = functools.partial(tokenizer.decode, skip_special_tokens=False)
        lengths, stopped = truncate_at_stop_strings(decode, tokens_nt, lengths, eos, stop_strings)
        texts = decode_completions(tokenizer, tokens_nt, lengths, eos & ~stopped)
        return texts, lengths, eos | stopped
    return decode_completions(tokenizer, tokens_nt, lengths, eos), lengths, eos
