"""Workloads: reproducible from the seed, trace replay, clear errors on bad input."""

from __future__ import annotations

import statistics

import pytest

from schedkit.config import config_from_dict
from schedkit.errors import ConfigError
from schedkit.lab.workloads import generate


def wl(**kw):
    return config_from_dict({"workload": kw}).workload


def test_same_seed_same_requests_other_seed_other_requests():
    spec = dict(kind="gamma", burstiness=2.0, num_requests=300, seed=7,
                prompt_len={"dist": "zipf", "min": 4, "max": 900},
                output_len={"dist": "lognormal", "median": 50, "max": 400},
                tenants=[{"name": "a", "weight": 3}, {"name": "b"}],
                priorities=[{"priority": 0}, {"priority": 2, "weight": 2}],
                shared_prefix={"count": 3, "length": 32, "fraction": 0.5})
    a, b = generate(wl(**spec)), generate(wl(**spec))
    assert a == b
    assert generate(wl(**{**spec, "seed": 8})) != a
    assert {r.tenant for r in a} == {"a", "b"} and {r.priority for r in a} == {0, 2}
    assert all(4 <= len(r.prompt_token_ids) - (32 if r.prompt_token_ids[:32] in _prefixes(a) else 0) <= 900
               for r in a)
    assert all(1 <= r.max_tokens <= 400 for r in a)
    assert [r.arrival_time for r in a] == sorted(r.arrival_time for r in a)


def _prefixes(reqs):
    firsts = [tuple(r.prompt_token_ids[:32]) for r in reqs]
    return [list(p) for p in {p for p in firsts if firsts.count(p) > 5}]


def test_arrival_processes_have_the_asked_rate_and_burstiness():
    for kind, cv in (("poisson", 1.0), ("gamma", 3.0), ("fixed", 0.0)):
        reqs = generate(wl(kind=kind, rate=5.0, burstiness=cv if kind == "gamma" else 1.0,
                           num_requests=4000, prompt_len=8, output_len=8))
        gaps = [b.arrival_time - a.arrival_time for a, b in zip(reqs, reqs[1:], strict=False)]
        mean = statistics.fmean(gaps)
        assert mean == pytest.approx(0.2, rel=0.1)
        assert statistics.pstdev(gaps) / mean == pytest.approx(cv, abs=0.15 * max(cv, 1))


def test_shared_prefix_fraction():
    reqs = generate(wl(num_requests=1000, prompt_len=10,
                       shared_prefix={"count": 2, "length": 64, "fraction": 0.25}))
    assert sum(len(r.prompt_token_ids) == 74 for r in reqs) == pytest.approx(250, abs=45)


def test_azure_replay_times_lengths_and_scaling():
    base = dict(kind="trace", num_requests=50,
                trace={"format": "azure", "path": "data/azure/AzureLLMInferenceTrace_conv.csv"})
    reqs = generate(wl(**base))
    # first rows of the file: 18:15:46.6805900,374,44 and 18:15:50.9951690,396,109
    assert reqs[0].arrival_time == 0.0 and len(reqs[0].prompt_token_ids) == 374 and reqs[0].max_tokens == 44
    assert reqs[1].arrival_time == pytest.approx(4.314579) and reqs[1].max_tokens == 109
    fast = generate(wl(**{**base, "trace": {**base["trace"], "time_scale": 0.5}}))
    assert fast[1].arrival_time == pytest.approx(reqs[1].arrival_time / 2)
    clipped = generate(wl(**{**base, "trace": {**base["trace"], "max_prompt_len": 380, "max_output_len": 50}}))
    assert [len(r.prompt_token_ids) for r in clipped[:2]] == [374, 380]
    assert [r.max_tokens for r in clipped[:2]] == [44, 50]


def test_mooncake_hash_ids_become_shared_prefixes():
    reqs = generate(wl(kind="trace", num_requests=40,
                       trace={"format": "mooncake", "path": "data/mooncake/conversation_trace.jsonl"}))
    # every conversation request starts with hash id 0: the same 512 tokens
    assert all(r.prompt_token_ids[:512] == reqs[0].prompt_token_ids[:512] for r in reqs)
    assert len(reqs[0].prompt_token_ids) == 6758 and reqs[0].max_tokens == 500
    assert reqs[0].prompt_token_ids[512:1024] != reqs[1].prompt_token_ids[512:1024]


def test_vidur_lengths_with_generated_arrivals():
    reqs = generate(wl(kind="trace", num_requests=100, rate=2.0, trace={
        "format": "vidur", "path": "data/vidur/arxiv_summarization_stats_llama2_tokenizer_filtered_v2.csv"}))
    assert len(reqs[0].prompt_token_ids) == 3772 and reqs[0].max_tokens == 54
    assert reqs[-1].arrival_time > reqs[0].arrival_time >= 0


def test_bad_workload_input(tmp_path):
    with pytest.raises(ConfigError, match="file not found"):
        generate(wl(kind="trace", trace={"format": "azure", "path": "no/such.csv"}))
    bad = tmp_path / "bad.csv"
    bad.write_text("time,prompt,output\n1,2,3\n")
    with pytest.raises(ConfigError, match="missing columns"):
        generate(wl(kind="trace", trace={"format": "azure", "path": str(bad)}))
    junk = tmp_path / "junk.jsonl"
    junk.write_text('{"timestamp": 0}\n')
    with pytest.raises(ConfigError, match="not a Mooncake trace line"):
        generate(wl(kind="trace", trace={"format": "mooncake", "path": str(junk)}))
    for spec, needle in ((dict(rate=-2), "workload.rate"), (dict(slo={"ttft": 1}), "workload.slo.ttft"),
                         (dict(kind="trace"), "needs a trace"), (dict(prompt_len=[9, 3]), "min"),
                         (dict(burstiness=0), "burstiness")):
        with pytest.raises(ConfigError, match=needle):
            wl(**spec)


AZURE_HEAD = "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.6805900,374,44\n"


@pytest.mark.parametrize(("fmt", "content", "needle"), [
    ("azure", b"TIMESTAMP,ContextTokens,GeneratedTokens\n", "no requests from row 0 on"),
    ("azure", b"TIMESTAMP,ContextTokens,GeneratedTokens\ngarbage\x00\xff\n", r"not UTF-8 text .*0xff"),
    ("mooncake", b"", "no requests from row 0 on"),
    ("mooncake", b"\xff\xfe{}\n", r"not UTF-8 text .*0xff"),
])
def test_an_empty_or_binary_trace_is_a_config_error(tmp_path, fmt, content, needle):
    path = tmp_path / "t.trace"
    path.write_bytes(content)
    with pytest.raises(ConfigError, match=needle):
        generate(wl(kind="trace", trace={"format": fmt, "path": str(path)}))


@pytest.mark.parametrize(("row", "needle"), [
    ("2023-11-16 18:15:47.1000000,abc,5", r":3: ContextTokens = 'abc': not a whole number"),
    ("2023-11-16 18:15:47.1000000,12,-5", r":3: GeneratedTokens = -5: a token count cannot be negative"),
    ("yesterday,12,5", r":3: TIMESTAMP = 'yesterday': not a time"),
    ("2023-11-16 18:15:45.0000000,12,5", r":3: TIMESTAMP = .* is earlier than the row before it"),
])
def test_a_bad_azure_row_is_named_by_file_and_line(tmp_path, row, needle):
    path = tmp_path / "t.csv"
    path.write_text(AZURE_HEAD + row + "\n")
    with pytest.raises(ConfigError, match=needle):
        generate(wl(kind="trace", trace={"format": "azure", "path": str(path)}))


def test_a_bad_vidur_row_is_named_by_file_and_line(tmp_path):
    path = tmp_path / "v.csv"
    path.write_text("num_prefill_tokens,num_decode_tokens\n100,20\n100,2.5\n")
    with pytest.raises(ConfigError, match=r"v.csv:3: num_decode_tokens = '2.5': not a whole number"):
        generate(wl(kind="trace", trace={"format": "vidur", "path": str(path)}))
