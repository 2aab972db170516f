"""Seeded temperature / nucleus sampling from a Hugging Face causal LM, with generation-time log-probs (BMO).

:func:`sample_responses` decodes with its own KV-cached loop: one ``torch.Generator`` per prompt
(:func:`derive_seed`), left-padded prompts, inverse-CDF draws (:func:`nucleus_probs`, :func:`draw_tokens`), so a
prompt's samples do not depend on the batch; each :class:`Sample` records ``log pi(y_t | x, y_<t)`` at temperature
1 from the raw logits (what BMO's importance weights and vLLM's ``raw_logprobs`` use).  Temperature 0 is greedy.
Decisions: docs/bilevel.md, "HF sampling loop" and "Log-probs".
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch


def left_pad(sequences: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad token id lists into a batch.

    Args:
        sequences: B lists of token ids.
        pad_id: Padding token id.

    Returns:
        ``input_ids`` (B, T) and ``attention_mask`` (B, T) with zeros on the left padding.
    """
    width = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), width), dtype=torch.long)
    for row, seq in enumerate(sequences):
        if len(seq):
            ids[row, width - len(seq):] = torch.as_tensor(list(seq), dtype=torch.long)
            mask[row, width - len(seq):] = 1
    return ids, mask


@dataclass(frozen=True)
class Sample:
    """One sampled response.

    Attributes:
        response_ids: Generated token ids (the stop token included when ``finished``).
        token_logprobs: ``log pi(y_t | x, y_<t)`` at temperature 1, one per response token.
        finished: True when the response ended with a stop token, False when it hit ``max_new_tokens``.
    """

    response_ids: list[int]
    token_logprobs: list[float]
    finished: bool

    @property
    def logprob(self) -> float:
        """Sequence log-prob, the sum of ``token_logprobs``."""
        return float(sum(self.token_logprobs))


def derive_seed(*parts: object) -> int:
    """A stable 63-bit seed from any values (e.g. ``(seed, step, question_id)``); same parts, same seed, any process.

    Python's ``hash`` is salted per process, so it cannot be used for seeds that must agree across Ray actors.
    """
    digest = hashlib.sha256("\x1f".join(repr(p) for p in parts).encode()).digest()
    return int.from_bytes(digest[:8], "big") & (2**63 - 1)


def _cache_keyword() -> str:
    """Name of the KV-cache argument of HF ``forward``: ``cache`` from transformers 5.2x, ``past_key_values`` before."""
    from transformers.modeling_outputs import CausalLMOutputWithPast

    return "cache" if "cache" in getattr(CausalLMOutputWithPast, "__dataclass_fields__", {}) else "past_key_values"


def _returned_cache(out: Any) -> Any:
    cache = getattr(out, "cache", None)
    return cache if cache is not None else out.past_key_values


def _check_arguments(prompts: Sequence[Sequence[int]], n: int, temperature: float, max_new_tokens: int,
                     top_p: float) -> None:
    if n < 1:
        raise ValueError(f"n={n}: ask for at least one sample per prompt")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens}: the generation budget must be at least 1 token")
    if temperature < 0:
        raise ValueError(f"temperature={temperature} is negative; use 0 for greedy decoding or a positive value")
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p={top_p} must be in (0, 1]; 1.0 disables nucleus sampling")
    empty = [i for i, prompt in enumerate(prompts) if len(prompt) == 0]
    if empty:
        raise ValueError(f"prompts {empty[:5]} are empty; every prompt needs at least one token (e.g. BOS)")


def _row_generators(generator: torch.Generator | Sequence[torch.Generator], n_prompts: int) -> list[torch.Generator]:
    """One generator per prompt (a single shared generator is repeated)."""
    if isinstance(generator, torch.Generator):
        return [generator] * n_prompts
    generators = list(generator)
    if len(generators) != n_prompts:
        raise ValueError(
            f"got {len(generators)} generators for {n_prompts} prompts; pass one torch.Generator, or one per prompt"
        )
    return generators


def nucleus_probs(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """Sampling distribution: softmax of ``logits / temperature`` restricted to the top-p nucleus, renormalised.

    Args:
        logits: (B, V) raw next-token logits.
        temperature: > 0.
        top_p: Nucleus mass in (0, 1]; the smallest set of most likely tokens whose mass reaches ``top_p`` is kept
            (always at least the most likely token).

    Returns:
        (B, V) float32 probabilities, each row summing to 1.
    """
    probs = torch.softmax(logits.float() / temperature, dim=-1)  # (B, V)
    if top_p >= 1.0:
        return probs
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs  # (B, V) mass of strictly more likely tokens
    sorted_keep = mass_before < top_p  # the first token always has mass_before == 0
    keep = torch.zeros_like(sorted_keep).scatter(-1, order, sorted_keep)
    probs = probs * keep
    return probs / probs.sum(dim=-1, keepdim=True)


def draw_tokens(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF draw: the first token whose cumulative probability exceeds ``u`` (never a zero-prob token).

    Args:
        probs: (B, V) probabilities.
        uniforms: (B,) draws in [0, 1).

    Returns:
        (B,) long token ids.
    """
    cdf = probs.cumsum(dim=-1)  # (B, V)
    # Scaled by the row total, so float drift in the cumsum can never push u past the last token.
    targets = (uniforms.to(device=cdf.device, dtype=cdf.dtype) * cdf[:, -1]).unsqueeze(-1)  # (B, 1)
    return torch.searchsorted(cdf, targets, right=True).squeeze(-1).clamp_(max=probs.shape[-1] - 1)


def _next_tokens(logits: torch.Tensor, temperature: float, top_p: float, row_generators: list[torch.Generator],
                 n: int, live: torch.Tensor | None = None) -> torch.Tensor:
    """(L, V) logits of the live rows -> (L,) tokens.

    Row ``r`` of the full (B*n) batch belongs to prompt ``r // n`` and uses its generator; ``live`` (L,) names the
    full-batch rows still decoding (None: all of them).  Every generator draws for all its ``n`` rows at every step,
    finished or not, so a row's tokens do not depend on when the other rows finished or were pruned.
    """
    if temperature == 0:
        return logits.argmax(dim=-1)
    uniforms = torch.cat([torch.rand(n, generator=g) for g in row_generators])  # (B*n,)
    if live is not None:
        uniforms = uniforms[live.cpu()]
    return draw_tokens(nucleus_probs(logits, temperature, top_p), uniforms)


#: Finished rows are dropped from the decoding batch (and its KV cache) once they are this share of it: a fine-tuned
#: model's held-out answers average ~35 of the 64 new tokens while each batch runs to its longest (~58), so ~40% of
#: the decode compute went to rows already done; a prune copies the cache, so it waits for several to finish.
PRUNE_SHARE = 0.125


def _prefill(model: torch.nn.Module, prompts: Sequence[Sequence[int]], n: int, pad_id: int,
             device: torch.device) -> tuple[Any, torch.Tensor, torch.Tensor]:
    """Forward the prompts once and repeat each row ``n`` times: (output, attention_mask, position_ids), (B*n, T).

    The output's last-position logits and its KV cache are repeated row by row (``batch_repeat_interleave``), so
    the n samples of a prompt share one prompt pass (the prompt forward was ~70% of the eval's sampling time at
    n = 4). A cache without that method (every transformers ``Cache`` has it; a model's own cache type may not)
    falls back to forwarding every repeated row, after the wasted one-row-per-prompt pass.
    """
    input_ids, attention_mask = (t.to(device) for t in left_pad(prompts, pad_id))  # (B, T)
    position_ids = (attention_mask.cumsum(-1) - 1).clamp_(min=0)  # (B, T) positions count real tokens only
    # logits_to_keep=1: only the last position's logits; (B, T, V) would not fit for long prompts and big vocabularies
    kwargs = {"use_cache": True, "logits_to_keep": 1}
    out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, **kwargs)
    cache = _returned_cache(out)
    if n > 1 and hasattr(cache, "batch_repeat_interleave"):
        cache.batch_repeat_interleave(n)
        out.logits = out.logits.repeat_interleave(n, dim=0)
    elif n > 1:
        input_ids, attention_mask, position_ids = (t.repeat_interleave(n, dim=0)
                                                   for t in (input_ids, attention_mask, position_ids))
        out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, **kwargs)
        return out, attention_mask, position_ids
    return out, attention_mask.repeat_interleave(n, dim=0), position_ids.repeat_interleave(n, dim=0)


@torch.no_grad()
def _sample_chunk(model: torch.nn.Module, prompts: Sequence[Sequence[int]], row_generators: list[torch.Generator], *,
                  n: int, temperature: float, top_p: float, max_new_tokens: int, stop: set[int],
                  pad_id: int, prune: bool = True) -> list[list[Sample]]:
    device = next(model.parameters()).device
    out, attention_mask, position_ids = _prefill(model, prompts, n, pad_id, device)  # masks (R, T), R = B*n
    next_position = position_ids[:, -1] + 1  # (L,) for the L live rows, L = R at first
    rows = attention_mask.shape[0]
    live = torch.arange(rows, device=device)  # (L,) full-batch row of each live row
    running = torch.ones(rows, dtype=torch.bool, device=device)  # (L,)
    tokens = torch.full((rows, max_new_tokens), pad_id, dtype=torch.long, device=device)  # (R, max_new_tokens)
    logprobs = torch.zeros((rows, max_new_tokens), dtype=torch.float32, device=device)
    stop_ids = torch.tensor(sorted(stop), dtype=torch.long, device=device)
    cache_keyword = _cache_keyword()
    cache = _returned_cache(out)
    steps = 0
    for step in range(max_new_tokens):
        logits = out.logits[:, -1, :].float()  # (L, V)
        token = _next_tokens(logits, temperature, top_p, row_generators, n, live).to(device)
        logprob = torch.log_softmax(logits, dim=-1).gather(-1, token.unsqueeze(-1)).squeeze(-1)  # (L,) temperature 1
        token = torch.where(running, token, torch.full_like(token, pad_id))
        tokens[live, step] = token
        logprobs[live, step] = logprob
        steps = step + 1
        running = running & ~torch.isin(token, stop_ids)
        if not bool(running.any()) or step == max_new_tokens - 1:  # the last token needs no forward pass
            break
        attention_mask = torch.cat([attention_mask, attention_mask.new_ones(attention_mask.shape[0], 1)], dim=1)
        done = int((~running).sum())
        if prune and done >= max(1, PRUNE_SHARE * running.numel()) and hasattr(cache, "batch_select_indices"):
            keep = running.nonzero().squeeze(-1)  # (L',) positions in the live batch
            cache.batch_select_indices(keep)
            live, attention_mask, next_position, running, token = (
                t[keep] for t in (live, attention_mask, next_position, running, token))
        out = model(input_ids=token.unsqueeze(-1), attention_mask=attention_mask,
                    position_ids=next_position.unsqueeze(-1), use_cache=True, **{cache_keyword: cache})
        cache = _returned_cache(out)
        next_position = next_position + 1
    return _collect(tokens[:, :steps].tolist(), logprobs[:, :steps].tolist(), stop, len(prompts), n)


def _collect(tokens: list[list[int]], logprobs: list[list[float]], stop: set[int], n_prompts: int,
             n: int) -> list[list[Sample]]:
    """Cut each row after its first stop token and group rows by prompt."""
    samples = []
    for row_tokens, row_logprobs in zip(tokens, logprobs):
        cut = next((i + 1 for i, tok in enumerate(row_tokens) if tok in stop), None)
        length = len(row_tokens) if cut is None else cut
        samples.append(Sample(row_tokens[:length], [float(x) for x in row_logprobs[:length]], cut is not None))
    return [samples[k * n:(k + 1) * n] for k in range(n_prompts)]


def sample_responses(
    model: torch.nn.Module,
    prompts: Sequence[Sequence[int]],
    *,
    n: int,
    temperature: float,
    max_new_tokens: int,
    eos_ids: Sequence[int],
    pad_id: int,
    generator: torch.Generator | Sequence[torch.Generator],
    top_p: float = 1.0,
    batch_size: int = 32,
    prune_finished: bool = True,
) -> list[list[Sample]]:
    """Sample ``n`` responses per prompt and record each token's log-prob under the policy at temperature 1.

    Args:
        model: A causal LM (eval mode is set here) returning ``.logits`` (B, T, V) and ``.past_key_values``.
        prompts: Token ids of each prompt, BOS / chat-template tokens included.
        n: Responses per prompt (G).
        temperature: Sampling temperature (> 0), or 0 for greedy decoding.
        max_new_tokens: Generation budget per response.
        eos_ids: Tokens that end a response (kept in it).
        pad_id: Padding token id.
        generator: One CPU ``torch.Generator`` for the whole call, or one per prompt (then each prompt's samples
            depend only on its generator, not on the other prompts or on ``batch_size``).
        top_p: Nucleus mass in (0, 1]; 1.0 samples from the full tempered distribution.
        batch_size: Prompts per forward batch (each expands to ``n`` rows).
        prune_finished: Drop finished rows from the decoding batch (:data:`PRUNE_SHARE`): the same tokens up to
            floating-point differences between batch shapes, less compute when response lengths differ.

    Returns:
        ``result[k][g]`` is the ``g``-th :class:`Sample` of prompt ``k``.
    """
    _check_arguments(prompts, n, temperature, max_new_tokens, top_p)
    if batch_size < 1:
        raise ValueError(f"batch_size={batch_size}: use at least 1 prompt per batch")
    row_generators = _row_generators(generator, len(prompts))
    model.eval()
    stop = {int(e) for e in eos_ids}
    results: list[list[Sample]] = []
    for start in range(0, len(prompts), batch_size):
        end = start + batch_size
        results.extend(_sample_chunk(model, prompts[start:end], row_generators[start:end], n=n,
                                     temperature=temperature, top_p=top_p, max_new_tokens=max_new_tokens,
                                     stop=stop, pad_id=pad_id, prune=prune_finished))
    return results
