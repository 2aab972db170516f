"""BRIDGE budget sweep: one model pass for every budget (issue #15), through the real stages on a local Ray.

Usage::

    python benchmarks/bench_budget_sweep.py [--rows 200] [--actors 1]

Sets up a run directory whose upstream stages are the committed 2-layer embedded model (as theta_bar), ``--rows``
tokenized embedded-corpus rows and a seeded scoring direction on its last layer, then times scoring + selection
only (no training, no evaluation):

* **single**: ``bridge_score`` + ``bridge_select`` at one budget (rho_p = rho_r = 0.75) in a fresh run directory;
* **sweep**: the budgets of ``tune/bridge_budgets.yaml`` (its rho_p x rho_r grid, 6 trials) one after another in
  another fresh run directory, each trial calling ``bridge_score`` (skipped after the first: its hash ignores the
  budgets) and ``bridge_select``, as the Tune trials do in their shared run directory.

``model_passes`` counts the executions of ``bridge_score`` in the sweep's manifest (target 1).  On a shared
machine the load drifts between the two timings, so the line before the last also gives the sweep over its own
first trial (which scores and selects one budget under the same load).  Last line:
``model_passes=… sweep_seconds_over_single=…`` (target ratio <= 1.5).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import shutil
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def budget_grid() -> list[dict]:
    """The trials of ``tune/bridge_budgets.yaml`` (grid over its params)."""
    import yaml

    params = yaml.safe_load((REPO / "tune" / "bridge_budgets.yaml").read_text())["params"]
    keys = sorted(params)
    return [{k.removeprefix("bridge."): v for k, v in zip(keys, values)}
            for values in itertools.product(*(params[k]["grid"] for k in keys))]


def prepare(work: Path, rows: int) -> dict:
    import pyarrow.parquet as pq
    import torch
    from safetensors.torch import save_file

    from raycurate.algorithms.bridge.token_utility import scoring_parameters
    from raycurate.data.corpus import generate_corpus
    from raycurate.data.tokenize import token_table, tokenize_batch
    from raycurate.models.loading import embedded_model_dir, load_model, load_tokenizer

    model_dir = embedded_model_dir()
    tokenizer = load_tokenizer(model_dir)
    records = [dict(r, source="bench", line=i + 1) for i, r in enumerate(generate_corpus(rows, seed=7))]
    token_rows, _ = tokenize_batch(tokenizer, records, 384)
    tokens = work / "tokens"
    tokens.mkdir()
    pq.write_table(token_table(token_rows), tokens / "part-0.parquet")
    gen = torch.Generator().manual_seed(0)
    direction = {k: torch.randn(v.shape, generator=gen) * 1e-2
                 for k, v in scoring_parameters(load_model(model_dir), 2).items()}
    save_file(direction, str(work / "direction.safetensors"))
    return {"tokens": tokens, "model": Path(model_dir), "direction": work / "direction.safetensors",
            "rows": len(token_rows)}


def new_run(root: Path, inputs: dict):
    """A run directory with the three upstream stages recorded (copies of the prepared files)."""
    from raycurate.rundir import RunDir
    from raycurate.stages.base import StageOutput, run_stage

    run = RunDir(root, lock=True)
    for stage, name, src in (("rows", "tokens", inputs["tokens"]), ("warmup", "model", inputs["model"]),
                             ("direction", "direction", inputs["direction"])):
        def body(out: Path, name: str = name, src: Path = src) -> StageOutput:
            (shutil.copytree if src.is_dir() else shutil.copy)(src, out / src.name)
            return StageOutput(outputs={name: src.name})

        run_stage(run, stage, body, config={"bench": stage})
    return run


def score_and_select(run, bridge_cfg, pool) -> None:
    from raycurate.stages.bridge import score_stage, select_stage

    score_stage(run, tokens_stage="rows", warmup_stage="warmup", direction_stage_name="direction",
                bridge_cfg=bridge_cfg, pool_cfg=pool, progress=False)
    select_stage(run, score_stage_name="bridge_score", bridge_cfg=bridge_cfg, pool_cfg=pool, progress=False)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=200)
    parser.add_argument("--actors", type=int, default=1)
    args = parser.parse_args()

    from raycurate.config.bridge import BridgeConfig
    from raycurate.config.pool import ActorPoolConfig
    from raycurate.stages.executor import configure_data_context
    from raycurate.stages.runtime import init_ray

    init_ray(num_cpus=2)
    configure_data_context(progress=False)
    work = Path(tempfile.mkdtemp(prefix="raycurate-budget-sweep-"))
    inputs = prepare(work, args.rows)
    pool = ActorPoolConfig(num_actors=args.actors, batch_size=32, shard_rows=max(1, args.rows // 2))
    base = BridgeConfig(last_layers=2, micro_batch=8)

    warm = new_run(work / "warm", inputs)  # worker start and imports, outside both timings
    score_and_select(warm, dataclasses.replace(base, rho_p=0.6, rho_r=0.6), pool)

    single = new_run(work / "single", inputs)
    started = time.perf_counter()
    score_and_select(single, base, pool)
    single_s = time.perf_counter() - started
    stages = json.loads(single.manifest_path.read_text())["stages"]
    print(f"single budget: {single_s:.1f} s (bridge_score {stages['bridge_score']['seconds']:.1f} s, "
          f"bridge_select {stages['bridge_select']['seconds']:.1f} s), {inputs['rows']} rows; stored scores "
          f"{stages['bridge_score']['metrics']['score_bytes'] / 1e6:.2f} MB "
          f"({stages['bridge_score']['metrics']['score_bytes'] / inputs['rows'] / 1e3:.1f} kB per row, "
          f"{stages['bridge_score']['metrics']['score_dtype']})")

    sweep = new_run(work / "sweep", inputs)
    trials = budget_grid()
    started = time.perf_counter()
    trial_s = []
    for trial in trials:
        t0 = time.perf_counter()
        score_and_select(sweep, dataclasses.replace(base, **trial), pool)
        trial_s.append(time.perf_counter() - t0)
        m = json.loads(sweep.manifest_path.read_text())["stages"]["bridge_select"]["metrics"]
        print(f"  trial {trial}: {trial_s[-1]:.1f} s, realised rho_p {m['prompt_budget_ratio']:.3f} "
              f"rho_r {m['response_budget_ratio']:.3f}")
    sweep_s = time.perf_counter() - started
    stages = json.loads(sweep.manifest_path.read_text())["stages"]
    passes = stages["bridge_score"]["executions"]
    print(f"sweep of {len(trials)} budgets: {sweep_s:.1f} s; bridge_score executions {passes}, bridge_select "
          f"executions {stages['bridge_select']['executions']}")
    shutil.rmtree(work, ignore_errors=True)
    print(f"sweep over its own first trial (same load): {sweep_s / trial_s[0]:.2f}")
    print(f"model_passes={passes} sweep_seconds_over_single={sweep_s / single_s:.2f}")


if __name__ == "__main__":
    main()
