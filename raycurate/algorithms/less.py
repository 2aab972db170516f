"""LESS: gradient-feature data selection (Xia et al. 2024; bilevel paper baseline B4), the pure pieces.

Per training example the LoRA gradient turned into the Adam update direction (:func:`adam_preconditioned`), per
validation example the plain LoRA gradient (:func:`gradient_features`), both projected by one seeded random matrix
(:class:`Projector`; :func:`random_projection`, :func:`project`, :func:`project_in_blocks`) -> :func:`less_scores`
(several checkpoints: :func:`combine_checkpoint_scores`) -> :func:`select_top_fraction`.  The model work (warmup,
orchestration) is :mod:`raycurate.training.less_warmup`; the decisions (Adam direction without bias correction,
projection blocks, the score) are docs/bilevel.md, "Decisions the papers leave open".
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import torch

PROJECTION_KINDS = ("rademacher", "gaussian")
# Rows of the projection matrix drawn from one generator; fixed so chunking never changes the matrix.
PROJECTION_BLOCK_ROWS = 4096


def adam_preconditioned(
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    eps: float = 1e-8,
    beta1: float = 0.9,
    beta2: float = 0.999,
    step: int | None = None,
) -> torch.Tensor:
    """The Adam update direction each example's gradient would produce from the warmup optimizer state.

    Args:
        grad: (N, P) per-example gradients (flattened trainable parameters).
        exp_avg: (P,) Adam first moment of the warmup run.
        exp_avg_sq: (P,) Adam second moment of the warmup run.
        eps: Added to the second moment inside the square root.
        beta1: First-moment decay.
        beta2: Second-moment decay.
        step: None for LESS's uncorrected form; else the updates the warmup optimizer has taken (torch's
            ``state["step"]``), and the direction is bias-corrected as update ``step + 1`` would be.

    Returns:
        (N, P) float32 directions.
    """
    if grad.ndim != 2 or exp_avg.shape != grad.shape[1:] or exp_avg_sq.shape != grad.shape[1:]:
        raise ValueError(
            f"grad {tuple(grad.shape)} must be (N, P) with exp_avg {tuple(exp_avg.shape)} and exp_avg_sq "
            f"{tuple(exp_avg_sq.shape)} both (P,); flatten the optimizer state in the same parameter order"
        )
    g = grad.float()
    m = beta1 * exp_avg.float() + (1.0 - beta1) * g  # (N, P)
    v = beta2 * exp_avg_sq.float() + (1.0 - beta2) * g * g  # (N, P)
    if step is not None:
        m = m / (1.0 - beta1 ** (step + 1))
        v = v / (1.0 - beta2 ** (step + 1))
    return m / torch.sqrt(v + eps)


def _projection_block(seed: int, block: int, rows: int, dim_out: int, kind: str) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed * 1_000_003 + block)
    if kind == "rademacher":
        signs = torch.randint(0, 2, (rows, dim_out), generator=gen, dtype=torch.int8)
        values = signs.float() * 2.0 - 1.0
    elif kind == "gaussian":
        values = torch.randn(rows, dim_out, generator=gen)
    else:
        raise ValueError(f"unknown projection kind {kind!r}; use one of {PROJECTION_KINDS}")
    return values / math.sqrt(dim_out)


def _block_rows(block: int, dim_in: int) -> int:
    return min(PROJECTION_BLOCK_ROWS, dim_in - block * PROJECTION_BLOCK_ROWS)


def random_projection(dim_in: int, dim_out: int, seed: int, kind: str = "rademacher") -> torch.Tensor:
    """A seeded random projection matrix scaled by ``1/sqrt(dim_out)``.

    Memory is ``dim_in * dim_out * 4`` bytes; for large ``dim_in`` use :func:`project_in_blocks`, which builds the
    same matrix block by block.

    Args:
        dim_in: P, the gradient dimension.
        dim_out: d, the feature dimension.
        seed: Seed (same seed, same matrix).
        kind: ``"rademacher"`` (entries +-1/sqrt(d)) or ``"gaussian"`` (N(0, 1/d)).

    Returns:
        (dim_in, dim_out) float32 matrix.
    """
    if dim_in < 1 or dim_out < 1:
        raise ValueError(f"dim_in={dim_in} and dim_out={dim_out} must be >= 1")
    blocks = math.ceil(dim_in / PROJECTION_BLOCK_ROWS)
    return torch.cat([_projection_block(seed, b, _block_rows(b, dim_in), dim_out, kind) for b in range(blocks)])


def project(features: torch.Tensor, proj: torch.Tensor) -> torch.Tensor:
    """Project features: ``features @ proj``.

    Args:
        features: (N, P) gradients or Adam directions.
        proj: (P, d) from :func:`random_projection`.

    Returns:
        (N, d) float32.
    """
    if features.ndim != 2 or features.shape[1] != proj.shape[0]:
        raise ValueError(f"features {tuple(features.shape)} and proj {tuple(proj.shape)} do not chain: need (N, P) @ "
                         "(P, d)")
    return features.float() @ proj.float()


def project_in_blocks(features: torch.Tensor, dim_out: int, seed: int, kind: str = "rademacher") -> torch.Tensor:
    """``project(features, random_projection(P, dim_out, seed, kind))`` without holding the (P, d) matrix.

    Args:
        features: (N, P) gradients or Adam directions.
        dim_out: d.
        seed: Seed of the projection.
        kind: Projection kind.

    Returns:
        (N, d) float32.
    """
    if features.ndim != 2:
        raise ValueError(f"features must be (N, P), got {tuple(features.shape)}")
    dim_in = features.shape[1]
    out = torch.zeros(features.shape[0], dim_out)
    for b in range(math.ceil(dim_in / PROJECTION_BLOCK_ROWS)):
        lo = b * PROJECTION_BLOCK_ROWS
        block = _projection_block(seed, b, _block_rows(b, dim_in), dim_out, kind)  # (rows, d)
        out += features[:, lo:lo + block.shape[0]].float() @ block
    return out


def less_scores(
    train_feats: torch.Tensor, val_feats: torch.Tensor, val_tasks: torch.Tensor | None = None
) -> torch.Tensor:
    """LESS score of each training example: max over tasks of the mean cosine to that task's validation features.

    Args:
        train_feats: (N, d) projected Adam directions of the training examples.
        val_feats: (M, d) projected gradients of the validation examples.
        val_tasks: (M,) task id of each validation example; None = one task.

    Returns:
        (N,) float32 scores in [-1, 1].
    """
    if train_feats.ndim != 2 or val_feats.ndim != 2 or train_feats.shape[1] != val_feats.shape[1]:
        raise ValueError(f"train_feats {tuple(train_feats.shape)} and val_feats {tuple(val_feats.shape)} must be "
                         "(N, d) and (M, d) with the same d")
    train = torch.nn.functional.normalize(train_feats.float(), dim=1)
    val = torch.nn.functional.normalize(val_feats.float(), dim=1)
    cosine = train @ val.T  # (N, M)
    if val_tasks is None:
        return cosine.mean(dim=1)
    if val_tasks.shape != (val_feats.shape[0],):
        raise ValueError(f"val_tasks has shape {tuple(val_tasks.shape)}; pass one task id per validation row")
    per_task = [cosine[:, val_tasks == t].mean(dim=1) for t in torch.unique(val_tasks)]  # T x (N,)
    return torch.stack(per_task, dim=1).max(dim=1).values


def combine_checkpoint_scores(scores: list[torch.Tensor], learning_rates: list[float]) -> torch.Tensor:
    """Sum of per-checkpoint scores weighted by each checkpoint's learning rate (normalised to sum 1).

    Args:
        scores: C tensors (N,) from :func:`less_scores`, one per warmup checkpoint.
        learning_rates: C learning rates (the mean lr of the epoch each checkpoint closes, in LESS).

    Returns:
        (N,) combined scores.
    """
    if not scores or len(scores) != len(learning_rates) or sum(learning_rates) <= 0:
        raise ValueError("pass one positive learning rate per checkpoint score (at least one checkpoint)")
    total = sum(learning_rates)
    return sum(s.float() * (lr / total) for s, lr in zip(scores, learning_rates))


def select_top_fraction(scores: torch.Tensor, fraction: float) -> torch.Tensor:
    """Indices of the top ``round(fraction * N)`` scores (halves round up), ties by index, sorted ascending.

    Args:
        scores: (N,) scores.
        fraction: Share of examples to keep, in [0, 1].

    Returns:
        (k,) int64 indices.
    """
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"fraction must lie in [0, 1], got {fraction}")
    n = scores.numel()
    k = min(n, math.floor(fraction * n + 0.5 + 1e-9))
    order = torch.sort(-scores.float(), stable=True).indices  # descending, equal scores keep index order
    return torch.sort(order[:k]).values


# --------------------------------------------------------------------------------------------- gradient features

# Projection matrices up to this many entries (1 GiB of float32) are built once; larger ones are generated block
# by block for every chunk of examples (the same matrix, much slower).
MAX_DENSE_PROJECTION = 2**28
# Per-example gradients held at once before projecting: at most this many float32 entries (256 MiB), <= 64 rows.
FEATURE_CHUNK_ENTRIES = 2**26
MAX_FEATURE_CHUNK = 64


def trainable_named(model: Any) -> list[tuple[str, Any]]:
    """The parameters that receive gradients, in module order (the order of every flattened feature)."""
    return [(name, p) for name, p in model.named_parameters() if p.requires_grad]


def example_gradients(model: Any, rows: list[dict], params: list[Any], *, pad_id: int,
                      chunk: int) -> Iterator[Any]:
    """Flattened gradient of each row's masked mean loss, one backward per row, yielded in chunks.

    Yields:
        (C, P) float32 gradients, C <= ``chunk``, rows in order.
    """
    import torch

    from raycurate.algorithms.losses import model_example_losses, pad_rows

    device = params[0].device
    for lo in range(0, len(rows), chunk):
        grads = []
        for row in rows[lo:lo + chunk]:
            batch = {k: v.to(device) for k, v in pad_rows([row], pad_id).items()}
            loss = model_example_losses(model, batch["input_ids"], batch["attention_mask"], batch["loss_mask"])[0]
            grads.append(torch.cat([g.reshape(-1) for g in torch.autograd.grad(loss, params)]).float())  # (P,)
        yield torch.stack(grads)


class Projector:
    """The seeded (P, d) Rademacher projection of :func:`random_projection`, dense when it fits in
    :data:`MAX_DENSE_PROJECTION` entries, else generated block by block on every call (same matrix)."""

    def __init__(self, dim_in: int, dim_out: int, seed: int, device: Any):
        self.dim_out, self.seed = dim_out, seed
        dense = dim_in * dim_out <= MAX_DENSE_PROJECTION
        self.matrix = random_projection(dim_in, dim_out, seed).to(device) if dense else None

    def __call__(self, features: Any) -> Any:
        """(C, P) -> (C, d) float32 on the CPU."""
        if self.matrix is not None:
            return project(features, self.matrix).cpu()
        return project_in_blocks(features.cpu(), self.dim_out, self.seed)


def gradient_features(model: Any, rows: list[dict], *, pad_id: int, projector: Projector,
                      moments: tuple[Any, Any] | None = None, betas: tuple[float, float] = (0.9, 0.999),
                      eps: float = 1e-8) -> Any:
    """Projected LoRA gradient features of ``rows``: Adam directions when ``moments`` is given (LESS's training
    features), plain gradients otherwise (its validation features).

    Returns:
        (len(rows), d) float32 features on the CPU.
    """
    import torch

    params = [p for _, p in trainable_named(model)]
    n_params = sum(p.numel() for p in params)
    chunk = max(1, min(MAX_FEATURE_CHUNK, FEATURE_CHUNK_ENTRIES // n_params))
    feats = []
    for grads in example_gradients(model, rows, params, pad_id=pad_id, chunk=chunk):  # (C, P)
        if moments is not None:
            grads = adam_preconditioned(grads, moments[0], moments[1], eps=eps, beta1=betas[0], beta2=betas[1])
        feats.append(projector(grads))  # (C, d)
    return torch.cat(feats)
