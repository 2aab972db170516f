"""BRIDGE attention routing weights and interaction terms (paper §4.3, App. B.3), pure torch.

:func:`routing_weights` / :func:`routing_weights_batch` give per response token ``j`` the head-averaged attention
``A_p[j, i]`` from its input position ``t_j = p + j`` to every prompt key ``i`` and the history mass ``c[j]`` on
the earlier response keys (self excluded); :func:`attention_for_layer` and :func:`default_routing_layer` pick the
one eager layer.  :func:`interaction_terms` forms ``beta[i, j] = A_p[j, i] a_j`` and ``gamma[j] = a_j c_j``.
Rows and columns cover every position, fixed ones included; which are eligible is :mod:`.selection`'s business.
The App. B.3 reading (query row, softmax over keys incl. self, no renormalisation): docs/bridge.md, "Routing".
"""

from __future__ import annotations

from typing import Any

import torch


def _check_lengths(prompt_len: int, n: int, length: int) -> None:
    if not 0 < prompt_len < n <= length:
        raise ValueError(
            f"need 0 < prompt_len < n <= T, got prompt_len={prompt_len}, n={n}, T={length}; prompt_len counts the "
            "prompt side (BOS included) and n the real tokens of the example"
        )


def routing_weights(attn: torch.Tensor, prompt_len: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompt routing weights and response-history mass of one example from one attention layer.

    Args:
        attn: (H, T, T) attention probabilities of one layer for one example (rows = queries, each a softmax over
            the causal keys); only the first ``n`` rows/columns are read, so right padding is ignored.
        prompt_len: Number of prompt-side positions ``p`` (BOS included).
        n: Number of real tokens (prompt side + response side, EOS included).

    Returns:
        ``A_p`` (r, p) float32: ``A_p[j, i]`` = head-mean weight of query ``p + j`` on key ``i``;
        ``c`` (r,) float32: head-mean weight of query ``p + j`` on keys ``p .. p + j - 1``; ``r = n - p``.
    """
    if attn.dim() != 3 or attn.shape[1] != attn.shape[2]:
        raise ValueError(f"attn must be (H, T, T) for one example and one layer, got {tuple(attn.shape)}")
    _check_lengths(prompt_len, n, attn.shape[-1])
    rows = attn[:, prompt_len:n, :n].float().mean(dim=0)  # (r, n): query t_j = p + j, head-averaged
    a_p = rows[:, :prompt_len]  # (r, p)
    history = rows[:, prompt_len:]  # (r, r): key p + j' for query p + j; diagonal = self
    c = torch.tril(history, diagonal=-1).sum(dim=1)  # (r,): strictly earlier response keys
    return a_p.contiguous(), c


def _right_padded_lengths(attention_mask: torch.Tensor) -> torch.Tensor:
    """(B,) real lengths; raises unless every row is ones followed by zeros."""
    mask = attention_mask != 0  # (B, T)
    lengths = mask.sum(dim=1)
    positions = torch.arange(mask.shape[1], device=mask.device)
    if not torch.equal(mask, positions[None, :] < lengths[:, None]):
        raise ValueError("attention_mask must be right-padded (1s then 0s per row); collate with right padding")
    return lengths


def routing_weights_batch(
    attn: torch.Tensor, prompt_lens: torch.Tensor, attention_mask: torch.Tensor
) -> dict[str, torch.Tensor]:
    """Batched :func:`routing_weights` over a right-padded batch (vectorised, no Python loop over examples).

    Args:
        attn: (B, H, T, T) attention probabilities of one layer.
        prompt_lens: (B,) prompt-side lengths ``p_b``.
        attention_mask: (B, T) 1 on real tokens, right-padded.

    Returns:
        ``{"A_p": (B, R, P), "c": (B, R), "prompt_mask": (B, P) bool, "response_mask": (B, R) bool}`` with
        ``P = max p_b`` and ``R = max r_b``; example ``b`` occupies ``A_p[b, :r_b, :p_b]`` and ``c[b, :r_b]``
        (identical to :func:`routing_weights` on it), everything outside is 0.
    """
    if attn.dim() != 4 or attn.shape[2] != attn.shape[3]:
        raise ValueError(f"attn must be (B, H, T, T) for one layer, got {tuple(attn.shape)}")
    batch, _, length, _ = attn.shape
    if attention_mask.shape != (batch, length):
        raise ValueError(f"attention_mask must be ({batch}, {length}), got {tuple(attention_mask.shape)}")
    device = attn.device
    lengths = _right_padded_lengths(attention_mask).to(device)  # (B,)
    prompt_lens = torch.as_tensor(prompt_lens, device=device).long().reshape(-1)  # (B,)
    bad = ((prompt_lens <= 0) | (prompt_lens >= lengths)).nonzero().flatten().tolist()
    if bad:
        raise ValueError(f"examples {bad} need 0 < prompt_len < number of real tokens (a non-empty response side)")
    n_resp = lengths - prompt_lens  # (B,)
    width_p, width_r = int(prompt_lens.max()), int(n_resp.max())
    j = torch.arange(width_r, device=device)  # (R,)
    response_mask = j[None, :] < n_resp[:, None]  # (B, R)
    query = (prompt_lens[:, None] + j[None, :]).clamp(max=length - 1)  # (B, R) query position t_j
    mean = attn.float().mean(dim=1)  # (B, T, T) head-averaged
    rows = torch.take_along_dim(mean, query[:, :, None], dim=1)  # (B, R, T)
    keys = torch.arange(length, device=device)  # (T,)
    prompt_mask = keys[None, :width_p] < prompt_lens[:, None]  # (B, P)
    a_p = rows[:, :, :width_p] * (prompt_mask[:, None, :] & response_mask[:, :, None])  # (B, R, P)
    history = (keys[None, None, :] >= prompt_lens[:, None, None]) & (keys[None, None, :] < query[:, :, None])
    c = (rows * history).sum(dim=-1) * response_mask  # (B, R)
    return {"A_p": a_p, "c": c, "prompt_mask": prompt_mask, "response_mask": response_mask}


def interaction_terms(a_p: torch.Tensor, a: torch.Tensor, c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """BRIDGE interaction terms beta and gamma (paper §4.3): ``beta[i, j] = A_p[j, i] a_j``, ``gamma_j = a_j c_j``.

    Leading batch dimensions broadcast, so the batched outputs of :func:`routing_weights_batch` work too.

    Args:
        a_p: (..., r, p) prompt routing weights.
        a: (..., r) utilities of the response tokens (``a[p + j]`` of the full (T,) utility row).
        c: (..., r) response-history mass.

    Returns:
        ``beta`` (..., p, r) and ``gamma`` (..., r), float32.
    """
    if a.shape != c.shape or a_p.shape[:-1] != a.shape:
        raise ValueError(
            f"shapes must be A_p (..., r, p), a (..., r), c (..., r); got {tuple(a_p.shape)}, {tuple(a.shape)}, "
            f"{tuple(c.shape)}"
        )
    a = a.float()
    beta = a_p.float().transpose(-1, -2) * a[..., None, :]  # (..., p, r)
    return beta, a * c.float()


def attention_for_layer(
    model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor, layer: int
) -> torch.Tensor:
    """Attention probabilities of ONE layer, materialised for that layer only.

    Switches the model to the selective-eager implementation for ``[layer]`` (all other layers keep SDPA and store
    nothing), runs one forward without logits beyond the last position, and restores the previous attention
    implementation.

    Args:
        model: A transformers causal LM in eval mode.
        input_ids: (B, T) token ids.
        attention_mask: (B, T) 1 on real tokens.
        layer: Layer index (negative counts from the end).

    Returns:
        (B, H, T, T) float attention probabilities of ``layer`` (query rows sum to 1 over unmasked keys).
    """
    from raycurate.models.loading import attention_layer_types, check_attentions, enable_attention_outputs

    n_layers = len(attention_layer_types(model))
    index = layer + n_layers if layer < 0 else layer
    if not 0 <= index < n_layers:
        raise ValueError(f"layer={layer} is out of range for a model with {n_layers} layers")
    if model.training:
        raise ValueError("attention_for_layer needs deterministic attention; call model.eval() first")
    previous = model.config._attn_implementation
    enable_attention_outputs(model, [index])
    try:
        with torch.no_grad():
            outputs = model(
                input_ids=input_ids,
                attention_mask=attention_mask,
                output_attentions=True,
                use_cache=False,
                logits_to_keep=1,
            )
        return check_attentions(outputs, [index])[index]
    finally:
        model.set_attn_implementation(previous)


def default_routing_layer(model: Any) -> int:
    """The last full/global-attention layer (paper App. B.3: final layer for Llama, last global layer for Gemma).

    Args:
        model: A transformers model (or anything :func:`raycurate.models.loading.attention_layer_types` accepts).

    Returns:
        The layer index.
    """
    from raycurate.models.loading import attention_layer_types

    types = attention_layer_types(model)
    full = [i for i, kind in enumerate(types) if kind in ("full_attention", "global_attention")]
    if not full:
        raise ValueError(f"no full-attention layer among layer types {sorted(set(types))}; pass the routing layer")
    return full[-1]
