"""The built-in ``structured-outputs`` plugin, its registration, and the python backend
built from a real (small, local) tokenizer."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from schedkit.config import StructuredOutputsConfig, config_from_dict
from schedkit.core.grammar import StructuredOutputsParams
from schedkit.core.structured_output import GrammarBitmask
from schedkit.errors import ConfigError, RequestError
from schedkit.plugins.facade import HookFacade
from schedkit.plugins.manager import STRUCTURED_OUTPUTS_PLUGIN, describe_plugins, get_plugin_manager
from schedkit.structured import plugin
from schedkit.structured.python_backend import PythonBackend, token_strings_of

HOOK = "schedkit_create_structured_output_backend"


def create(backend: str, tokenizer, vocab_size: int = 336):
    return plugin.schedkit_create_structured_output_backend(
        config=StructuredOutputsConfig(backend=backend), tokenizer=tokenizer, vocab_size=vocab_size)


def test_registered_on_every_scheduler_last_and_listed():
    pm = get_plugin_manager(config_from_dict({"scheduler": {"policy": "priority"}}))
    names = [name for name, _ in describe_plugins(pm)]
    assert names == ["defaults", "priority", "fcfs", STRUCTURED_OUTPUTS_PLUGIN[0]]
    assert dict(describe_plugins(pm))["structured-outputs"] == [HOOK]
    (impl,) = getattr(pm.hook, HOOK).get_hookimpls()
    assert impl.trylast and impl.plugin_name == "structured-outputs"


def test_cannot_be_blocked_or_listed(monkeypatch):
    with pytest.raises(ConfigError, match="built in and always on.*structured_outputs.backend"):
        get_plugin_manager(config_from_dict({"plugins": [{"name": "structured-outputs"}]}))
    monkeypatch.setenv("SCHEDKIT_DISABLE_PLUGINS", "structured-outputs")
    with pytest.raises(ConfigError, match="disables the built-in 'structured-outputs'"):
        get_plugin_manager(config_from_dict({}))


def test_other_backend_names_are_left_to_plugins():
    assert create("mine", tokenizer=None) is None


@pytest.mark.parametrize("backend", ["auto", "python", "xgrammar"])
def test_no_tokenizer_is_a_request_error(backend):
    with pytest.raises(RequestError, match="need the model's tokenizer: set model.tokenizer"):
        create(backend, tokenizer=None)


def test_python_and_auto(bpe_tokenizer, monkeypatch):
    b = create("python", bpe_tokenizer)
    assert isinstance(b, PythonBackend) and b.vocab_size == 336
    assert b.stop_token_ids == (bpe_tokenizer.eos_token_id,)
    if plugin.xgrammar_available():
        assert create("auto", bpe_tokenizer).name == "xgrammar"
        assert create("xgrammar", bpe_tokenizer).name == "xgrammar"
    monkeypatch.setattr(plugin, "xgrammar_available", lambda: False)
    assert create("auto", bpe_tokenizer).name == "python"


def test_missing_xgrammar_is_a_request_error(bpe_tokenizer, monkeypatch):
    monkeypatch.setitem(sys.modules, "xgrammar", None)  # import xgrammar raises ImportError
    monkeypatch.delitem(sys.modules, "schedkit.structured.xgrammar_backend", raising=False)
    assert not plugin.xgrammar_available()
    with pytest.raises(RequestError, match=r"need the xgrammar package: pip install 'schedkit\[paged\]'"):
        create("xgrammar", bpe_tokenizer)
    assert create("auto", bpe_tokenizer).name == "python"


def test_through_the_facade(bpe_tokenizer):
    facade = HookFacade(get_plugin_manager(config_from_dict({})))
    b = facade.create_structured_output_backend(eos_token_ids=(), config=StructuredOutputsConfig(backend="python"),
                                                tokenizer=bpe_tokenizer, vocab_size=320)
    assert isinstance(b, PythonBackend)
    assert facade.create_structured_output_backend(eos_token_ids=(), config=StructuredOutputsConfig(backend="nobody"),
                                                   tokenizer=bpe_tokenizer, vocab_size=320) is None


def test_importing_the_plugin_and_python_backend_needs_no_torch():
    code = ("import sys; import schedkit.structured, schedkit.structured.plugin; "
            "from schedkit.plugins.manager import get_plugin_manager; get_plugin_manager(); "
            "from schedkit.structured import PythonBackend; "
            "b = PythonBackend(['a', 'b', '<eos>'], [2]); "
            "from schedkit.core.grammar import StructuredOutputsParams as P; "
            "b.new_grammar(b.compile(P(regex='a+b')), 0); "
            "bad = [m for m in ('torch', 'xgrammar', 'transformers') if m in sys.modules]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)


# --------------------------------------------------- the python backend from a tokenizer
def test_token_strings_of_a_byte_level_tokenizer(bpe_tokenizer):
    strings = token_strings_of(bpe_tokenizer)
    assert len(strings) == len(bpe_tokenizer)
    assert strings[bpe_tokenizer.eos_token_id] is None and strings[bpe_tokenizer.pad_token_id] is None
    pieces = bpe_tokenizer.convert_ids_to_tokens(list(range(len(bpe_tokenizer))))
    assert strings[pieces.index("Ġ")] == " "
    spaced = [i for i, p in enumerate(pieces) if p.startswith("Ġ") and len(p) > 1]
    assert spaced and all(strings[i] == " " + bpe_tokenizer.decode([i]).lstrip(" ") for i in spaced)
    assert strings[pieces.index("Ã")] is None  # the first byte of a two-byte character
    for i, s in enumerate(strings):
        if s is not None:
            assert bpe_tokenizer.decode([i]) == s


def test_token_strings_of_a_sentencepiece_style_tokenizer():
    pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(),
                                     decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    byte_tokens = [f"<0x{i:02X}>" for i in range(256)]
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>", *byte_tokens],
                                  show_progress=False)
    tok.train_from_iterator(["hello world yes no", "hello there"] * 10, trainer)
    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>", bos_token="<s>",
                                              unk_token="<unk>")
    strings = dict(zip(hf.convert_ids_to_tokens(list(range(len(hf)))), token_strings_of(hf), strict=True))
    assert strings["\u2581hello"] == " hello" and strings["\u2581"] == " " and strings["llo"] == "llo"
    assert strings["<0x41>"] == "A" and strings["<0x0A>"] == "\n" and strings["<0xC3>"] is None
    assert strings["<s>"] is None and strings["</s>"] is None and strings["<unk>"] is None

    b = PythonBackend.from_tokenizer(hf)
    g = b.new_grammar(b.compile(StructuredOutputsParams(regex=r" (hello|yes) world")), 0)
    ids = hf.encode("hello world", add_special_tokens=False)  # "▁hello", "▁world"
    assert g.accept_tokens("r", ids) and g.accept_tokens("r", [hf.eos_token_id]) and g.is_terminated()


def test_python_backend_from_a_tokenizer_walks_to_a_match(bpe_tokenizer):
    b = PythonBackend.from_tokenizer(bpe_tokenizer, 336, stop_token_ids=[bpe_tokenizer.eos_token_id])
    params = StructuredOutputsParams(regex=r'\{"age": [1-9][0-9]?\}')
    g = b.new_grammar(b.compile(params), 0)
    out: list[int] = []
    while not g.is_terminated():
        bm = GrammarBitmask.allocate(1, b.vocab_size)
        g.fill_bitmask(b.bitmask_view(bm), 0)
        ids = bm.allowed(0)
        assert ids and max(ids) < len(bpe_tokenizer)
        token = max(ids, key=lambda t: (len(bpe_tokenizer.decode([t])), -t))  # longest token first
        assert g.accept_tokens("r", [token])
        out.append(token)
        assert len(out) < 40
    text = bpe_tokenizer.decode(out[:-1])
    assert json.loads(text)["age"] >= 1 and out[-1] == bpe_tokenizer.eos_token_id
