"""Example-selection baselines of the bilevel pipeline (DSIR and LESS; docs/bilevel.md, "Decisions the papers leave
open"): each stage scores every candidate against the validation set, keeps ``k = round(fraction * N)`` (halves up,
at least 1) and writes ``selection.parquet`` (``id``, ``log_weight`` or ``score``, ``selected``; one row per
candidate in id order), which :func:`raycurate.stages.p2d.selected_ids` reads.

DSIR (:func:`dsir_select_stage`, :mod:`raycurate.algorithms.dsir`) runs in the driver; LESS
(:func:`less_select_stage`) runs :func:`raycurate.training.less_warmup.less_model_scores` in one Ray task (1 GPU when
the cluster has one).
"""

from __future__ import annotations

import math
from pathlib import Path

from raycurate.rundir import RunDir
from raycurate.stages.base import StageOutput, output_path, run_stage
from raycurate.stages.data_stages import trusted_rows_in
from raycurate.stages.rows import clean_labels, precision
from raycurate.stages.runtime import run_as_task

SELECTION_FILE = "selection.parquet"
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]


# --------------------------------------------------------------------------------------------- shared


def selection_count(fraction: float, n: int) -> int:
    """``round(fraction * n)`` with halves rounded up (as :func:`raycurate.algorithms.less.select_top_fraction`),
    clamped to ``[1, n]``."""
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"bilevel.select_fraction={fraction} must lie in (0, 1]; it is the share of candidates kept")
    if n < 1:
        raise ValueError("the candidate table is empty; check data.split_ratios gives the candidate split rows")
    return min(n, max(1, math.floor(fraction * n + 0.5 + 1e-9)))


def token_table(run: RunDir, tokens_stage: str, columns: list[str]) -> Path:
    """Path of a stage's token table, after checking that it has ``columns``."""
    import pyarrow.parquet as pq

    path = output_path(run, tokens_stage, "tokens")
    parts = sorted(Path(path).glob("*.parquet"))
    if not parts:
        raise ValueError(f"token table of stage '{tokens_stage}' ({path}) has no parquet files")
    present = set(pq.read_schema(parts[0]).names)
    missing = [c for c in columns if c not in present]
    if missing:
        raise ValueError(f"token table of stage '{tokens_stage}' lacks columns {missing} (has {sorted(present)}); "
                         "selection needs the tokenized rows with their original record columns")
    return path


def sorted_rows(path: str | Path, columns: list[str]) -> list[dict]:
    """Rows of a token table folder sorted by id (the order of every selection output)."""
    from raycurate.stages.bridge import read_token_rows

    rows = sorted(read_token_rows(Path(path), columns), key=lambda r: r["id"])
    if not rows:
        raise ValueError(f"token table {path} has no rows; check the split that feeds it")
    return rows


def read_rows(run: RunDir, tokens_stage: str, columns: list[str]) -> list[dict]:
    """Rows of a stage's token table sorted by id, after checking that it has ``columns``."""
    return sorted_rows(token_table(run, tokens_stage, columns), columns)


def example_text(row: dict) -> str:
    """The text a data selector sees: ``prompt + "\\n" + response``."""
    return f"{row['prompt']}\n{row['response']}"


def write_selection(path: Path, ids: list[str], score_name: str, scores: list[float], chosen: set[str]) -> None:
    """``selection.parquet``: one row per candidate (``id``, ``score_name``, ``selected``) in the order of ``ids``."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"id": pa.array(ids, type=pa.string()),
                             score_name: pa.array(scores, type=pa.float64()),
                             "selected": pa.array([i in chosen for i in ids], type=pa.bool_())}), path)


def selection_metrics(run: RunDir, candidate_stage: str, ids: list[str], chosen: list[str]) -> dict:
    """Counts and, where the candidates carry ground-truth labels, the clean share of the selection and pool."""
    labels = clean_labels(run, candidate_stage)
    return {"candidates": len(ids), "selected": len(chosen), "precision_selected": precision(chosen, labels),
            "precision_pool": precision(ids, labels)}


# --------------------------------------------------------------------------------------------- DSIR


def dsir_select_stage(run: RunDir, stage: str, *, candidate_stage: str, validation_stage: str, fraction: float,
                      buckets: int, seed: int, force: bool = False) -> dict:
    """DSIR baseline: importance-resample ``round(fraction * N)`` candidates towards the validation texts.

    Args:
        run: The run directory.
        stage: Name of this stage.
        candidate_stage: Stage whose ``tokens`` table holds the candidate pool (columns id, prompt, response).
        validation_stage: Stage whose ``tokens`` table holds the target (validation) examples.
        fraction: Share of candidates kept, in (0, 1].
        buckets: Hashed n-gram buckets.
        seed: Seed of the Gumbel top-k resampling.
        force: Re-run even when current.

    Returns:
        The stage record; output ``selection`` (id, log_weight, selected), metrics selected / precision.
    """
    from raycurate.algorithms import dsir

    selection_count(fraction, 1)  # validates fraction before reading anything
    if buckets < 1:
        raise ValueError(f"bilevel.dsir_buckets={buckets} must be >= 1")

    def body(out: Path) -> StageOutput:
        candidates = read_rows(run, candidate_stage, ["id", "prompt", "response"])
        targets = read_rows(run, validation_stage, ["id", "prompt", "response"])
        ids = [r["id"] for r in candidates]
        log_w = dsir.target_log_weights([example_text(r) for r in targets], [example_text(r) for r in candidates],
                                        buckets)
        drawn = dsir.resample(log_w, selection_count(fraction, len(ids)), seed)
        chosen = sorted(ids[i] for i in drawn)
        write_selection(out / SELECTION_FILE, ids, "log_weight", [float(w) for w in log_w], set(chosen))
        return StageOutput(outputs={"selection": SELECTION_FILE}, metrics={
            **selection_metrics(run, candidate_stage, ids, chosen), "validation": len(targets), "buckets": buckets,
            "trusted_rows": trusted_rows_in(run, validation_stage)})

    config = {"method": "dsir", "fraction": fraction, "buckets": buckets, "seed": seed}
    return run_stage(run, stage, body, config=config, upstream=[candidate_stage, validation_stage], force=force)


# --------------------------------------------------------------------------------------------- LESS


def less_scores_task(model_dir: str, candidate_tokens: str, validation_tokens: str, *, lora_r: int,
                     lora_alpha: float, dim: int, warmup_fraction: float, warmup_epochs: int, lr: float,
                     batch_size: int, seed: int) -> dict:
    """The model part of LESS, inside a Ray task: warmup, gradient features, scores.

    Args:
        model_dir: Base model checkpoint.
        candidate_tokens: Candidate token table folder (``id``, ``input_ids``, ``loss_mask``).
        validation_tokens: Validation token table folder.
        lora_r, lora_alpha: LoRA adapter on q/k/v/o projections.
        dim: Projection dimension d.
        warmup_fraction: Share of the candidates (seeded random draw, at least one) the warmup trains on.
        warmup_epochs: Warmup epochs.
        lr: Warmup AdamW learning rate.
        batch_size: Warmup rows per step.
        seed: Seed of the LoRA init, the warmup subset and order, and the projection.

    Returns:
        ``ids`` of the candidates (sorted), their ``scores`` in that order, and summary numbers.
    """
    import torch

    from raycurate.models.adapters import apply_adapter
    from raycurate.models.loading import best_device, load_model, load_tokenizer
    from raycurate.training.less_warmup import less_model_scores

    columns = ["id", "input_ids", "loss_mask"]
    candidate_rows, validation_rows = sorted_rows(candidate_tokens, columns), sorted_rows(validation_tokens, columns)
    device = best_device()
    if device == "cpu":
        torch.set_flush_denormal(True)  # denormal arithmetic slows CPU backward passes several-fold
    torch.manual_seed(seed)  # LoRA A matrices are drawn at attach time
    model = apply_adapter(load_model(model_dir, dtype="float32", device=device),
                          {"kind": "lora", "r": lora_r, "alpha": lora_alpha, "targets": LORA_TARGETS})
    pad_id = load_tokenizer(model_dir).pad_token_id or 0
    info = less_model_scores(model, candidate_rows, validation_rows, pad_id=pad_id, dim=dim,
                             warmup_fraction=warmup_fraction, warmup_epochs=warmup_epochs, lr=lr,
                             batch_size=batch_size, seed=seed, device=device)
    return {"ids": [r["id"] for r in candidate_rows], "scores": info.pop("scores"),
            "validation": len(validation_rows), **info, "device": device}


def less_select_stage(run: RunDir, stage: str, *, candidate_stage: str, validation_stage: str, base_stage: str,
                      fraction: float, lora_r: int, lora_alpha: float, dim: int, warmup_fraction: float,
                      warmup_epochs: int = 4, lr: float = 2e-5, batch_size: int = 4, seed: int,
                      force: bool = False) -> dict:
    """LESS baseline: the top ``round(fraction * N)`` candidates by gradient similarity to the validation set.

    LESS averages the scores of several warmup checkpoints weighted by their learning rate
    (:func:`raycurate.algorithms.less.combine_checkpoint_scores`); this stage scores one checkpoint, the end of
    warmup, and trains the warmup at a constant learning rate.  When the LoRA parameter count P is at most ``dim``
    the projection does not reduce anything, and the features still go through the same seeded projection so the
    scores come from one code path (a random projection to d >= P preserves cosines in expectation).

    Args:
        run: The run directory.
        stage: Name of this stage.
        candidate_stage: Stage whose ``tokens`` table holds the candidates.
        validation_stage: Stage whose ``tokens`` table holds the validation (target) examples.
        base_stage: Stage whose ``model`` output is the base checkpoint the warmup starts from.
        fraction: Share of candidates kept, in (0, 1].
        lora_r: LoRA rank of the warmup adapter.
        lora_alpha: LoRA alpha.
        dim: Random-projection dimension of the gradient features.
        warmup_fraction: Share of candidates the warmup trains on, in (0, 1].
        warmup_epochs: Warmup epochs (LESS: 4).
        lr: Warmup learning rate (LESS: 2e-5).
        batch_size: Warmup rows per optimizer step.
        seed: Seed of LoRA init, warmup subset, order and projection.
        force: Re-run even when current.

    Returns:
        The stage record; output ``selection`` (id, score, selected).
    """
    selection_count(fraction, 1)  # validates fraction before any model work
    if not 0.0 < warmup_fraction <= 1.0:
        raise ValueError(f"less warmup_fraction={warmup_fraction} must lie in (0, 1]")
    for name, value in (("warmup_epochs", warmup_epochs), ("dim", dim), ("lora_r", lora_r),
                        ("batch_size", batch_size)):
        if value < 1:
            raise ValueError(f"less {name}={value} must be >= 1")

    def body(out: Path) -> StageOutput:
        import torch

        from raycurate.algorithms.less import select_top_fraction

        columns = ["id", "input_ids", "loss_mask"]
        info = run_as_task(less_scores_task, str(output_path(run, base_stage, "model")),
                           str(token_table(run, candidate_stage, columns)),
                           str(token_table(run, validation_stage, columns)), lora_r=lora_r, lora_alpha=lora_alpha,
                           dim=dim, warmup_fraction=warmup_fraction, warmup_epochs=warmup_epochs, lr=lr,
                           batch_size=batch_size, seed=seed)
        ids, scores = info.pop("ids"), info.pop("scores")
        k = selection_count(fraction, len(ids))
        top = select_top_fraction(torch.tensor(scores), k / len(ids))  # k / N of N rows rounds back to exactly k
        chosen = sorted(ids[int(i)] for i in top)
        write_selection(out / SELECTION_FILE, ids, "score", scores, set(chosen))
        return StageOutput(outputs={"selection": SELECTION_FILE}, metrics={
            **selection_metrics(run, candidate_stage, ids, chosen), "dim": dim, **info,
            "trusted_rows": trusted_rows_in(run, validation_stage)})

    config = {"method": "less", "fraction": fraction, "lora_r": lora_r, "lora_alpha": lora_alpha, "dim": dim,
              "warmup_fraction": warmup_fraction, "warmup_epochs": warmup_epochs, "lr": lr,
              "batch_size": batch_size, "seed": seed}
    return run_stage(run, stage, body, config=config, upstream=[candidate_stage, validation_stage, base_stage],
                     force=force)
