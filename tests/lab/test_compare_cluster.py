"""``schedkit compare`` on a config with replicas: each profile's router is simulated
over the replicas on one virtual clock, and the table and results.json carry the
cluster figures (load imbalance, re-routed, per replica)."""

from __future__ import annotations

import json

import yaml

from schedkit.cli import main

CONFIG = {
    "runner": {"kind": "simulated"},
    "cache": {"block_size": 16, "num_blocks": 4096},
    "scheduler": {"max_num_seqs": 32, "max_num_batched_tokens": 2048},
    "replicas": {"count": 4},
    "workload": {"kind": "poisson", "rate": 40, "num_requests": 300, "prompt_len": [64, 256],
                 "output_len": [8, 32], "shared_prefix": {"count": 40, "length": 512, "fraction": 0.9},
                 "seed": 3},
    "compare": {"profiles": [
        {"name": "rr", "router": {"policy": "round-robin"}},
        {"name": "affinity", "router": {"policy": "prefix-affinity"}},
    ]},
}


def test_compare_runs_router_profiles_on_the_cluster(tmp_path, capsys):
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump(CONFIG))
    assert main(["compare", str(path), "--output-dir", str(tmp_path / "out")]) == 0
    table = capsys.readouterr().out
    assert "imbalance, requests" in table and "replicas" in table
    res = json.loads((tmp_path / "out" / "results.json").read_text())
    rr, aff = res["summaries"]["rr"], res["summaries"]["affinity"]
    for s in (rr, aff):
        assert s["requests"] == 300
        assert s["cluster"]["num_replicas"] == 4
        assert sum(r["requests"] for r in s["cluster"]["replicas"]) == 300
    assert rr["cluster"]["router"]["policy"] == "round-robin"
    assert max(rr["cluster"]["router"]["num_routed"]) - min(rr["cluster"]["router"]["num_routed"]) <= 1
    # Forty shared 512-token prefixes over four replicas: affinity keeps each on one
    # replica, round-robin makes every replica compute every prefix.
    assert aff["prefix_hit_rate"] > rr["prefix_hit_rate"] + 0.1
    assert len(res["requests"]["rr"]) == 300


def test_a_router_profile_naming_an_unknown_router_fails_before_running(tmp_path, capsys):
    bad = {**CONFIG, "compare": {"profiles": [{"name": "rr", "router": {"policy": "round-robin"}},
                                              {"name": "x", "router": {"policy": "no-such-router"}}]}}
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(bad))
    assert main(["compare", str(path), "--output-dir", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "no-such-router" in err and "compare profile 'x'" in err
    assert not (tmp_path / "out" / "results.json").exists()
