"""Config section of the composable curation pipeline (``curate:`` in a job YAML; ``pipeline: curate``)."""

from __future__ import annotations

from dataclasses import dataclass

from raycurate.config.base import option

CURATE_STEPS = ("dedup", "reference", "bds", "p2d", "mask", "bridge")
#: Example-level steps that rank the rows (``keep_fraction`` applies); ``dedup`` only drops near-duplicates.
RANKING_STEPS = ("reference", "bds", "p2d")
#: Token-level steps: at most one, and last (they act on the rows the example-level steps kept).
TOKEN_STEPS = ("mask", "bridge")
#: The split every step curates (BRIDGE's selection split and the bilevel candidate pool).
POOL_SPLIT = "selection"
#: dedup step's pair measures and keep rules (:mod:`raycurate.algorithms.dedup` implements them).
DEDUP_SIMILARITIES = ("jaccard", "containment", "example")
DEDUP_KEEP_RULES = ("first", "shortest")
#: What each step does, in plain words (the CLI's help and the report use them).
STEP_HELP = {
    "dedup": "drop near-duplicate rows",
    "reference": "keep the rows a LoRA reference, fine-tuned on the trusted rows, finds least surprising",
    "bds": "keep the top rows by their learned BDS weight (bilevel data selection)",
    "p2d": "keep the top rows by P2D's score (how much each row helps as an in-context example)",
    "mask": "token-level: drop the loss of the response tokens the reference finds most surprising",
    "bridge": "token-level: BRIDGE token selection (train on the prompt and response tokens that help most)",
}


def steps_problems(steps: list[str]) -> list[str]:
    """Problems of an ordered ``curate.steps`` list (empty when it is valid).

    Valid: at least one step, each one of :data:`CURATE_STEPS`, no step twice, at most one token-level step
    (:data:`TOKEN_STEPS`), and it last.
    """
    if not steps:
        return [f"curate.steps: is empty; list at least one step, e.g. [bds, bridge] (allowed: "
                f"{', '.join(CURATE_STEPS)})"]
    problems = []
    unknown = [s for s in steps if s not in CURATE_STEPS]
    if unknown:
        problems.append(f"curate.steps: unknown step(s) {unknown}; allowed: {', '.join(CURATE_STEPS)}")
    repeated = sorted({s for s in steps if steps.count(s) > 1})
    if repeated:
        problems.append(f"curate.steps: {repeated} appear more than once; each step runs at most once")
    token_steps = [s for s in steps if s in TOKEN_STEPS]
    if len(token_steps) > 1:
        problems.append(f"curate.steps: {token_steps} are both token-level steps; keep one of them")
    elif token_steps and steps[-1] != token_steps[0]:
        step = token_steps[0]
        problems.append(f"curate.steps: {step!r} must be the last step (token selection runs on the rows the "
                        f"example-level steps kept); got {steps}, e.g. use {[s for s in steps if s != step] + [step]}")
    return problems


@dataclass
class CurateConfig:
    """Composable curation: example-level selection / weighting, then token-level selection, then one SFT."""

    steps: list[str] = option(
        ["dedup", "reference"], "Ordered steps (default dedup then reference: on the real model the reference "
        "separated every corruption kind but near-duplicates from clean rows, which dedup finds, while BDS missed "
        "swapped numbers and BRIDGE / P2D lost to random; docs/design.md): dedup (drop near-duplicates), "
        "reference (keep the rows a LoRA reference trained on the trusted set finds least surprising), bds (keep "
        "the top rows by the learned BDS weight), p2d (keep the top rows by the P2D ICL score), then at most one "
        "token-level step, last: mask (drop the loss of the response tokens the reference finds most surprising) or "
        "bridge (BRIDGE token selection). Each example-level step filters the rows the previous one kept.")
    keep_fraction: float = option(
        0.6, "Share of the rows it receives that each ranking step (bds, p2d) keeps: round(keep_fraction * rows), "
        "halves up.", gt=0, le=1)
    bds_mode: str = option(
        "select", "select: keep the top rows by BDS weight and train on them unweighted; weight: also train with "
        "the kept rows' BDS weights (renormalised to mean 1) as the SFT weight column.", choices=("select", "weight"))
    reference_signals: list[str] = option(
        ["max", "excess_max"], "reference step: the row signals (higher loss = worse) under a LoRA reference trained "
        "on the trusted set, among max (the worst token), mean, top3 (mean of the three worst tokens), eos (the "
        "end-of-turn token), excess_max (the worst token of reference minus base loss). A row's badness is its worst "
        "standing over them: the max of its percentiles among held-out trusted rows (or among the pool when "
        "calibration_fraction is 0).", items=("mean", "max", "top3", "eos", "excess_max"))
    keep_rule: str = option(
        "calibrated", "reference step: calibrated (keep the rows whose badness is at most calibration_quantile: "
        "no worse than that share of held-out trusted rows, whatever the pool's share of bad rows) or fraction "
        "(keep the keep_fraction best rows, as the other ranking steps).", choices=("calibrated", "fraction"))
    calibration_fraction: float = option(
        0.25, "reference step: share of the trusted rows held out from the reference's training to calibrate the "
        "signals on (a seeded split by curate.seed; 0: none, only with keep_rule fraction).", ge=0, lt=1)
    calibration_quantile: float = option(
        0.95, "reference step, keep_rule calibrated: the badness a kept row may have, as the share of held-out trusted "
        "rows it may be worse than.", gt=0, le=1)
    reference_epochs: int = option(
        3, "reference step / mask step: epochs of the reference's LoRA fine-tuning on the trusted rows (train.* "
        "otherwise).", ge=1)
    mask_threshold: float = option(
        6.0, "mask step: response tokens whose loss under the trusted reference exceeds this many nats lose their "
        "loss in the kept rows (the end-of-turn token always keeps it).", gt=0)
    dedup_threshold: float = option(
        0.95, "dedup step: the curate.dedup_similarity at which two rows count as near-duplicates.", gt=0, le=1)
    dedup_similarity: str = option(
        "example", "dedup step: example (one prompt's word 3-grams inside the other's and the same response: the "
        "lower of the two similarities), jaccard or containment (of prompt + response as one text). example found "
        "86% of the real corpus's near-duplicates at 3% of clean rows flagged (jaccard 0.9: 29-52%; "
        "benchmarks/RESULTS.md).", choices=DEDUP_SIMILARITIES)
    dedup_keep: str = option(
        "shortest", "dedup step: the copy of each duplicate cluster that stays: shortest (the copy without added "
        "words, e.g. a greeting or 'Please answer.') or first (by id). Trusted rows always stay and win their "
        "cluster.", choices=DEDUP_KEEP_RULES)
    compare: bool = option(
        True, "Also train and evaluate, at the composition's response-token budget T, each single step alone over "
        "the full pool and seeded random rows, with paired bootstrap CIs of composition minus each.")
    train_steps: str = option(
        "matched", "How long a kept subset trains: epochs (train.epochs passes over its rows, so fewer steps than "
        "the whole pool) or matched (as many optimizer steps as train.epochs over the whole pool: more passes over "
        "fewer rows, the same compute as SFT on every row; it beat epochs on the real model's validation "
        "questions). Applies to the composition, the single-step and random arms, the clean reference and "
        "raycurate curate --train; SFT on all rows defines the count.", choices=("epochs", "matched"))
    arms: list[str] | None = option(
        None, "With compare: the matched-budget arms to train, among the steps and random (null: every step of a "
        "composition of two or more, and random).")
    seed: int = option(0, "Seed of the tie-break among equal scores and of the random arm.")

    def config_problems(self) -> list[str]:
        """The step list's problems (:func:`steps_problems`) and arms that are neither a step nor random."""
        problems = steps_problems(self.steps)
        if not self.reference_signals:
            problems.append("curate.reference_signals: is empty; list at least one, e.g. [max, excess_max]")
        if self.keep_rule == "calibrated" and self.calibration_fraction == 0 and "reference" in self.steps:
            problems.append("curate.calibration_fraction: keep_rule calibrated needs held-out trusted rows; set it "
                            "above 0 (e.g. 0.25) or use curate.keep_rule=fraction")
        unknown = sorted(set(self.arms or []) - set(self.steps) - {"random"})
        if unknown:
            problems.append(f"curate.arms: {unknown} are not steps of curate.steps {self.steps} nor random")
        return problems

    def methods(self) -> set[str]:
        """The method sections the steps use: bridge, bilevel (bds and dedup split on its splits), p2d."""
        names = {"bridge": "bridge", "bds": "bilevel", "dedup": "bilevel", "p2d": "p2d", "reference": "reference",
                 "mask": "reference"}
        return {names[s] for s in self.steps if s in names}
