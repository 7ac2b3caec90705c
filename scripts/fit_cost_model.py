"""Fit a simulator profile to a real runner's measured step times.

    python scripts/fit_cost_model.py CONFIG.yaml --name NAME [-o PROFILE.json]

CONFIG's runner should be the real one (kind: paged); its workload should cover the
shapes to model (prefill-heavy and decode-heavy steps, short and long contexts). The
profile goes to schedkit/runners/profiles/NAME.json unless -o is given.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from schedkit.config import load_config
from schedkit.lab.calibrate import fit, record_steps, relative_error, write_profile
from schedkit.runners.simulated import PROFILE_DIR


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("config")
    ap.add_argument("--name", required=True)
    ap.add_argument("-o", "--output")
    a = ap.parse_args()
    config = load_config(a.config)
    records = record_steps(config)
    coef = fit(records)
    err = relative_error(records, coef)
    out = Path(a.output) if a.output else PROFILE_DIR / f"{a.name}.json"
    write_profile(out, a.name, coef, f"Fitted to {len(records)} steps of {a.config} "
                  f"({config.model.name}, {config.runner.device}).", len(records), err)
    print(f"{len(records)} steps, mean relative step error {err:.1%}: {coef}\nwrote {out}")


if __name__ == "__main__":
    main()
