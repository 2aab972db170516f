"""Writing rows as jsonl (atomically), and the invalid jsonl lines the demo appends to exercise rejection."""

from __future__ import annotations

import json
import os
import random
from pathlib import Path


def write_jsonl(rows: list[dict], path: str | os.PathLike) -> Path:
    """Write rows as JSON lines atomically (:func:`raycurate.rundir.atomic_file`, fsynced before the rename).

    Readers never see a half-written file: either the old file or the complete new one.

    Args:
        rows: JSON-serialisable dicts.
        path: Destination; parent directories are created.

    Returns:
        The destination path.
    """
    from raycurate.rundir import atomic_file  # lazy: the generator itself needs no storage/pyarrow imports

    path = Path(path)
    with atomic_file(path, fsync=True) as tmp, open(tmp, "w", encoding="utf-8") as handle:
        for row in rows:
            handle.write(json.dumps(row, ensure_ascii=False) + "\n")
    return path


BAD_LINE_KINDS = ("malformed_json", "missing_field", "empty_field", "wrong_type", "duplicate_id", "unknown_domain",
                  "non_utf8", "over_length")


def bad_input_lines(rows: list[dict], n_lines: int, seed: int, over_length_words: int = 4000) -> list[bytes]:
    """Raw jsonl lines that ingest or tokenization must reject, one kind after another (see ``BAD_LINE_KINDS``).

    The demo appends them to its corpus file so that the rejection path and the manifest's row accounting are
    exercised on every run.

    Args:
        rows: Corpus rows (used as templates and for a duplicate id).
        n_lines: How many bad lines; kinds cycle in ``BAD_LINE_KINDS`` order.
        seed: Seed of the template choice.
        over_length_words: Words in the over-length response (must exceed the token limit).

    Returns:
        Encoded lines, each ending in a newline.
    """
    rng = random.Random(seed)
    lines = []
    for i in range(n_lines):
        kind = BAD_LINE_KINDS[i % len(BAD_LINE_KINDS)]
        base = dict(rng.choice(rows), id=f"bad-{i:04d}")
        if kind == "malformed_json":
            lines.append(json.dumps(base)[:-7].encode() + b"\n")
            continue
        if kind == "non_utf8":
            lines.append(json.dumps(base).encode()[:-1] + b', "note": "\xff\xfe"}\n')
            continue
        if kind == "missing_field":
            base.pop("response")
        elif kind == "empty_field":
            base["response"] = "   "
        elif kind == "wrong_type":
            base["prompt"] = 42
        elif kind == "duplicate_id":
            base["id"] = rows[0]["id"]
        elif kind == "unknown_domain":
            base["domain"] = "poetry"
        elif kind == "over_length":
            base["response"] = " ".join(["step"] * over_length_words)
        lines.append((json.dumps(base, ensure_ascii=False) + "\n").encode())
    return lines
