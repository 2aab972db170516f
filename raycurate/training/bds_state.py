"""The BDS data logits omega and their checkpoint / output files (numpy + pyarrow; no torch, no Ray).

* ``omega_state.npz`` (:func:`save_omega_state`): omega, its Adam moments and per-row step counts, the per-epoch
  omega history, each row's first-sample step and latest omega loss, and a digest of the candidate ids, so a
  resumed run restores omega bit for bit and refuses a different candidate table.
* ``bds_state.json``: the per-step curves (:class:`BDSCurves`).
* ``weights.parquet`` (:func:`write_weights`): one row per (candidate, snapshot).
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from raycurate.algorithms import bilevel

OMEGA_STATE_FILE = "omega_state.npz"
BDS_STATE_FILE = "bds_state.json"
WEIGHTS_FILE = "weights.parquet"


def ids_digest(ids: np.ndarray) -> str:
    """sha256 of the candidate ids in table order (ties a checkpoint's omega to its candidate table)."""
    return hashlib.sha256("\n".join(str(i) for i in ids).encode("utf-8")).hexdigest()


def omega_digest(omega: np.ndarray) -> str:
    """First 13 hex digits of sha256 over omega's float64 bytes (fits a float64 exactly for all-gathering)."""
    return hashlib.sha256(np.ascontiguousarray(omega, dtype=np.float64).tobytes()).hexdigest()[:13]


@dataclass
class OmegaState:
    """The data logits and everything needed to continue updating them.

    Attributes:
        omega: (N,) float64 data logits.
        adam: Adam moments of omega.
        history: (S, N) omega snapshots (end of each epoch, and after the last step).
        history_epoch: (S,) epoch of each snapshot.
        history_step: (S,) optimizer steps done at each snapshot.
        first_step: (N,) int64 0-based step at which each row was first sampled; -1 = not yet.
        last_loss: (N,) float64 each row's latest omega loss; NaN = not yet sampled.
        loss_history: (S, N) ``last_loss`` at each snapshot.
    """

    omega: np.ndarray
    adam: bilevel.AdamState
    history: np.ndarray
    history_epoch: np.ndarray
    history_step: np.ndarray
    first_step: np.ndarray
    last_loss: np.ndarray
    loss_history: np.ndarray

    @classmethod
    def fresh(cls, n: int) -> OmegaState:
        """omega = 0 (uniform weights 1), zero moments, no snapshots."""
        return cls(np.zeros(n), bilevel.AdamState.zeros(n), np.zeros((0, n)), np.zeros(0, np.int64),
                   np.zeros(0, np.int64), np.full(n, -1, np.int64), np.full(n, np.nan), np.zeros((0, n)))

    def snapshot(self, epoch: int, step: int) -> OmegaState:
        """A copy with the current omega (and latest losses) appended to the history."""
        return dataclasses.replace(
            self,
            history=np.concatenate([self.history, self.omega[None, :]]),
            history_epoch=np.append(self.history_epoch, epoch),
            history_step=np.append(self.history_step, step),
            loss_history=np.concatenate([self.loss_history, self.last_loss[None, :]]),
        )

    def observe(self, step: int, idx: np.ndarray, losses: np.ndarray) -> OmegaState:
        """A copy recording that rows ``idx`` (B,) were sampled at ``step`` with omega losses ``losses`` (B,)."""
        first, last = self.first_step.copy(), self.last_loss.copy()
        first[idx[first[idx] < 0]] = step
        last[idx] = losses
        return dataclasses.replace(self, first_step=first, last_loss=last)


@dataclass
class BDSCurves:
    """Per-step curves that survive a resume (``bds_state.json``)."""

    gamma_per_step: list[float] = field(default_factory=list)
    val_loss_per_step: list[float] = field(default_factory=list)
    cand_loss_per_step: list[float] = field(default_factory=list)
    omega_loss_per_step: list[float] = field(default_factory=list)
    online_questions_per_step: list[int] = field(default_factory=list)
    generation_steps: list[int] = field(default_factory=list)


def save_omega_state(path: str, state: OmegaState, candidate_digest: str) -> None:
    """Write ``state`` as an ``.npz`` (float64, exact)."""
    np.savez(path, omega=state.omega, exp_avg=state.adam.exp_avg, exp_avg_sq=state.adam.exp_avg_sq,
             adam_step=np.int64(state.adam.step), adam_row_steps=state.adam.counts(), history=state.history,
             history_epoch=state.history_epoch, history_step=state.history_step, first_step=state.first_step,
             last_loss=state.last_loss, loss_history=state.loss_history,
             candidate_digest=np.array(candidate_digest))


def load_omega_state(path: str, candidate_digest: str) -> OmegaState:
    """Read an ``omega_state.npz``.

    Raises:
        ValueError: When the checkpoint was written for a different candidate table.
    """
    with np.load(path) as data:
        if str(data["candidate_digest"]) != candidate_digest:
            raise ValueError(
                f"{path} holds data logits for a different candidate table (ids differ); resume with the same "
                "candidates or delete the run's storage directory to start from scratch."
            )
        missing = {"adam_row_steps", "first_step", "last_loss", "loss_history"} - set(data.files)
        if missing:
            raise ValueError(f"{path} predates the sampled-row omega state (no {sorted(missing)}); delete the "
                             "run's storage directory to start BDS from scratch.")
        adam = bilevel.AdamState(int(data["adam_step"]), data["exp_avg"].copy(), data["exp_avg_sq"].copy(),
                                 data["adam_row_steps"].copy())
        return OmegaState(data["omega"].copy(), adam, data["history"].copy(), data["history_epoch"].copy(),
                          data["history_step"].copy(), data["first_step"].copy(), data["last_loss"].copy(),
                          data["loss_history"].copy())


def weights_table(ids: np.ndarray, state: OmegaState) -> Any:
    """``weights.parquet`` rows: one per (candidate, snapshot) with id, omega, sigma, rank, epoch, step, first_step
    (-1 = not sampled by then) and loss (latest omega loss by then)."""
    import pyarrow as pa

    n = len(ids)
    columns: dict[str, list[np.ndarray]] = {k: [] for k in ("omega", "sigma", "rank", "epoch", "step",
                                                            "first_step", "loss")}
    for omega, epoch, step, loss in zip(state.history, state.history_epoch, state.history_step,
                                        state.loss_history):
        sigma = bilevel.data_weights(omega)
        order = np.argsort(-sigma, kind="stable")
        rank = np.empty(n, dtype=np.int64)
        rank[order] = np.arange(1, n + 1)
        columns["omega"].append(omega)
        columns["sigma"].append(sigma)
        columns["rank"].append(rank)
        columns["epoch"].append(np.full(n, epoch, dtype=np.int64))
        columns["step"].append(np.full(n, step, dtype=np.int64))
        columns["first_step"].append(np.where(state.first_step < step, state.first_step, -1))
        columns["loss"].append(loss)
    snapshots = len(state.history)
    return pa.table({
        "id": pa.array(np.tile(ids.astype(str), snapshots).tolist(), type=pa.string()),
        "omega": pa.array(np.concatenate(columns["omega"]) if snapshots else [], type=pa.float64()),
        "sigma": pa.array(np.concatenate(columns["sigma"]) if snapshots else [], type=pa.float64()),
        "rank": pa.array(np.concatenate(columns["rank"]) if snapshots else [], type=pa.int64()),
        "epoch": pa.array(np.concatenate(columns["epoch"]) if snapshots else [], type=pa.int64()),
        "step": pa.array(np.concatenate(columns["step"]) if snapshots else [], type=pa.int64()),
        "first_step": pa.array(np.concatenate(columns["first_step"]) if snapshots else [], type=pa.int64()),
        "loss": pa.array(np.concatenate(columns["loss"]) if snapshots else [], type=pa.float64()),
    })


def write_weights(output_dir: str, ids: np.ndarray, state: OmegaState) -> str:
    """Write ``weights.parquet`` into ``output_dir`` atomically; returns its path."""
    import pyarrow.parquet as pq

    path = os.path.join(output_dir, WEIGHTS_FILE)
    tmp = f"{path}.tmp-{os.getpid()}"
    pq.write_table(weights_table(ids, state), tmp)
    os.replace(tmp, path)
    return path
