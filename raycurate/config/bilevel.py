"""Config section of the bilevel pipeline (``bilevel:`` in a job YAML); defaults are the paper's (App. D;
docs/bilevel.md)."""

from __future__ import annotations

from dataclasses import dataclass

from raycurate.config.base import option

BILEVEL_METHODS = ("bds", "online", "mix_0.5", "mix_1", "random", "dsir", "less")
#: omega optimizers and the sparse optimizers' baselines (the BDS step, :mod:`raycurate.algorithms.bilevel`,
#: implements them; the first is the default).
OMEGA_OPTIMIZERS = ("sparse_sgd", "sgd", "sparse_adam", "adam")
OMEGA_BASELINES = ("median", "mean")


def is_bilevel_method(name: object) -> bool:
    """bds, online, random, dsir, less or mix_<rho> with 0 < rho <= 1 (e.g. mix_0.5)."""
    if not isinstance(name, str):
        return False
    if name.startswith("mix_"):
        try:
            return 0 < float(name.removeprefix("mix_")) <= 1
        except ValueError:
            return False
    return name in BILEVEL_METHODS


@dataclass
class BilevelConfig:
    """BDS data weights learned during training, BMO online regeneration, and the example-level baselines."""

    methods: list[str] = option(
        list(BILEVEL_METHODS),
        "Methods trained and evaluated: bds (offline BDS), online (BDS + BMO regeneration), mix_<rho> (direct "
        "mixing, eq. 3), random, dsir, less (selection baselines trained on validation + selected candidates).",
        items=is_bilevel_method)
    validation_split: str = option("validation", "Split (data.split_ratios) forming the upper-level validation set.")
    candidate_split: str = option("selection", "Split forming the lower-level candidate pool.")
    validation_clean_only: bool = option(
        True, "Embedded corpus only: keep the validation rows whose ground-truth label is clean (the high-quality "
        "upper level); ignored for data without labels.")
    adapter: str = option("lora", "theta is a PEFT LoRA adapter (paper) or the full model.", choices=("lora", "full"))
    lora_r: int = option(16, "LoRA rank (paper: 16).", ge=1)
    lora_alpha: float = option(16, "LoRA alpha (paper: 16).", gt=0)
    lr: float = option(5e-6, "theta learning rate (paper: Adam 5e-6); replaces train.lr for every bilevel method "
                       "(BDS and its baselines alike).", gt=0)
    epochs: int = option(3, "Epochs over the candidates (paper: 3); replaces train.epochs for every bilevel "
                         "method.", ge=1)
    omega_optimizer: str = option(
        "sparse_sgd", "Optimizer of omega. sparse_sgd / sparse_adam: each sampled row is centred on the rest of its "
        "batch and only sampled logits (and Adam moments) move; sgd: the exact mini-batch gradient through the full "
        "softmax with plain SGD; adam: the paper's dense Adam, which makes omega record when each row was first "
        "sampled, not its quality (docs/bilevel.md) -- faithful reproduction only.",
        choices=OMEGA_OPTIMIZERS)
    omega_baseline: str = option(
        "median", "sparse_sgd / sparse_adam: each sampled row's loss is compared with the median (robust to the "
        "heavy-tailed losses of corrupted rows) or the mean (exactly the full gradient in expectation) of the rest "
        "of its batch.", choices=OMEGA_BASELINES)
    omega_lr: float = option(
        100.0, "Step size of omega. The omega gradient is O(gamma/B * loss spread) (B = candidates per step), so "
        "SGD needs about B/gamma for O(1) logit moves per epoch; Adam steps are ~lr per sighting (paper: Adam 1e-4).",
        gt=0)
    rho0: float = option(0.1, "rho of the first epoch; gamma_k = rho_k / (1 - rho_k), so 0 < rho < 1.", gt=0, lt=1)
    rho_step: float = option(0.1, "rho added after every epoch.", ge=0)
    rho_max: float = option(0.9, "Cap on rho (0 < rho_max < 1).", gt=0, lt=1)
    variant: str = option("exact", "omega sees candidate losses at theta^{k+1} (exact, eq. 5b) or at theta^k "
                          "(detached, BIPOST's cheaper form).", choices=("exact", "detached"))
    val_batch: int | None = option(None, "Validation rows per step (null: half of train.effective_batch_size).",
                                   ge=1)
    online_ratio: float = option(0.10, "R: share of candidate questions whose responses are regenerated online.",
                                 ge=0, le=1)
    online_mask: str = option("fixed", "Masked questions: a fixed seeded random set, or the bottom-R by sigma at "
                              "each generation round.", choices=("fixed", "dynamic"))
    online_samples: int = option(1, "G: responses generated per masked question.", ge=1)
    generation_every: int = option(500, "K_gen: optimizer steps between generation rounds (paper: 500).", ge=1)
    temperature: float = option(0.8, "Sampling temperature of the online generation.", ge=0)
    max_new_tokens: int = option(512, "Generation budget per response.", ge=1)
    importance: str = option("clip", "Importance weights r = pi_theta / pi_old: per-token clipped, or "
                             "self-normalised per question (Lemma 4).", choices=("clip", "self_normalize"))
    importance_clip: float = option(2.0, "Ratio bound of the clipped importance weights ([1/c, c]).", ge=1)
    generation_actors: int = option(1, "Generation actors of the online pool (one model / vLLM engine each).", ge=1)
    generation_backend: str = option("auto", "Generation actors: vllm on GPU clusters, HF generate on CPU.",
                                     choices=("auto", "hf", "vllm"))
    select_fraction: float = option(0.5, "Share of candidates kept by the random, DSIR and LESS baselines.", gt=0, le=1)
    dsir_buckets: int = option(10000, "DSIR: hashed unigram+bigram buckets.", ge=1)
    less_dim: int = option(8192, "LESS: random-projection dimension of the LoRA gradient features.", ge=1)
    less_warmup_fraction: float = option(0.05, "LESS: share of candidates the warmup LoRA trains on.", gt=0, le=1)
    dedup_threshold: float | None = option(
        None, "Near-duplicate filter before every method (null: off): drop a candidate whose word 3-gram Jaccard "
        "similarity (MinHash + LSH, verified exactly) with an earlier row (validation rows first, then candidates "
        "by id) is >= this, e.g. 0.9. Reported as stage bilevel_dedup.", gt=0, le=1)
    seed: int = option(0, "Seed of row sampling, masks and the selection baselines.")
