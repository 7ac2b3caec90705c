"""``test_hook_schedkit_create_structured_output_backend`` (checked by tests/test_docs.py).

The plugin classes are the examples shown in docs/hooks.md and docs/structured-outputs.md
(tests/test_docs.py checks that they are copied verbatim).
"""

from __future__ import annotations

import pytest

from schedkit import PluginError, hookimpl
from schedkit.config import StructuredOutputsConfig
from schedkit.core.grammar import StructuredOutputsParams
from schedkit.core.structured_output import GrammarBitmask, StructuredOutputManager
from schedkit.plugins.facade import HookFacade
from schedkit.plugins.manager import get_plugin_manager
from schedkit.plugins.testing import make_request
from schedkit.structured import PythonBackend


class FixedVocabulary:
    """Answers ``structured_outputs.backend: mine``: the python backend over a vocabulary
    of its own, whatever the model's tokenizer."""

    def __init__(self, vocabulary, eos_token_id) -> None:
        self.vocabulary = vocabulary
        self.eos_token_id = eos_token_id
        self.created = []

    @hookimpl
    def schedkit_create_structured_output_backend(self, config, vocab_size):
        if config.backend != "mine":
            return None  # a built-in backend, or another plugin's
        backend = PythonBackend(self.vocabulary, [self.eos_token_id], vocab_size)
        self.created.append(backend)
        return backend


VOCAB = ["<eos>", *"0123456789", "42", "x"]


def facade_with(*plugins) -> HookFacade:
    return HookFacade(get_plugin_manager(extra_plugins=plugins))


def test_hook_schedkit_create_structured_output_backend():
    plugin = FixedVocabulary(VOCAB, 0)
    facade = facade_with(plugin)
    config = StructuredOutputsConfig(backend="mine")
    backend = facade.create_structured_output_backend(eos_token_ids=(), config=config, tokenizer=None, vocab_size=64)
    assert plugin.created == [backend] and backend.vocab_size == 64

    # the manager builds it on first use and serves a request's grammar from it
    manager = StructuredOutputManager(
        lambda: facade.create_structured_output_backend(eos_token_ids=(), config=config, tokenizer=None, vocab_size=64))
    req = make_request("r", [1, 2], structured_outputs=StructuredOutputsParams(regex=r"\d\d"))
    manager.add_request(req)
    req.structured_output.compiled.result(timeout=5)
    assert manager.check_ready(req)
    bm, _ = manager.grammar_bitmask({"r": req}, {"r": 0}, {}, 1)
    assert bm.allowed(0) == [*range(1, 12)]  # the ten digits and "42"; not "x", not the end

    # another name goes to the other plugins (here nobody answers, nor does the built-in)
    tokenizer_free = facade.create_structured_output_backend(eos_token_ids=(),
        config=StructuredOutputsConfig(backend="theirs"), tokenizer=None, vocab_size=64)
    assert tokenizer_free is None and len(plugin.created) == 2


def test_a_backend_that_is_not_a_backend_is_a_plugin_error():
    class Broken:
        @hookimpl
        def schedkit_create_structured_output_backend(self, config):
            return "xgrammar"

    facade = facade_with(FixedVocabulary(VOCAB, 0), Broken())  # registered last: asked first
    with pytest.raises(PluginError, match="'Broken-1'.*must be a StructuredOutputBackend") as exc:
        facade.create_structured_output_backend(eos_token_ids=(), config=StructuredOutputsConfig(backend="mine"),
                                                tokenizer=None, vocab_size=64)
    assert exc.value.plugin == "Broken-1" and exc.value.hook == "schedkit_create_structured_output_backend"

    facade = facade_with(Broken(), FixedVocabulary(VOCAB, 0))
    mine = facade.create_structured_output_backend(eos_token_ids=(), config=StructuredOutputsConfig(backend="mine"),
                                                   tokenizer=None, vocab_size=64)
    assert isinstance(mine, PythonBackend)  # FixedVocabulary answered first
    with pytest.raises(PluginError, match="'Broken-0'") as exc:
        facade.create_structured_output_backend(eos_token_ids=(), config=StructuredOutputsConfig(backend="theirs"),
                                                tokenizer=None, vocab_size=64)
    assert exc.value.plugin == "Broken-0"


def test_a_plugin_backend_wins_over_the_builtin_for_builtin_names():
    class Everything(FixedVocabulary):
        @hookimpl
        def schedkit_create_structured_output_backend(self, config, vocab_size):
            return PythonBackend(self.vocabulary, [self.eos_token_id], vocab_size)

    facade = facade_with(Everything(VOCAB, 0))
    backend = facade.create_structured_output_backend(eos_token_ids=(),
        config=StructuredOutputsConfig(backend="auto"), tokenizer=None, vocab_size=32)
    assert isinstance(backend, PythonBackend)  # the built-in would have refused: no tokenizer
    g = backend.new_grammar(backend.compile(StructuredOutputsParams(choice=["42"])), 0)
    bm = GrammarBitmask.allocate(1, 32)
    g.fill_bitmask(backend.bitmask_view(bm), 0)
    assert bm.allowed(0) == [VOCAB.index("4"), VOCAB.index("42")]
