"""The lab benchmarks catch policy regressions (docs/benchmarks.md, "Regression suite").

A baseline of a few lab benchmarks is saved into a temporary storage; then pytest is run
on them again with ``--benchmark-compare``, once unchanged (it must pass) and once per
injected regression, each of which must end as an ordinary pytest failure (exit code 1,
``FAILED <test> - serving metric ...`` in the short summary, one line per metric, no
traceback):

a. LIFO FCFS: new requests go to the head of the FCFS waiting queue.
b. Oldest-first victim: FCFS preempts ``running[0]`` instead of the latest admitted.
c. Inverted priority: the priority queue serves the largest ``priority`` first.
d. A worse third-party plugin: the ``--lab-config`` YAML's policy (an entry point of a
   package in a temporary folder on PYTHONPATH) is replaced by a worse version.
e. Fewer sequences: the ``--lab-config`` YAML's ``scheduler.max_num_seqs`` halved.

(a)-(c) are injected by a pytest plugin (``-p``) that patches schedkit's built-in policy
modules at import. Every run is a subprocess; they run two at a time.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

BUNDLED = ["benchmarks/test_lab.py::test_bundled_policy[fcfs]",
           "benchmarks/test_lab.py::test_bundled_policy[priority]"]
LAB = "benchmarks/test_lab.py::test_lab_config"
THIRDPARTY = f"{LAB}[lab:thirdparty]"
LAB_FCFS = f"{LAB}[lab:fcfs]"

pytestmark = pytest.mark.slow  # benchmark runs

INJECT = '''\
"""Patch one regression (SCHEDKIT_BENCH_REGRESSION) into schedkit's built-in policies."""
import os

import schedkit.policies.fcfs as fcfs
import schedkit.policies.priority as priority
from schedkit.core.queues import FCFSQueue, KeyedQueue
from schedkit.hookspecs import hookimpl


class LIFOQueue(FCFSQueue):
    __slots__ = ()

    def add(self, request):
        self._q.appendleft(request)


@hookimpl(trylast=True)
def lifo_queue():
    return LIFOQueue()


@hookimpl(trylast=True)
def oldest_victim(running):
    return running[0]


@hookimpl(trylast=True)
def inverted_priority_queue():
    return KeyedQueue(lambda r: (-r.priority, r.arrival_time, r.request_id))


PATCHES = {
    "lifo": (fcfs, "schedkit_create_waiting_queue", lifo_queue),
    "oldest-victim": (fcfs, "schedkit_select_preemption_victim", oldest_victim),
    "inverted-priority": (priority, "schedkit_create_waiting_queue", inverted_priority_queue),
}
module, name, impl = PATCHES[os.environ["SCHEDKIT_BENCH_REGRESSION"]]
assert hasattr(module, name), f"{module.__name__}.{name} is gone: update this test"
setattr(module, name, impl)
'''

POLICY = '''\
from schedkit import hookimpl
from schedkit.core.queues import KeyedQueue


class ShortestPromptFirst:
    """{doc}"""

    @hookimpl
    def schedkit_create_waiting_queue(self):
        return KeyedQueue(lambda r: ({sign}r.num_prompt_tokens, r.arrival_time, r.request_id))
'''

LAB_YAML = '''\
runner: {{kind: simulated}}
cache: {{block_size: 16, num_blocks: 300, enable_prefix_caching: true}}
scheduler: {{max_num_batched_tokens: 2048, max_num_seqs: {max_num_seqs}, max_model_len: 4096}}
workload:
  kind: poisson
  rate: 150.0
  num_requests: 200
  seed: 3
  prompt_len: {{dist: lognormal, median: 256, sigma: 0.8, min: 16, max: 2048}}
  output_len: {{dist: lognormal, median: 64, sigma: 1.2, min: 4, max: 1024}}
  tenants: [{{name: a, weight: 2}}, {{name: b, weight: 1}}]
  priorities: [{{priority: 0, weight: 1}}, {{priority: 1, weight: 3}}]
  shared_prefix: {{count: 4, length: 256, fraction: 0.5}}
  slo: {{ttft_s: 1.0, tpot_s: 0.05}}
compare:
  profiles:
    - {{name: thirdparty, policy: shortest-prompt}}
    - {{name: fcfs, policy: fcfs}}
'''


def plugin_site(where: Path, *, good: bool) -> Path:
    """A folder holding an installed third-party policy (module + dist-info with its
    ``schedkit`` entry point ``shortest-prompt``), to put on PYTHONPATH."""
    (where / "tmp_policy").mkdir(parents=True)
    doc = "Shortest prompt first." if good else "Regressed: longest prompt first."
    (where / "tmp_policy" / "__init__.py").write_text(POLICY.format(doc=doc, sign="" if good else "-"))
    dist = where / "tmp_policy-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: tmp-policy\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[schedkit]\nshortest-prompt = tmp_policy:ShortestPromptFirst\n")
    return where


def lab_yaml(where: Path, max_num_seqs: int) -> Path:
    """The --lab-config file; always named lab.yaml, so its cases keep their test ids."""
    where.mkdir(parents=True)
    path = where / "lab.yaml"
    path.write_text(LAB_YAML.format(max_num_seqs=max_num_seqs))
    return path


def run_benchmarks(storage: Path, lab: Path, site: Path, *args: str, tests: tuple[str, ...] = (*BUNDLED, LAB),
                   inject: Path | None = None, regression: str | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PYTEST_", "SCHEDKIT_")) and k not in ("CI", "COLUMNS")}
    paths = [str(site), *([str(inject)] if inject else []), str(ROOT), os.environ.get("PYTHONPATH", "")]
    env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    env["COLUMNS"] = "300"  # the short summary shows the whole first metric line
    cmd = [sys.executable, "-m", "pytest", *tests, f"--lab-config={lab}", "-q",
           f"--benchmark-storage=file://{storage}", *args]
    if regression is not None:
        env["SCHEDKIT_BENCH_REGRESSION"] = regression
        cmd += ["-p", "schedkit_bench_inject"]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, subprocess.CompletedProcess]:
    tmp = tmp_path_factory.mktemp("bench-regressions")
    storage = tmp / "storage"
    good, bad = plugin_site(tmp / "good", good=True), plugin_site(tmp / "bad", good=False)
    inject = tmp / "inject"
    inject.mkdir()
    (inject / "schedkit_bench_inject.py").write_text(INJECT)
    lab = lab_yaml(tmp / "lab", max_num_seqs=16)
    fewer = lab_yaml(tmp / "fewer-seqs", max_num_seqs=8)

    baseline = run_benchmarks(storage, lab, good, "--benchmark-autosave")
    assert baseline.returncode == 0, baseline.stdout + baseline.stderr
    variants = {  # name: (lab YAML, plugin site, options); regression runs are limited to
        # the benchmarks they can change, to stay quick
        "unchanged": (lab, good, {}),
        "lifo": (lab, good, dict(inject=inject, regression="lifo")),
        "oldest-victim": (lab, good, dict(inject=inject, regression="oldest-victim", tests=tuple(BUNDLED))),
        "inverted-priority": (lab, good, dict(inject=inject, regression="inverted-priority",
                                              tests=tuple(BUNDLED))),
        "bad-plugin": (lab, bad, dict(tests=(LAB, BUNDLED[0]))),
        "fewer-seqs": (fewer, good, dict(tests=(LAB,))),
    }
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = {name: pool.submit(run_benchmarks, storage, yaml, site, "--benchmark-compare", **kw)
                   for name, (yaml, site, kw) in variants.items()}
        return {name: f.result() for name, f in futures.items()}


def output(result: subprocess.CompletedProcess) -> str:
    return result.stdout + result.stderr


def failed_tests(result: subprocess.CompletedProcess) -> set[str]:
    return set(re.findall(r"^FAILED (\S+) - ", result.stdout, re.MULTILINE))


def test_an_unchanged_run_passes(runs):
    result = runs["unchanged"]
    assert result.returncode == 0, output(result)
    assert re.search(r"^4 passed in ", result.stdout, re.MULTILINE), output(result)
    assert "compared against " in result.stdout and "4 benchmarks, 0 regressed" in result.stdout


@pytest.mark.parametrize("regression, failing, passing, metrics", [
    ("lifo", {BUNDLED[0], LAB_FCFS}, {BUNDLED[1], THIRDPARTY}, {"max_wait_s", "ttft_p99_s"}),
    ("oldest-victim", {BUNDLED[0]}, {BUNDLED[1]}, {"recomputed_tokens", "max_preemptions_per_request"}),
    ("inverted-priority", {BUNDLED[1]}, {BUNDLED[0]}, {"prio0_ttft_mean_s", "prio0_ttft_p99_s"}),
    ("bad-plugin", {THIRDPARTY}, {BUNDLED[0], LAB_FCFS}, {"ttft_p50_s", "e2e_mean_s"}),
    ("fewer-seqs", {LAB_FCFS, THIRDPARTY}, set(), {"goodput_req_s", "ttft_p50_s"}),
])
def test_a_regression_fails_as_a_test_failure(runs, regression, failing, passing, metrics):
    result = runs[regression]
    text = output(result)
    assert result.returncode == 1, text
    assert "Traceback" not in text and "PerformanceRegression" not in text, text
    assert failed_tests(result) == failing, text
    counts = f"{len(failing)} failed" + (f", {len(passing)} passed" if passing else "")
    assert re.search(rf"^{counts} in ", result.stdout, re.MULTILINE), text
    # the summary names each failed test with its worst metric, and the failure lists
    # every regressed metric on a line of its own
    for test in failing:
        assert re.search(rf"^FAILED {re.escape(test)} - serving metric \w+: \S+ -> \S+ \([+-]\d",
                         result.stdout, re.MULTILINE), text
    regressed = set(re.findall(r"^serving metric (\w+): \S+ -> \S+ \([+-][\d.]+%\)$", result.stdout,
                               re.MULTILINE))
    assert regressed & metrics, f"expected one of {sorted(metrics)} to regress\n{text}"
