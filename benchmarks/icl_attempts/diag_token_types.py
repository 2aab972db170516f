"""Per-token-type answer loss with 0 vs 5 clean demonstrations (digits / text / special tokens, per domain).

Usage (repository root): ``PYTHONPATH=. python benchmarks/icl_attempts/diag_token_types.py [MODEL_DIR]``.
"""

from __future__ import annotations

import re
import sys

import numpy as np
import torch

from raycurate.algorithms.p2d.icl_probe import answer_token_logprobs, assemble_prompt  # noqa: E402
from raycurate.config.p2d import P2DConfig  # noqa: E402
from raycurate.data.chat_layout import chat_layout, instruction_ids, split_row  # noqa: E402
from raycurate.data.corpus import generate_corpus  # noqa: E402
from raycurate.data.tokenize import tokenize_batch  # noqa: E402
from raycurate.models.loading import load_model, load_tokenizer  # noqa: E402


def token_losses(model, ids: list[int], span: tuple[int, int]) -> list[float]:
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0]
    return (-answer_token_logprobs(logits, torch.tensor(ids), span)).tolist()


def main(model_dir: str = "embedded", n_queries: int = 40) -> None:
    torch.set_num_threads(1)
    tok, model = load_tokenizer(model_dir), load_model(model_dir)
    rows, _ = tokenize_batch(tok, generate_corpus(800, 7, 0.3), max_length=4096)
    layout = chat_layout(tok)
    instruction = instruction_ids(tok, layout, P2DConfig().instruction)
    clean = [r for r in rows if r["label"]["clean"]]
    rng = np.random.default_rng(0)
    stats: dict[str, list[float]] = {}
    for qi in rng.permutation(len(clean))[:n_queries].tolist():
        query, answer = split_row(clean[qi], layout)
        picks = [i for i in rng.choice(len(clean), 6, replace=False).tolist() if i != qi][:5]
        demos = [sum(split_row(clean[i], layout), []) for i in picks]
        zero_ids = instruction + query + answer
        zero = token_losses(model, zero_ids, (len(instruction) + len(query), len(zero_ids)))
        assembled = assemble_prompt(instruction, demos, [query], [answer], separator=layout.separator)
        five = token_losses(model, assembled["input_ids"], assembled["answer_spans"][0])
        for token, x0, x5 in zip(answer, zero, five):
            text = tok.decode([token])
            kind = "digit" if re.fullmatch(r"\s*\d+", text) else ("special" if token < 7 else "text")
            for key in (f"{clean[qi]['domain']}:{kind}", f"all:{kind}"):
                entry = stats.setdefault(key, [0, 0.0, 0.0])
                entry[0] += 1
                entry[1] += x0
                entry[2] += x5
    total = sum(v[1] for k, v in stats.items() if k.startswith("all:"))
    for key, (n, s0, s5) in sorted(stats.items()):
        print(f"{key:20s} n={int(n):5d} loss0={s0 / n:.3f} loss5={s5 / n:.3f} share_of_loss0={s0 / total:.3f}")


if __name__ == "__main__":
    main(*sys.argv[1:2])
