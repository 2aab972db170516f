"""Config section of the BRIDGE pipeline (``bridge:`` in a job YAML); defaults are the paper's (docs/bridge.md)."""

from __future__ import annotations

from dataclasses import dataclass

from raycurate.config.base import option

BRIDGE_BASELINES = ("random", "rho1", "token_cleaning", "independent", "sequential")


@dataclass
class BridgeConfig:
    """Coupled prompt-token / response-token selection."""

    rho_p: float = option(0.75, "Share of eligible prompt tokens kept (b_p = round(rho_p * eligible)).", gt=0, le=1)
    rho_r: float = option(0.75, "Share of eligible response tokens supervised (b_r = round(rho_r * eligible)).",
                          gt=0, le=1)
    budget: str = option(
        "per_example", "Response budget: per_example (paper: b_r = round(rho_r * eligible) in every row) or corpus "
        "(beyond the paper: one budget round(rho_r * all eligible response tokens), allocated across rows by the "
        "same conditional scores, so low-scoring rows get few or none; docs/bridge.md).",
        choices=("per_example", "corpus"),
    )
    row_floor: float = option(0.0, "budget=corpus: share of every row's eligible response tokens supervised before "
                              "the corpus-wide allocation (0 <= row_floor <= rho_r).", ge=0, le=1)
    first_tokens: int = option(
        0, "Beyond the paper: supervise every row's first N eligible response tokens (swapped in for the lowest-"
        "scoring selected ones, so the budget is unchanged; the final-answer line is never swapped out). The first "
        "token decides which kind of answer the model starts (docs/bridge.md).", ge=0,
    )
    schedule: str = option("alternating", "Selection schedule.", choices=("independent", "one_pass", "alternating"))
    rounds: int = option(4, "Alternating rounds T (alternating schedule only).", ge=1)
    lam: float = option(0.2, "Anchor weight lambda in v = (1-lambda) g_target/|g| + lambda g_anchor/|g|.", ge=0, le=1)
    last_layers: int = option(4, "Final transformer layers whose parameters define the scoring direction.",
                              ge=1)
    routing_layer: int | None = option(None, "Attention layer for routing weights (null: last full-attention layer).",
                                       ge=0)
    closure: bool = option(True, "Apply the structure-aware closure projection to the response mask.")
    closure_tau: float | None = option(None, "Closure score floor tau (null: the closure module's default).", ge=0)
    closure_alpha: float = option(0.5, "Closure length exponent alpha in q(u) = sum max(s, -tau) / |u|^alpha.", ge=0)
    max_unit_tokens: int = option(96, "Closure: split structural units longer than this.", ge=1)
    min_unit_tokens: int = option(4, "Closure: merge structural units shorter than this.", ge=1)
    fold_fixed_response: bool = option(
        False, "Count the always-supervised EOS / end-of-turn tokens in the prompt scores Delta_p (paper: no)."
    )
    prompt_proxy: str = option(
        "routing", "Prompt-side score: routing (paper: final-layer attention x utility) or knockout_grad (beyond the "
        "paper: derivative of the S_r utility sum w.r.t. per-token attention key scales in every layer; one extra "
        "double-backward pass per micro-batch).", choices=("routing", "knockout_grad"),
    )
    score_dtype: str = option(
        "float16", "Storage dtype of bridge_score's per-row scores (utilities, routing weights, knock-out scores; "
        "each row scaled by its max |x|). float32 stores them exactly: bridge_select then reproduces the unquantized "
        "selection bit for bit, at twice the disk.", choices=("float16", "float32"),
    )
    select_actors: int | None = option(
        None, "CPU actors of bridge_select (selection from the stored scores; no model). 0 selects in the driver "
        "process; null: in the driver up to 20,000 rows (actor start-up costs more than the selection there), "
        "else bridge_pool.num_actors actors. Does not change the selection.", ge=0,
    )
    warmup_epochs: int = option(1, "Epochs of warmup SFT on the warmup split (theta_old -> theta_bar); 0: no "
                               "warmup, theta_bar = theta_old (direction and utilities at the base model).", ge=0)
    warmup_batch: str = option(
        "minibatch", "Warmup SFT batches: minibatch (train's batches, shuffled by train.seed) or full (beyond the "
        "paper: the same number of optimizer steps, each on the mean gradient of the whole warmup split, so "
        "theta_bar and the selection do not depend on a batch order; docs/bridge.md).", choices=("minibatch", "full"))
    validation_rows: int | None = option(None, "Cap on validation rows for g_target (null: the whole split).", ge=1)
    micro_batch: int = option(8, "Examples per forward JVP / attention pass inside a scoring actor.", ge=1)
    diagnostics_rows: int = option(200, "Examples in the fidelity diagnostics sample (0 disables).", ge=0)
    baselines: list[str] = option(
        ["random"], "Token-selection baselines trained at matched budgets: random, rho1 (excess loss l_base - l_ref "
        "per example), token_cleaning (the same score, one corpus-wide threshold), independent / sequential "
        "(surprisal prompt selector + Token Cleaning scores per example, App. D.1; at rho_p = 1 both equal rho1).",
        items=BRIDGE_BASELINES,
    )
    seed: int = option(0, "Seed of the random baseline and the diagnostics sample.")

    def config_problems(self) -> list[str]:
        """Settings BRIDGE's selection rejects when it starts (checked before anything runs)."""
        if self.row_floor > self.rho_r:
            return [f"bridge.row_floor: {self.row_floor} is above bridge.rho_r={self.rho_r} (it is the share of every "
                    "row supervised before the corpus-wide allocation); set it to at most rho_r"]
        return []
