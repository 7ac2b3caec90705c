"""How an OpenAI request becomes engine requests: the Server's choices, without a server."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

pytest.importorskip("prometheus_client")

from schedkit.config import config_from_dict  # noqa: E402
from schedkit.engine.tokenizer import model_eos_ids  # noqa: E402
from schedkit.server.metrics import ServerMetrics  # noqa: E402
from schedkit.server.protocol import APIError, CompletionRequest, parse_body  # noqa: E402
from schedkit.server.serving import Server  # noqa: E402

BYTE_LM = Path(__file__).resolve().parents[1] / "fixtures" / "byte-lm"


def server(**runner) -> Server:
    cfg = config_from_dict({"runner": {"kind": "fake", "vocab_size": 64, "eos_token_id": 2, **runner},
                            "scheduler": {"max_model_len": 32}})
    return Server(cfg, None, None, ServerMetrics("m", "fcfs", []), "m", model_eos_ids=(2, 7))


def choices(s: Server, **body):
    req = parse_body(CompletionRequest, {"prompt": [5, 6, 7], **body})
    return s.make_choices(req, "r", [list(p) for p in req.prompts()], req.max_tokens, "max_tokens")


def test_the_models_other_end_tokens_stop_unless_eos_is_ignored():
    s = server()
    (c,) = choices(s, stop_token_ids=[9])
    assert c.params.eos_token_id == 2 and c.params.stop_token_ids == (9, 7)
    (c,) = choices(s, ignore_eos=True)
    assert c.params.stop_token_ids == () and c.params.ignore_eos


def test_n_choices_get_their_own_ids_and_seeds():
    cs = choices(server(), n=3, seed=10)
    assert [c.index for c in cs] == [0, 1, 2]
    assert [c.params.seed for c in cs] == [10, 11, 12]
    assert len({c.request_id for c in cs}) == 3 and all(c.request_id.startswith("r-") for c in cs)


def test_limits_name_the_field():
    with pytest.raises(APIError, match="max_model_len") as e:
        choices(server(), max_tokens=30)
    assert e.value.param == "max_tokens"
    with pytest.raises(APIError, match="min_tokens") as e:
        choices(server(), max_tokens=2, min_tokens=3)
    assert e.value.status == 400


def test_model_eos_ids_read_config_and_generation_config(tmp_path):
    folder = tmp_path / "lm"
    shutil.copytree(BYTE_LM, folder)
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(cfg | {"eos_token_id": 3}))
    gen = json.loads((folder / "generation_config.json").read_text())
    (folder / "generation_config.json").write_text(json.dumps(gen | {"eos_token_id": [3, 4]}))
    config = config_from_dict({"model": {"name": str(folder)}, "runner": {"kind": "paged"}})
    assert model_eos_ids(config) == (3, 4)
    assert model_eos_ids(config_from_dict({})) == ()
