"""N-gram drafting (no torch)."""

from __future__ import annotations

from schedkit.runners.ngram import propose_ngram


def test_longest_most_recent_match_wins():
    toks = [1, 2, 3, 9, 1, 2, 3, 7, 8, 5, 2, 3]
    # suffix [5, 2, 3] never occurred before; [2, 3] last occurred at 5 -> followed by 7, 8
    assert propose_ngram(toks, 2) == [7, 8]
    assert propose_ngram(toks, 5) == [7, 8, 5, 2, 3]
    assert propose_ngram([4, 5, 6, 4, 5], 3) == [6, 4, 5]


def test_no_match_and_edge_cases():
    assert propose_ngram([1, 2, 3, 4], 3) == []
    assert propose_ngram([7], 3) == [] and propose_ngram([], 3) == []
    assert propose_ngram([1, 1, 1], 0) == []
    assert propose_ngram([1, 1, 1], 2) == [1]
