"""The ``structured_outputs`` section: grammar-constrained decoding."""

from __future__ import annotations

from pydantic import Field

from schedkit.config.base import StrictModel


class StructuredOutputsConfig(StrictModel):
    """Grammar-constrained decoding (requests with ``structured_outputs``)."""

    backend: str = Field(default="auto", min_length=1)
    """``auto`` (xgrammar, else the pure-Python backend), ``xgrammar``, ``python`` (regex
    and choice only, no torch), or the name a plugin's
    ``schedkit_create_structured_output_backend`` answers to."""
    num_workers: int = Field(default=2, ge=1, le=64)
    """Grammars checked and compiled at once, off the engine thread: worker processes
    for backends that can compile in one (xgrammar), threads otherwise."""
    cache_size: int = Field(default=256, ge=1)
    """Compiled grammars kept, by constraint (least recently used dropped first)."""
    jump_forward: bool = False
    """Jump-forward decoding: where the grammar allows exactly one continuation, append
    its tokens in one step instead of one step per token."""
    json_max_whitespace: int | None = Field(default=4, ge=0)
    """Most whitespace characters a JSON output may put between two of its tokens
    (xgrammar's ``max_whitespace_cnt``); None: no limit. Without one a small model can
    spend its whole ``max_tokens`` on newlines inside an unfinished object."""
    compile_timeout_s: float = Field(default=10.0, gt=0, le=3600)
    """Longest a constraint's check and compilation may run on a worker; past it the
    compile is stopped (its worker process killed) and its requests fail."""
    max_queued_compiles: int = Field(default=128, ge=1, le=100_000)
    """Compiles waiting for a worker, in total; a new constraint beyond it is refused."""
    max_queued_compiles_per_client: int = Field(default=16, ge=1, le=100_000)
    """Compiles waiting for a worker per client (a request's ``client_index`` and
    ``tenant``, over HTTP the ``user`` field); the queue serves the clients in turn."""
    max_constraint_chars: int = Field(default=65536, ge=1)
    """Longest constraint text (a schema's compact JSON, a pattern, a grammar, the
    choices' JSON list), checked before compiling."""
    max_json_schema_depth: int = Field(default=64, ge=1, le=10_000)
    """Deepest nesting of objects and arrays in a JSON schema's text, checked before
    compiling (compiling costs about the cube of the depth)."""
    step_budget_ms: float | None = Field(default=None, gt=0)
    """Matcher work one request may cost per step (filling its bitmask rows and
    accepting its tokens); a request over it two steps in a row, or ten times over in
    one, fails alone. None: the backend's own default (xgrammar 10 ms; the python
    backend, whose every new state scans the whole vocabulary, 2 ms per 1,000 tokens of
    vocabulary, at least 10 ms)."""
