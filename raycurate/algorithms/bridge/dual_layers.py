"""Hand-written forward-mode rules for Llama-style decoder layers (RMSNorm, rotary GQA attention, SwiGLU MLP).

Token utilities (:mod:`.token_utility`) need each supervised token's loss tangent along a direction on the last L
decoder layers; torch's generic forward-mode AD pays per-op dispatch that dominates small layers.  These rules carry
the hidden states h and their tangent dh side by side: :func:`linear_jvp` (``[x; dx]`` in one matmul),
:func:`rms_norm_jvp`, :func:`attention_jvp`, :func:`swiglu_jvp` and :func:`loss_tangents_from_hidden` (each
docstring gives its formula).  :func:`plan_dual_layers` says whether a model and direction fit them (else the
caller keeps the generic path); :func:`patched_dual_layers` swaps the dual layers' ``forward`` for the rules while
the model's own forward runs.  Decisions and costs: docs/bridge.md, "Utilities"; benchmarks/RESULTS.md.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

_LAYER_CLASSES = ("LlamaDecoderLayer", "Qwen2DecoderLayer", "MistralDecoderLayer")
_PARAM_SUFFIXES = tuple(
    f"{module}.{kind}"
    for module in ("input_layernorm", "post_attention_layernorm", "self_attn.q_proj", "self_attn.k_proj",
                   "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
    for kind in ("weight", "bias")
)


@dataclass
class DualPlan:
    """Which decoder layers run the hand-written rules, and the direction's tangent of each of their parameters.

    Attributes:
        prefix: Qualified name of the layers' ModuleList (``model.layers``).
        first: Index of the first layer holding a direction parameter; it and every later layer are dual.
        tangents: ``{layer index: {parameter suffix (e.g. "self_attn.q_proj.weight"): tangent}}``, in the
            parameter's dtype and device; suffixes outside the direction are absent (zero tangent).
    """

    prefix: str
    first: int
    tangents: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict)


def decoder_layers(model: nn.Module) -> tuple[str, nn.ModuleList]:
    """The decoder-layer ModuleList (``model.model.layers``) and its qualified name inside ``model``."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise ValueError(
            f"{type(model).__name__} has no `model.model.layers` ModuleList; scoring_parameters supports "
            "Llama/Qwen2/Mistral/Gemma-style causal LMs (XxxForCausalLM wrapping XxxModel.layers). Pass the "
            "restricted parameters explicitly as a {name: parameter} dict for other architectures."
        )
    for name, module in model.named_modules():
        if module is layers:
            return name, layers
    raise ValueError("model.model.layers is not registered as a submodule of the model; cannot name its parameters")


def plan_dual_layers(model: nn.Module, direction: Mapping[str, torch.Tensor]) -> DualPlan | None:
    """A :class:`DualPlan` when every direction parameter belongs to a supported decoder layer; else None.

    Args:
        model: An ``XxxForCausalLM`` whose decoder is ``model.model`` with ``layers`` and a final ``norm``.
        direction: ``{qualified parameter name: tangent}``.
    """
    import transformers

    if int(transformers.__version__.split(".")[0]) < 5:
        return None  # decoder layers returned tuples before transformers 5; the patched forward returns a tensor
    try:
        prefix, layers = decoder_layers(model)
    except ValueError:
        return None
    if not direction or not _is_rms_norm(getattr(model.model, "norm", None)):
        return None
    tangents: dict[int, dict[str, torch.Tensor]] = {}
    for name, tangent in direction.items():
        index, _, suffix = name.removeprefix(f"{prefix}.").partition(".")
        if not name.startswith(f"{prefix}.") or not index.isdigit() or suffix not in _PARAM_SUFFIXES:
            return None
        param = layers[int(index)].get_parameter(suffix)
        tangents.setdefault(int(index), {})[suffix] = tangent.detach().to(param.device, param.dtype)
    first = min(tangents)
    if not all(_is_supported_layer(layers[i]) for i in range(first, len(layers))):
        return None
    return DualPlan(prefix=prefix, first=first, tangents=tangents)


def _is_rms_norm(module: object) -> bool:
    return (isinstance(module, nn.Module) and type(module).__name__.endswith("RMSNorm")
            and hasattr(module, "variance_epsilon") and isinstance(getattr(module, "weight", None), torch.Tensor))


def _is_supported_layer(layer: nn.Module) -> bool:
    attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    if type(layer).__name__ not in _LAYER_CLASSES or attn is None or mlp is None:
        return False
    if not (_is_rms_norm(getattr(layer, "input_layernorm", None))
            and _is_rms_norm(getattr(layer, "post_attention_layernorm", None))):
        return False
    linears = [getattr(attn, n, None) for n in ("q_proj", "k_proj", "v_proj", "o_proj")]
    linears += [getattr(mlp, n, None) for n in ("gate_proj", "up_proj", "down_proj")]
    if not all(isinstance(m, nn.Linear) for m in linears) or hasattr(attn, "q_norm"):
        return False
    act = getattr(mlp, "act_fn", None)
    return (isinstance(act, nn.SiLU) or type(act).__name__ == "SiLUActivation") and hasattr(attn, "scaling")


@dataclass
class _Carry:
    """The tangent of the hidden states between dual layers, and the last layer's output (the final norm's input)."""

    tangent: torch.Tensor | None = None
    output: torch.Tensor | None = None


@contextmanager
def patched_dual_layers(model: nn.Module, plan: DualPlan, rows: slice) -> Iterator[_Carry]:
    """Run layers ``plan.first ..`` through :func:`dual_layer` while the model's forward runs inside the block.

    Args:
        rows: The positions whose final hidden states are read (the loss window); the last layer computes its
            output only there (keys and values up to ``rows.stop``), and returns the other positions unchanged.

    Yields:
        The carry: after the forward, ``carry.output`` is the last layer's output at ``rows`` (B, R, H) and
        ``carry.tangent`` its tangent along the direction (None if it carries none).
    """
    layers = model.get_submodule(plan.prefix)
    carry = _Carry()

    def make_forward(layer: nn.Module, tangents: dict[str, torch.Tensor], last: bool):
        def forward(hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None,
                    position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None, **_: object):
            if position_embeddings is None:
                raise ValueError("the decoder passed no position_embeddings; the hand-written rules need them")
            out, carry.tangent = dual_layer(layer, hidden_states, carry.tangent, tangents, attention_mask,
                                            position_embeddings, rows if last else None)
            if not last:
                return out
            carry.output = out
            full = hidden_states.clone()  # the decoder's final norm reads every position; only `rows` are used
            full[:, rows] = out
            return full
        return forward

    dual = range(plan.first, len(layers))
    try:
        for i in dual:
            layers[i].forward = make_forward(layers[i], plan.tangents.get(i, {}), i == len(layers) - 1)
        yield carry
    finally:
        for i in dual:
            layers[i].__dict__.pop("forward", None)


def dual_layer(layer: nn.Module, h: torch.Tensor, dh: torch.Tensor | None, tangents: Mapping[str, torch.Tensor],
               mask: torch.Tensor | None, position_embeddings: tuple[torch.Tensor, torch.Tensor],
               rows: slice | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One pre-norm decoder layer and its tangent.

    Inside the layer, a value and its tangent travel as one "stacked" tensor ``[y; dy]`` of 2B rows (B rows: no
    tangent), so that each linear reads both in one matmul.

    Args:
        layer: A supported decoder layer (:func:`plan_dual_layers`).
        h: (B, T, H) input hidden states; ``dh`` their tangent or None (zero).
        tangents: ``{parameter suffix: tangent}`` of this layer's direction parameters.
        mask: The attention mask the decoder passes to this layer: None (causal), (B|1, 1, T, T) bool (True =
            attend) or additive float.
        position_embeddings: (cos, sin), each (B|1, T, head_dim).
        rows: Compute the output at these positions only (B, R, H); None: every position.

    Returns:
        (output (B, T|R, H), its tangent or None).
    """
    attn, mlp = layer.self_attn, layer.mlp
    batch = h.shape[0]
    rows = rows or slice(0, h.shape[1])
    x = rms_norm_jvp(layer.input_layernorm, h[:, : rows.stop], None if dh is None else dh[:, : rows.stop],
                     tangents.get("input_layernorm.weight"))
    qkv = fused_linear([attn.q_proj, attn.k_proj, attn.v_proj], ["self_attn.q_proj", "self_attn.k_proj",
                                                                 "self_attn.v_proj"], tangents)
    a = attention_jvp(attn, qkv, x, batch, mask, position_embeddings, rows.start)
    a = linear_jvp(fused_linear([attn.o_proj], ["self_attn.o_proj"], tangents), a, batch)
    h, dh = _add_stacked(h[:, rows], None if dh is None else dh[:, rows], a, batch)
    x = rms_norm_jvp(layer.post_attention_layernorm, h, dh, tangents.get("post_attention_layernorm.weight"))
    m = swiglu_jvp(fused_linear([mlp.gate_proj, mlp.up_proj], ["mlp.gate_proj", "mlp.up_proj"], tangents), x, batch)
    m = linear_jvp(fused_linear([mlp.down_proj], ["mlp.down_proj"], tangents), m, batch)
    return _add_stacked(h, dh, m, batch)


def _add_stacked(h: torch.Tensor, dh: torch.Tensor | None, stacked: torch.Tensor, batch: int
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The residual sum ``(h + y, dh + dy)`` with ``stacked = [y; dy]`` (or y alone)."""
    out = h + stacked[:batch]
    if stacked.shape[0] == batch:
        return out, dh
    return out, stacked[batch:] if dh is None else dh + stacked[batch:]


def rms_norm_jvp(norm: nn.Module, x: torch.Tensor, dx: torch.Tensor | None, dweight: torch.Tensor | None
                 ) -> torch.Tensor:
    """Llama's RMSNorm (fp32 statistics, weight applied in the input dtype) and its tangent.

    ``y = w * n``, ``n = x r``, ``r = (mean(x^2) + eps)^-1/2``: ``dn = r (dx - n mean(n dx))``, ``dy = w dn + dw n``.

    Args:
        norm: The RMSNorm module (``weight`` (H,), ``variance_epsilon``).
        x: (B, ..., H) input; ``dx`` its tangent or None; ``dweight`` the weight's tangent or None.

    Returns:
        ``[y; dy]`` stacked along the batch (2B, ..., H), or y alone (B, ..., H) when nothing carries a tangent.
    """
    dtype = x.dtype
    xf = x.float()
    r = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)  # (..., 1)
    nf = xf * r
    n = nf.to(dtype)
    if dx is None and dweight is None:
        return norm.weight * n
    out = torch.empty((2 * x.shape[0], *x.shape[1:]), dtype=dtype, device=x.device)
    torch.mul(norm.weight, n, out=out[: x.shape[0]])
    dy = out[x.shape[0]:]
    if dx is not None:
        dxf = dx.float()
        dn = dxf.addcmul(nf, (nf * dxf).mean(-1, keepdim=True), value=-1).mul_(r)  # r (dx - n mean(n dx))
        torch.mul(norm.weight, dn.to(dtype), out=dy)
        if dweight is not None:
            dy.addcmul_(dweight, n)
    else:
        assert dweight is not None
        torch.mul(dweight, n, out=dy)
    return out


@dataclass
class FusedLinear:
    """Linears that read the same input, concatenated along their outputs, with the direction's tangents.

    Attributes:
        weight: (out, in), the modules' weights stacked; ``bias`` (out,) or None.
        dweight: (out, in) tangent of the weight, or None (zero); ``dbias`` likewise.
        widths: Each module's output width, in order.
    """

    weight: torch.Tensor
    bias: torch.Tensor | None
    dweight: torch.Tensor | None
    dbias: torch.Tensor | None
    widths: list[int]


def fused_linear(modules: list[nn.Linear], names: list[str], tangents: Mapping[str, torch.Tensor]) -> FusedLinear:
    """:class:`FusedLinear` of ``modules`` (their parameter suffixes ``names``); one module is not copied."""

    def stacked(parts: list[torch.Tensor | None], like: list[torch.Tensor]) -> torch.Tensor | None:
        if all(part is None for part in parts):
            return None
        full = [torch.zeros_like(ref) if part is None else part for part, ref in zip(parts, like)]
        return full[0] if len(full) == 1 else torch.cat(full)

    weights = [m.weight for m in modules]
    biases = [m.bias if m.bias is not None else torch.zeros_like(m.weight[:, 0]) for m in modules]
    has_bias = any(m.bias is not None for m in modules)
    return FusedLinear(
        weight=weights[0] if len(weights) == 1 else torch.cat(weights),
        bias=stacked([m.bias for m in modules], biases) if has_bias else None,
        dweight=stacked([tangents.get(f"{n}.weight") for n in names], weights),
        dbias=stacked([tangents.get(f"{n}.bias") for n in names], biases),
        widths=[m.out_features for m in modules],
    )


def linear_jvp(fused: FusedLinear, stacked: torch.Tensor, batch: int) -> torch.Tensor:
    """``[y; dy]`` with ``y = x W^T + b`` and ``dy = dx W^T + x dW^T + db`` from ``stacked = [x; dx]``.

    y and ``dx W^T`` come from one matmul over the stacked rows.

    Args:
        fused: The linear(s) (:func:`fused_linear`).
        stacked: (2B, T, in) ``[x; dx]``, or (B, T, in) x alone (dx = 0).
        batch: B.

    Returns:
        (2B, T, out) ``[y; dy]``, or (B, T, out) y alone when nothing carries a tangent.
    """
    x = stacked[:batch]
    if stacked.shape[0] == batch:
        y = F.linear(x, fused.weight, fused.bias)
        if fused.dweight is not None:
            return torch.cat([y, F.linear(x, fused.dweight, fused.dbias)])
        return y if fused.dbias is None else torch.cat([y, fused.dbias.expand_as(y)])
    both = F.linear(stacked, fused.weight)  # (2B, T, out)
    if fused.bias is not None:
        both[:batch] += fused.bias
    if fused.dweight is not None:
        both[batch:] += F.linear(x, fused.dweight, fused.dbias)
    elif fused.dbias is not None:
        both[batch:] += fused.dbias
    return both


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of x (N, T, heads, d) with cos / sin (N|1, T, 1, d), as transformers' rotate_half."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin


def attention_jvp(attn: nn.Module, qkv: FusedLinear, x: torch.Tensor, batch: int, mask: torch.Tensor | None,
                  position_embeddings: tuple[torch.Tensor, torch.Tensor], first_query: int = 0) -> torch.Tensor:
    """Rotary grouped-query self-attention before ``o_proj`` (eager semantics: fp32 softmax) and its tangent.

    ``P = softmax(q k^T s + M)``, ``o = P v`` with grouped KV heads (no ``repeat_kv`` copy); the rotary embedding is
    linear and applied to the stacked ``[q; dq]``: ``dS = [dq, q] [k, dk]^T s`` (one matmul),
    ``dP = P (dS - rowsum(P dS))``, ``do = [dP, P] [v; dv]``.

    Args:
        attn: The layer's attention module (``head_dim``, ``scaling``).
        qkv: q, k and v projections fused (:func:`fused_linear`).
        x: (2B|B, K, H) normed input of the first K positions (the keys) and its tangent, stacked.
        batch: B.
        mask: The decoder's mask for this layer (None: causal), over at least K positions.
        position_embeddings: (cos, sin), each (B|1, >= K, head_dim).
        first_query: Queries are the positions ``first_query .. K - 1``.

    Returns:
        (2B|B, Q, heads * head_dim): the output at the Q = K - first_query query positions and its tangent, stacked.
    """
    length = x.shape[1]  # the keys
    queries = length - first_query
    d = attn.head_dim
    q_heads, kv_heads = qkv.widths[0] // d, qkv.widths[1] // d
    groups = q_heads // kv_heads
    stacked = linear_jvp(qkv, x, batch)  # (n, K, (Hq + 2 KV) d), n = 2B with a tangent
    n = stacked.shape[0]
    heads = stacked.view(n, length, q_heads + 2 * kv_heads, d)
    cos, sin = (e[:, :length].unsqueeze(2) for e in position_embeddings)  # (B|1, K, 1, d)
    if cos.shape[0] not in (1, n):
        cos, sin = cos.repeat(2, 1, 1, 1), sin.repeat(2, 1, 1, 1)
    rotated = _rotate(heads[:, :, : q_heads + kv_heads], cos, sin)  # q and k heads at once
    q = rotated[:, first_query:, :q_heads].transpose(1, 2)  # (n, Hq, Q, d)
    k = rotated[:, :, q_heads:].transpose(1, 2)  # (n, KV, K, d)
    v = heads[:, :, q_heads + kv_heads:].transpose(1, 2)  # (n, KV, K, d)
    # Query heads kv * groups + j share KV head kv (transformers' repeat_kv order): grouped without a copy of k, v.
    # The scaling is applied to q (Q x d values) rather than to the scores (Q x K).
    qg = q.reshape(n, kv_heads, groups * queries, d) * attn.scaling
    scores = (qg[:batch] @ k[:batch].transpose(-1, -2)).view(batch, kv_heads, groups, queries, length)
    scores += _additive_mask(mask, first_query, length, scores.dtype, scores.device)
    probs_f = torch.softmax(scores, dim=-1, dtype=torch.float32)  # (B, KV, G, Q, K)
    probs = probs_f.to(x.dtype).view(batch, kv_heads, groups * queries, length)
    out = probs @ v[:batch]  # (B, KV, G*Q, d)
    if n == 2 * batch:
        dscores = torch.cat([qg[batch:], qg[:batch]], -1) @ torch.cat([k[:batch], k[batch:]], -1).transpose(-1, -2)
        weighted = probs_f * dscores.view(batch, kv_heads, groups, queries, length).float()  # P dS
        dprobs = weighted.addcmul_(probs_f, weighted.sum(-1, keepdim=True), value=-1)  # P dS - P rowsum(P dS)
        dprobs = dprobs.to(x.dtype).view(batch, kv_heads, groups * queries, length)
        dout = (dprobs @ v[:batch]).add_(probs @ v[batch:])  # no (Q, 2K) concatenation of the probabilities
        out = torch.cat([out, dout])
    # (n, KV, G*Q, d) -> (n, Q, heads * d): one copy into the rows o_proj reads
    return out.view(n, q_heads, queries, d).transpose(1, 2).reshape(n, queries, q_heads * d)


def _additive_mask(mask: torch.Tensor | None, first_query: int, length: int, dtype: torch.dtype,
                   device: torch.device) -> torch.Tensor:
    """The layer's mask over queries ``first_query .. length - 1`` and keys ``0 .. length - 1``, additive,
    (B|1, 1, 1, Q, K), broadcast over query groups."""
    if mask is None:
        mask = torch.ones(length, length, dtype=torch.bool, device=device).tril()[None, None]
    mask = mask[..., first_query:length, :length]
    if mask.dtype == torch.bool:
        mask = torch.zeros(mask.shape, dtype=dtype, device=device).masked_fill(~mask, torch.finfo(dtype).min)
    return mask.to(dtype).unsqueeze(2)


def swiglu_jvp(gate_up: FusedLinear, x: torch.Tensor, batch: int) -> torch.Tensor:
    """``silu(gate(x)) * up(x)`` (the MLP before ``down_proj``) and its tangent.

    ``m = silu(g) u``: ``dm = silu'(g) dg u + silu(g) du``, ``silu'(g) = sig(g) (1 + g (1 - sig(g)))``.

    Args:
        gate_up: gate and up projections fused (:func:`fused_linear`).
        x: (2B|B, T, H) input and its tangent, stacked.
        batch: B.

    Returns:
        (2B|B, T, I) ``[m; dm]`` stacked.
    """
    y = linear_jvp(gate_up, x, batch)
    width = gate_up.widths[0]
    g, u = y[:batch, ..., :width], y[:batch, ..., width:]
    act = F.silu(g)
    if y.shape[0] == batch:
        return act * u
    out = torch.empty((2 * batch, *g.shape[1:]), dtype=g.dtype, device=g.device)
    torch.mul(act, u, out=out[:batch])
    dg, du = y[batch:, ..., :width], y[batch:, ..., width:]
    # silu_backward(a, g) = a * silu'(g), silu'(g) = sig(g) (1 + g (1 - sig(g))), in one fused kernel
    torch.ops.aten.silu_backward(dg * u, g, grad_input=out[batch:])
    out[batch:].addcmul_(act, du)
    return out


# ------------------------------------------------------------------------------------------- the loss layer


def plain_lm_head(model: nn.Module, params: Mapping[str, torch.Tensor]) -> nn.Linear | None:
    """The LM head when the logits are exactly ``model.model(...) @ head.weight.T`` and no parameter of the head is
    in the direction; None otherwise (the generic forward-mode path then runs)."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    decoder = getattr(model, "model", None)
    config = getattr(model, "config", None)
    if not isinstance(head, nn.Linear) or head.bias is not None or not isinstance(decoder, nn.Module):
        return None
    if getattr(config, "final_logit_softcapping", None) or getattr(config, "logit_scale", None) not in (None, 1, 1.0):
        return None
    if any(param is head.weight for param in params.values()):
        return None  # a tied head inside the direction (e.g. the embedding): its tangent reaches the logits too
    return head


def window_loss_tangents(hidden: torch.Tensor, tangent: torch.Tensor, window_ids: torch.Tensor,
                         window_mask: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """(B, W) loss tangents of the window from the final hidden states (B, W - 1, H) that predict
    ``window_ids[:, 1:]`` and their tangents (B, W - 1, H)."""
    counted = window_mask[:, 1:]  # (B, W - 1)
    out = torch.zeros(window_ids.shape, dtype=torch.float32, device=window_ids.device)  # (B, W)
    out[:, 1:][counted] = loss_tangents_from_hidden(hidden[counted], tangent[counted], window_ids[:, 1:][counted],
                                                    weight)
    return out


def loss_tangents_from_hidden(hidden: torch.Tensor, tangent: torch.Tensor, targets: torch.Tensor,
                              weight: torch.Tensor) -> torch.Tensor:
    """d l / d e for ``l = logsumexp(z) - z[y]``, ``z = h W^T``, given h's tangent; W carries none.

    ``dl = (softmax(z) - onehot(y)) . dz = dh . ((softmax(z) - onehot(y)) W)``; the difference is formed before
    the matmul, so a confident prediction (softmax ~ onehot) loses no precision to cancellation in bf16.

    Args:
        hidden: (N, H) final hidden states (after the final norm) of the positions that predict a supervised token.
        tangent: (N, H) their tangents along the scoring direction.
        targets: (N,) the token each position predicts.
        weight: (V, H) LM head weight.

    Returns:
        (N,) float32 loss tangents.
    """
    logits = hidden @ weight.T  # (N, V) in the head's dtype, as the model's own logits
    residual = torch.softmax(logits, dim=-1, dtype=torch.float32)  # (N, V); no fp32 copy of the logits
    residual[torch.arange(targets.shape[0], device=targets.device), targets] -= 1.0
    pulled = (residual.to(weight.dtype) @ weight).float()  # (N, H)
    return (tangent.float() * pulled).sum(dim=-1)
