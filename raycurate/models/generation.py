"""Batched generation with a Hugging Face causal LM (the CPU / no-vLLM path)."""

from __future__ import annotations

from typing import Sequence

import torch

from raycurate.models.sampling import left_pad, sample_responses


@torch.no_grad()
def generate_greedy(
    model: torch.nn.Module,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    pad_id: int,
    eos_ids: Sequence[int],
    batch_size: int = 32,
    prune_finished: bool = True,
) -> list[list[int]]:
    """Greedy continuation of each prompt, stopping at any of ``eos_ids``.

    The KV-cached loop of :func:`raycurate.models.sampling.sample_responses` at temperature 0, which drops finished
    rows from the batch (``prune_finished``); Hugging Face ``generate`` decodes every row to its batch's longest.
    Agreement and speed against ``generate``: benchmarks/bench_eval_decode.py (benchmarks/RESULTS.md).

    Args:
        model: A causal LM in eval mode.
        prompts: Token ids of each prompt (already including BOS / chat-template tokens).
        max_new_tokens: Generation budget per prompt.
        pad_id: Padding token id.
        eos_ids: Token ids that end a response (e.g. EOS and the chat end-of-turn token).
        batch_size: Prompts per forward batch.
        prune_finished: As :func:`raycurate.models.sampling.sample_responses`.

    Returns:
        The generated token ids of each prompt, without the prompt and without the stop token.
    """
    samples = sample_responses(model, prompts, n=1, temperature=0.0, max_new_tokens=max_new_tokens, eos_ids=eos_ids,
                               pad_id=pad_id, generator=torch.Generator(), batch_size=batch_size,
                               prune_finished=prune_finished)
    return [s[0].response_ids[:-1] if s[0].finished else s[0].response_ids for s in samples]


@torch.no_grad()
def generate_greedy_hf(
    model: torch.nn.Module,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    pad_id: int,
    eos_ids: Sequence[int],
    batch_size: int = 32,
) -> list[list[int]]:
    """:func:`generate_greedy` through Hugging Face ``generate`` (what evaluation used before the eleventh session;
    the benchmark's reference)."""
    device = next(model.parameters()).device
    outputs: list[list[int]] = []
    stop = set(int(e) for e in eos_ids)
    for start in range(0, len(prompts), batch_size):
        chunk = prompts[start:start + batch_size]
        ids, mask = left_pad(chunk, pad_id)
        generated = model.generate(
            input_ids=ids.to(device),
            attention_mask=mask.to(device),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            use_cache=True,  # explicit: a checkpoint saved by training says use_cache=false in its config.json
            eos_token_id=list(stop),
            pad_token_id=pad_id,
        )
        for row in generated[:, ids.shape[1]:].tolist():
            cut = next((i for i, tok in enumerate(row) if tok in stop), len(row))
            outputs.append(row[:cut])
    return outputs
