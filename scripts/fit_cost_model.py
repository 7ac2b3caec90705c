"""Fit a simulator profile to a real runner's measured step times.

    python scripts/fit_cost_model.py CONFIG.yaml --name NAME [-o PROFILE.json]
        [--grid-output 16] [--grid-prompts 32,256,1024] [--grid-batches 1,4,16,64]

CONFIG's runner should be the real one (kind: paged). Its workload runs first, then a
grid of bursts (every batch size with every prompt length; defaults in
schedkit.lab.calibrate.grid_phases) so the fit covers large prefills and large decode
batches. The profile goes to schedkit/runners/profiles/NAME.json unless -o is given.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from schedkit.config import load_config
from schedkit.lab.calibrate import fit, grid_phases, record_steps, relative_error, write_profile
from schedkit.runners.simulated import PROFILE_DIR


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("config")
    ap.add_argument("--name", required=True)
    ap.add_argument("-o", "--output")
    ap.add_argument("--grid-output", type=int, default=16, help="output tokens of each grid request")
    ap.add_argument("--grid-prompts", type=_ints, help="prompt lengths of the grid")
    ap.add_argument("--grid-batches", type=_ints, help="batch sizes of the grid")
    a = ap.parse_args()
    config = load_config(a.config)
    device = config.runner.device if config.runner.kind == "paged" else config.runner.kind
    phases = grid_phases(config, a.grid_output, a.grid_prompts, a.grid_batches)
    records = record_steps(config, phases=phases)
    model = fit(records)
    err = relative_error(records, model)
    out = Path(a.output) if a.output else PROFILE_DIR / f"{a.name}.json"
    write_profile(out, a.name, model, f"Fitted to {len(records)} steps of {a.config} "
                  f"({config.model.name}, {device}) and a grid of {len(phases)} bursts.",
                  len(records), err)
    print(f"{len(records)} steps, mean relative step error {err:.1%}: {model}\nwrote {out}")


if __name__ == "__main__":
    main()
