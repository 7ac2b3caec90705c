"""What every config section shares: the strict pydantic base and the located error."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict


class StrictModel(BaseModel):
    """A config section: unknown keys are errors, values are never coerced, fields are
    documented by the docstring under them, and a validated section is frozen."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True,
                              use_attribute_docstrings=True)


class LocatedValueError(ValueError):
    """A validator's ValueError about one key below the model (``loc``, with its value), so
    that :func:`format_validation_error` can name that key and its line."""

    def __init__(self, message: str, loc: tuple[int | str, ...], value: Any):
        super().__init__(message)
        self.loc, self.value = loc, value
