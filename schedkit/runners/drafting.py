"""Model-free draft proposers a runner chooses from (``runner.speculative_method``).

A proposer sees each request's tokens (prompt then outputs: only accepted tokens ever
reach them) when asked for drafts, and is told when a request finishes. ``ngram``
looks the last few tokens up in the request's own latest 1,024 tokens
(:func:`schedkit.runners.ngram.propose_ngram`); ``suffix`` searches suffix trees of
the request and of recent requests' outputs (:class:`schedkit.runners.suffix.SuffixProposer`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from schedkit.runners.ngram import propose_ngram
from schedkit.runners.suffix import SuffixProposer

__all__ = ["DraftProposer", "NgramProposer", "SuffixProposer", "make_proposer"]

NGRAM_WINDOW = 1024


class DraftProposer(Protocol):
    keeps_outputs: bool
    """Whether :meth:`finish` wants the request's tokens (to learn from its output)."""

    def propose(self, request_id: str, tokens: Sequence[int], num_prompt_tokens: int, k: int) -> list[int]:
        """Up to ``k`` draft tokens continuing ``tokens``."""
        ...

    def finish(self, request_id: str, tokens: Sequence[int] | None = None, num_prompt_tokens: int = 0) -> None:
        """The request is done (``tokens``: all of them, its prompt first, when known)."""
        ...


class NgramProposer:
    """Prompt lookup: the tokens that followed the latest earlier occurrence of the
    request's last 1 to 3 tokens, within its last 1,024."""

    keeps_outputs = False

    def propose(self, request_id: str, tokens: Sequence[int], num_prompt_tokens: int, k: int) -> list[int]:
        return propose_ngram(tokens[-NGRAM_WINDOW:], k)

    def finish(self, request_id: str, tokens: Sequence[int] | None = None, num_prompt_tokens: int = 0) -> None:
        pass


def make_proposer(runner_config: Any) -> DraftProposer:
    """The proposer a runner config names (``speculative_method`` and the ``suffix_*``
    settings; a config without them gets n-gram)."""
    method = getattr(runner_config, "speculative_method", "ngram")
    if method == "suffix":
        return SuffixProposer(max_depth=runner_config.suffix_max_depth,
                              max_cached_tokens=runner_config.suffix_max_cached_tokens,
                              min_probability=runner_config.suffix_min_probability)
    return NgramProposer()
