"""Sparse head adaptation as a head-delta adapter (P2D §3.2.3 "P2D‡").

:func:`attach_head_delta` gives each selected head's q_proj rows, its KV group's k/v rows (one delta per group) and
optionally its o_proj columns a zero-initialised ``delta`` (:class:`SliceDelta`), added to the projection outputs by
forward hooks, so the effective weight is ``W + scatter(delta)`` and the optimizer keeps state for the deltas only.
The hooks call the delta modules and never read the base weights: bf16 and DeepSpeed ZeRO-2/3 work.  Attach before
building the optimizer or engine.  :func:`merge_head_delta` folds the deltas into the weights for
``save_pretrained`` (under ZeRO-3 :func:`merge_head_delta_state_dict` on the consolidated state dict; the indices
are persistent buffers).  Head slices: :mod:`raycurate.models.heads`; decisions: docs/p2d.md, "Sparse adaptation".
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from raycurate.models.loading import attention_modules, head_geometry

ADAPTER_NAME = "head_delta"
# slice key -> (projection module name, which side of the weight the delta covers)
SLICES = {"q": ("q_proj", "rows"), "k": ("k_proj", "rows"), "v": ("v_proj", "rows"), "o": ("o_proj", "columns")}


class SliceDelta(nn.Module):
    """A trainable delta for some output rows (q/k/v) or input columns (o) of one projection weight.

    Attributes:
        delta: (n_rows, in_features) for ``rows``; (out_features, n_cols) for ``columns``; zero-initialised.
        index: (n_rows,) or (n_cols,) int64 row/column indices of the base weight the delta adds to.
    """

    def __init__(self, side: str, index: torch.Tensor, other_dim: int, dtype: torch.dtype, device: Any) -> None:
        super().__init__()
        self.side = side
        shape = (index.numel(), other_dim) if side == "rows" else (other_dim, index.numel())
        self.delta = nn.Parameter(torch.zeros(shape, dtype=dtype, device=device))
        self.register_buffer("index", index.to(device=device, dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(..., in_features) -> (..., n_rows) for rows, (..., out_features) for columns."""
        if self.side == "columns":
            x = x.index_select(-1, self.index)
        return nn.functional.linear(x.to(self.delta.dtype), self.delta)

    def patch(self, output: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """The projection output with this delta's contribution added."""
        update = self(x).to(output.dtype)
        if self.side == "rows":
            return output.index_add(-1, self.index, update)
        return output + update


class HeadDelta(nn.Module):
    """The deltas of one attention layer (child ``head_delta`` of the attention module)."""

    def __init__(self, heads: Sequence[int], slices: dict[str, SliceDelta]) -> None:
        super().__init__()
        self.heads = tuple(heads)
        self.slices = nn.ModuleDict(slices)
        self.handles: list[Any] = []


def _make_hook(delta: SliceDelta):
    def hook(module: nn.Module, args: tuple, kwargs: dict, output: torch.Tensor) -> torch.Tensor:
        x = args[0] if args else kwargs["input"]
        return delta.patch(output, x)

    return hook


def _selected_by_layer(heads: Sequence[tuple[int, int]], geometry: dict[str, int]) -> dict[int, list[int]]:
    by_layer: dict[int, set[int]] = {}
    for pair in heads:
        layer, head = (int(value) for value in pair)
        if not 0 <= layer < geometry["n_layers"] or not 0 <= head < geometry["n_heads"]:
            raise ValueError(
                f"head {(layer, head)} is out of range; the model has layers 0..{geometry['n_layers'] - 1} and "
                f"query heads 0..{geometry['n_heads'] - 1}"
            )
        by_layer.setdefault(layer, set()).add(head)
    if not by_layer:
        raise ValueError("no heads selected; pass at least one (layer, head) pair")
    return {layer: sorted(selected) for layer, selected in sorted(by_layer.items())}


def _span_index(blocks: Sequence[int], dim: int) -> torch.Tensor:
    """Row indices of head blocks ``[b * dim, (b + 1) * dim)`` for each block b, concatenated."""
    return (torch.tensor(blocks, dtype=torch.long)[:, None] * dim + torch.arange(dim)).flatten()


def _layer_slices(
    attention: nn.Module, selected: list[int], geometry: dict[str, int], train_o: bool, dtype: torch.dtype | None
) -> dict[str, SliceDelta]:
    dim, group_size = geometry["head_dim"], geometry["n_heads"] // geometry["n_kv_heads"]
    groups = sorted({head // group_size for head in selected})
    indices = {"q": _span_index(selected, dim), "k": _span_index(groups, dim), "v": _span_index(groups, dim)}
    if train_o:
        indices["o"] = _span_index(selected, dim)
    slices = {}
    for key, index in indices.items():
        projection_name, side = SLICES[key]
        projection = getattr(attention, projection_name)
        # in_features / out_features come from the module, not the (possibly ZeRO-3-partitioned) weight tensor
        other = projection.in_features if side == "rows" else projection.out_features
        weight = projection.weight
        slices[key] = SliceDelta(side, index, other, dtype or weight.dtype, weight.device)
    return slices


def attach_head_delta(
    model: nn.Module, heads: Sequence[tuple[int, int]], train_o: bool = False, dtype: torch.dtype | None = None
) -> list[nn.Parameter]:
    """Freeze the model and make only the selected heads' slices trainable, through zero-initialised deltas.

    Args:
        model: A transformers causal LM (Llama/Qwen2/Mistral/Gemma-style attention), modified in place.
        heads: ``(layer, query_head)`` pairs (duplicates ignored).
        train_o: Also train the heads' o_proj columns.
        dtype: dtype of the deltas; default the projection weights' dtype.  With bf16 weights, ``torch.float32``
            keeps the small updates exact (the hook casts in and out).

    Returns:
        The delta parameters (the only ones with ``requires_grad``), layer by layer, q, k, v[, o].
    """
    geometry = head_geometry(model)
    if geometry["n_heads"] % geometry["n_kv_heads"]:
        raise ValueError(f"n_heads={geometry['n_heads']} is not a multiple of n_kv_heads={geometry['n_kv_heads']}")
    attentions = {module.layer_idx: module for module in attention_modules(model)}
    if len(attentions) != geometry["n_layers"]:
        raise ValueError(f"found {len(attentions)} attention modules for {geometry['n_layers']} layers")
    if any(hasattr(module, ADAPTER_NAME) for module in attentions.values()):
        raise RuntimeError("a head-delta adapter is already attached; merge_head_delta(model) first")
    selected_by_layer = _selected_by_layer(heads, geometry)
    for parameter in model.parameters():
        parameter.requires_grad_(False)
    parameters = []
    for layer, selected in selected_by_layer.items():
        attention = attentions[layer]
        adapter = HeadDelta(selected, _layer_slices(attention, selected, geometry, train_o, dtype))
        attention.add_module(ADAPTER_NAME, adapter)
        for key, delta in adapter.slices.items():
            projection = getattr(attention, SLICES[key][0])
            adapter.handles.append(projection.register_forward_hook(_make_hook(delta), with_kwargs=True))
            parameters.append(delta.delta)
    return parameters


def _adapters(model: nn.Module) -> list[tuple[nn.Module, HeadDelta]]:
    return [
        (module, getattr(module, ADAPTER_NAME))
        for module in attention_modules(model)
        if isinstance(getattr(module, ADAPTER_NAME, None), HeadDelta)
    ]


def merge_head_delta(model: nn.Module) -> None:
    """Add the deltas into the base weights in place and remove the adapter (hooks and parameters).

    Afterwards ``model.state_dict()`` has exactly the base model's keys and ``save_pretrained`` writes a plain HF
    checkpoint.  Base parameters stay frozen (``requires_grad=False``).  Needs full (gathered) weights: under ZeRO-3
    use :func:`merge_head_delta_state_dict` on the consolidated state dict.
    """
    adapters = _adapters(model)
    if not adapters:
        raise RuntimeError("the model has no head-delta adapter; call attach_head_delta first")
    with torch.no_grad():
        for attention, adapter in adapters:
            for key, delta in adapter.slices.items():
                weight = getattr(attention, SLICES[key][0]).weight
                axis = 0 if delta.side == "rows" else 1
                weight.index_add_(axis, delta.index.to(weight.device), delta.delta.to(weight.dtype))
            for handle in adapter.handles:
                handle.remove()
            delattr(attention, ADAPTER_NAME)


def merge_head_delta_state_dict(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A plain HF state dict from one that holds head-delta entries (e.g. a ZeRO-3 consolidated state dict).

    Args:
        state: Parameter name -> tensor, with ``...self_attn.head_delta.slices.{q,k,v,o}.{delta,index}`` entries
            next to the base ``...self_attn.{q,k,v,o}_proj.weight``.

    Returns:
        A new dict without the adapter entries, whose projection weights include the deltas (others shared).
    """
    marker = f".{ADAPTER_NAME}.slices."
    merged = {name: tensor for name, tensor in state.items() if marker not in name}
    for name in state:
        if marker not in name or not name.endswith(".delta"):
            continue
        prefix, rest = name.split(marker)
        key = rest.split(".")[0]
        projection, side = SLICES[key]
        target = f"{prefix}.{projection}.weight"
        index = state[f"{prefix}{marker}{key}.index"]
        weight = merged[target].clone()
        weight.index_add_(0 if side == "rows" else 1, index.to(weight.device), state[name].to(weight.dtype))
        merged[target] = weight
    return merged


def head_delta_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Detached copies of the adapter's deltas and indices, keyed by their names in ``model.state_dict()``."""
    return {
        name: tensor.detach().clone()
        for name, tensor in model.state_dict().items()
        if f".{ADAPTER_NAME}.slices." in name
    }


def trainable_parameter_count(model: nn.Module) -> int:
    """Number of parameters with ``requires_grad`` (full sizes, also when ZeRO-3 has partitioned them)."""
    return sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters() if p.requires_grad)
