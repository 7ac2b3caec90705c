"""N-gram ("prompt lookup") drafting: propose the tokens that followed the latest earlier
occurrence of the sequence's last n tokens. No model, no torch; any runner can use it."""

from __future__ import annotations

from collections.abc import Sequence


def propose_ngram(tokens: Sequence[int], k: int, *, min_n: int = 1, max_n: int = 3,
                  window: int = 1024) -> list[int]:
    """Up to ``k`` draft tokens for ``tokens`` (prompt then outputs), or [] if no match.

    Tries the longest suffix first (``max_n`` down to ``min_n`` tokens) and the most
    recent earlier occurrence of it within the last ``window`` tokens.
    """
    if k <= 0:
        return []
    seq = list(tokens[-window:])
    size = len(seq)
    for n in range(min(max_n, size - 1), min_n - 1, -1):
        suffix = seq[size - n:]
        for start in range(size - n - 1, -1, -1):
            if seq[start:start + n] == suffix:
                return seq[start + n: start + n + k]
    return []
