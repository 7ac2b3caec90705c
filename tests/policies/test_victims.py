"""LeastComputedFirst: the preempted request is the one with the least work to redo."""

from __future__ import annotations

from schedkit import hookimpl
from schedkit.policies.victims import LeastComputedFirst

from ._harness import req, run

KW = dict(block_size=16, num_blocks=11, max_num_seqs=4)  # 10 usable blocks


class Recording(LeastComputedFirst):
    """Logs the computed tokens of the running requests and of the chosen victim."""

    def __init__(self) -> None:
        super().__init__()
        self.log: list[tuple[list[int], int]] = []

    @hookimpl
    def schedkit_select_preemption_victim(self, running):
        victim = super().schedkit_select_preemption_victim(running)
        self.log.append(([r.num_computed_tokens for r in running], victim.num_computed_tokens))
        return victim


def small_then_big() -> list:
    """"small" (8-token prompt) is admitted before "big" (100 tokens); both decode until the
    10 blocks run out, when small has computed ~32 tokens and big ~130."""
    return [req("small", 8, t=0.0, max_tokens=60), req("big", 100, t=0.0, max_tokens=40)]


def recomputed(res) -> int:
    return sum(r.num_recomputed_tokens for r in res.requests.values())


def test_the_request_with_the_fewest_computed_tokens_is_preempted():
    policy = Recording()
    res = run(small_then_big(), [policy], check=True, **KW)
    fcfs = run(small_then_big(), **KW)
    assert policy.log and all(victim == min(running) for running, victim in policy.log)
    assert res.requests["small"].num_preemptions > 0 and res.requests["big"].num_preemptions == 0
    # FCFS preempts the latest admitted, big, and recomputes its long prompt.
    assert fcfs.requests["big"].num_preemptions > 0
    assert recomputed(res) < recomputed(fcfs) / 2


def test_ties_go_to_the_latest_admitted_request():
    a, b, c = (req(x, 8) for x in "abc")
    a.num_computed_tokens, b.num_computed_tokens, c.num_computed_tokens = 5, 3, 3
    assert LeastComputedFirst().schedkit_select_preemption_victim(running=[a, b, c]) is c
    assert LeastComputedFirst().schedkit_select_preemption_victim(running=[c, b, a]) is b
    assert LeastComputedFirst().schedkit_select_preemption_victim(running=[a]) is a
