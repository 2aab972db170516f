"""Which weights an attention head owns, and its flattened weight vector (P2D head identification).

Query head ``h`` owns rows ``[h * head_dim, (h + 1) * head_dim)`` of ``q_proj`` and the same columns of ``o_proj``,
and shares the k/v rows of its KV group ``g = h // (n_heads // n_kv_heads)`` (Llama, Qwen2, Mistral, Gemma;
``head_dim`` need not be ``hidden / n_heads``): :func:`head_param_slices`, :func:`kv_group`.  A head's vector
(:func:`layer_head_vectors`, :func:`head_vectors`, :func:`iter_head_vectors`) is its q rows, its group's k and v
rows and optionally its o columns (transposed), flattened in that fixed order, which index-support scores such as
W1 (:mod:`raycurate.algorithms.p2d.head_scoring`) depend on.  Why group, not index, slicing: docs/p2d.md,
"Head slices (GQA)"; the trainable head deltas are :mod:`raycurate.models.head_adapter`.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

from raycurate.models.loading import head_geometry

if TYPE_CHECKING:
    import torch

LAYER_PREFIX = "model.layers"
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")


def param_name(layer: int, projection: str, prefix: str = LAYER_PREFIX) -> str:
    """HF parameter name of one attention projection weight, e.g. ``model.layers.3.self_attn.q_proj.weight``."""
    if projection not in PROJECTIONS:
        raise ValueError(f"unknown projection {projection!r}; valid projections: {list(PROJECTIONS)}")
    return f"{prefix}.{layer}.self_attn.{projection}.weight"


def kv_group(config: Any, head: int) -> int:
    """KV group (key/value head index) that query head ``head`` reads: ``head // (n_heads // n_kv_heads)``."""
    geometry = head_geometry(config)
    return head // (geometry["n_heads"] // geometry["n_kv_heads"])


def _check_head(geometry: dict[str, int], layer: int, head: int) -> None:
    if not 0 <= layer < geometry["n_layers"]:
        raise ValueError(f"layer {layer} is out of range; the model has layers 0..{geometry['n_layers'] - 1}")
    if not 0 <= head < geometry["n_heads"]:
        raise ValueError(f"head {head} is out of range; the model has query heads 0..{geometry['n_heads'] - 1}")
    if geometry["n_heads"] % geometry["n_kv_heads"]:
        raise ValueError(
            f"n_heads={geometry['n_heads']} is not a multiple of n_kv_heads={geometry['n_kv_heads']}; "
            "only grouped-query attention with equal-size groups is supported"
        )


def head_param_slices(
    config: Any, layer: int, head: int, include_o: bool = True, prefix: str = LAYER_PREFIX
) -> dict[str, tuple[str, int, slice]]:
    """The weight slices that query head ``head`` of ``layer`` uses.

    Args:
        config: A transformers config or model (see :func:`raycurate.models.loading.head_geometry`).
        layer: Layer index.
        head: Query-head index within the layer.
        include_o: Whether to include the head's ``o_proj`` columns.
        prefix: Module path of the decoder layers (``"model.layers"`` for Llama/Qwen2/Mistral/Gemma).

    Returns:
        ``{"q": (name, 0, rows), "k": (name, 0, rows of the KV group), "v": (name, 0, same rows)
        [, "o": (name, 1, columns)]}``: the parameter name, the sliced dimension and the slice along it.
    """
    geometry = head_geometry(config)
    _check_head(geometry, layer, head)
    dim = geometry["head_dim"]
    group = head // (geometry["n_heads"] // geometry["n_kv_heads"])
    head_rows = slice(head * dim, (head + 1) * dim)
    group_rows = slice(group * dim, (group + 1) * dim)
    slices = {
        "q": (param_name(layer, "q_proj", prefix), 0, head_rows),
        "k": (param_name(layer, "k_proj", prefix), 0, group_rows),
        "v": (param_name(layer, "v_proj", prefix), 0, group_rows),
    }
    if include_o:
        slices["o"] = (param_name(layer, "o_proj", prefix), 1, head_rows)
    return slices


def _weights(state: Mapping[str, torch.Tensor] | torch.nn.Module) -> Mapping[str, torch.Tensor]:
    import torch

    if isinstance(state, torch.nn.Module):
        return dict(state.named_parameters())
    return state


def _weight(weights: Mapping[str, torch.Tensor], name: str) -> torch.Tensor:
    if name not in weights:
        some = sorted(k for k in weights.keys() if "self_attn" in k)[:4]
        raise KeyError(
            f"parameter {name!r} not found; attention parameters look like {some}; pass prefix= matching the "
            "model's decoder-layer path"
        )
    return weights[name].detach()


def layer_head_vectors(
    state: Mapping[str, torch.Tensor] | torch.nn.Module,
    config: Any,
    layer: int,
    include_o: bool = False,
    prefix: str = LAYER_PREFIX,
) -> torch.Tensor:
    """Per-query-head weight vectors of one layer, vectorised (no loop over heads).

    Args:
        state: A state dict or a module whose ``named_parameters()`` carry HF names.
        config: A transformers config or model.
        layer: Layer index.
        include_o: Append each head's ``o_proj`` columns.
        prefix: Module path of the decoder layers.

    Returns:
        (H, D) tensor in the weights' dtype, ``D = 3 * head_dim * hidden`` (``4 * ...`` with ``include_o``); row
        ``h`` is q rows of ``h``, then k and v rows of its KV group, then (optionally) its o columns.
    """
    import torch

    geometry = head_geometry(config)
    _check_head(geometry, layer, 0)
    n_heads, n_kv, dim = geometry["n_heads"], geometry["n_kv_heads"], geometry["head_dim"]
    weights = _weights(state)

    def block(projection: str) -> torch.Tensor:
        return _weight(weights, param_name(layer, projection, prefix))

    q = block("q_proj").reshape(n_heads, -1)  # (H, head_dim * hidden)
    group_size = n_heads // n_kv
    # (n_kv, head_dim * hidden) -> (H, head_dim * hidden): query head h gets group h // group_size
    k = block("k_proj").reshape(n_kv, 1, -1).expand(n_kv, group_size, -1).reshape(n_heads, -1)
    v = block("v_proj").reshape(n_kv, 1, -1).expand(n_kv, group_size, -1).reshape(n_heads, -1)
    parts = [q, k, v]
    if include_o:
        o = block("o_proj")  # (hidden, H * head_dim)
        parts.append(o.reshape(o.shape[0], n_heads, dim).permute(1, 2, 0).reshape(n_heads, -1))  # (H, dim*hidden)
    return torch.cat(parts, dim=1)


def iter_head_vectors(
    state: Mapping[str, torch.Tensor] | torch.nn.Module,
    config: Any,
    layers: Iterable[int] | None = None,
    include_o: bool = False,
    prefix: str = LAYER_PREFIX,
) -> Iterator[tuple[int, torch.Tensor]]:
    """Yield ``(layer, (H, D) vectors)`` one layer at a time, so a 7B model is scored without an (L, H, D) copy."""
    n_layers = head_geometry(config)["n_layers"]
    for layer in range(n_layers) if layers is None else layers:
        yield layer, layer_head_vectors(state, config, layer, include_o=include_o, prefix=prefix)


def head_vectors(
    state: Mapping[str, torch.Tensor] | torch.nn.Module,
    config: Any,
    layers: Iterable[int] | None = None,
    include_o: bool = False,
    prefix: str = LAYER_PREFIX,
) -> torch.Tensor:
    """Weight vectors of every query head of the chosen layers (see :func:`layer_head_vectors`).

    Args:
        state: A state dict or a module with HF parameter names.
        config: A transformers config or model.
        layers: Layer indices (default: all layers), in the order of the output's first axis.
        include_o: Append each head's ``o_proj`` columns.
        prefix: Module path of the decoder layers.

    Returns:
        (L, H, D) tensor.  For large models prefer :func:`iter_head_vectors` (one layer in memory at a time).
    """
    import torch

    return torch.stack([vectors for _, vectors in iter_head_vectors(state, config, layers, include_o, prefix)])
