"""``schedkit compare --ray``: the profiles and load points as Ray tasks give the same
``results.json``, to the byte, as the serial run; without Ray installed, ``--ray`` says
how to install it and the serial path does not need it."""

from __future__ import annotations

import json
import sys
import time

import pytest

from schedkit.cli import main
from schedkit.config import config_from_dict
from schedkit.lab.compare import Point, SerialRunner, compare, run_point, submit

pytestmark = pytest.mark.slow  # Ray clusters

# Loaded enough (a small batch, a small KV cache) that the two policies differ.
SWEEP_YAML = """\
runner: {kind: simulated}
cache: {block_size: 16, num_blocks: 200, enable_prefix_caching: true}
scheduler: {max_num_batched_tokens: 512, max_num_seqs: 8, max_model_len: 2048}
workload:
  kind: poisson
  rate: 20
  num_requests: 80
  prompt_len: [32, 384]
  output_len: {dist: lognormal, median: 48, sigma: 1.0, min: 4, max: 300}
  seed: 2
  slo: {ttft_s: 0.5}
compare:
  profiles:
    - {name: fcfs, policy: fcfs}
    - {name: sjf, policy: sjf}
"""
SWEEP = ["--sweep", "rate=50,200,800", "--seeds", "2,3"]  # two runs per point: means, intervals
# Routers compared on three simulated replicas: each point is a cluster simulation.
CLUSTER_YAML = """\
runner: {kind: simulated}
cache: {block_size: 16, num_blocks: 400, enable_prefix_caching: true}
scheduler: {max_num_batched_tokens: 512, max_num_seqs: 8, max_model_len: 2048}
replicas: {count: 3}
workload:
  kind: poisson
  rate: 20
  num_requests: 80
  prompt_len: [32, 256]
  output_len: {dist: lognormal, median: 32, sigma: 1.0, min: 4, max: 200}
  shared_prefix: {count: 12, length: 256, fraction: 0.8}
  seed: 2
  slo: {ttft_s: 0.5}
compare:
  profiles:
    - {name: fcfs, router: {policy: round-robin}}
    - {name: sjf, router: {policy: prefix-affinity}}
"""


@pytest.fixture(params=["engines", "cluster"])
def sweep_yaml(tmp_path, request):
    path = tmp_path / "sweep.yaml"
    path.write_text(SWEEP_YAML if request.param == "engines" else CLUSTER_YAML)
    return path


def test_ray_sweep_gives_the_serial_results_json_byte_for_byte(sweep_yaml, tmp_path, capsys):
    ray = pytest.importorskip("ray")
    assert not ray.is_initialized()
    t0 = time.perf_counter()
    assert main(["compare", str(sweep_yaml), "-o", str(tmp_path / "serial"), *SWEEP]) == 0
    t1 = time.perf_counter()
    serial_out = capsys.readouterr().out
    # --ray alone: a local cluster, started for this run and stopped after it.
    assert main(["compare", str(sweep_yaml), "-o", str(tmp_path / "ray"), *SWEEP, "--ray"]) == 0
    t2 = time.perf_counter()
    ray_out = capsys.readouterr().out
    assert not ray.is_initialized()
    serial = (tmp_path / "serial" / "results.json").read_bytes()
    assert (tmp_path / "ray" / "results.json").read_bytes() == serial
    assert ray_out.replace(str(tmp_path / "ray"), "DIR") == serial_out.replace(str(tmp_path / "serial"), "DIR")
    with capsys.disabled():
        print(f"\nserial {t1 - t0:.1f} s, --ray {t2 - t1:.1f} s")
    # Not a vacuous comparison: every point ran, and the policies came out differently.
    data = json.loads(serial)
    assert set(data["sweep"]) == {"fcfs", "sjf"}
    assert [p["rate"] for p in data["sweep"]["fcfs"]] == [50, 200, 800]
    assert len(data["requests"]["fcfs"]) == 2 * 80 and set(data["ci95"]) == {"fcfs", "sjf"}
    assert data["summaries"]["fcfs"] != data["summaries"]["sjf"]
    assert data["sweep"]["fcfs"] != data["sweep"]["sjf"]


def test_without_ray_installed_ray_says_how_to_install_it(sweep_yaml, tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray raises ImportError
    out = tmp_path / "out"
    assert main(["compare", str(sweep_yaml), "-o", str(out), *SWEEP, "--ray"]) == 2
    err = capsys.readouterr().err
    assert "error: schedkit compare --ray needs Ray" in err
    assert "pip install 'schedkit[cluster]'" in err and "pip install -e '.[cluster]'" in err
    assert not (out / "results.json").exists()
    # The serial path never imports Ray.
    assert main(["compare", str(sweep_yaml), "-o", str(out), *SWEEP]) == 0
    assert (out / "results.json").exists()


def test_without_ray_installed_init_ray_raises_the_hint(monkeypatch):
    from schedkit.cluster.ray_util import init_ray, require_ray
    from schedkit.errors import ConfigError

    monkeypatch.setitem(sys.modules, "ray", None)
    for call in (require_ray, lambda: init_ray(None), lambda: init_ray("auto")):
        with pytest.raises(ConfigError, match=r"schedkit\[cluster\]"):
            call()


def test_every_point_is_run_point_in_order(monkeypatch):
    """The serial runner runs each point through run_point when its result is asked
    for: the single-load comparison first, then the sweep's points, the profiles taking
    turns at each load."""
    import schedkit.lab.points as points_mod

    cfg = config_from_dict({"runner": {"kind": "fake"}, "workload": {"num_requests": 6, "seed": 1},
                            "compare": {"profiles": [{"name": "a", "policy": "fcfs"},
                                                     {"name": "b", "policy": "sjf"}]}})
    ran = []

    def spy(config, workload, **kw):
        ran.append((config.scheduler.policy, config.workload.rate, len(workload)))
        return run_point(config, workload, **kw)

    monkeypatch.setattr(points_mod, "run_point", spy)
    todo = submit(cfg, knob="rate", values=[2.0, 8.0], runner=SerialRunner())
    assert ran == []  # nothing runs before it is asked for
    result = todo.compared()
    assert ran == [("fcfs", cfg.workload.rate, 6), ("sjf", cfg.workload.rate, 6)]
    todo.swept()
    assert ran[2:] == [("fcfs", 2.0, 6), ("sjf", 2.0, 6), ("fcfs", 8.0, 6), ("sjf", 8.0, 6)]
    assert [p.knob for p in result.sweep["b"]] == [2.0, 8.0]
    assert result.summaries == compare(cfg).summaries


def test_a_runner_is_handed_every_point_at_once():
    cfg = config_from_dict({"runner": {"kind": "fake"}, "workload": {"num_requests": 4},
                            "compare": {"profiles": [{"name": "a", "policy": "fcfs"},
                                                     {"name": "b", "policy": "sjf"}]}})
    batches: list[list[Point]] = []

    class Recording(SerialRunner):
        def submit(self, points):
            batches.append(list(points))
            return super().submit(points)

    submit(cfg, knob="rate", values=[1.0, 2.0, 4.0], runner=Recording()).done()
    (points,) = batches
    assert len(points) == 2 + 2 * 3
    # One workload object per load, shared by the profiles (put in Ray's store once).
    assert len({id(p.workload) for p in points}) == 1 + 3
    assert [p.keep_metrics for p in points] == [True] * 2 + [False] * 6
