"""Bilevel data curation math: BDS data weights and their omega update (BMO lives in :mod:`raycurate.algorithms.bmo`).

Paper: bilevel-data-curation (eqs. 2, 5, 8-10, Lemma 4, Corollary 5, Algorithm 1); decisions in docs/bilevel.md.
Data weights ``sigma(omega) = N * softmax(omega)`` over all N candidates (:func:`data_weights`); the penalty schedule
(:func:`gamma_schedule`); the omega step :func:`update_omega`, dispatching on :data:`OMEGA_OPTIMIZERS` to the dense
(:func:`omega_gradient` + :func:`sgd_update` / :func:`adam_update`) or sampled-row (:func:`sampled_omega_gradient` +
:func:`sparse_sgd_update` / :func:`sparse_adam_update`) forms ("The omega optimizer" in docs/bilevel.md).  All of it
is float64 numpy and pure, so the same inputs give bit-identical outputs on every worker.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

OMEGA_VARIANTS = ("exact", "detached")
OMEGA_OPTIMIZERS = ("sgd", "sparse_sgd", "sparse_adam", "adam")
"""omega optimizers: dense-gradient SGD, sampled-row SGD / Adam (signal preserving), dense Adam (the paper's, records
the sampling order; faithful reproduction only)."""
SPARSE_OPTIMIZERS = ("sparse_sgd", "sparse_adam")
OMEGA_BASELINES = ("median", "mean")
"""Baseline of the sampled-row estimator: the median of the rest of the batch (robust) or the unbiased mean."""
OMEGA_ADAM_BETAS = (0.9, 0.999)
"""Adam betas of the data logits (``adam`` / ``sparse_adam``; not a config setting)."""
OMEGA_ADAM_EPS = 1e-8
"""Adam eps of the data logits."""


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
    replaced by our N-scaled ones; with Adam the constant factor only matters relative to ``eps``, and the N
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
    betas: tuple[float, float] = OMEGA_ADAM_BETAS,
    eps: float = OMEGA_ADAM_EPS,
    baseline: str = "median",
) -> tuple[np.ndarray, AdamState]:
    """One omega step (eq. 5b) with optimizer ``optimizer`` (:data:`OMEGA_OPTIMIZERS`); pure, float64.

    * ``sgd``: :func:`omega_gradient` + :func:`sgd_update` (the state passes through).
    * ``sparse_sgd``: :func:`sampled_omega_gradient` + :func:`sparse_sgd_update`.
    * ``sparse_adam``: :func:`sampled_omega_gradient` + :func:`sparse_adam_update`.
    * ``adam``: :func:`omega_gradient` + dense :func:`adam_update` -- the paper's; Adam normalises every unsampled
      logit's tiny same-sign coupling gradient to a ~+lr step, so omega ends up encoding when each row was first
      sampled (docs/bilevel.md).  Faithful reproduction only.

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
