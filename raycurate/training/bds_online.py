"""Online BMO responses of the BDS loop: generated sequences of the masked questions, their checkpoint file and
the batches that mix them with table rows (numpy + torch; no Ray).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from raycurate.training.batches import TokenTable, collate

ONLINE_STATE_FILE = "online_responses.parquet"


GeneratedSequence = tuple[np.ndarray, np.ndarray, np.ndarray]  # input_ids (T,), loss_mask (T,), old_logp (T,)


@dataclass
class OnlineResponses:
    """The latest generated responses of the masked questions (Algorithm 1, line 7: y_old and pi_old).

    A candidate with an entry is a masked question: whenever it is sampled, it trains on these G sequences with
    importance weights instead of its offline response, and its omega coefficient is their mean loss (eq. 9-10).

    Attributes:
        sequences: candidate row -> G ``(input_ids, loss_mask, old_logp)``: the candidate's prompt tokens followed
            by the response tokens, 1 on the response, and the generation-time log-probs (0 on the prompt).
        step: The step before which they were generated.
    """

    sequences: dict[int, list[GeneratedSequence]]
    step: int


def prompt_ids(table: TokenTable, row: int) -> np.ndarray:
    """The prompt side of a token-table row: its tokens before the first supervised position.

    Raises:
        ValueError: When the row has no supervised token.
    """
    ids, mask = table.row(row)
    supervised = np.flatnonzero(mask)
    if supervised.size == 0:
        raise ValueError(f"row {table.ids[row]!r} has no supervised token, so it has no response to regenerate")
    return ids[:supervised[0]]


def online_from_rows(rows: list[dict], table: TokenTable, step: int) -> OnlineResponses:
    """Turn the generation pool's rows into training sequences for the masked questions.

    Args:
        rows: Pool rows with ``question_id`` (a candidate id), ``response_ids`` and ``token_logprobs``.
        table: The candidate token table.
        step: Step of the generation.

    Raises:
        ValueError: For an unknown question id or log-probs not aligned with the response.
    """
    row_of = {str(i): r for r, i in enumerate(table.ids)}
    sequences: dict[int, list[GeneratedSequence]] = {}
    for item in rows:
        question = str(item["question_id"])
        if question not in row_of:
            raise ValueError(f"generated response for unknown question {question!r}; question ids must be "
                             "candidate ids (use generation_requests)")
        response = np.asarray(item["response_ids"], dtype=np.int64)
        logp = np.asarray(item["token_logprobs"], dtype=np.float32)
        if response.size == 0 or logp.shape != response.shape:
            raise ValueError(f"question {question!r}: {len(response)} response tokens but {len(logp)} log-probs; "
                             "the pool must return one log-prob per generated token")
        r = row_of[question]
        prompt = prompt_ids(table, r)
        ids = np.concatenate([prompt, response])
        mask = np.concatenate([np.zeros(len(prompt), np.int8), np.ones(len(response), np.int8)])
        old = np.concatenate([np.zeros(len(prompt), np.float32), logp])
        sequences.setdefault(r, []).append((ids, mask, old))
    return OnlineResponses(sequences, step)


def save_online(path: str, online: OnlineResponses) -> None:
    """Write the online responses as parquet (one row per sequence)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    flat = [(r, seq) for r in sorted(online.sequences) for seq in online.sequences[r]]
    pq.write_table(pa.table({
        "row": pa.array([r for r, _ in flat], type=pa.int64()),
        "input_ids": pa.array([s[0].tolist() for _, s in flat], type=pa.list_(pa.int64())),
        "loss_mask": pa.array([s[1].tolist() for _, s in flat], type=pa.list_(pa.int8())),
        "old_logp": pa.array([s[2].tolist() for _, s in flat], type=pa.list_(pa.float32())),
        "step": pa.array([online.step] * len(flat), type=pa.int64()),
    }), path)


def load_online(path: str) -> OnlineResponses:
    """Read what :func:`save_online` wrote."""
    import pyarrow.parquet as pq

    table = pq.read_table(path).to_pydict()
    sequences: dict[int, list[GeneratedSequence]] = {}
    for r, ids, mask, old in zip(table["row"], table["input_ids"], table["loss_mask"], table["old_logp"]):
        sequences.setdefault(int(r), []).append(
            (np.asarray(ids, np.int64), np.asarray(mask, np.int8), np.asarray(old, np.float32)))
    return OnlineResponses(sequences, int(table["step"][0]) if table["step"] else 0)


def collate_slots(table: TokenTable, slots: list[Any], pad_id: int) -> dict[str, Any]:
    """Batch of question slots: a table row (int) or a masked question's generated sequences.

    Only table rows: exactly :func:`raycurate.training.batches.collate`.  With generated sequences the batch also
    carries ``old_logp`` (R, T), ``generated`` (R,) and ``slot`` (R,), the slot of each of its R sequences.
    """
    import torch

    if all(isinstance(slot, (int, np.integer)) for slot in slots):
        return collate(table, np.asarray(slots, dtype=np.int64), pad_id)
    seqs, slot_of, generated = [], [], []
    for s, slot in enumerate(slots):
        if isinstance(slot, (int, np.integer)):
            ids, mask = table.row(int(slot))
            items = [(ids, mask, np.zeros(len(ids), np.float32))]
        else:
            items = slot
        seqs.extend(items)
        slot_of.extend([s] * len(items))
        generated.extend([not isinstance(slot, (int, np.integer))] * len(items))
    width = max(len(ids) for ids, _, _ in seqs)
    input_ids = np.full((len(seqs), width), pad_id, dtype=np.int64)
    attention = np.zeros((len(seqs), width), dtype=np.int64)
    loss_mask = np.zeros((len(seqs), width), dtype=np.int8)
    old_logp = np.zeros((len(seqs), width), dtype=np.float32)
    for b, (ids, mask, old) in enumerate(seqs):
        input_ids[b, :len(ids)], attention[b, :len(ids)] = ids, 1
        loss_mask[b, :len(ids)], old_logp[b, :len(ids)] = mask, old
    return {
        "input_ids": torch.from_numpy(input_ids),
        "attention_mask": torch.from_numpy(attention),
        "loss_mask": torch.from_numpy(loss_mask),
        "old_logp": torch.from_numpy(old_logp),
        "generated": torch.tensor(generated),
        "slot": torch.tensor(slot_of, dtype=torch.int64),
        "weight": torch.ones(len(slots), dtype=torch.float32),
    }
