"""Check the simulator against the real runner on one workload (target: within 10%).

    python scripts/validate_simulator.py CONFIG.yaml --profile NAME [--policy fcfs --policy sjf]

Runs CONFIG's workload on its real runner (kind: paged) and on the simulator with the
given profile, for each policy, and prints TTFT and TPOT p50/p90 from both with the
relative error. Writes the numbers as JSON with -o.
"""

from __future__ import annotations

import argparse
import json

from schedkit.config import ProfileConfig, SimulatedRunnerConfig, load_config
from schedkit.lab.compare import profile_config
from schedkit.lab.metrics import summarize
from schedkit.lab.simulate import run_workload
from schedkit.lab.workloads import generate


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("config")
    ap.add_argument("--profile", required=True)
    ap.add_argument("--policy", action="append", default=[])
    ap.add_argument("-o", "--output")
    a = ap.parse_args()
    base = load_config(a.config)
    workload = generate(base.workload, base.runner.vocab_size)
    rows = {}
    for policy in a.policy or ["fcfs"]:
        real_cfg = profile_config(base, ProfileConfig(name=policy, policy=policy))
        sim_runner = SimulatedRunnerConfig(vocab_size=real_cfg.runner.vocab_size,
                                           eos_token_id=real_cfg.runner.eos_token_id,
                                           profile=a.profile)
        sim_cfg = real_cfg.model_copy(update={"runner": sim_runner})
        real = summarize(run_workload(real_cfg, workload).metrics)
        sim = summarize(run_workload(sim_cfg, workload).metrics)
        for metric in ("ttft_s", "tpot_s"):
            for q in ("p50", "p90"):
                r, s = real[metric][q], sim[metric][q]
                rows[f"{policy} {metric[:-2]} {q}"] = {"real": r, "sim": s, "error": abs(s - r) / r}
    for k, v in rows.items():
        print(f"{k:<22} real {v['real'] * 1e3:9.2f} ms  sim {v['sim'] * 1e3:9.2f} ms  error {v['error']:6.1%}")
    if a.output:
        with open(a.output, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
