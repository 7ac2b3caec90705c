"""Suffix decoding's trees and proposer: counts that match a brute-force count, drafts
that follow the most frequent continuation, and a shared tree whose memory stays
bounded."""

from __future__ import annotations

import random
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from schedkit.runners.drafting import NgramProposer, make_proposer
from schedkit.runners.suffix import SuffixProposer, SuffixTree


def _counts(tree: SuffixTree) -> Counter[tuple[int, ...]]:
    out: Counter[tuple[int, ...]] = Counter()
    stack = [((), tree.root)]
    while stack:
        path, node = stack.pop()
        for t, child in node.items():
            out[path + (t,)] = child.count
            stack.append((path + (t,), child))
    return out


def _brute(seqs: list[list[int]], depth: int) -> Counter[tuple[int, ...]]:
    out: Counter[tuple[int, ...]] = Counter()
    for seq in seqs:
        for i in range(len(seq)):
            for j in range(i + 1, min(len(seq), i + depth) + 1):
                out[tuple(seq[i:j])] += 1
    return out


@settings(max_examples=60, deadline=None)
@given(seqs=st.lists(st.lists(st.integers(0, 4), max_size=30), min_size=1, max_size=4),
       depth=st.integers(2, 6))
def test_every_node_counts_the_occurrences_of_its_path(seqs, depth):
    grown = SuffixTree(depth)  # one sequence extended token by token
    grown.extend(seqs[0])
    assert _counts(grown) == _brute(seqs[:1], depth)
    added = SuffixTree(depth)  # whole sequences added, then some taken out again
    for seq in seqs:
        added.add_sequence(seq)
    assert _counts(added) == _brute(seqs, depth)
    assert added.num_nodes == len(_brute(seqs, depth))
    for seq in seqs[1:]:
        added.remove_sequence(seq)
    assert _counts(added) == _brute(seqs[:1], depth)
    assert added.num_nodes == len(_brute(seqs[:1], depth))


def test_drafts_follow_the_continuation_seen_most_often():
    tree = SuffixTree(8)
    # "1 2 3" was followed by 4 5 twice and by 9 once
    tree.extend([1, 2, 3, 4, 5, 0, 1, 2, 3, 4, 5, 0, 1, 2, 3, 9, 0, 1, 2, 3])
    draft, score = tree.draft([7, 1, 2, 3], 3, min_probability=0.1)
    assert draft == [4, 5, 0]
    # the node of "1 2 3" counts 4 occurrences (the last has no continuation yet)
    assert score == pytest.approx(2 / 4 * 1 * 1)
    assert tree.draft([7, 1, 2, 3], 3, min_probability=0.6) == ([], 0.0)  # 4 has half
    node, n = tree.match([8, 8, 2, 3])
    assert n == 2 and node is not None  # the longest suffix found: "2 3"
    assert tree.draft([6, 6], 3, 0.1) == ([], 0.0)  # never seen


def test_proposer_learns_from_its_own_tokens_and_from_finished_outputs():
    p = SuffixProposer(max_depth=8, max_cached_tokens=1000)
    loop = [10, 11, 12, 13, 14]
    tokens = [1, 2] + loop * 3
    assert p.propose("a", tokens, 2, 4) == [10, 11, 12, 13]  # its own repetition
    # the next call extends the same tree with the new tokens only
    assert p.propose("a", tokens + [10, 11], 2, 2) == [12, 13]
    # a new request whose context was never seen in its own tokens: nothing, until a
    # finished request's output shows what follows it
    other = [50, 60, 70, 80]
    assert p.propose("b", [3, 50, 60], 1, 2) == []
    p.finish("c", [9] + other * 2 + [90], 1)  # its output goes into the shared tree
    assert p.num_cached_tokens == 9
    assert p.propose("b", [3, 50, 60], 1, 2) == [70, 80]
    p.finish("a")  # no tokens: forgotten, nothing shared
    assert p.num_cached_tokens == 9


def test_the_shared_tree_keeps_only_the_latest_outputs():
    rng = random.Random(0)
    p = SuffixProposer(max_depth=6, max_cached_tokens=300)
    outputs = [[rng.randrange(1000) for _ in range(50)] for _ in range(40)]
    for i, out in enumerate(outputs):
        p.propose(f"r{i}", [7] + out[:3], 1, 1)
        p.finish(f"r{i}", [7] + out, 1)
        assert p.num_cached_tokens <= 300
        assert p.num_shared_nodes <= 300 * 6
    assert p.num_cached_tokens == 300  # the last six outputs
    last, first = outputs[-1], outputs[0]
    assert p.propose("new", [1] + last[10:14], 1, 3) == last[14:17]
    assert p.propose("new2", [1] + first[10:14], 1, 3) != first[14:17]  # evicted
    assert not [rid for rid in p._requests if rid.startswith("r")]  # finished ones forgotten


def test_settings_are_checked_and_the_config_picks_the_proposer():
    with pytest.raises(ValueError, match="max_depth"):
        SuffixProposer(max_depth=1)
    with pytest.raises(ValueError, match="max_cached_tokens"):
        SuffixProposer(max_cached_tokens=-1)
    with pytest.raises(ValueError, match="min_probability"):
        SuffixProposer(min_probability=1.5)
    from schedkit.config import config_from_dict

    cfg = config_from_dict({"runner": {"kind": "paged", "speculative_method": "suffix",
                                       "suffix_max_depth": 5, "suffix_max_cached_tokens": 0}})
    proposer = make_proposer(cfg.runner)
    assert isinstance(proposer, SuffixProposer) and proposer.max_depth == 5 and proposer.num_shared_nodes == 0
    assert isinstance(make_proposer(config_from_dict({"runner": {"kind": "paged"}}).runner), NgramProposer)
    from schedkit.errors import ConfigError

    with pytest.raises(ConfigError, match="speculative_method"):
        config_from_dict({"runner": {"kind": "paged", "speculative_method": "eagle"}})
