"""Held-out evaluation of a LoRA arm in two precisions: merged fp32 (the evaluation before ``eval.dtype``) vs the
frozen base in bf16 with the adapter unmerged in fp32 (issue #39).

Steps:

1. ``--train``: corpus -> ingest -> base_model -> tokenize -> ``train_mixed`` of ``--job`` (default
   ``jobs/real_proving_ground.yaml``, corpus seed 0) in ``runs/<--run>/``, the stages the real proving ground's
   mixed arm runs, with ``train.threads_per_worker=1`` (finished stages are skipped as in any run; ~25 min of
   training on 2 shared cores). Without ``--train`` the run must already hold them.
2. Both evaluations of ``train_mixed``'s adapter on the run's held-out questions, in this process (no Ray), with
   the job's eval settings (greedy + ``eval.samples`` sampled answers): ``old`` is ``eval.dtype=float32`` (the
   adapter merged in fp32, as evaluation loaded it before the option), ``new`` is ``eval.dtype=bfloat16`` (the
   frozen base in bf16, the adapter unmerged in fp32). Both models stay loaded and take turns per batch of
   ``eval.batch_size`` questions (:func:`evaluate_interleaved`), so a shared machine's load falls on both; wall and
   CPU seconds are summed per path, the model loads timed apart.
3. ``--cold-start``: a fresh Python process that imports what an evaluation task imports and loads the model (what
   the executor's cold tasks' ``max_calls=1`` costs per evaluation stage and task), and its peak RSS.

Prints ``uptime`` first and last (the machine may be shared), one line per path, and last::

    old_over_new=<eval wall s fp32 / bf16> cpu_old_over_new=... agreement=<share of identical greedy texts> \
    greedy_em_old=... greedy_em_new=... greedy_diff=... [lo, hi] sampled_em_old=... sampled_em_new=... \
    sampled_diff=... [lo, hi] gold_loss_max_abs_diff=...

(diff = new - old, paired percentile bootstrap 95% CI over questions, ``raycurate.algorithms.stats``.)

Usage::

    .venv/bin/python benchmarks/bench_eval_dtype.py --train --run evalspeed [--questions 300] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def job_config(job: str, run: str, runs_dir: str, extra: list[str]):
    from raycurate.config.loader import load_config
    from raycurate.config.schema import JobConfig

    overrides = ["pipeline=demo", "demo.methods=[sft]", "train.threads_per_worker=1", f"run.name={run}",
                 f"run.runs_dir={runs_dir}", "data.corpus_seed=0", *extra]
    return load_config(JobConfig, job, overrides)


def train(cfg) -> None:
    """The mixed arm's stages of the demo pipeline (pipelines/demo.py), nothing after ``train_mixed``."""
    from raycurate.pipelines.common import open_run, prepare_data
    from raycurate.stages.model_stages import train_stage

    run = open_run(cfg)
    prepare_data(run, cfg)
    train_stage(run, "train_mixed", tokens_stage="tokenize", init_stage="base_model", train_cfg=cfg.train)


def load(model_dir: str, dtype: str) -> tuple[object, float]:
    """(model, load seconds) of one path: ``eval.dtype=dtype`` (:func:`raycurate.models.precision.load_eval_model`)."""
    from raycurate.models.precision import load_eval_model

    start = time.perf_counter()
    model = load_eval_model(model_dir, dtype)
    return model, time.perf_counter() - start


def evaluate_interleaved(models: dict[str, object], tokenizer, rows: list[dict], cfg) -> tuple[dict, dict, dict]:
    """Every path on every batch of ``eval.batch_size`` questions, the paths' order alternating per batch, so a
    change in the machine's load falls on both: (results, wall seconds, CPU seconds) per path.

    A batch is what ``evaluate_rows`` would generate together anyway, and sampled answers are seeded per question,
    so the results equal one ``evaluate_rows`` call over all the rows.
    """
    from raycurate.stages.model_stages import evaluate_rows

    results: dict[str, list] = {name: [] for name in models}
    wall = dict.fromkeys(models, 0.0)
    cpu = dict.fromkeys(models, 0.0)
    size = cfg.eval.batch_size
    for index, start in enumerate(range(0, len(rows), size)):
        names = list(models) if index % 2 == 0 else list(models)[::-1]
        for name in names:
            t0, c0 = time.perf_counter(), time.process_time()
            results[name] += evaluate_rows(models[name], tokenizer, rows[start:start + size],
                                           max_length=cfg.data.max_length, max_new_tokens=cfg.eval.max_new_tokens,
                                           batch_size=size, samples=cfg.eval.samples, temperature=cfg.eval.temperature,
                                           seed=cfg.eval.seed, system_prompt=cfg.tokenize.system_prompt)
            wall[name] += time.perf_counter() - t0
            cpu[name] += time.process_time() - c0
        print(f"  batch {index}: {len(results[names[0]])} questions, wall so far "
              + ", ".join(f"{k} {v:.0f} s" for k, v in wall.items()) + f"; {uptime()}", flush=True)
    return results, wall, cpu


COLD_START = """
import sys, time
start = time.perf_counter()
import torch, transformers, peft, pyarrow  # what EvaluateUDF's task imports
from raycurate.models.loading import load_tokenizer
from raycurate.models.precision import load_eval_model
imported = time.perf_counter()
torch.set_num_threads(1)
load_tokenizer(sys.argv[1]); load_eval_model(sys.argv[1], sys.argv[2])
loaded = time.perf_counter()
# VmHWM, not ru_maxrss: Linux carries a parent's ru_maxrss through fork + exec
peak_kib = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmHWM:"))
print(f"{imported - start:.2f} {loaded - imported:.2f} {peak_kib / 1024:.0f}")
"""


def cold_start(model_dir: str, dtype: str) -> tuple[float, float, float]:
    """(import seconds, model load seconds, peak RSS MiB after the load) in a fresh interpreter."""
    out = subprocess.run([sys.executable, "-c", COLD_START, model_dir, dtype], capture_output=True, text=True,
                         check=True, cwd=ROOT).stdout.split()
    return float(out[-3]), float(out[-2]), float(out[-1])


def paired(old: list[float], new: list[float], seed: int = 0) -> tuple[float, float, float]:
    """new - old: mean and paired bootstrap 95% CI over questions."""
    import numpy as np

    from raycurate.algorithms.stats import paired_bootstrap_ci

    ci = paired_bootstrap_ci(np.asarray(new, dtype=float), np.asarray(old, dtype=float), seed=seed)
    return ci.value, ci.low, ci.high


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--job", default=str(ROOT / "jobs" / "real_proving_ground.yaml"))
    parser.add_argument("--run", default="evalspeed", help="run name under --runs-dir")
    parser.add_argument("--runs-dir", default=str(ROOT / "runs"))
    parser.add_argument("--train", action="store_true", help="run the stages up to train_mixed first")
    parser.add_argument("--questions", type=int, default=None, help="first N held-out questions (default: all)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of each evaluation")
    parser.add_argument("--cold-start", action="store_true", help="also time imports + load in a fresh process")
    parser.add_argument("--out", default=None, help="write per-question results of both paths here (json)")
    parser.add_argument("overrides", nargs="*", help="key=value job overrides (e.g. eval.samples=2)")
    args = parser.parse_args()

    print("uptime before:", uptime(), flush=True)
    cfg = job_config(args.job, args.run, args.runs_dir, args.overrides)
    if args.train:
        train(cfg)
    run_dir = Path(args.runs_dir) / args.run
    model_dir = str(run_dir / "train_mixed" / "model")
    rows = [json.loads(line) for line in (run_dir / "corpus" / "heldout.jsonl").read_text().splitlines() if line]
    rows = rows[:args.questions] if args.questions else rows
    print(f"{len(rows)} held-out questions, model {model_dir}", flush=True)

    import torch

    from raycurate.models.loading import load_tokenizer

    torch.set_num_threads(args.threads)
    models = {}
    for name, dtype in (("old", "float32"), ("new", "bfloat16")):
        models[name], load_s = load(model_dir, dtype)
        print(f"{name}: eval.dtype={dtype}, load {load_s:.1f} s", flush=True)
    results, wall, cpu = evaluate_interleaved(models, load_tokenizer(model_dir), rows, cfg)
    for name in models:
        print(f"{name}: eval {wall[name]:.1f} s wall, {cpu[name]:.1f} s CPU ({args.threads} torch thread)",
              flush=True)
    if args.cold_start:
        for name, dtype in (("old", "float32"), ("new", "bfloat16")):
            imports, load_s, rss = cold_start(model_dir, dtype)
            print(f"cold start {name}: imports {imports:.1f} s, load {load_s:.1f} s, peak RSS {rss:.0f} MiB",
                  flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(results))

    old, new = (sorted(results[k], key=lambda r: r["id"]) for k in ("old", "new"))
    agreement = sum(o["generated"] == n["generated"] for o, n in zip(old, new)) / len(old)
    line = [f"old_over_new={wall['old'] / wall['new']:.2f}", f"cpu_old_over_new={cpu['old'] / cpu['new']:.2f}",
            f"agreement={agreement:.3f}"]
    for metric, key in (("greedy", "correct"), ("sampled", "sampled_accuracy")):
        if key not in old[0]:
            continue
        o, n = [float(r[key]) for r in old], [float(r[key]) for r in new]
        diff, low, high = paired(o, n)
        line += [f"{metric}_em_old={sum(o) / len(o):.3f}", f"{metric}_em_new={sum(n) / len(n):.3f}",
                 f"{metric}_diff={diff:+.3f} [{low:+.3f}, {high:+.3f}]"]
    gold = [abs(o["gold_loss"] - n["gold_loss"]) for o, n in zip(old, new)]
    line.append(f"gold_loss_max_abs_diff={max(gold):.4f}")
    print("uptime after:", uptime())
    print(" ".join(line))


if __name__ == "__main__":
    main()
