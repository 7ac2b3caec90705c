"""Token ids to text, one engine delta at a time, with stop strings.

The engine works in token ids; the server turns each request's stream of new ids into
text. :class:`TextStream` decodes incrementally (a token's text can depend on the ones
before it: leading spaces, multi-byte characters split over tokens) and checks the
request's stop strings on the text. While stop strings are pending it holds back the
last ``len(longest stop) - 1`` characters, so a stop string split over two deltas is
never half sent.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

CONTEXT_TOKENS = 5
"""Prompt tokens decoded before the first output token, so its text has the spacing it
has after the prompt (a SentencePiece token's leading space, say)."""

_INCOMPLETE = "\ufffd"
"""What a byte-level tokenizer decodes a partial UTF-8 character to."""


class TextStream:
    """The output text of one request, built from its new token ids.

    Args:
        tokenizer: A transformers tokenizer, or None (no text: ``add`` returns "").
        prompt_token_ids: The prompt (its last tokens give the first output its context).
        stop: Stop strings; the first one to appear ends the text.
        include_stop: Keep the stop string in the text.
        min_tokens: Stop strings are looked for only once this many tokens are out.
        skip_special_tokens: Leave special tokens (EOS, chat markers) out of the text.
    """

    __slots__ = ("tokenizer", "stop", "include_stop", "min_tokens", "skip_special",
                 "ids", "prefix_offset", "read_offset", "text", "sent",
                 "hold", "stop_reason", "output_token_ids")

    def __init__(self, tokenizer: Any, prompt_token_ids: Sequence[int], *,
                 stop: Sequence[str] = (), include_stop: bool = False, min_tokens: int = 0,
                 skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.stop = tuple(s for s in stop if s)
        self.include_stop = include_stop
        self.min_tokens = min_tokens
        self.skip_special = skip_special_tokens
        context = list(prompt_token_ids[-CONTEXT_TOKENS:])
        self.ids: list[int] = context
        self.prefix_offset = 0
        self.read_offset = len(context)
        self.text = ""
        """The output text so far (cut at a stop string once one appeared)."""
        self.sent = 0
        """Characters of ``text`` already handed out."""
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.stop_reason: str | None = None
        """The stop string that ended the text, once one did."""
        self.output_token_ids: list[int] = []
        """Output ids taken in (up to the one that completed a stop string)."""

    @property
    def stopped(self) -> bool:
        return self.stop_reason is not None

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special)

    def _append(self, token_id: int) -> None:
        """Decode one more token onto ``text`` (nothing while it ends a partial character)."""
        self.ids.append(token_id)
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.ids[self.prefix_offset:])
        if len(full) > len(prefix) and not full.endswith(_INCOMPLETE):
            self.text += full[len(prefix):]
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.ids)

    def _check_stop(self, searched_to: int) -> bool:
        """Cut ``text`` at the first stop string that ends after ``searched_to``."""
        best: tuple[int, str] | None = None
        for s in self.stop:
            i = self.text.find(s, max(0, searched_to - len(s) + 1))
            if i >= 0 and (best is None or i < best[0]):
                best = (i, s)
        if best is None:
            return False
        i, s = best
        self.text = self.text[:i + len(s)] if self.include_stop else self.text[:i]
        self.stop_reason = s
        return True

    def add(self, token_ids: Sequence[int]) -> str:
        """Take new output ids; return the text that may be sent now ("" if none).

        Once a stop string appeared the text ends there, later ids are ignored and
        :attr:`stopped` is True (the caller then finishes the request).
        """
        if self.stopped:
            return ""
        out = self.output_token_ids
        for t in token_ids:
            out.append(t)
            if self.tokenizer is None:
                continue
            before = len(self.text)
            self._append(t)
            if self.stop and len(out) >= self.min_tokens and self._check_stop(before):
                break
        return self._take(final=self.stopped)

    def finish(self) -> str:
        """The text held back so far (call once the request ended)."""
        return self._take(final=True)

    def _take(self, final: bool) -> str:
        end = len(self.text) if final or not self.stop else max(self.sent, len(self.text) - self.hold)
        out = self.text[self.sent:end]
        self.sent = end
        return out
