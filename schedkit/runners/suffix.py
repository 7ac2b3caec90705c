"""Suffix decoding: model-free drafts from suffix trees of this request's tokens and of
recent requests' outputs (after SuffixDecoding, Oliaro et al. 2024).

Agentic and repetitive workloads (code edits, JSON, tool calls, a model rewriting its
own draft) repeat long spans of earlier text. N-gram lookup finds the most recent
earlier occurrence of the last few tokens; a suffix tree instead counts *every*
earlier occurrence of the longest matching suffix and follows the continuation seen
most often, for as long as it stays likely. Two trees are searched:

* the request's own (its prompt and its outputs so far), and
* a shared one over the outputs of the requests that finished most recently, bounded
  by ``max_cached_tokens``: when it holds more, the oldest request's output is taken
  back out (its counts subtracted, emptied nodes dropped), so memory stays bounded
  however long the server runs.

Each tree is a trie of the sequence's suffixes cut at ``max_depth`` tokens; a node
counts the suffixes that pass through it. A draft walks from the node of the longest
suffix of the request's tokens found in the tree (at most ``max_depth - 1`` tokens, so
a continuation can follow), then takes the child seen most often while its share of
its parent's count stays at least ``min_probability``. The draft with the larger
product of those shares wins between the two trees.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

__all__ = ["SuffixProposer", "SuffixTree"]


class _Node:
    """A trie node: how many suffixes pass through it, and its children by token. Most
    nodes have at most one child (a suffix of text seen once is a single chain), so a
    lone child is kept in two fields and a dict made only for a second one: a node costs
    about a quarter of what a dict per node would."""

    __slots__ = ("count", "_token", "_child", "_kids")

    def __init__(self) -> None:
        self.count = 0
        self._token = 0
        self._child: _Node | None = None
        self._kids: dict[int, _Node] | None = None

    def get(self, token: int) -> _Node | None:
        if self._kids is not None:
            return self._kids.get(token)
        return self._child if self._child is not None and self._token == token else None

    def add(self, token: int) -> _Node:
        """A new child under ``token`` (which has none yet)."""
        child = _Node()
        if self._kids is not None:
            self._kids[token] = child
        elif self._child is None:
            self._token, self._child = token, child
        else:
            self._kids = {self._token: self._child, token: child}
            self._child = None
        return child

    def remove(self, token: int) -> None:
        if self._kids is not None:
            del self._kids[token]
        else:
            assert self._child is not None and self._token == token
            self._child = None

    def has_children(self) -> bool:
        return self._child is not None or bool(self._kids)

    def items(self) -> list[tuple[int, _Node]]:
        if self._kids is not None:
            return list(self._kids.items())
        return [(self._token, self._child)] if self._child is not None else []


class SuffixTree:
    """A count-annotated trie of a token sequence's suffixes, each cut at ``max_depth``
    tokens, extended one token at a time (``O(max_depth)`` per token). Sequences added
    with :meth:`add_sequence` can be taken back out with :meth:`remove_sequence`."""

    def __init__(self, max_depth: int) -> None:
        if max_depth < 2:
            raise ValueError(f"max_depth must be at least 2, got {max_depth}")
        self.max_depth = max_depth
        self.root = _Node()
        self.num_nodes = 0
        self._open: deque[_Node] = deque()
        """The nodes where the suffixes starting in the last ``max_depth - 1`` tokens end."""

    def append(self, token: int) -> None:
        """Extend the sequence by ``token``: every open suffix grows by it, a new suffix
        starts with it, and the one reaching ``max_depth`` tokens closes."""
        opened: deque[_Node] = deque()
        for node in (*self._open, self.root):
            child = node.get(token)
            if child is None:
                child = node.add(token)
                self.num_nodes += 1
            child.count += 1
            opened.append(child)
        if len(opened) >= self.max_depth:
            opened.popleft()
        self._open = opened

    def extend(self, tokens: Sequence[int]) -> None:
        for t in tokens:
            self.append(t)

    def add_sequence(self, tokens: Sequence[int]) -> None:
        """Add every suffix of ``tokens``, a sequence of its own (the open suffixes of
        the sequence being extended are left as they were)."""
        self._walk(tokens, +1)

    def remove_sequence(self, tokens: Sequence[int]) -> None:
        """Take out what :meth:`add_sequence` of the same tokens put in."""
        self._walk(tokens, -1)

    def _walk(self, tokens: Sequence[int], sign: int) -> None:
        depth = self.max_depth
        for start in range(len(tokens)):
            node = self.root
            for t in tokens[start:start + depth]:
                child = node.get(t)
                if child is None:
                    if sign < 0:
                        raise ValueError("remove_sequence: the sequence was not added")
                    child = node.add(t)
                    self.num_nodes += 1
                child.count += sign
                if child.count == 0:
                    self.num_nodes -= _size(child)
                    node.remove(t)
                    break
                node = child

    def match(self, tokens: Sequence[int], max_len: int | None = None) -> tuple[_Node | None, int]:
        """The node of the longest suffix of ``tokens`` (at most ``max_len`` of them,
        default ``max_depth - 1``) that the tree holds and that has a continuation, and
        its length; (None, 0) when even the last token has none."""
        longest = min(len(tokens), self.max_depth - 1 if max_len is None else max(1, max_len))
        for n in range(longest, 0, -1):
            node: _Node | None = self.root
            for t in tokens[len(tokens) - n:]:
                node = node.get(t) if node is not None else None
                if node is None:
                    break
            if node is not None and node.has_children():
                return node, n
        return None, 0

    def draft(self, tokens: Sequence[int], k: int, min_probability: float) -> tuple[list[int], float]:
        """Up to ``k`` draft tokens continuing ``tokens`` and their score (the product of
        each token's share of its parent's count); ([], 0.0) without a match. The match
        is at most ``max_depth - k`` tokens long, so that the tree holds ``k`` more."""
        node, _ = self.match(tokens, self.max_depth - k)
        out: list[int] = []
        score = 1.0
        while node is not None and len(out) < k and node.has_children():
            token, child = max(node.items(), key=lambda item: item[1].count)
            share = child.count / node.count
            if share < min_probability:
                break
            out.append(token)
            score *= share
            node = child
        return out, (score if out else 0.0)


def _size(node: _Node) -> int:
    """The nodes of the subtree under (and including) ``node``."""
    n, stack = 0, [node]
    while stack:
        cur = stack.pop()
        n += 1
        stack.extend(child for _, child in cur.items())
    return n


@dataclass
class _Request:
    tree: SuffixTree
    num_tokens: int = 0
    """Tokens of the request already in its tree."""


@dataclass
class SuffixProposer:
    """Draft tokens by suffix decoding (module docstring), for any runner that knows its
    requests' tokens.

    The runner tells it nothing per step: :meth:`propose` brings the request's tree up
    to the tokens it is given (only accepted tokens ever reach a request's tokens, so
    nothing needs undoing), and :meth:`finish` moves a finished request's output into
    the shared tree.

    Args:
        max_depth: Longest suffix kept in a tree (>= 2): the longest match, plus the
            longest continuation walked from it in one node chain. A request's tree
            holds up to its length times this many nodes (about 70 bytes each on
            CPython 3.11: 1.1 KB a token at depth 16 for text seen once).
        max_cached_tokens: Most output tokens of finished requests in the shared tree
            (0: no shared tree).
        min_probability: Least share of its parent's count a drafted token needs.
    """

    keeps_outputs = True
    max_depth: int = 16
    max_cached_tokens: int = 100_000
    min_probability: float = 0.1
    _requests: dict[str, _Request] = field(default_factory=dict)
    _shared: SuffixTree | None = None
    _cached: deque[list[int]] = field(default_factory=deque)
    _num_cached: int = 0

    def __post_init__(self) -> None:
        if self.max_cached_tokens < 0:
            raise ValueError(f"max_cached_tokens must be >= 0, got {self.max_cached_tokens}")
        if not 0.0 <= self.min_probability <= 1.0:
            raise ValueError(f"min_probability must be in [0, 1], got {self.min_probability}")
        if self.max_depth < 2:
            raise ValueError(f"max_depth must be at least 2, got {self.max_depth}")
        self._shared = SuffixTree(self.max_depth) if self.max_cached_tokens else None

    @property
    def num_cached_tokens(self) -> int:
        """Output tokens of finished requests in the shared tree."""
        return self._num_cached

    @property
    def num_shared_nodes(self) -> int:
        return self._shared.num_nodes if self._shared is not None else 0

    def propose(self, request_id: str, tokens: Sequence[int], num_prompt_tokens: int, k: int) -> list[int]:
        """Up to ``k`` drafts continuing ``tokens`` (the request's prompt and outputs so
        far), from its own tree or the shared one, whichever scores higher."""
        if k <= 0 or not tokens:
            return []
        state = self._requests.get(request_id)
        if state is None or state.num_tokens > len(tokens):  # new, or its tokens were replaced
            state = self._requests[request_id] = _Request(SuffixTree(self.max_depth))
        if state.num_tokens < len(tokens):
            state.tree.extend(tokens[state.num_tokens:])
            state.num_tokens = len(tokens)
        # its own tree holds its last suffix too, which has no continuation: match()
        # only stops at nodes that have one
        own, own_score = state.tree.draft(tokens, k, self.min_probability)
        if self._shared is not None and self._shared.num_nodes:
            shared, shared_score = self._shared.draft(tokens, k, self.min_probability)
            if shared_score > own_score or (shared_score == own_score and len(shared) > len(own)):
                return shared
        return own

    def finish(self, request_id: str, tokens: Sequence[int] | None = None, num_prompt_tokens: int = 0) -> None:
        """Forget a request; its output (``tokens`` past its first ``num_prompt_tokens``)
        goes into the shared tree, the oldest outputs out while it holds too many."""
        self._requests.pop(request_id, None)
        if self._shared is None or tokens is None:
            return
        output = list(tokens[num_prompt_tokens:])
        if not output or len(output) > self.max_cached_tokens:
            return
        self._shared.add_sequence(output)
        self._cached.append(output)
        self._num_cached += len(output)
        while self._num_cached > self.max_cached_tokens:
            old = self._cached.popleft()
            self._shared.remove_sequence(old)
            self._num_cached -= len(old)
