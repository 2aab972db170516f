"""The Python API: a few calls for notebooks and Ray jobs, on top of the same stages the pipelines run::

    data = raycurate.ingest(rows)                                       # validate + tokenize
    masks = raycurate.bridge_select(data, rho_p=0.75, rho_r=0.5)        # BRIDGE token masks at one budget
    model = raycurate.train(masks)                                      # compact SFT on Ray Train
    scores = raycurate.evaluate(model, heldout)                         # held-out exact match, gold loss
    curated = raycurate.curate(data, steps=["dedup", "p2d", "bridge"])  # composed curation + one SFT

Each call runs in a resumable workspace (``workdir=``) and returns a :class:`Result` the next call takes.  Why one
module, workspaces, keywords and ``config=``: docs/design.md, "Python API"; examples: README.md, "Python API".
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import shutil
import tempfile
import weakref
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

from raycurate.config.job import build_job_config, check_keyword_types
from raycurate.errors import UserError

if TYPE_CHECKING:
    from raycurate.config.schema import JobConfig
    from raycurate.rundir import RunDir

log = logging.getLogger("raycurate")

__all__ = ["Result", "ingest", "bridge_select", "identify_heads", "p2d_select", "bds_weights", "curate", "train",
           "evaluate"]

# Sections that describe how the rows were prepared; a result carries them to the calls it feeds.
PREPARATION_SECTIONS = ("data", "model", "tokenize", "ray")


@dataclasses.dataclass
class Result:
    """One call's output: a stage of a workspace, its metrics and the config it ran with.

    Attributes:
        workdir: The workspace (run directory) the call worked in; pass it as ``workdir=`` to later calls, open
            it with ``raycurate inspect`` / ``raycurate report``.
        stage: The stage whose output this result reads (``tokenize``, ``bridge_select``, ``train_bridge``, ...).
        output: That stage's output name (``tokens``, ``selection``, ``heads``, ``weights``, ``model``,
            ``predictions``).
        metrics: The stage's metrics (row accounting, budgets, losses, held-out scores, ...).
        config: The resolved :class:`raycurate.config.schema.JobConfig` of the call.
        tokens_stage: The token table :func:`train` fits on when this result is its ``data`` (None: not a
            training set, e.g. a trained model).
        method: Names the training stage :func:`train` writes (``train`` for ``all``, else ``train_<method>``).
        adapter: The adapter :func:`train` uses by default (P2D: a head-delta adapter on the selected heads).
        config_hash: The stage's config hash when the result was made; reading a result whose stage was since
            re-run with another config is an error rather than silently other data.
        root: The workspace's local folder (differs from ``workdir`` for a storage URI).
    """

    workdir: str
    stage: str
    output: str
    metrics: dict
    config: Any
    tokens_stage: str | None = None
    method: str = "all"
    adapter: dict | None = None
    config_hash: str = ""
    root: str = ""
    _workspace: Any = dataclasses.field(default=None, repr=False, compare=False)  # keeps a temp workspace alive

    def _record(self, stage: str) -> dict:
        manifest = json.loads((Path(self.root) / "manifest.json").read_text())
        record = manifest.get("stages", {}).get(stage) or {}
        if record.get("status") != "done":
            raise UserError(f"stage {stage!r} of workspace {self.workdir} has not finished; re-run the call")
        if stage == self.stage and self.config_hash and record.get("config_hash") != self.config_hash:
            raise UserError(f"stage {stage!r} of workspace {self.workdir} was re-run with another config since this "
                            "result was made (e.g. another budget); re-run the call, or use one workdir per setting")
        return record

    def _output(self, stage: str, name: str) -> Path:
        from raycurate.rundir import inside

        return inside(Path(self.root), self._record(stage)["outputs"][name])

    @property
    def path(self) -> Path:
        """Local path of the output (a parquet folder or file, ``heads.json``, or a checkpoint folder)."""
        return self._output(self.stage, self.output)

    @property
    def table(self) -> Any:
        """The output as a ``pyarrow.Table`` (see each call's Returns for its columns)."""
        import pyarrow as pa

        path = self.path
        if self.output == "model":
            raise UserError(f"{self.stage} produced a model, not a table; use .model_dir")
        if path.suffix == ".json":
            return pa.Table.from_pylist(json.loads(path.read_text())["heads"])
        from raycurate.stages.tables import read_table

        return read_table(path)

    @property
    def dataset(self) -> Any:
        """The output as a ``ray.data.Dataset`` (same columns as :attr:`table`; parquet outputs are read lazily)."""
        from raycurate.stages.tables import read_dataset

        return read_dataset(self.table if self.path.suffix == ".json" else self.path)

    @property
    def tokens(self) -> Any:
        """The token table :func:`train` fits on, as a ``pyarrow.Table`` (for BRIDGE: the compacted rows)."""
        if self.tokens_stage is None:
            raise UserError(f"{self.stage} has no token table to train on")
        from raycurate.stages.tables import read_table

        return read_table(self._output(self.tokens_stage, "tokens"))

    @property
    def model_dir(self) -> Path | None:
        """The checkpoint folder this result holds (train, bds_weights), else None."""
        record = self._record(self.stage)
        return self._output(self.stage, "model") if "model" in record.get("outputs", {}) else None

    @property
    def heads(self) -> list[list[int]]:
        """``[[layer, head], ...]`` selected by P2D head scoring (identify_heads, p2d_select)."""
        if self.adapter is None or "heads" not in self.adapter:
            raise UserError(f"{self.stage} selected no attention heads")
        return [list(h) for h in self.adapter["heads"]]

    def __repr__(self) -> str:
        numbers = {k: v for k, v in self.metrics.items()
                   if isinstance(v, (int, float, str)) and not isinstance(v, bool)}
        shown = ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in list(numbers.items())[:6])
        return f"Result(stage={self.stage!r}, output={self.output!r}, workdir={self.workdir!r}, {shown})"


# --------------------------------------------------------------------------------------------- config


def job_config(call: str, pipeline: str, *, base: Any = None, defaults: dict | None = None,
               config: dict | None = None, sections: dict | None = None, keys: dict | None = None) -> Any:
    """The validated :class:`~raycurate.config.schema.JobConfig` of one API call
    (:func:`raycurate.config.job.build_job_config`, the route the CLI's commands take too).

    Layers, later ones win: ``base``'s preparation sections (the config of the result the call continues),
    the call's ``defaults``, ``config`` (dotted keys or section mappings), section keywords, then the call's
    explicit keywords (``keys``, dotted; None values are left out).

    Raises:
        ConfigError: Every unknown key, wrong type, out-of-range value and failed cross-field check, in one
            message naming the call (``raycurate.bridge_select() has 1 problem: bridge.rho_p: 1.5 must be <= 1``).
    """
    from raycurate.config.loader import to_dict

    prepared: dict = {}
    if base is not None:
        plain = to_dict(base)
        prepared = {k: plain[k] for k in PREPARATION_SECTIONS if k in plain}
    return build_job_config(layers=[prepared, defaults or {}, config or {}, sections or {}], keys=keys,
                            pipeline=pipeline, source=f"raycurate.{call}()")


_PATH_TYPES = (str, os.PathLike)


# --------------------------------------------------------------------------------------------- workspaces


class _TempWorkspace:
    """A workspace folder the API made in ``$TMPDIR`` because the call was given no ``workdir=``.

    Removal policy: the folder is deleted when the last :class:`Result` made in it is garbage-collected (each
    result holds this object), or when the interpreter exits, whichever comes first (``weakref.finalize``).
    Pass ``workdir=`` to keep a workspace: the API never deletes a folder it did not create.
    """

    def __init__(self) -> None:
        self.path = tempfile.mkdtemp(prefix="raycurate-")
        self._finalizer = weakref.finalize(self, shutil.rmtree, self.path, True)
        _TEMP_WORKSPACES[os.path.realpath(self.path)] = self
        log.info("workspace: %s (temporary: removed when its last result is gone)", self.path)

    def __reduce__(self) -> tuple:
        return (str, (self.path,))  # a pickled copy (e.g. a Result sent to a Ray task) does not own the folder


_TEMP_WORKSPACES: weakref.WeakValueDictionary[str, _TempWorkspace] = weakref.WeakValueDictionary()


def _with_workdir(cfg: JobConfig, workdir: str) -> JobConfig:
    from raycurate.storage import split_name

    runs_dir, name = split_name(str(workdir))
    return dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, runs_dir=runs_dir or ".", name=name))


@contextlib.contextmanager
def _opened(cfg: JobConfig) -> Iterator[RunDir]:
    """``open_run(cfg)`` (inputs checked, config saved, Ray started), its writer lock released at the end."""
    from raycurate.pipelines.common import open_run
    from raycurate.rundir import release_lock

    run = open_run(cfg)
    try:
        yield run
    finally:
        release_lock(run.root)


def _is_paths(source: Any) -> bool:
    if isinstance(source, (str, os.PathLike)):
        return True
    return isinstance(source, (list, tuple)) and bool(source) and all(isinstance(s, (str, os.PathLike))
                                                                       for s in source)


def _source_inputs(source: Any, cfg: JobConfig, stack: contextlib.ExitStack) -> list[str]:
    """Input paths for ``source``: paths as given, in-memory rows written into the workspace's ``inputs/``.

    The rows are checked before the workspace is created (an empty list or table creates nothing), and the
    workspace's writer lock taken here stays held (released by ``stack``) until the call has run on them, so a
    second caller never sees another call's half-replaced ``inputs/``.
    """
    if _is_paths(source):
        return [str(source)] if isinstance(source, (str, os.PathLike)) else [str(s) for s in source]
    from raycurate.rundir import open_run_dir, release_lock
    from raycurate.stages.tables import check_source, write_source

    check_source(source)
    run = open_run_dir(cfg.run.runs_dir, cfg.run.name, cfg.run.local_dir)
    stack.callback(release_lock, run.root)
    return [write_source(source, run.root / "inputs")]


@dataclasses.dataclass
class _Prepared:
    run: RunDir
    cfg: JobConfig
    tokens_stage: str


def _check_chained(call: str, data: Result, model: str | None, config: dict | None, sections: dict) -> None:
    given = set(sections) | {str(k).split(".", 1)[0] for k in (config or {})}
    clash = sorted(given & set(PREPARATION_SECTIONS) - {"ray"})
    if clash:
        raise UserError(f"raycurate.{call}(): {', '.join(clash)} keys describe how rows are prepared; they apply when "
                        f"data is raw rows, not a result (its rows were prepared in {data.workdir}); pass them to "
                        "raycurate.ingest() or give the raw rows")
    if model is not None and model != data.config.model.name_or_path:
        raise UserError(f"raycurate.{call}(): data was tokenized for model {data.config.model.name_or_path!r}, not "
                        f"{model!r}; pass the raw rows to use another model")


@contextlib.contextmanager
def _prepared(call: str, pipeline: str, data: Any, *, model: str | None, workdir: str | os.PathLike | None,
              config: dict | None, sections: dict, defaults: dict | None = None, keys: dict | None = None,
              prepare: bool = True) -> Iterator[_Prepared]:
    """Validate the call's config, open its workspace and have the token table ready.

    ``data`` as a :class:`Result` continues in its workspace (nothing re-runs); raw rows (paths, a list of
    dicts, a pyarrow Table, a Ray Dataset, ...) go through :func:`raycurate.pipelines.common.prepare_data` -- the
    same ingest -> base_model -> tokenize sequence every pipeline starts with, skipped where current -- unless
    ``prepare`` is False (a whole pipeline runs next and prepares them itself).
    """
    from raycurate.pipelines.common import prepare_data

    check_keyword_types(call, model=(model, str), workdir=(workdir, _PATH_TYPES), config=(config, dict))
    keys = {"model.name_or_path": model, **(keys or {})}
    if isinstance(data, Result):
        _check_chained(call, data, model, config, sections)
        cfg = job_config(call, pipeline, base=data.config, defaults=defaults, config=config, sections=sections,
                         keys=keys)
        same = workdir is None or os.path.abspath(str(workdir)) in (os.path.abspath(data.workdir), data.root)
        if same:
            data._record(data.stage)  # still current: raises when re-run with another config since
            if data.tokens_stage is None:
                raise UserError(f"raycurate.{call}(): {data.stage} holds no token table; pass rows or a result of "
                                "ingest / bridge_select / p2d_select")
            cfg = _with_workdir(cfg, data.workdir)
            with _opened(cfg) as run:
                yield _Prepared(run, cfg, data.tokens_stage)
            return
        if data.tokens_stage != "tokenize":
            raise UserError(f"raycurate.{call}(): a {data.stage} result continues in its own workspace "
                            f"({data.workdir}); leave workdir unset, or pass the rows")
        cfg = _with_workdir(cfg, str(workdir))  # same preparation config and inputs, in another workspace
    with contextlib.ExitStack() as stack:
        temp = None
        if not isinstance(data, Result):
            cfg = job_config(call, pipeline, defaults=defaults, config=config, sections=sections, keys=keys)
            temp = _TempWorkspace() if workdir is None else None  # referenced by the results made in it
            cfg = _with_workdir(cfg, str(workdir) if temp is None else temp.path)
            inputs = _source_inputs(data, cfg, stack)
            cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, input=inputs))
        with _opened(cfg) as run:
            if prepare:
                prepare_data(run, cfg)
            yield _Prepared(run, cfg, "tokenize")


def _result(prep: _Prepared, stage: str, output: str, **fields: Any) -> Result:
    record = prep.run.stage_record(stage) or {}
    metrics = fields.pop("metrics", None)
    location = prep.cfg.run.runs_dir.rstrip("/") + "/" + prep.cfg.run.name
    return Result(workdir=location if "://" in location else str(prep.run.root), stage=stage, output=output,
                  metrics=dict(record.get("metrics") or {}) if metrics is None else metrics, config=prep.cfg,
                  config_hash=record.get("config_hash", ""), root=str(prep.run.root),
                  _workspace=_TEMP_WORKSPACES.get(os.path.realpath(prep.run.root)), **fields)


def _require_tokenize(call: str, prep: _Prepared) -> None:
    if prep.tokens_stage != "tokenize":
        raise UserError(f"raycurate.{call}() selects from the whole tokenized table; pass the result of "
                        f"raycurate.ingest() (or rows), not a {prep.tokens_stage} selection")


# --------------------------------------------------------------------------------------------- calls


def ingest(source: Any, *, model: str | None = None, max_length: int | None = None,
           split_ratios: dict[str, float] | None = None, split_seed: int | None = None, strict: bool | None = None,
           workdir: str | os.PathLike | None = None, config: dict | None = None, **sections: Any) -> Result:
    """Validate and tokenize rows: the ``ingest`` and ``tokenize`` stages of every pipeline.

    Args:
        source: Path(s) (jsonl / parquet files, folders, globs, HF ``save_to_disk`` folders), a list of dicts, a
            ``pyarrow.Table``, a pandas DataFrame, a ``datasets.Dataset`` or a ``ray.data.Dataset``; each row has
            ``prompt`` and ``response`` (optional ``id``, ``domain``, ``messages``; other fields pass through).
            In-memory rows are written once into ``<workdir>/inputs/source-<content hash>/``.
        model: Base model whose tokenizer is used (``embedded``, a tiny preset or a local checkpoint folder);
            default ``embedded``.
        max_length: Longest tokenized row (``data.max_length``); longer rows are rejected as ``over_length``.
        split_ratios: Split name -> share (``data.split_ratios``; BRIDGE needs warmup / validation / selection).
        split_seed: Seed of the deterministic split assignment.
        strict: Fail on the first bad row instead of rejecting it.
        workdir: The workspace; default a fresh temporary folder.
        config: Further keys, dotted (``{"data.shard_rows": 1000}``) or as section mappings.
        **sections: Section mappings (``tokenize={"num_actors": 1}``, ``ray={"num_cpus": 2}``).

    Returns:
        :class:`Result` of stage ``tokenize`` (output ``tokens``): one row per accepted input row with columns
        ``id`` (str), ``prompt``, ``response``, ``domain``, ``split`` (str), ``source``, ``line``, the pass-through
        fields, ``input_ids`` (list<int32>, length T <= max_length), ``prompt_len`` (int32), ``loss_mask``
        (list<int8>, length T, 1 on supervised response tokens), ``weight`` (float32), ``prompt_offsets`` /
        ``response_offsets`` (list<int32>, character offsets).  ``metrics`` holds the tokenize counts and
        ``metrics["rows"]`` the accounting ``{input, accepted, rejected, rejected_by_reason, rejected_files}``
        (``input == accepted + rejected``).

    Raises:
        ConfigError: A bad key or value.  InputError: Unreadable inputs, or no row accepted.
    """
    if isinstance(source, Result):
        raise UserError(f"raycurate.ingest(): {source.stage} is a result of a workspace already; pass it to the next "
                        "call directly, or re-ingest its rows with raycurate.ingest(result.path)")
    keys = {"data.max_length": max_length, "data.split_ratios": split_ratios, "data.split_seed": split_seed,
            "data.strict": strict}
    with _prepared("ingest", "sft", source, model=model, workdir=workdir, config=config, sections=sections,
                   keys=keys) as prep:
        result = _result(prep, "tokenize", "tokens", tokens_stage="tokenize")
        result.metrics["rows"] = prep.run.load_manifest().get("rows", {})
        return result


def bridge_select(data: Any, *, model: str | None = None, rho_p: float | None = None, rho_r: float | None = None,
                  workdir: str | os.PathLike | None = None, config: dict | None = None, **sections: Any) -> Result:
    """BRIDGE token masks at one budget: warmup SFT, scoring direction, fused scoring + coupled selection +
    closure, compaction (``docs/bridge.md``); the stages of ``pipeline: bridge`` before its final training.

    A workspace that has the warmup and direction already re-runs only the selection and compaction at a new
    budget.  The token-selection baselines and the fidelity diagnostics are off here unless configured
    (``bridge={"baselines": ["random"], "diagnostics_rows": 200}``).

    Args:
        data: Rows (anything :func:`ingest` takes) or an :func:`ingest` result; the rows need the splits
            ``warmup`` (warmup SFT), ``validation`` (scoring direction) and ``selection`` (the rows selected).
        model: Base model (raw rows only; a result keeps its own).
        rho_p: Share of eligible prompt tokens kept (``bridge.rho_p``).
        rho_r: Share of eligible response tokens supervised (``bridge.rho_r``).
        workdir: The workspace; default that of ``data`` when it is a result, else a fresh temporary folder.
        config: Further keys, dotted or as section mappings.
        **sections: Section mappings: ``bridge`` (e.g. ``last_layers``, ``schedule``), ``train`` (the warmup
            SFT), ``bridge_pool`` (scoring actors), ``run`` (``force``), ...

    Returns:
        :class:`Result` of stage ``bridge_select`` (output ``selection``): one row per ``selection``-split row,
        its token columns (as :func:`ingest`) plus ``sel_prompt_keep`` (list<int8>, length prompt_len, 1 on kept prompt
        tokens), ``sel_loss_mask`` (list<int8>, length T, 1 on supervised response tokens), ``sel_response_scores``
        (list<float32>), budgets ``sel_b_p`` / ``sel_b_r`` and realised ``sel_kept_prompt`` /
        ``sel_supervised_response`` (int32), ``sel_utility_retained`` (float64) and the closure columns.
        ``metrics``: realised budget ratios, U_sur per schedule, closure coverage, and ``compact`` (token counts
        of the compacted table).  :func:`train` on it fits the compacted rows (``.tokens``: stage
        ``bridge_compact``, kept prompt tokens only, unselected responses masked).
    """
    # bridge_score (budget-free, cached in the workspace) then bridge_select: another budget in the same workspace
    # re-runs only the selection (and compaction), not the model.
    from raycurate.pipelines.bridge import run_bridge_selection

    defaults = {"bridge.baselines": [], "bridge.diagnostics_rows": 0}
    with _prepared("bridge_select", "bridge", data, model=model, workdir=workdir, config=config, sections=sections,
                   defaults=defaults, keys={"bridge.rho_p": rho_p, "bridge.rho_r": rho_r}) as prep:
        _require_tokenize("bridge_select", prep)
        methods = run_bridge_selection(prep.run, prep.cfg)
        result = _result(prep, "bridge_select", "selection", tokens_stage=methods["bridge"], method="bridge")
        result.metrics["compact"] = (prep.run.stage_record(methods["bridge"]) or {}).get("metrics", {})
        return result


def identify_heads(data: Any, *, model: str | None = None, head_ratio: float | None = None,
                   task_model: str | None = None, workdir: str | os.PathLike | None = None,
                   config: dict | None = None, **sections: Any) -> Result:
    """P2D head scoring: fine-tune a proxy on 100 seeded rows (or use ``task_model``) and rank every query head
    by the W1 distance of its weights from the base model's (``docs/p2d.md``).

    Args:
        data: Rows (anything :func:`ingest` takes) or an :func:`ingest` result.
        model: Base model (raw rows only).
        head_ratio: rho_P, the share of query heads selected (``p2d.head_ratio``).
        task_model: A fine-tuned checkpoint folder to score against instead of training the proxy.
        workdir: The workspace; default that of ``data`` when it is a result, else a fresh temporary folder.
        config: Further keys, dotted or as section mappings.
        **sections: Section mappings: ``p2d`` (``proxy_steps``, ``head_tau``, ...), ``train`` (the proxy's
            workers / batch), ``run``, ...

    Returns:
        :class:`Result` of stage ``p2d_heads`` (output ``heads``, ``heads.json``): ``.table`` has one row per query
        head (``layer``, ``head``, ``score``, ``selected``, ...), ``.heads`` the selected ``[[layer, head], ...]``
        and ``.adapter`` the head-delta adapter spec on them.
    """
    from raycurate.pipelines.p2d import run_p2d_heads
    from raycurate.stages.p2d import selected_heads

    with _prepared("identify_heads", "p2d", data, model=model, workdir=workdir, config=config, sections=sections,
                   keys={"p2d.head_ratio": head_ratio, "p2d.task_model": task_model}) as prep:
        _require_tokenize("identify_heads", prep)
        run_p2d_heads(prep.run, prep.cfg)
        adapter = {"kind": "head_delta", "heads": selected_heads(prep.run, "p2d_heads"),
                   "train_o": prep.cfg.p2d.train_o}
        return _result(prep, "p2d_heads", "heads", adapter=adapter)


def p2d_select(data: Any, *, model: str | None = None, head_ratio: float | None = None,
               data_ratio: float | None = None, task_model: str | None = None,
               workdir: str | os.PathLike | None = None, config: dict | None = None, **sections: Any) -> Result:
    """P2D example selection: head scoring (:func:`identify_heads`), ICL probing with the selected heads'
    attention on Ray Data actors, and the top rho_D rows by their probing score.

    Args:
        data: Rows (anything :func:`ingest` takes) or an :func:`ingest` result.
        model: Base model (raw rows only).
        head_ratio: rho_P, the share of query heads selected.
        data_ratio: rho_D, the share of the pool selected (``p2d.data_ratio``).
        task_model: A fine-tuned checkpoint folder to score heads against instead of training the proxy.
        workdir: The workspace; default that of ``data`` when it is a result, else a fresh temporary folder.
        config: Further keys, dotted or as section mappings.
        **sections: Section mappings: ``p2d`` (``rounds``, ``demos``, ``query_score``, ``pool_split``,
            ``baselines``: none by default here), ``p2d_pool``, ``train``, ``run``, ...

    Returns:
        :class:`Result` of stage ``p2d_select`` (output ``selection``): one row per pool row with ``id``,
        ``s_final`` (float64 probing score), ``rank`` (int64, 1 = best), ``selected`` (bool), ``reason`` (str) and
        ``clean`` (the ground-truth label where the rows carry one).  ``metrics``: pool size, selected count and
        (labelled rows) the clean share among selected / random / all rows.  ``.tokens`` is the selected rows'
        token table (stage ``p2d_rows``); :func:`train` on it adapts the selected heads only (``.adapter``) unless
        given ``adapter=None``.
    """
    from raycurate.pipelines.p2d import run_p2d_selection
    from raycurate.stages.p2d import selected_heads

    keys = {"p2d.head_ratio": head_ratio, "p2d.data_ratio": data_ratio, "p2d.task_model": task_model}
    with _prepared("p2d_select", "p2d", data, model=model, workdir=workdir, config=config, sections=sections,
                   defaults={"p2d.baselines": []}, keys=keys) as prep:
        _require_tokenize("p2d_select", prep)
        run_p2d_selection(prep.run, prep.cfg)
        adapter = {"kind": "head_delta", "heads": selected_heads(prep.run, "p2d_heads"),
                   "train_o": prep.cfg.p2d.train_o}
        return _result(prep, "p2d_select", "selection", tokens_stage="p2d_rows", method="p2d", adapter=adapter)


def bds_weights(data: Any, *, model: str | None = None, online: bool = False, workdir: str | os.PathLike | None = None,
                config: dict | None = None, **sections: Any) -> Result:
    """BDS data weights: LoRA training on the candidate rows with per-row weights sigma(omega) learned against
    the validation rows (bilevel, ``docs/bilevel.md``); ``online=True`` adds BMO regeneration on generation actors.

    Args:
        data: Rows (anything :func:`ingest` takes) or an :func:`ingest` result; the validation rows are split
            ``bilevel.validation_split`` (default ``validation``; clean rows only when the rows carry the embedded
            corpus's labels), the candidates ``bilevel.candidate_split`` (default ``selection``).
        model: Base model (raw rows only).
        online: Run BDS + BMO online regeneration (method ``online``) instead of offline BDS (``bds``).
        workdir: The workspace; default that of ``data`` when it is a result, else a fresh temporary folder.
        config: Further keys, dotted or as section mappings.
        **sections: Section mappings: ``bilevel`` (``lr``, ``epochs``, ``omega_lr``, ``adapter``, ...), ``train``
            (workers, batch: the effective batch is split between validation and candidate rows), ``run``, ...

    Returns:
        :class:`Result` of stage ``train_bilevel_bds`` (or ``train_bilevel_online``), output ``weights``: one row
        per (epoch snapshot, candidate) with ``id``, ``step``, ``omega``, ``sigma`` (the weight, float) and
        ``rank``; ``.model_dir`` is the trained (merged) checkpoint.  ``metrics`` holds the training metrics and
        ``analysis`` (weights by label and their AUROC where the rows carry labels, extremes, sampling-order
        Spearman).
    """
    from raycurate.pipelines.bilevel import bilevel_train_config, split_rows, train_method
    from raycurate.stages.bilevel import weight_analysis

    check_keyword_types("bds_weights", online=(online, bool))
    method = "online" if online else "bds"
    with _prepared("bds_weights", "bilevel", data, model=model, workdir=workdir, config=config, sections=sections,
                   keys={"bilevel.methods": [method]}) as prep:
        _require_tokenize("bds_weights", prep)
        split_rows(prep.run, prep.cfg)
        stage = train_method(prep.run, prep.cfg, method, bilevel_train_config(prep.cfg))
        result = _result(prep, stage, "weights")
        result.metrics["analysis"] = weight_analysis(prep.run, stage, "bilevel_candidate_rows")
        return result


def curate(data: Any, *, steps: list[str] | None = None, keep_fraction: float | None = None,
           bds_mode: str | None = None, compare: bool | None = None, model: str | None = None,
           trusted: Any = None, out: str | os.PathLike | None = None, train: bool = False, heldout: Any = None,
           force: bool = False, workdir: str | os.PathLike | None = None, config: dict | None = None,
           **sections: Any) -> Result:
    """Composed curation, ``pipeline: curate``: ``steps`` in order over the ``selection`` split (dedup drops
    near-duplicates, reference / bds / p2d keep the top ``keep_fraction`` of the rows they receive, mask / bridge
    select tokens on the rest), one SFT on the kept rows; with ``compare`` also each step alone and random rows at
    the same response-token budget (:mod:`raycurate.pipelines.curate`).  With ``out``: ``raycurate curate``
    (:mod:`raycurate.pipelines.user_curate`): every row of your files curated toward ``trusted``, the curated data
    written to ``out`` (the run in ``out/run``), no SFT unless ``train``.

    Args:
        data: Rows (anything :func:`ingest` takes) or an :func:`ingest` result (with ``out``: file paths); the
            splits are ``selection`` (the pool), ``validation`` and ``warmup`` (BRIDGE's warmup SFT).
        steps: Ordered steps (``curate.steps``): dedup, reference, bds, p2d, then mask or bridge.
        keep_fraction: Share of its rows each ranking step keeps (``curate.keep_fraction``).
        bds_mode: ``select`` (train the kept rows unweighted) or ``weight`` (with their BDS weights).
        compare: Also train the matched-budget single-step and random arms (``curate.compare``, default true).
        model: Base model (raw rows only; a result keeps its own).
        trusted, out, train, heldout, force: ``raycurate curate``'s ``--trusted``, ``--out``, ``--train``,
            ``--heldout`` and ``--force`` (paths, booleans).
        workdir: The workspace; default that of ``data`` when it is a result, else a fresh temporary folder.
        config: Further keys, dotted or as section mappings.
        **sections: Section mappings: ``bridge``, ``bilevel``, ``p2d``, ``train`` (every SFT), ``run``, ...

    Returns:
        :class:`Result` of stage ``train_curate`` (output ``model``, the SFT on stage ``curate_rows``); ``metrics``
        holds the training metrics and ``composition`` (``steps``, ``pool_rows``, ``budget_tokens``, ``step_info``,
        ``arms``).  With ``out``: of ``train_curate`` with ``train``, else ``curate_rows``, and
        ``metrics["summary"]`` is ``out/summary.json``.
    """
    check_keyword_types("curate", compare=(compare, bool), train=(train, bool), force=(force, bool))
    keys = {"curate.steps": steps, "curate.keep_fraction": keep_fraction, "curate.bds_mode": bds_mode,
            "curate.compare": compare}
    if out is not None:
        from raycurate.pipelines.user_curate import curate_folder
        from raycurate.rundir import RunDir

        done = curate_folder(data, trusted=trusted, out=out, model=model, train=train, heldout=heldout, force=force,
                             layers=[config or {}, sections], keys=keys, source="raycurate.curate()")
        stage = "train_curate" if train or heldout is not None else "curate_rows"
        result = _result(_Prepared(RunDir(done.root), done.cfg, "curate_rows"), stage,
                         "model" if stage == "train_curate" else "tokens", tokens_stage="curate_rows", method="curate")
        result.metrics["summary"] = done.summary
        return result
    from raycurate.pipelines.curate import run_curate

    with _prepared("curate", "curate", data, model=model, workdir=workdir, config=config, sections=sections,
                   keys=keys, prepare=False) as prep:
        _require_tokenize("curate", prep)
        manifest = run_curate(prep.cfg)  # the whole pipeline: opens the workspace again (the lock is re-entrant)
        result = _result(prep, "train_curate", "model", method="curate")
        result.metrics["composition"] = manifest["results"]["composition"]
        return result


_AUTO: Any = "auto"


def train(data: Any, *, model: str | None = None, epochs: int | None = None, lr: float | None = None,
          adapter: dict | None = _AUTO, name: str | None = None, workdir: str | os.PathLike | None = None,
          config: dict | None = None, **sections: Any) -> Result:
    """Supervised fine-tuning on Ray Train (DeepSpeed ZeRO or DDP): the ``train`` stage of ``pipeline: sft``.

    Args:
        data: Rows (anything :func:`ingest` takes; all rows are trained on) or a result: :func:`ingest` (all
            rows), :func:`bridge_select` (the compacted rows), :func:`p2d_select` (the selected rows).
        model: Base model (raw rows only; a result keeps its own).  Training starts from it.
        epochs: Passes over the rows (``train.epochs``).
        lr: Peak learning rate (``train.lr``).
        adapter: An adapter spec (``{"kind": "lora", "r": 16, "alpha": 16}``, a P2D head-delta spec) or None
            for full fine-tuning; by default the result's own (P2D: its heads), else full fine-tuning.
        name: The stage name (default ``train`` for all rows, ``train_bridge`` / ``train_p2d`` for selections).
        workdir: The workspace; default that of ``data`` when it is a result, else a fresh temporary folder.
        config: Further keys, dotted or as section mappings.
        **sections: Section mappings: ``train`` (``num_workers``, ``micro_batch_size``, ``effective_batch_size``,
            ``engine``, ``zero_stage``, ...), ``run``, ...

    Returns:
        :class:`Result` of the training stage, output ``model``: ``.model_dir`` is a Hugging Face checkpoint
        folder (weights + tokenizer; LoRA also under ``adapter/``); ``metrics`` holds steps, final loss and
        throughput.  Pass it to :func:`evaluate`.
    """
    from raycurate.stages.model_stages import train_stage

    check_keyword_types("train", name=(name, str), adapter=(None if adapter is _AUTO else adapter, dict))
    keys = {"train.epochs": epochs, "train.lr": lr}
    with _prepared("train", "sft", data, model=model, workdir=workdir, config=config, sections=sections,
                   keys=keys) as prep:
        method = data.method if isinstance(data, Result) else "all"
        stage = name or ("train" if method == "all" else f"train_{method}")
        spec = (data.adapter if isinstance(data, Result) else None) if adapter is _AUTO else adapter
        train_stage(prep.run, stage, tokens_stage=prep.tokens_stage, init_stage="base_model",
                    train_cfg=prep.cfg.train, adapter=spec)
        return _result(prep, stage, "model")


def evaluate(model: Any, heldout: Any, *, name: str | None = None, workdir: str | os.PathLike | None = None,
             config: dict | None = None, **sections: Any) -> Result:
    """Held-out evaluation on a Ray Data actor pool: greedy and sampled answers, exact match of the final
    ``####`` answer, gold-response loss (the pipelines' ``eval_*`` stages).

    Args:
        model: A :func:`train` / :func:`bds_weights` result, or a checkpoint folder.
        heldout: Rows with ``id``, ``prompt``, ``response`` and the gold final answer in ``label.answer`` (e.g.
            :func:`raycurate.data.corpus.generate_heldout`): a list of dicts, a jsonl / parquet path, a
            ``pyarrow.Table`` or a ``ray.data.Dataset``.
        name: The stage name (default ``eval`` / ``eval_<method>`` after the model's training stage).
        workdir: The workspace; default the model result's, else a fresh temporary folder.
        config: Further keys, dotted or as section mappings (``data.max_length`` limits the gold sequences;
            default the model result's).
        **sections: Section mappings: ``eval`` (``samples``, ``max_new_tokens``, ``temperature``, ``pool``), ...

    Returns:
        :class:`Result` of the evaluation stage, output ``predictions``: one row per held-out question with
        ``id``, ``generated``, ``predicted_answer``, ``gold_answer``, ``correct`` (bool), ``gold_loss`` (float),
        ``has_final_answer``, ``unsafe_marker``, ``equations_correct`` / ``equations_total`` and, with
        ``eval.samples > 0``, ``sampled_accuracy`` / ``sampled_unsafe``.  ``metrics``: ``rows``,
        ``exact_match``, ``gold_loss``, ``answer_format_rate``, ``unsafe_rate``, ``equation_accuracy`` (and
        ``sampled_exact_match`` / ``sampled_unsafe_rate``).
    """
    from raycurate.stages.model_stages import evaluate_stage
    from raycurate.stages.tables import external_model_stage, heldout_stage, source_rows

    chained = isinstance(model, Result)
    check_keyword_types("evaluate", model=(model, (Result, *_PATH_TYPES)), name=(name, str),
                        workdir=(workdir, _PATH_TYPES), config=(config, dict))
    if chained and model.model_dir is None:
        raise UserError(f"raycurate.evaluate(): {model.stage} holds no model; pass a train() result or a "
                        "checkpoint folder")
    base = model.config if chained else None
    cfg = job_config("evaluate", "sft", base=base, config=config, sections=sections)
    temp = _TempWorkspace() if workdir is None and not chained else None  # referenced by the result
    if workdir is None:
        workdir = model.workdir if temp is None else temp.path  # temp: not chained
    cfg = _with_workdir(cfg, str(workdir))
    rows = source_rows(heldout)
    with _opened(cfg) as run:
        prep = _Prepared(run, cfg, "")
        same = chained and str(run.root) == model.root
        if same:
            model_stage = model.stage
        else:
            model_stage = "external_model"
            external_model_stage(run, model_stage, model.model_dir if chained else model)
        heldout_stage(run, "heldout", rows)
        stage = name or ("eval" if model_stage == "train" else f"eval_{model_stage.removeprefix('train_')}")
        evaluate_stage(run, stage, model_stage=model_stage, heldout_stage="heldout", eval_cfg=cfg.eval,
                       max_length=cfg.data.max_length,
                       system_prompt=cfg.tokenize.system_prompt)
        return _result(prep, stage, "predictions")
