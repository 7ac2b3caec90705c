"""Limits on grammar work that the engine thread checks itself, cheaply.

* Before compiling (:func:`constraint_limit_error`): the constraint's text size and a
  JSON schema's nesting depth. Compiling a schema costs about the cube of its depth
  (figures in docs/structured-outputs.md), so a
  deep schema is refused at once instead of occupying a compile worker until its
  timeout.
* Each step (:class:`StepBudget`): the time a request's matcher takes to fill its
  bitmask rows and accept its sampled tokens. An ambiguous grammar's matcher can cost
  more with every token; over its budget the request fails alone.
"""

from __future__ import annotations

import re
from itertools import accumulate

from schedkit.config import StructuredOutputsConfig
from schedkit.core.grammar import StructuredOutputsParams

_JSON_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
_BRACKET = re.compile(r"[\[\]{}]")
_DEPTH_STEP = {"[": 1, "{": 1, "]": -1, "}": -1}

OVER_BUDGET_STEPS = 2
"""Steps in a row over its budget after which a request fails (one step over
:data:`OVER_BUDGET_FACTOR` times its budget is enough): one slow step may be the
machine's hiccup, not the grammar's cost."""
OVER_BUDGET_FACTOR = 10


def json_nesting_depth(text: str) -> int:
    """How deeply the objects and arrays of JSON text nest (``{}`` is 1, ``[[1]]`` 2);
    linear in the text, with no recursion and the strings' brackets skipped."""
    brackets = _BRACKET.findall(_JSON_STRING.sub("", text))
    return max(accumulate(map(_DEPTH_STEP.__getitem__, brackets)), default=0)


def constraint_limit_error(params: StructuredOutputsParams, config: StructuredOutputsConfig) -> str | None:
    """Why the constraint is refused before compiling, or None: its text is longer than
    ``structured_outputs.max_constraint_chars``, or its JSON schema nests deeper than
    ``structured_outputs.max_json_schema_depth``."""
    spec = params.spec
    kind = params.kind.replace("_", " ")
    if len(spec) > config.max_constraint_chars:
        return (f"the {kind} constraint is {len(spec)} characters long, over the limit of "
                f"{config.max_constraint_chars} (structured_outputs.max_constraint_chars)")
    if params.kind == "json":
        depth = json_nesting_depth(spec)
        if depth > config.max_json_schema_depth:
            return (f"the json schema nests {depth} levels deep, over the limit of "
                    f"{config.max_json_schema_depth} (structured_outputs.max_json_schema_depth)")
    return None


class StepBudget:
    """The per-step grammar budget of one request: ``record`` each step's measured work;
    it answers why the request must fail once it went over budget :data:`OVER_BUDGET_STEPS`
    steps in a row (or once by :data:`OVER_BUDGET_FACTOR` times).

    Args:
        budget_s: ``structured_outputs.step_budget_ms`` in seconds.
    """

    __slots__ = ("budget_s", "num_over")

    def __init__(self, budget_s: float) -> None:
        self.budget_s = budget_s
        self.num_over = 0

    def record(self, work_s: float) -> str | None:
        if work_s <= self.budget_s:
            self.num_over = 0
            return None
        self.num_over += 1
        if self.num_over < OVER_BUDGET_STEPS and work_s <= OVER_BUDGET_FACTOR * self.budget_s:
            return None
        return (f"its grammar took {work_s * 1e3:.0f} ms of matcher work in one step (fill_bitmask "
                f"+ accept_tokens), over its budget of {self.budget_s * 1e3:g} ms "
                "(structured_outputs.step_budget_ms)")
