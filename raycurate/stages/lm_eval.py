"""lm-eval on a checkpoint: named harness tasks and local YAML tasks over the embedded held-out set.

:func:`lm_eval_stage` / :func:`run_lm_eval` hand a model loaded by :func:`raycurate.models.loading.load_model` to
lm-eval as ``HFLM(pretrained=model, tokenizer=tok)`` after :func:`force_offline`; :func:`load_named_tasks` loads
each named task's dataset from the local HF cache before the model (a missing one raises
:class:`BenchmarkDataMissing`); :func:`write_local_tasks` writes ``raycurate_heldout_em`` and
``raycurate_heldout_gold_ll`` (scored by :mod:`raycurate.algorithms.eval_summary`, prompts rendered as in training);
:func:`flatten_results` returns ``"<task>/<metric>[/<filter>]"`` numbers.  Decisions: docs/tune_eval.md.
"""

from __future__ import annotations

import difflib
import functools
import json
import logging
import os
import re
import sys
import tempfile
from pathlib import Path
from typing import Any, Iterable

from raycurate.config.schema import CODE_TASKS, LOCAL_LM_EVAL_TASKS
from raycurate.rundir import RunDir
from raycurate.stages.base import StageOutput, output_path, run_stage

log = logging.getLogger("raycurate")

EXACT_MATCH_TASK, GOLD_LOGLIK_TASK = LOCAL_LM_EVAL_TASKS
LOCAL_TASKS = (EXACT_MATCH_TASK, GOLD_LOGLIK_TASK)
HELDOUT_FILE = "heldout.jsonl"
PAPER_TASKS = ("arc_challenge", "hellaswag", "mmlu", "humaneval", "gsm8k", "minerva_math", "ifeval")
_CODE_TASKS = CODE_TASKS  # tasks that execute model-written code (the job config checks them too)

_UTILS_PY = '''"""lm-eval hooks for the raycurate held-out tasks (written by raycurate.stages.lm_eval)."""

from raycurate.algorithms.eval_summary import heldout_exact_match, heldout_gold_loglikelihood  # noqa: F401
'''

_TASK_HEAD = """\
task: {task}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data_file}
test_split: test
"""

_EXACT_MATCH_YAML = _TASK_HEAD + """\
output_type: generate_until
doc_to_text: prompt
doc_to_target: answer
num_fewshot: 0
generation_kwargs:
  until: []
  do_sample: false
  max_gen_toks: {max_gen_toks}
process_results: !function utils.heldout_exact_match
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
  - metric: answer_format
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
"""

_GOLD_LOGLIK_YAML = _TASK_HEAD + """\
output_type: loglikelihood
doc_to_text: prompt
doc_to_target: response
target_delimiter: ""
num_fewshot: 0
process_results: !function utils.heldout_gold_loglikelihood
metric_list:
  - metric: gold_loglik
    aggregation: mean
    higher_is_better: true
  - metric: gold_nll_per_byte
    aggregation: mean
    higher_is_better: false
  - metric: gold_greedy
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
"""


class BenchmarkDataMissing(RuntimeError):
    """A named lm-eval task's dataset is not in the local Hugging Face cache (and the run is offline)."""


def write_local_tasks(heldout_rows: list[dict], dest: Path, *, max_gen_toks: int = 256) -> list[str]:
    """Write lm-eval YAML tasks over the embedded held-out set into ``dest``.

    Args:
        heldout_rows: Held-out records in the corpus schema (``id``, ``prompt``, ``response``, ``domain`` and the
            gold final answer in ``label.answer``), e.g. the ``heldout`` output of the corpus stage.
        dest: Folder for ``heldout.jsonl``, one YAML per task and the ``utils.py`` hooks; created if missing.
        max_gen_toks: Generation budget of the exact-match task.

    Returns:
        The task names, for :func:`run_lm_eval` with ``local_task_dir=dest``.
    """
    if not heldout_rows:
        raise ValueError("no held-out rows to build lm-eval tasks from; set corpus.heldout_rows > 0")
    bad = [row.get("id", i) for i, row in enumerate(heldout_rows)
           if not (row.get("prompt") and row.get("response") and (row.get("label") or {}).get("answer"))]
    if bad:
        raise ValueError(f"held-out rows {bad[:5]} lack a prompt, a response or label.answer; lm-eval tasks need "
                         "all three (use the corpus stage's heldout.jsonl)")
    if max_gen_toks < 1:
        raise ValueError(f"max_gen_toks must be >= 1, got {max_gen_toks}")
    dest = Path(dest).resolve()
    dest.mkdir(parents=True, exist_ok=True)
    docs = [{"id": row["id"], "domain": row.get("domain", ""), "prompt": row["prompt"], "response": row["response"],
             "answer": row["label"]["answer"]} for row in heldout_rows]
    data_file = dest / HELDOUT_FILE
    data_file.write_text("".join(json.dumps(doc) + "\n" for doc in docs))
    (dest / "utils.py").write_text(_UTILS_PY)
    quoted = json.dumps(str(data_file))  # a JSON string is a valid double-quoted YAML scalar
    (dest / f"{EXACT_MATCH_TASK}.yaml").write_text(
        _EXACT_MATCH_YAML.format(task=EXACT_MATCH_TASK, data_file=quoted, max_gen_toks=max_gen_toks))
    (dest / f"{GOLD_LOGLIK_TASK}.yaml").write_text(_GOLD_LOGLIK_YAML.format(task=GOLD_LOGLIK_TASK, data_file=quoted))
    return list(LOCAL_TASKS)


def run_lm_eval_private(model_dir: str, tasks: list[str], heldout_rows: list[dict] | None, *, max_gen_toks: int,
                        **kwargs: Any) -> dict:
    """:func:`run_lm_eval` with the local held-out tasks written to a private temp folder (``mkdtemp``, mode
    0700) that is removed afterwards, so the generated ``utils.py`` lm-eval imports cannot be replaced."""
    if heldout_rows is None:
        return run_lm_eval(model_dir, tasks, local_task_dir=None, **kwargs)
    with tempfile.TemporaryDirectory(prefix="raycurate-lm-eval-") as private:
        write_local_tasks(heldout_rows, Path(private), max_gen_toks=max_gen_toks)
        return run_lm_eval(model_dir, tasks, local_task_dir=private, **kwargs)


def force_offline() -> None:
    """Make Hugging Face libraries fail fast instead of reaching for the network, even if already imported."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["HF_DATASETS_OFFLINE"] = "1"
    hub_constants: Any = sys.modules.get("huggingface_hub.constants")
    if hub_constants is not None:
        hub_constants.HF_HUB_OFFLINE = True
    datasets_config: Any = sys.modules.get("datasets.config")
    if datasets_config is not None:
        datasets_config.HF_HUB_OFFLINE = True
        datasets_config.HF_DATASETS_OFFLINE = True


def local_task_names(local_task_dir: str | Path) -> list[str]:
    """Task names declared (``task: NAME``) by the YAML files in ``local_task_dir``."""
    names = []
    for path in sorted(Path(local_task_dir).glob("*.yaml")):
        match = re.search(r"^task:\s*(\S+)\s*$", path.read_text(), flags=re.MULTILINE)
        if match:
            names.append(match.group(1))
    return names


def _missing_data_message(task: str, exc: BaseException) -> str:
    cache = os.environ.get("HF_DATASETS_CACHE") or os.path.join(
        os.environ.get("HF_HOME", "~/.cache/huggingface"), "datasets")
    return (
        f"lm-eval task '{task}' needs its dataset locally, and it is not in the Hugging Face cache ({exc}). "
        f"This run is offline and never downloads. On a machine with network access, load the task once "
        f"(e.g. `lm_eval --model hf --model_args pretrained=<any small model> --tasks {task} --limit 1`, which "
        f"fills the cache), then copy the cache here and point HF_DATASETS_CACHE (datasets cache, now "
        f"{cache}) and HF_HUB_CACHE / HF_HOME at it; or drop '{task}' from the task list."
    )


def _check_known(manager: Any, names: list[str]) -> None:
    unknown = [name for name in names if name not in manager.task_index]
    if unknown:
        hints = {name: difflib.get_close_matches(name, manager.all_tasks, n=3) for name in unknown}
        raise ValueError(f"unknown lm-eval tasks {unknown} (close matches: {hints}); use harness task names such "
                         f"as {list(PAPER_TASKS)} or the local tasks {list(LOCAL_TASKS)}")


def load_named_tasks(manager: Any, names: list[str]) -> dict:
    """Load harness tasks one at a time so a missing dataset is reported with its task's name.

    Args:
        manager: An ``lm_eval.tasks.TaskManager`` that indexes the tasks.
        names: Task, group or tag names.

    Returns:
        lm-eval's task dict (``tasks``, ``groups``, ``group_map``) for all of ``names``.

    Raises:
        ValueError: a name lm-eval does not know.
        BenchmarkDataMissing: a task's dataset is not available offline.
    """
    _check_known(manager, names)
    merged: dict[str, dict] = {"tasks": {}, "groups": {}, "group_map": {}}
    for name in names:
        try:
            part = manager.load([name])
        except OSError as exc:  # datasets' offline ConnectionError, DatasetNotFoundError, FileNotFoundError
            raise BenchmarkDataMissing(_missing_data_message(name, exc)) from exc
        for key in merged:
            merged[key].update(part.get(key, {}))
    return merged


@functools.lru_cache(maxsize=1)
def harness_task_manager() -> Any:
    """lm-eval's index of its built-in tasks (scanning ~10k YAML files takes seconds, so it is built once)."""
    from lm_eval.tasks import TaskManager

    return TaskManager()


class _PreloadedTasks:
    """A TaskManager stand-in whose ``load`` returns tasks loaded (and checked) earlier."""

    def __init__(self, manager: Any, loaded: dict):
        self._manager = manager
        self._loaded = loaded

    def load(self, task_list: Any) -> dict:
        return self._loaded

    def __getattr__(self, name: str) -> Any:
        return getattr(self._manager, name)


def _prompt_tokenizer(tokenizer: Any) -> Any:
    """The tokenizer with BOS rendered in front of the chat template when the template omits it.

    Training prompts are ``[BOS] + render(conversation)`` (:mod:`raycurate.data.tokenize`); lm-eval encodes the
    rendered text without adding special tokens, so BOS has to be part of the text.
    """
    template = getattr(tokenizer, "chat_template", None)
    bos = tokenizer.bos_token
    if not template or not bos:
        return tokenizer
    probe = tokenizer.apply_chat_template([{"role": "user", "content": "x"}], tokenize=False,
                                          add_generation_prompt=True)
    if not probe.startswith(bos):
        tokenizer.chat_template = "{{ bos_token }}" + template
    return tokenizer


def flatten_results(results: dict) -> dict[str, float]:
    """Flat ``{"<task>/<metric>[/<filter>]": value}`` from lm-eval's results (numbers only)."""
    flat: dict[str, float] = {}
    for section in ("results", "groups"):
        for task, metrics in (results.get(section) or {}).items():
            for key, value in metrics.items():
                if isinstance(value, bool) or not isinstance(value, (int, float)) or key == "sample_len":
                    continue
                metric, _, filter_name = key.partition(",")
                name = f"{task}/{metric}" if filter_name in ("", "none") else f"{task}/{metric}/{filter_name}"
                flat[name] = float(value)
    for task, counts in (results.get("n-samples") or {}).items():
        flat[f"{task}/samples"] = float(counts.get("effective", counts.get("original", 0)))
    return flat


def run_lm_eval(
    model_dir: str,
    tasks: list[str],
    *,
    local_task_dir: str | None = None,
    num_fewshot: int | None = None,
    limit: int | None = None,
    batch_size: int | str = 8,
    device: str | None = None,
    chat_template_named: bool = False,
    allow_code_execution: bool = False,
    seed: int = 1234,
    samples_path: str | None = None,
) -> dict[str, float]:
    """Evaluate a local checkpoint with lm-eval.

    Args:
        model_dir: Local HF checkpoint directory (model and tokenizer).
        tasks: Task names: local ones (declared in ``local_task_dir``) and/or harness tasks.
        local_task_dir: Folder written by :func:`write_local_tasks` (or any folder of lm-eval YAML tasks).
        num_fewshot: Few-shot examples for harness tasks (``None``: each task's default; tasks fixed at 0 stay 0).
        limit: Documents per task (``None``: all).
        batch_size: lm-eval batch size (an int, or ``"auto"`` on GPU).
        device: ``"cpu"``, ``"cuda"`` ...; default CUDA when available.
        chat_template_named: Render harness-task prompts with the chat template too (local tasks always are).
        allow_code_execution: Needed for tasks that run model-written code (HumanEval).
        seed: lm-eval's python / numpy / torch / few-shot seeds.
        samples_path: When given, the local tasks' per-document records (see :func:`sample_records`) are written
            there as JSON lines (harness tasks are not logged: their prompts can run to many megabytes).

    Returns:
        Flat metrics (see the module docstring), e.g. ``{"raycurate_heldout_em/exact_match": 0.25, ...}``.

    Raises:
        ValueError: unknown task names, or code tasks without ``allow_code_execution``.
        BenchmarkDataMissing: a harness task's dataset is not available locally (raised before the model loads).
    """
    if not tasks:
        raise ValueError("no lm-eval tasks given")
    local_names = set(local_task_names(local_task_dir)) if local_task_dir else set()
    local = [name for name in tasks if name in local_names]
    named = [name for name in tasks if name not in local_names]
    code_tasks = [name for name in named if name.startswith(_CODE_TASKS)]
    if code_tasks and not allow_code_execution:
        raise ValueError(f"tasks {code_tasks} execute model-written code; pass allow_code_execution=True (in a "
                         "sandboxed environment) or drop them")
    force_offline()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if allow_code_execution:
        os.environ["HF_ALLOW_CODE_EVAL"] = "1"

    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    jobs = []  # (task manager, task names, is local)
    if named:
        manager = harness_task_manager()
        jobs.append((_PreloadedTasks(manager, load_named_tasks(manager, named)), named, False))
    if local:
        manager = TaskManager(include_path=str(local_task_dir), include_defaults=False)
        jobs.append((manager, local, True))
    lm = _hf_lm(model_dir, batch_size=batch_size, device=device)
    has_template = bool(getattr(lm.tokenizer, "chat_template", None))
    flat: dict[str, float] = {}
    for manager, names, is_local in jobs:
        log_samples = is_local and samples_path is not None
        results = simple_evaluate(
            model=lm, tasks=names, task_manager=manager, num_fewshot=num_fewshot, limit=limit,
            apply_chat_template=has_template and (is_local or chat_template_named),
            log_samples=log_samples, bootstrap_iters=0, confirm_run_unsafe_code=allow_code_execution,
            random_seed=seed, numpy_random_seed=seed, torch_random_seed=seed, fewshot_random_seed=seed,
        ) or {}
        flat.update(flatten_results(results))
        if log_samples and samples_path is not None:
            Path(samples_path).write_text("".join(json.dumps(r) + "\n" for r in sample_records(results)))
    return flat


def sample_records(results: dict) -> list[dict]:
    """Per-document records from lm-eval results logged with ``log_samples=True``.

    Returns:
        One dict per task and document: ``task``, ``doc_id``, ``id`` (the held-out row id when the doc has one),
        ``context`` (the rendered prompt), ``response`` (the filtered model output: generated text, or
        ``[log-likelihood, is_greedy]``) and the document's metric values.
    """
    records = []
    for task, samples in (results.get("samples") or {}).items():
        metric_names = {key.partition(",")[0] for key in (results.get("results") or {}).get(task, {})}
        for sample in samples:
            response = sample["filtered_resps"][0] if sample.get("filtered_resps") else None
            records.append({
                "task": task, "doc_id": sample["doc_id"], "id": (sample.get("doc") or {}).get("id"),
                "context": sample["arguments"][0][0],
                "response": list(response) if isinstance(response, tuple) else response,
                **{k: v for k, v in sample.items() if k in metric_names and isinstance(v, (int, float))},
            })
    return records


def _hf_lm(model_dir: str, *, batch_size: int | str, device: str | None) -> Any:
    from lm_eval.models.huggingface import HFLM

    from raycurate.models.loading import best_device, load_model, load_tokenizer

    device = device or best_device()
    tokenizer = _prompt_tokenizer(load_tokenizer(model_dir))
    model = load_model(model_dir, device=device).eval()
    return HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size)


def lm_eval_stage(
    run: RunDir,
    stage: str,
    *,
    model_stage: str,
    heldout_stage: str | None,
    tasks: Iterable[str] = LOCAL_TASKS,
    num_fewshot: int | None = None,
    limit: int | None = None,
    batch_size: int = 8,
    max_gen_toks: int = 256,
    domain: str = "math",
    allow_code_execution: bool = False,
    force: bool = False,
) -> dict:
    """Run lm-eval on ``model_stage``'s checkpoint as one Ray task; writes ``lm_eval.json``.

    The local held-out tasks (YAML files and the ``utils.py`` lm-eval imports) are written from ``heldout_stage``'s
    ``heldout`` output into a private temp folder on the machine that runs lm-eval (never the shared scratch,
    where another user could swap the imported code); their per-question records go to
    ``heldout_samples.jsonl`` (output ``samples``).  The manifest metrics are the flat lm-eval metrics plus the
    BRIDGE aggregates (``general_avg``, ``target``, ``overall_avg`` for ``domain``) when the named benchmarks
    allow them.
    """
    from raycurate.algorithms.eval_summary import DOMAINS, benchmark_scores, summarize_benchmarks
    from raycurate.stages.runtime import run_as_task

    tasks = list(tasks)
    if domain not in DOMAINS:
        raise ValueError(f"lm_eval_stage: unknown domain {domain!r}; use one of {list(DOMAINS)}")
    model_dir = output_path(run, model_stage, "model")
    local = [name for name in tasks if name in LOCAL_TASKS]
    if local and (heldout_stage is None or run.stage_record(heldout_stage) is None):
        raise ValueError(f"lm-eval tasks {local} run over the embedded corpus's held-out set, which this run does "
                         "not have; use named harness tasks (e.g. arc_challenge,hellaswag,mmlu) for your own data")
    heldout = output_path(run, heldout_stage, "heldout") if local and heldout_stage is not None else None

    def body(out: Path) -> StageOutput:
        rows = None
        if heldout is not None:
            rows = [json.loads(line) for line in heldout.read_text().splitlines() if line.strip()]
        samples = out / "heldout_samples.jsonl"
        metrics = run_as_task(run_lm_eval_private, str(model_dir), tasks, rows, max_gen_toks=max_gen_toks,
                              num_fewshot=num_fewshot, limit=limit, batch_size=batch_size,
                              allow_code_execution=allow_code_execution, samples_path=str(samples))
        benchmarks = benchmark_scores(metrics)
        summary = summarize_benchmarks(benchmarks, domain)
        (out / "lm_eval.json").write_text(json.dumps(
            {"model_dir": str(model_dir), "tasks": tasks, "domain": domain, "limit": limit,
             "num_fewshot": num_fewshot, "metrics": metrics, "benchmarks": benchmarks, "summary": summary},
            indent=2) + "\n")
        log.info("%s: %s", stage, ", ".join(f"{k} {v:.4f}" for k, v in sorted(metrics.items())
                                             if not k.endswith(("_stderr", "/samples"))))
        outputs = {"lm_eval": "lm_eval.json"}
        if samples.exists():
            outputs["samples"] = samples.name
        # The manifest keeps the requested tasks' own metrics (a group's subtasks stay in lm_eval.json).
        top_level = {k: v for k, v in metrics.items() if k.split("/", 1)[0] in tasks}
        return StageOutput(outputs=outputs, metrics={**top_level, **summary})

    config = {"tasks": tasks, "num_fewshot": num_fewshot, "limit": limit, "batch_size": batch_size,
              "max_gen_toks": max_gen_toks, "domain": domain, "allow_code_execution": allow_code_execution}
    upstream = [model_stage, heldout_stage] if heldout is not None and heldout_stage is not None else [model_stage]
    return run_stage(run, stage, body, config=config, upstream=upstream, force=force)
