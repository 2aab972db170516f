"""Copy one pre-training attempt's loss curve (25-step means) and its benchmark figures into benchmarks/icl_attempts.

Usage: ``python benchmarks/record_icl_attempt.py RUN_DIR NAME [BENCH_JSON]`` writes ``icl_attempts/NAME.csv``
(step, block_len, mean training loss over the 25 steps ending there) and ``icl_attempts/NAME.json`` (the recipe
settings without the per-step losses, plus the benchmark result when given).
"""

from __future__ import annotations

import csv
import json
import sys
from pathlib import Path

ATTEMPTS = Path(__file__).resolve().parent / "icl_attempts"


def main(run_dir: str, name: str, bench_json: str | None = None, window: int = 25) -> None:
    rows = list(csv.DictReader(open(Path(run_dir) / "loss_curve.csv")))
    ATTEMPTS.mkdir(exist_ok=True)
    with open(ATTEMPTS / f"{name}.csv", "w") as out:
        out.write("step,block_len,mean_loss\n")
        for end in range(window, len(rows) + 1, window):
            chunk = rows[end - window:end]
            mean = sum(float(r["loss"]) for r in chunk) / window
            out.write(f"{chunk[-1]['step']},{chunk[-1]['block_len']},{mean:.4f}\n")
    record = {}
    recipe = Path(run_dir) / "recipe.json"
    if recipe.exists():
        record["recipe"] = {k: v for k, v in json.loads(recipe.read_text()).items() if k != "losses"}
    else:
        record["recipe"] = {"note": "run cut short; curve up to step " + rows[-1]["step"] if rows else "empty"}
    if bench_json:
        record["bench"] = json.loads(Path(bench_json).read_text())
    (ATTEMPTS / f"{name}.json").write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main(*sys.argv[1:])
