"""Config section ``data``: corpus inputs, validation mode, splits, length limit and the embedded corpus."""

from __future__ import annotations

from dataclasses import dataclass

from raycurate.config.base import option
from raycurate.config.pool import ActorPoolConfig


@dataclass
class DataConfig:
    """Where the corpus comes from and how it is validated, split and tokenized (docs/data.md)."""

    input: str | list[str] = option(
        "",
        "Corpus path(s): jsonl/parquet files, folders, globs or HF save_to_disk folders; empty = the embedded corpus.",
    )
    validation_input: str | None = option(
        None,
        "Optional separate validation file/folder; its rows form the validation split and the main input is split "
        "over the remaining split_ratios (rescaled).",
    )
    trusted_input: str | list[str] = option(
        "",
        "A small hand-checked file (jsonl/parquet/HF folder, as data.input): the target every method aims at "
        "(BRIDGE's direction, BDS's upper level, P2D's probe queries, LESS's and DSIR's target, the dedup "
        "reference). Its rows are never curated or trained on by the comparison arms; a pool row with the same "
        "prompt is rejected (overlaps_trusted).",
    )
    trusted_rows: int = option(
        200, "Embedded corpus only (when trusted_input is empty): clean rows generated from their own random stream "
        "as the trusted set, disjoint from the pool, held-out and validation questions (0 = no trusted set).", ge=0)
    strict: bool = option(
        False,
        "Stop at the first bad row with an error naming file, line and field, instead of writing it to rejected.jsonl.",
    )
    split_seed: int = option(0, "Seed of the deterministic (id, seed) -> split assignment.")
    split_ratios: dict[str, float] = option(
        {"warmup": 0.05, "validation": 0.05, "selection": 0.90},
        "Split name -> fraction of accepted rows (must sum to 1; order fixes the hash intervals).",
    )
    max_length: int = option(
        512, "Longest tokenized sequence (prompt + response + specials); longer rows are rejected as over_length.", ge=8
    )
    shard_rows: int = option(50_000, "Accepted rows per parquet shard written by ingest.", ge=1)
    corpus_rows: int = option(3000, "Rows of the embedded benchmark corpus (used when input is empty).", ge=1)
    corpus_seed: int = option(0, "Seed of the embedded corpus generator.")
    corrupt_fraction: float = option(0.3, "Fraction of embedded-corpus responses that are corrupted (and labelled).",
                                     ge=0, le=1)
    corruption_mix: dict[str, float] = option(
        {}, "Relative weight per corruption kind of the embedded corpus (wrong_final_answer, wrong_intermediate_step, "
        "swapped_entity, off_topic, truncated, unsafe, near_duplicate); each domain's corrupted rows are apportioned "
        "exactly over the kinds that apply to it. Empty = balanced kinds (every applicable kind equally often).")
    corpus_bad_lines: int = option(
        8, "Malformed/invalid lines appended to the embedded corpus so the demo exercises rejection (0 = none).", ge=0
    )
    heldout_rows: int = option(200, "Held-out clean embedded-corpus rows kept for evaluation (never trained on).", ge=0)
    validation_questions: int = option(
        0, "Validation questions generated beside the held-out set (embedded corpus): clean math problems from their "
        "own random stream, none equal to a held-out prompt. eval.split=validation evaluates on them, so learning "
        "rates, epochs and budgets are chosen without looking at held-out (0 = none).", ge=0)

    def config_problems(self) -> list[str]:
        """``split_ratios`` must be non-negative finite shares summing to 1."""
        from raycurate.data.splits import check_ratios

        try:
            check_ratios(self.split_ratios)
        except ValueError as exc:
            return [f"data.split_ratios: {exc}"]
        from raycurate.data.corpus.corruptions import check_corruption_mix
        from raycurate.data.corpus.domains import DOMAINS

        try:
            check_corruption_mix(self.corruption_mix, DOMAINS)
        except ValueError as exc:
            return [f"data.corruption_mix: {exc}"]
        return []

    def input_paths(self) -> list[str]:
        """``input`` as a list (empty list = use the embedded corpus)."""
        return _as_paths(self.input)

    def trusted_paths(self) -> list[str]:
        """``trusted_input`` as a list (empty: none given)."""
        return _as_paths(self.trusted_input)

    def has_trusted(self) -> bool:
        """Whether the job has a trusted set: a ``trusted_input`` file, or generated rows on the embedded corpus."""
        return bool(self.trusted_paths()) or (not self.input_paths() and self.trusted_rows > 0)


def _as_paths(value: str | list[str]) -> list[str]:
    if isinstance(value, str):
        return [value] if value else []
    return list(value)


@dataclass
class TokenizeConfig(ActorPoolConfig):
    """Config section ``tokenize``: how chat rows are rendered, and the actor pool that tokenizes them."""

    system_prompt: str = option(
        "default",
        "System turn of conversations that have none of their own: default (the chat template's own, e.g. "
        "SmolLM2's 'You are a helpful AI assistant named SmolLM...'; none for the embedded model), none (no system "
        "turn, even where the template would inject one), or any other text (that system prompt).  Applies to the "
        "training rows and to held-out evaluation prompts alike.",
    )

    def config_problems(self) -> list[str]:
        """An empty system prompt is ambiguous (an empty system turn or none?): ask for ``none``."""
        if not self.system_prompt.strip():
            return ["tokenize.system_prompt is empty; use 'none' for no system turn, or the prompt text"]
        return []

