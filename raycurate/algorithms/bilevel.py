"""Bilevel data curation math: BDS data weights and their omega update, BMO importance weights and masking.

Paper: bilevel-data-curation (eqs. 2, 5, 8-10, Lemma 4, Corollary 5, Algorithm 1); decisions in SPEC §6.

* Data weights (eq. 2, SPEC §6): one logit ``omega_i`` per candidate example, ``sigma(omega) = N * softmax(omega)``
  where the softmax runs over **all** N candidates (the paper's simplex weights scaled by N, so the weights have
  mean 1 and sum N; a uniform omega gives every example weight exactly 1).
* Penalty objective: ``L_val(theta) + gamma/N * sum_i sigma_i(omega) L_i(theta)`` with ``gamma = rho/(1 - rho)``;
  a mini-batch of B candidates estimates the second term without bias by ``gamma * mean_b(sigma_b * l_b)``.
* omega step (eq. 5b): :func:`update_omega` dispatches on :data:`OMEGA_OPTIMIZERS`.  ``sgd`` and ``adam`` take the
  exact mini-batch gradient through the full softmax (:func:`omega_gradient`, which gives every unsampled logit a
  small same-sign coupling term) and apply :func:`sgd_update` / :func:`adam_update`; ``sparse_sgd`` and
  ``sparse_adam`` take the sampled-row estimator :func:`sampled_omega_gradient` (same expectation over the batch
  draw, zero on unsampled rows) and apply :func:`sparse_sgd_update` / :func:`sparse_adam_update` (moments and step
  counts of the sampled rows only).  Dense ``adam`` (the paper's) records the sampling order instead of the loss
  signal (SPEC §6; kept only as the faithful reproduction).  Everything is float64 numpy and pure, so the same
  inputs give bit-identical outputs on every worker.
* BMO (Algorithm 1, eq. 8-10): :func:`importance_weights` of generated responses, :func:`masked_questions_fixed` /
  :func:`masked_questions_dynamic` for the masked question set, and :func:`response_mask_from_prompt` for the
  response positions of a left-padded generation batch.

Label shifting happens only in :func:`raycurate.algorithms.losses.token_losses`; :func:`token_logprobs` builds on it,
so log-probabilities are aligned with ``input_ids`` exactly like losses and masks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

from raycurate.algorithms.losses import token_losses

OMEGA_VARIANTS = ("exact", "detached")
OMEGA_OPTIMIZERS = ("sgd", "sparse_sgd", "sparse_adam", "adam")
"""omega optimizers: dense-gradient SGD, sampled-row SGD / Adam (signal preserving), dense Adam (the paper's, records
the sampling order; faithful reproduction only)."""
SPARSE_OPTIMIZERS = ("sparse_sgd", "sparse_adam")
OMEGA_BASELINES = ("median", "mean")
"""Baseline of the sampled-row estimator: the median of the rest of the batch (robust) or the unbiased mean."""
OmegaVariant = Literal["exact", "detached"]
IMPORTANCE_MODES = ("clip", "self_normalize")

# Added before flooring a count so an exact half (ratio * n = k + 0.5 in decimal) rounds up even when the float
# product lands a hair below it (the same convention as raycurate.algorithms.selection.budgets).
_HALF_UP_SLACK = 1e-9


# --------------------------------------------------------------------------------------------- data weights


def _softmax(omega: np.ndarray) -> np.ndarray:
    shifted = omega - omega.max()
    exp = np.exp(shifted)
    return exp / exp.sum()


def _as_logits(omega: np.ndarray) -> np.ndarray:
    omega = np.asarray(omega, dtype=np.float64)
    if omega.ndim != 1 or omega.size == 0:
        raise ValueError(f"omega must be a non-empty 1-D array of data logits, got shape {omega.shape}")
    if not np.all(np.isfinite(omega)):
        raise ValueError("omega holds non-finite values; restore the data logits from a checkpoint or re-initialise")
    return omega


def data_weights(omega: np.ndarray) -> np.ndarray:
    """Data weights ``sigma(omega) = N * softmax(omega)`` over all N candidates (mean 1, sum N).

    Args:
        omega: (N,) data logits.

    Returns:
        (N,) float64 weights; all exactly 1.0 when omega is uniform.
    """
    omega = _as_logits(omega)
    return omega.size * _softmax(omega)


def batch_weights(omega: np.ndarray, batch_idx: np.ndarray) -> np.ndarray:
    """The weights ``sigma_i`` of the sampled candidates (normalised over all N, not over the batch).

    Args:
        omega: (N,) data logits.
        batch_idx: (B,) candidate indices.

    Returns:
        (B,) float64 weights.
    """
    return data_weights(omega)[_check_indices(batch_idx, len(omega))]


def _check_indices(batch_idx: np.ndarray, n: int) -> np.ndarray:
    idx = np.asarray(batch_idx, dtype=np.int64)
    if idx.ndim != 1:
        raise ValueError(f"batch_idx must be 1-D, got shape {idx.shape}")
    if idx.size and (idx.min() < 0 or idx.max() >= n):
        raise ValueError(f"batch_idx must lie in [0, {n}), got values in [{idx.min()}, {idx.max()}]")
    return idx


def gamma_schedule(epoch: int, rho0: float = 0.1, rho_step: float = 0.1, rho_max: float = 0.9) -> float:
    """Penalty constant ``gamma_k = rho_k / (1 - rho_k)`` with ``rho_k = min(rho0 + epoch * rho_step, rho_max)``.

    Paper App. D.1: rho starts at 0.1 and grows by 0.1 after every epoch, so epochs 0, 1, 2 use
    gamma = 0.1/0.9, 0.2/0.8, 0.3/0.7.

    Args:
        epoch: 0-based epoch index.
        rho0: rho of epoch 0, in (0, 1).
        rho_step: rho added per epoch, >= 0.
        rho_max: cap on rho, in (0, 1) (rho -> 1 would make gamma infinite).

    Returns:
        gamma for this epoch.
    """
    if epoch < 0:
        raise ValueError(f"epoch must be >= 0, got {epoch}")
    if not (0.0 < rho0 < 1.0 and 0.0 < rho_max < 1.0):
        raise ValueError(f"rho0={rho0} and rho_max={rho_max} must lie in (0, 1); gamma = rho / (1 - rho)")
    if rho_step < 0:
        raise ValueError(f"rho_step must be >= 0, got {rho_step}")
    rho = min(rho0 + epoch * rho_step, rho_max)
    return rho / (1.0 - rho)


# --------------------------------------------------------------------------------------------- omega update


def omega_gradient(
    omega: np.ndarray, batch_idx: np.ndarray, batch_losses: np.ndarray, gamma: float
) -> np.ndarray:
    """Stochastic gradient of the penalty term with respect to the data logits (eq. 5b).

    Derivation.  With ``p = softmax(omega)`` over all N and ``sigma = N p``, ``d sigma_i / d omega_j =
    sigma_i (delta_ij - p_j)``.  A batch of B sampled candidates estimates the penalty term
    ``gamma/N sum_i sigma_i l_i`` without bias by ``F = gamma/B sum_b sigma_{i_b} l_{i_b}``, so::

        dF/d omega_j = gamma/B * sum_b sigma_{i_b} (delta_{i_b j} - p_j) l_{i_b}
                     = gamma/B * (c_j sigma_j l_j - p_j S),   S = sum_b sigma_{i_b} l_{i_b},

    where ``c_j`` counts how often j was sampled (0 or 1 without replacement).  Every logit gets gradient: sampled
    ones ``gamma/B (sigma_j l_j - p_j S)``, the others ``-gamma/B p_j S`` (the softmax couples them).  The
    components sum to 0 (softmax is shift invariant).  This is eq. 5b / 10b with the paper's simplex weights
    replaced by SPEC's N-scaled ones; with Adam the constant factor only matters relative to ``eps``, and the N
    scaling keeps sampled components O(l) whatever N is.

    The losses are numbers, not graph nodes: the exact method (eq. 5b) passes the candidates' losses at
    ``theta^{k+1}`` (a second, no-grad forward after the theta step); BIPOST's cheaper *detached* variant passes
    the losses at ``theta^k`` from the theta step's own forward, detached from the graph.  The formula is the
    same; the variants differ only in where the caller takes ``batch_losses`` from (see :data:`OMEGA_VARIANTS`).

    Args:
        omega: (N,) data logits at step k.
        batch_idx: (B,) sampled candidate indices (duplicates allowed; each occurrence counts).
        batch_losses: (B,) per-example SFT losses of those candidates.
        gamma: Penalty constant gamma_k.

    Returns:
        (N,) float64 gradient.
    """
    omega = _as_logits(omega)
    idx = _check_indices(batch_idx, omega.size)
    losses = np.asarray(batch_losses, dtype=np.float64)
    if losses.shape != idx.shape or idx.size == 0:
        raise ValueError(
            f"batch_losses has shape {losses.shape} but batch_idx has {idx.shape}; pass one loss per sampled "
            "candidate (at least one)"
        )
    if not np.all(np.isfinite(losses)):
        raise ValueError("batch_losses holds non-finite values; check the candidate forward pass (fp overflow?)")
    p = _softmax(omega)  # (N,)
    sigma_l = omega.size * p[idx] * losses  # (B,) sigma_{i_b} l_{i_b}
    grad = -p * sigma_l.sum()  # (N,) the -p_j S term, every logit
    np.add.at(grad, idx, sigma_l)  # + c_j sigma_j l_j on the sampled ones
    return grad * (gamma / idx.size)


def sampled_omega_gradient(
    omega: np.ndarray, batch_idx: np.ndarray, batch_losses: np.ndarray, gamma: float, baseline: str = "mean"
) -> np.ndarray:
    """Sampled-row estimator of the omega gradient: nonzero only on the B sampled logits (for sparse optimizers).

    The exact mini-batch gradient (:func:`omega_gradient`) puts the softmax normalisation on every logit: each
    unsampled j gets ``-gamma/B p_j S``.  Over the batch draw (B distinct rows, uniformly without replacement) its
    expectation is the full-data gradient ``gamma/N sigma_j (l_j - Lbar)`` with ``Lbar = sum_i p_i l_i``, the
    sigma-weighted mean loss.  This estimator has the same expectation but keeps the normalisation on the sampled
    rows, as a baseline subtracted from their own loss::

        g_j = gamma/B * sigma_j (l_j - beta_j)   for sampled j,   0 otherwise,
        beta_j = (sigma_j l_j + (N - 1)/(B - 1) * sum_{b != j} sigma_b l_b) / N,

    so ``E[1{j sampled} beta_j] = (B/N) Lbar`` exactly and ``E[g] = E[omega_gradient]`` for every logit (checked by
    enumerating all batches in the tests).  ``beta_j`` is about the leave-one-out batch mean of ``sigma l``: each
    sampled row is judged against the rows sampled with it, at the same theta, so a loss that drifts down while
    theta trains does not leak into omega, and a per-coordinate optimizer never sees the coupling term of rows
    it has not sampled.

    ``baseline="median"`` replaces ``beta_j`` by the median of ``sigma_b l_b`` over the rest of the batch.  SFT
    losses are heavy-tailed (one off-topic row can cost 10x a typical one), and a mean baseline lets such a row
    raise every batch-mate's omega.  The expected update then differs from the exact gradient's by
    ``gamma/N sigma_j (Lbar - m)`` (m: the expected median), a step proportional to sigma_j: a shared shift of all
    logits, which softmax ignores, while the weights are near uniform, and second order in their spread otherwise.

    Args:
        omega: (N,) data logits.
        batch_idx: (B,) distinct sampled candidate indices, B >= 2.
        batch_losses: (B,) their per-example losses.
        gamma: Penalty constant gamma_k.
        baseline: ``"mean"`` (exact expectation) or ``"median"`` (robust), see :data:`OMEGA_BASELINES`.

    Returns:
        (B,) float64 gradient components of the sampled logits, in ``batch_idx`` order.
    """
    omega = _as_logits(omega)
    idx = _check_indices(batch_idx, omega.size)
    losses = np.asarray(batch_losses, dtype=np.float64)
    if losses.shape != idx.shape:
        raise ValueError(f"batch_losses has shape {losses.shape} but batch_idx has {idx.shape}; pass one loss per "
                         "sampled candidate")
    if idx.size < 2 or np.unique(idx).size != idx.size:
        raise ValueError(f"the sampled-row omega gradient needs >= 2 distinct candidates per step (got {idx.size} "
                         f"indices, {np.unique(idx).size} distinct); raise the candidate batch or use a dense "
                         "optimizer (sgd)")
    if not np.all(np.isfinite(losses)):
        raise ValueError("batch_losses holds non-finite values; check the candidate forward pass (fp overflow?)")
    n, b = omega.size, idx.size
    sigma = data_weights(omega)[idx]  # (B,)
    sigma_l = sigma * losses  # (B,)
    if baseline == "mean":
        others = sigma_l.sum() - sigma_l  # (B,) sum over the other sampled rows
        beta = (sigma_l + (n - 1) / (b - 1) * others) / n  # (B,)
    elif baseline == "median":
        rest = ~np.eye(b, dtype=bool)  # (B, B) row j: every batch-mate but j
        beta = np.median(np.broadcast_to(sigma_l, (b, b))[rest].reshape(b, b - 1), axis=1)  # (B,)
    else:
        raise ValueError(f"unknown omega baseline {baseline!r}; use one of {OMEGA_BASELINES}")
    return gamma / b * sigma * (losses - beta)


@dataclass(frozen=True)
class AdamState:
    """Adam moments of the data logits (float64).

    Attributes:
        step: Updates applied so far (dense Adam's bias-correction count).
        exp_avg: (N,) first moment.
        exp_avg_sq: (N,) second moment.
        row_steps: (N,) int64 updates each logit received (sparse Adam's per-row bias-correction count); zeros
            for dense Adam.
    """

    step: int
    exp_avg: np.ndarray
    exp_avg_sq: np.ndarray
    row_steps: np.ndarray | None = None

    @classmethod
    def zeros(cls, n: int) -> AdamState:
        """The state before the first update."""
        return cls(0, np.zeros(n, dtype=np.float64), np.zeros(n, dtype=np.float64), np.zeros(n, dtype=np.int64))

    def counts(self) -> np.ndarray:
        """(N,) int64 per-row update counts (zeros when the state predates them)."""
        return np.zeros(self.exp_avg.shape, np.int64) if self.row_steps is None else self.row_steps


def adam_update(
    omega: np.ndarray,
    grad: np.ndarray,
    state: AdamState,
    lr: float = 1e-4,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
) -> tuple[np.ndarray, AdamState]:
    """One Adam step (Kingma & Ba, with bias correction) on the data logits; pure and float64.

    ``m = b1 m + (1 - b1) g``, ``v = b2 v + (1 - b2) g^2``, ``omega -= lr * m_hat / (sqrt(v_hat) + eps)`` with
    ``m_hat = m / (1 - b1^t)``, ``v_hat = v / (1 - b2^t)``.  Inputs are not modified; identical inputs give
    bit-identical outputs, which keeps omega the same on every data-parallel worker.

    Args:
        omega: (N,) data logits.
        grad: (N,) gradient from :func:`omega_gradient`.
        state: Moments before this step.
        lr: Step size (paper: 1e-4).
        betas: (b1, b2).
        eps: Denominator offset.

    Returns:
        (new omega (N,), new state).
    """
    omega = _as_logits(omega)
    grad = np.asarray(grad, dtype=np.float64)
    if grad.shape != omega.shape or state.exp_avg.shape != omega.shape or state.exp_avg_sq.shape != omega.shape:
        raise ValueError(
            f"omega {omega.shape}, grad {grad.shape} and Adam moments {state.exp_avg.shape} must have the same "
            "shape; was the state restored for a different candidate table?"
        )
    b1, b2 = betas
    step = state.step + 1
    exp_avg = b1 * state.exp_avg + (1.0 - b1) * grad
    exp_avg_sq = b2 * state.exp_avg_sq + (1.0 - b2) * grad * grad
    m_hat = exp_avg / (1.0 - b1**step)
    v_hat = exp_avg_sq / (1.0 - b2**step)
    return omega - lr * m_hat / (np.sqrt(v_hat) + eps), AdamState(step, exp_avg, exp_avg_sq, state.counts())


def sgd_update(omega: np.ndarray, grad: np.ndarray, lr: float) -> np.ndarray:
    """Plain gradient step ``omega - lr * grad`` (eq. 5b as written, with a constant step size alpha).

    An alternative to :func:`adam_update`: each logit is sampled about once per epoch, so Adam's per-coordinate
    normalisation turns every sampled logit's step into roughly ``lr * sign(grad)`` and discards how large the
    example's loss was; plain SGD keeps the step proportional to ``sigma_j l_j``.

    Args:
        omega: (N,) data logits.
        grad: (N,) gradient from :func:`omega_gradient`.
        lr: Step size alpha.

    Returns:
        (N,) float64 new logits.
    """
    omega = _as_logits(omega)
    grad = np.asarray(grad, dtype=np.float64)
    if grad.shape != omega.shape:
        raise ValueError(f"grad has shape {grad.shape} but omega has {omega.shape}")
    return omega - lr * grad


def sparse_sgd_update(omega: np.ndarray, batch_idx: np.ndarray, grad_rows: np.ndarray, lr: float) -> np.ndarray:
    """SGD on the sampled logits only: ``omega[idx] -= lr * grad_rows``; pure.

    Args:
        omega: (N,) data logits.
        batch_idx: (B,) distinct sampled indices.
        grad_rows: (B,) their gradient components (:func:`sampled_omega_gradient`).
        lr: Step size.

    Returns:
        (N,) float64 new logits (unsampled ones unchanged).
    """
    omega = _as_logits(omega).copy()
    idx = _check_indices(batch_idx, omega.size)
    omega[idx] -= lr * np.asarray(grad_rows, dtype=np.float64)
    return omega


def sparse_adam_update(
    omega: np.ndarray,
    batch_idx: np.ndarray,
    grad_rows: np.ndarray,
    state: AdamState,
    lr: float,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
) -> tuple[np.ndarray, AdamState]:
    """Adam on the sampled logits only ("lazy" Adam); pure and float64.

    The sampled rows' moments and step counts advance (``t_j += 1``, bias correction with each row's own ``t_j``);
    every other row keeps its moments and its logit.  So a logit moves only when its own example was seen, and
    by an amount set by its own gradient history -- never by the coupling term of somebody else's batch.  Note:
    a row's first update is ``lr * sign(g_j)`` (Adam's first step), so within the first epoch omega separates
    examples by the sign of ``l_j - beta_j`` only; magnitudes enter from the second sighting on.

    Args:
        omega: (N,) data logits.
        batch_idx: (B,) distinct sampled indices.
        grad_rows: (B,) their gradient components (:func:`sampled_omega_gradient`).
        state: Moments and per-row step counts before this step.
        lr: Step size.
        betas: (b1, b2).
        eps: Denominator offset.

    Returns:
        (new omega (N,), new state; ``state.step`` counts calls).
    """
    omega = _as_logits(omega).copy()
    idx = _check_indices(batch_idx, omega.size)
    grad_rows = np.asarray(grad_rows, dtype=np.float64)
    if state.exp_avg.shape != omega.shape or grad_rows.shape != idx.shape:
        raise ValueError(f"omega {omega.shape}, Adam moments {state.exp_avg.shape}, batch_idx {idx.shape} and "
                         f"grad_rows {grad_rows.shape} do not match; was the state restored for a different "
                         "candidate table?")
    b1, b2 = betas
    exp_avg, exp_avg_sq, row_steps = state.exp_avg.copy(), state.exp_avg_sq.copy(), state.counts().copy()
    row_steps[idx] += 1
    exp_avg[idx] = b1 * exp_avg[idx] + (1.0 - b1) * grad_rows
    exp_avg_sq[idx] = b2 * exp_avg_sq[idx] + (1.0 - b2) * grad_rows * grad_rows
    t = row_steps[idx]
    m_hat = exp_avg[idx] / (1.0 - b1**t)
    v_hat = exp_avg_sq[idx] / (1.0 - b2**t)
    omega[idx] -= lr * m_hat / (np.sqrt(v_hat) + eps)
    return omega, AdamState(state.step + 1, exp_avg, exp_avg_sq, row_steps)


def update_omega(
    optimizer: str,
    omega: np.ndarray,
    batch_idx: np.ndarray,
    batch_losses: np.ndarray,
    gamma: float,
    state: AdamState,
    lr: float,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    baseline: str = "median",
) -> tuple[np.ndarray, AdamState]:
    """One omega step (eq. 5b) with optimizer ``optimizer`` (:data:`OMEGA_OPTIMIZERS`); pure, float64.

    * ``sgd``: :func:`omega_gradient` + :func:`sgd_update` (the state passes through).
    * ``sparse_sgd``: :func:`sampled_omega_gradient` + :func:`sparse_sgd_update`.
    * ``sparse_adam``: :func:`sampled_omega_gradient` + :func:`sparse_adam_update`.
    * ``adam``: :func:`omega_gradient` + dense :func:`adam_update` -- the paper's; Adam normalises every unsampled
      logit's tiny same-sign coupling gradient to a ~+lr step, so omega ends up encoding when each row was first
      sampled (SPEC §6).  Faithful reproduction only.

    Args:
        optimizer: One of :data:`OMEGA_OPTIMIZERS`.
        omega: (N,) data logits.
        batch_idx: (B,) sampled candidate indices (the gathered batch of all workers).
        batch_losses: (B,) their losses.
        gamma: Penalty constant gamma_k.
        state: Adam state (used by the Adam variants).
        lr: Step size.
        betas: Adam betas.
        eps: Adam eps.
        baseline: Baseline of the sparse optimizers' sampled-row estimator (:data:`OMEGA_BASELINES`).

    Returns:
        (new omega (N,), new state).
    """
    if optimizer == "sgd":
        return sgd_update(omega, omega_gradient(omega, batch_idx, batch_losses, gamma), lr), state
    if optimizer == "adam":
        return adam_update(omega, omega_gradient(omega, batch_idx, batch_losses, gamma), state, lr, betas, eps)
    if optimizer == "sparse_sgd":
        grad = sampled_omega_gradient(omega, batch_idx, batch_losses, gamma, baseline)
        return sparse_sgd_update(omega, batch_idx, grad, lr), state
    if optimizer == "sparse_adam":
        grad = sampled_omega_gradient(omega, batch_idx, batch_losses, gamma, baseline)
        return sparse_adam_update(omega, batch_idx, grad, state, lr, betas, eps)
    raise ValueError(f"unknown omega optimizer {optimizer!r}; use one of {OMEGA_OPTIMIZERS}")


# --------------------------------------------------------------------------------------------- BMO: importance weights


def token_logprobs(logits: torch.Tensor, input_ids: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """Log-probability of each supervised token under the model, aligned with ``input_ids``.

    ``logprobs[:, t] = log pi(input_ids[:, t] | input_ids[:, :t])`` where ``loss_mask`` is set, else 0.  Labels are
    shifted once, inside :func:`raycurate.algorithms.losses.token_losses`.

    Args:
        logits: (B, T, V) model outputs.
        input_ids: (B, T) token ids.
        loss_mask: (B, T) 1 at the response tokens.

    Returns:
        (B, T) float32 log-probabilities (<= 0).
    """
    return -token_losses(logits, input_ids, loss_mask)


def importance_weights(
    logp_new: torch.Tensor,
    logp_old: torch.Tensor,
    mask: torch.Tensor,
    mode: str = "clip",
    clip: float = 2.0,
    group: torch.Tensor | None = None,
) -> torch.Tensor:
    """Importance weights ``r = pi_theta / pi_old`` of generated responses, computed in log space (Corollary 5).

    Both modes are treated as constants by the caller's loss (eq. 9 multiplies the gradient by r; this function
    detaches its inputs) and are exactly 1 when ``logp_new == logp_old``.

    * ``"clip"`` -- per token: ``r_t = exp(clamp(logp_new_t - logp_old_t, -log clip, log clip))``, i.e. the ratio
      truncated to ``[1/clip, clip]``; 0 outside ``mask``.  Returns (B, T).
    * ``"self_normalize"`` -- per sequence (Lemma 4): ``s_g = sum_t mask (logp_new - logp_old)``, then per
      question ``w_g = G * softmax_g(s_g)`` over that question's G responses (``group`` says which rows share a
      question), so the weights of one question average 1 and follow the implicit BMO weight lambda_{i,g}.  With
      G = 1 every weight is 1.  Returns (B,).

    Args:
        logp_new: (B, T) token log-probs under the current policy (from :func:`token_logprobs`).
        logp_old: (B, T) token log-probs kept at generation time.
        mask: (B, T) 1 at response tokens.
        mode: ``"clip"`` or ``"self_normalize"``.
        clip: Ratio bound of ``"clip"``, > 1.
        group: (B,) question id of each row for ``"self_normalize"``; None = every row its own question.

    Returns:
        float64 weights: (B, T) for ``"clip"``, (B,) for ``"self_normalize"``; finite for any response length.
    """
    if logp_new.shape != logp_old.shape or logp_new.shape != mask.shape or logp_new.ndim != 2:
        raise ValueError(
            f"logp_new {tuple(logp_new.shape)}, logp_old {tuple(logp_old.shape)} and mask {tuple(mask.shape)} must "
            "all be (B, T)"
        )
    on = (mask != 0).to(torch.float64)
    log_ratio = (logp_new.detach().to(torch.float64) - logp_old.detach().to(torch.float64)) * on  # (B, T)
    if mode == "clip":
        if not clip > 1.0:
            raise ValueError(f"clip must be > 1 (the ratio is truncated to [1/clip, clip]), got {clip}")
        bound = math.log(clip)
        return torch.exp(log_ratio.clamp(-bound, bound)) * on
    if mode == "self_normalize":
        return _group_softmax_times_size(log_ratio.sum(dim=1), group)
    raise ValueError(f"unknown importance weight mode {mode!r}; use one of {IMPORTANCE_MODES}")


def _group_softmax_times_size(scores: torch.Tensor, group: torch.Tensor | None) -> torch.Tensor:
    """``G_q * softmax`` of ``scores`` (B,) within each group q; exactly 1 where a group's scores are all equal."""
    if group is None:
        return torch.ones_like(scores)
    if group.shape != scores.shape:
        raise ValueError(f"group has shape {tuple(group.shape)}; pass one question id per row ({tuple(scores.shape)})")
    weights = torch.empty_like(scores)
    for q in torch.unique(group):
        rows = group == q
        s = scores[rows]
        shifted = s - s.max()  # exactly 0 for equal scores
        # log w = shifted - (log sum exp(shifted) - log G): both logs equal log G exactly when all scores tie.
        log_norm = torch.log(torch.exp(shifted).sum()) - math.log(int(rows.sum()))
        weights[rows] = torch.exp(shifted - log_norm)
    return weights


def grouped_response_losses(
    per_token: torch.Tensor,
    loss_mask: torch.Tensor,
    old_logp: torch.Tensor,
    generated: torch.Tensor,
    group: torch.Tensor,
    num_groups: int,
    mode: str = "clip",
    clip: float = 2.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-question losses of a batch that mixes offline rows and generated responses (eq. 9 and 10c).

    Each question (group) is one offline row, or the G generated responses of a masked question.  The theta-step
    loss of a masked question is ``1/G sum_g r_g l_g`` (eq. 9): with ``"self_normalize"`` r_g is the per-sequence
    weight of :func:`importance_weights` and ``l_g`` the mean token loss; with ``"clip"`` the per-token ratios
    weight the token losses, ``l_g = sum_t r_t l_t / n_g``.  Offline rows keep their plain mean token loss.  The
    omega coefficient (eq. 10c) is the unweighted mean ``1/G sum_g l_g``.

    Args:
        per_token: (R, T) token losses from :func:`raycurate.algorithms.losses.token_losses` (with graph).
        loss_mask: (R, T) supervised positions (the response of a generated row).
        old_logp: (R, T) generation-time token log-probs of generated rows (anything on offline rows).
        generated: (R,) bool, True for generated rows.
        group: (R,) int64 question slot of each row in ``[0, num_groups)``.
        num_groups: S, the number of questions in the batch.
        mode: Importance weight mode (:data:`IMPORTANCE_MODES`).
        clip: Ratio bound of ``"clip"``.

    Returns:
        (S,) weighted losses (with graph) and (S,) plain mean losses (detached).
    """
    counted = (loss_mask != 0).to(per_token.dtype)
    counted[:, 0] = 0.0  # position 0 has no prediction
    row_plain = per_token.sum(dim=1) / counted.sum(dim=1).clamp_min(1.0)  # (R,)
    generated = generated.to(torch.bool)
    on_generated = (loss_mask != 0) & generated.unsqueeze(1)  # (R, T)
    logp_new = -per_token.detach()  # token_losses is -log p on supervised positions, 0 elsewhere
    if mode == "clip":
        ratio = importance_weights(logp_new, old_logp, on_generated, mode="clip", clip=clip).to(per_token.dtype)
        row_generated = (ratio * per_token).sum(dim=1) / counted.sum(dim=1).clamp_min(1.0)
        row_weighted = torch.where(generated, row_generated, row_plain)
    elif mode == "self_normalize":
        weight = importance_weights(logp_new, old_logp, on_generated, mode="self_normalize", group=group)
        row_weighted = weight.to(per_token.dtype) * row_plain  # an offline row is alone in its group: weight 1
    else:
        raise ValueError(f"unknown importance weight mode {mode!r}; use one of {IMPORTANCE_MODES}")
    sizes = torch.zeros(num_groups, dtype=per_token.dtype, device=per_token.device).index_add_(
        0, group, torch.ones_like(row_plain))
    if (sizes == 0).any():
        raise ValueError("every group in [0, num_groups) needs at least one row")
    zeros = torch.zeros(num_groups, dtype=per_token.dtype, device=per_token.device)
    weighted = zeros.index_add(0, group, row_weighted) / sizes
    plain = zeros.index_add(0, group, row_plain.detach()) / sizes
    return weighted, plain


# --------------------------------------------------------------------------------------------- BMO: masking


def masked_count(n: int, ratio: float) -> int:
    """Number of masked questions ``round(ratio * n)``, halves rounded up, in [0, n]."""
    if isinstance(n, bool) or int(n) != n or n < 0:
        raise ValueError(f"n must be a non-negative integer, got {n!r}")
    if not 0.0 <= float(ratio) <= 1.0:
        raise ValueError(f"the online sample ratio R must lie in [0, 1], got {ratio!r}")
    return min(int(n), math.floor(float(ratio) * int(n) + 0.5 + _HALF_UP_SLACK))


def masked_questions_fixed(n: int, ratio: float, seed: int) -> np.ndarray:
    """Fixed random masked set I_M (Algorithm 1 default): ``round(ratio * n)`` questions drawn once.

    Args:
        n: Number of candidate questions.
        ratio: Online sample ratio R.
        seed: Seed of the draw (same seed, same set).

    Returns:
        (round(ratio * n),) sorted int64 indices.
    """
    k = masked_count(n, ratio)
    return np.sort(np.random.default_rng(seed).choice(n, size=k, replace=False)).astype(np.int64)


def masked_questions_dynamic(sigma: np.ndarray, ratio: float) -> np.ndarray:
    """Dynamic masked set (paper §5.2): the bottom ``round(ratio * N)`` questions by weight, ties by index.

    Args:
        sigma: (N,) current data weights (or logits; only the order matters).
        ratio: Online sample ratio R.

    Returns:
        (round(ratio * N),) sorted int64 indices.
    """
    sigma = np.asarray(sigma, dtype=np.float64)
    if sigma.ndim != 1:
        raise ValueError(f"sigma must be 1-D, got shape {sigma.shape}")
    k = masked_count(sigma.size, ratio)
    order = np.argsort(sigma, kind="stable")  # ascending; equal weights keep index order
    return np.sort(order[:k]).astype(np.int64)


def response_mask_from_prompt(
    padded_prompt_len: int, total_len: int, attention_mask: torch.Tensor
) -> torch.Tensor:
    """Response positions of a left-padded generation batch: every position at or after the padded prompt width.

    ``generate`` on a left-padded batch returns ``[pad..., prompt | response..., pad...]`` with the prompt block
    ``padded_prompt_len`` wide for every row, so the response starts at that column whatever a row's own prompt
    length is (using the unpadded prompt length instead would count prompt tokens of shorter prompts as response).

    Args:
        padded_prompt_len: Width P of the left-padded prompt block.
        total_len: T, the width of the generated batch (prompt block + generated tokens).
        attention_mask: (B, T) 1 at real tokens (prompt and generated), 0 at left and right padding.

    Returns:
        (B, T) bool, True at generated (non-padding) tokens only.
    """
    if attention_mask.ndim != 2 or attention_mask.shape[1] != total_len:
        raise ValueError(
            f"attention_mask has shape {tuple(attention_mask.shape)}, expected (B, {total_len}); pass the mask of "
            "the whole generated sequence (prompt mask + generated-token mask)"
        )
    if not 0 <= padded_prompt_len <= total_len:
        raise ValueError(f"padded_prompt_len={padded_prompt_len} must lie in [0, total_len={total_len}]")
    columns = torch.arange(total_len, device=attention_mask.device)
    return (columns >= padded_prompt_len).unsqueeze(0) & (attention_mask != 0)
