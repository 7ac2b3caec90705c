"""The built-in ``structured-outputs`` plugin: the backends named ``auto``, ``xgrammar``
and ``python`` (``structured_outputs.backend``).

Registered by the plugin manager on every scheduler, ``trylast``, so any other plugin's
backend wins. It answers None for any other backend name, which a third-party plugin
answers instead. Importing it imports neither torch nor xgrammar: the backend modules are
imported when the hook is called (at the first structured request).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from schedkit.config import StructuredOutputsConfig
from schedkit.core.structured_output import StructuredOutputBackend
from schedkit.errors import RequestError
from schedkit.hookspecs import hookimpl

BUILTIN_BACKENDS = ("auto", "xgrammar", "python")
XGRAMMAR_MISSING = ("structured outputs with backend xgrammar need the xgrammar package: "
                    "pip install 'schedkit[paged]'")
NO_TOKENIZER = ("structured outputs need the model's tokenizer: set model.tokenizer "
                "(or use runner.kind paged)")


def xgrammar_available() -> bool:
    """Whether the xgrammar backend can be imported (xgrammar and torch installed)."""
    try:
        import schedkit.structured.xgrammar_backend  # noqa: F401
    except ImportError:
        return False
    return True


def _python(tokenizer: Any, vocab_size: int, eos: Sequence[int] | None) -> StructuredOutputBackend:
    try:
        from schedkit.structured.python_backend import PythonBackend

        return PythonBackend.from_tokenizer(tokenizer, vocab_size, stop_token_ids=eos)
    except ImportError as e:
        raise RequestError(f"structured outputs with backend python: {e}") from e


def _xgrammar(tokenizer: Any, vocab_size: int, eos: Sequence[int] | None,
              config: StructuredOutputsConfig) -> StructuredOutputBackend:
    try:
        from schedkit.structured.xgrammar_backend import XGrammarBackend
    except ImportError as e:
        raise RequestError(f"{XGRAMMAR_MISSING} ({e})") from e
    return XGrammarBackend(tokenizer, vocab_size, stop_token_ids=eos,
                           json_max_whitespace=config.json_max_whitespace)


@hookimpl(trylast=True)
def schedkit_create_structured_output_backend(config: StructuredOutputsConfig, tokenizer: Any,
                                              vocab_size: int,
                                              eos_token_ids: Sequence[int] = ()) -> StructuredOutputBackend | None:
    backend = config.backend
    if backend not in BUILTIN_BACKENDS:
        return None  # a plugin's own backend name
    if tokenizer is None:
        raise RequestError(NO_TOKENIZER)
    eos = list(eos_token_ids) or None  # None: the tokenizer's own eos_token_id
    if backend == "python" or (backend == "auto" and not xgrammar_available()):
        return _python(tokenizer, vocab_size, eos)
    return _xgrammar(tokenizer, vocab_size, eos, config)
