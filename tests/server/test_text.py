"""TextStream: incremental detokenization and stop strings, on a byte-level BPE tokenizer
(tokens that split multi-byte characters) trained here."""

from __future__ import annotations

import random

import pytest

pytest.importorskip("tokenizers")

from schedkit.server.text import TextStream  # noqa: E402

CORPUS = ["héllo wörld, ça va? 日本語のテキスト 🙂🙃 naïve café", "the quick brown fox jumps over",
          "stop here STOP there ### end", "a b c d e f g h i j k l m n o p"] * 20


@pytest.fixture(scope="module")
def bpe():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=300, special_tokens=["<eos>"],
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")


def feed(stream, ids, sizes):
    out, i = [], 0
    for n in sizes:
        out.append(stream.add(ids[i:i + n]))
        i += n
        if stream.stopped:
            break
    out.append(stream.finish())
    return out


@pytest.mark.parametrize("seed", range(5))
def test_incremental_text_equals_decoding_everything(bpe, seed):
    rng = random.Random(seed)
    text = rng.choice(CORPUS[:4])
    prompt = bpe.encode("prompt: ")
    ids = bpe.encode(text)
    sizes = [rng.randint(1, 3) for _ in ids]
    parts = feed(TextStream(bpe, prompt), ids, sizes)
    assert "".join(parts) == bpe.decode(ids)
    assert "\ufffd" not in "".join(parts[:-1])  # never half a character


def test_stop_string_split_over_deltas_is_never_half_sent(bpe):
    ids = bpe.encode("stop here STOP there ### end")
    s = TextStream(bpe, [], stop=["STOP"])
    parts = feed(s, ids, [1] * len(ids))
    assert "".join(parts) == "stop here "
    assert s.stop_reason == "STOP"
    assert not any("ST" in p for p in parts)
    # tokens up to the one that completed the stop string were taken, no more
    assert bpe.decode(s.output_token_ids).startswith("stop here STOP")
    assert len(s.output_token_ids) < len(ids)


def test_include_stop_and_first_of_several(bpe):
    ids = bpe.encode("stop here STOP there ### end")
    s = TextStream(bpe, [], stop=["###", "there"], include_stop=True)
    assert "".join(feed(s, ids, [2] * len(ids))) == "stop here STOP there"
    assert s.stop_reason == "there"


def test_min_tokens_delays_stop_strings(bpe):
    ids = bpe.encode("a b c d e f g")
    first_a = TextStream(bpe, [], stop=["a"])
    assert "".join(feed(first_a, ids, [1] * len(ids))) == ""
    late = TextStream(bpe, [], stop=["a"], min_tokens=len(ids))
    assert "".join(feed(late, ids, [1] * len(ids))) == "a b c d e f g"
    assert not late.stopped


def test_special_tokens_are_skipped_unless_asked(bpe):
    eos = bpe.eos_token_id
    ids = bpe.encode("café") + [eos]
    assert "".join(feed(TextStream(bpe, []), ids, [1] * len(ids))) == "café"
    assert "".join(feed(TextStream(bpe, [], skip_special_tokens=False), ids, [1] * len(ids))) == "café<eos>"


def test_without_a_tokenizer_ids_are_counted_and_no_text_is_made():
    s = TextStream(None, [1, 2, 3])
    assert s.add([5, 6]) == "" and s.finish() == ""
    assert s.output_token_ids == [5, 6]
