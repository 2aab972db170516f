#!/usr/bin/env python
"""sha256 digests of the embedded corpus generators, to check that a refactor of ``raycurate.data.corpus`` keeps
every generated row byte-identical.

Usage::

    .venv/bin/python scripts/corpus_digest.py      # prints one digest per call and a combined one

Run it before and after the change and compare the lines.
"""

from __future__ import annotations

import hashlib
import json

from raycurate.data.corpus import (
    bad_input_lines,
    corpus_summary,
    generate_corpus,
    generate_heldout,
    generate_pretraining_texts,
    generate_validation_questions,
)


def _digest(value: object) -> str:
    if isinstance(value, list) and value and isinstance(value[0], bytes):
        payload = b"".join(value)
    else:
        payload = json.dumps(value, sort_keys=True, ensure_ascii=False).encode()
    return hashlib.sha256(payload).hexdigest()


def main() -> None:
    """Print ``<call> <sha256>`` lines and the sha256 of all of them."""
    lines = []
    for n, seed, fraction in ((3000, 0, 0.3), (1000, 1, 0.3), (600, 7, 0.4)):
        rows = generate_corpus(n, seed, corrupt_fraction=fraction)
        lines.append(f"generate_corpus({n},{seed},{fraction}) {_digest(rows)}")
        lines.append(f"corpus_summary({n},{seed},{fraction}) {_digest(corpus_summary(rows))}")
        lines.append(f"bad_input_lines({n},{seed},{fraction};16,{seed}) {_digest(bad_input_lines(rows, 16, seed))}")
    weighted = generate_corpus(500, 2, corrupt_fraction=0.5, domain_weights={"code": 1.0, "instruction": 2.0})
    lines.append(f"generate_corpus(500,2,0.5,code1/instr2) {_digest(weighted)}")
    for seed in (0, 1):
        heldout = generate_heldout(300, seed)
        exclude = {row["prompt"] for row in heldout}
        lines.append(f"generate_heldout(300,{seed}) {_digest(heldout)}")
        lines.append(f"generate_validation_questions(200,{seed},heldout) "
                     f"{_digest(generate_validation_questions(200, seed, exclude))}")
    lines.append(f"generate_pretraining_texts(4000,0) {_digest(generate_pretraining_texts(4000, 0))}")
    print("\n".join(lines))
    print("all", hashlib.sha256("\n".join(lines).encode()).hexdigest())


if __name__ == "__main__":
    main()
