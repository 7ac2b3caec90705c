"""schedkit's structured-output backends (grammar-constrained decoding).

* :class:`PythonBackend` (``python``): regular expressions and choices, matched with the
  ``regex`` module; no torch.
* :class:`~schedkit.structured.xgrammar_backend.XGrammarBackend` (``xgrammar``): every
  constraint kind, with xgrammar; imports torch, so it is loaded on first use only
  (``from schedkit.structured import XGrammarBackend`` imports it then).

The built-in plugin that picks between them is :mod:`schedkit.structured.plugin`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from schedkit.structured.python_backend import PythonBackend, PythonGrammar

if TYPE_CHECKING:
    from schedkit.structured.xgrammar_backend import XGrammarBackend, XGrammarGrammar

__all__ = ["PythonBackend", "PythonGrammar", "XGrammarBackend", "XGrammarGrammar"]


def __getattr__(name: str) -> Any:
    if name in ("XGrammarBackend", "XGrammarGrammar"):
        from schedkit.structured import xgrammar_backend

        return getattr(xgrammar_backend, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
