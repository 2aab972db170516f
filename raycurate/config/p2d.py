"""Config section of the P2D pipeline (``p2d:`` in a job YAML); defaults are the paper's (docs/p2d.md)."""

from __future__ import annotations

from dataclasses import dataclass

from raycurate.config.base import option

P2D_BASELINES = ("random_data", "random_heads", "full_heads", "lora", "ifd", "full_data")


@dataclass
class P2DConfig:
    """Attention heads as the compass: head scoring, head-guided ICL probing, sparse head adaptation."""

    task_model: str | None = option(
        None, "A fine-tuned task model to score heads against (a local HF checkpoint); null trains the proxy.")
    pool_split: str | None = option(
        None, "Split (data.split_ratios) that forms the selection pool; null: every tokenized training row. The "
        "paper's 90/10 protocol: split_ratios {selection: 0.9, validation: 0.1} and pool_split: selection.")
    proxy_examples: int = option(100, "Seeded random pool examples the proxy is fine-tuned on.", ge=1)
    proxy_steps: int = option(20, "Full-batch optimizer steps of the proxy fine-tuning.", ge=1)
    proxy_lr: float = option(2e-5, "Learning rate of the proxy fine-tuning.", gt=0)
    head_ratio: float = option(0.10, "rho_P: share of query heads selected (exactly ceil(rho_P * heads)).", gt=0, le=1)
    head_tau: float = option(0.1, "Softmax temperature tau of the head distributions P^h = softmax(vec / tau).", gt=0)
    head_scorer: str = option("w1", "Head score: exact W1 (paper) or an ablation.",
                              choices=("w1", "cosine", "l2", "kl"))
    include_o: bool = option(False, "Include the head's o_proj columns in its scoring vector.")
    data_ratio: float = option(0.10, "rho_D: share of the pool selected by ICL probing.", gt=0, le=1)
    rounds: int = option(3, "n: ICL prompts each example appears in as a demonstration.", ge=1)
    demos: int = option(5, "Demonstrations per ICL prompt.", ge=1)
    queries: int = option(3, "Queries per ICL prompt.", ge=1)
    query_score: str = option(
        "loglik", "Query score s^(k): teacher-forced gold likelihood (geometric-mean token probability, for models "
        "too small to generate), exact_match of the generated final answer, or rouge_l of the generated response.",
        choices=("loglik", "exact_match", "rouge_l"))
    query_baseline: str = option(
        "none", "s^(k) as the paper (none), or query_mean: each query's score minus its mean over every prompt it "
        "appears in, so a prompt's score measures what its demonstrations did rather than how hard its queries "
        "were (best with queries from a trusted set, where each query appears many times).",
        choices=("none", "query_mean"))
    instruction: str = option("Solve the following problems. Show your work and end with '#### answer'.",
                              "Instruction at the top of every ICL prompt.")
    max_prompt_tokens: int = option(2048, "ICL prompts longer than this are an error naming the prompt.", ge=1)
    epochs: int = option(3, "Epochs of the sparse head adaptation and the baselines on the selected data (paper: 3).",
                         ge=1)
    lr: float | None = option(None, "Learning rate of the adaptation (null: train.lr).", gt=0)
    train_o: bool = option(False, "Sparse adaptation also trains the selected heads' o_proj columns.")
    lora_r: int = option(128, "LoRA rank of the lora baseline (paper: 128 on q, k, v).", ge=1)
    baselines: list[str] = option(
        ["random_data", "random_heads"],
        f"Baselines trained and evaluated beside P2D: {', '.join(P2D_BASELINES)}.", items=P2D_BASELINES)
    seed: int = option(0, "Seed of the proxy sample, the ICL rounds and the random baselines.")
