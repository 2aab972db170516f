"""BRIDGE validation-directed token utilities (paper §4.2, App. A.1), pure torch.

The direction ``v = (1 - lam) g_target / ||g_target|| + lam g_anchor / ||g_anchor||`` lives on the last ``L``
decoder layers (:func:`scoring_parameters`, :func:`validation_gradient`, :func:`anchor_direction`,
:func:`scoring_direction`); a response token's utility is ``a_t = v . grad l_t``, large positive = useful (BRIDGE
keeps the highest).  :func:`token_utilities` computes every supervised position's ``a_t`` in one forward-mode pass:
the hand-written rules of :mod:`.dual_layers` for Llama / Qwen2 / Mistral layers, ``torch.autograd.forward_ad``
otherwise.  :func:`knockout_prompt_scores` is the ``knockout_grad`` prompt proxy; :func:`reference_token_utilities`
the per-token backward loop tests compare against.  Sign, paths and costs: docs/bridge.md, "Utilities".
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterable, Iterator, Mapping
from contextlib import ExitStack, contextmanager

import torch
from torch import nn

from raycurate.algorithms.bridge.dual_layers import (
    DualPlan,
    decoder_layers,
    patched_dual_layers,
    plain_lm_head,
    plan_dual_layers,
    rms_norm_jvp,
    window_loss_tangents,
)
from raycurate.algorithms.losses import example_losses, logit_window, token_losses

# Attention implementations whose SDPA calls become forward-AD capable under the MATH backend.
_MATH_SDPA_COMPATIBLE = ("sdpa", "eager", "raycurate_selective_eager", "raycurate_key_scaled_eager")
_BATCH_KEYS = ("input_ids", "attention_mask", "loss_mask")


# ------------------------------------------------------------------------------------------- parameters


def scoring_parameters(model: nn.Module, last_layers: int = 4) -> dict[str, nn.Parameter]:
    """Parameters of the final ``last_layers`` transformer layers (the BRIDGE gradient scope, paper Table 8).

    Args:
        model: A Llama/Qwen2/Mistral/Gemma-style causal LM (decoder layers at ``model.model.layers``).
        last_layers: How many final layers to include, 1 <= L <= number of layers.

    Returns:
        ``{qualified name: parameter}`` in ``model.named_parameters()`` order; names are usable with
        ``torch.func.functional_call(model, ...)``.
    """
    prefix, layers = decoder_layers(model)
    n_layers = len(layers)
    if not 1 <= last_layers <= n_layers:
        raise ValueError(
            f"last_layers={last_layers} is out of range; the model has {n_layers} layers (use 1..{n_layers})"
        )
    wanted = tuple(f"{prefix}.{i}." for i in range(n_layers - last_layers, n_layers))
    return {name: param for name, param in model.named_parameters() if name.startswith(wanted)}


# -------------------------------------------------------------------------------------------- direction


def _check_batch(batch: Mapping[str, torch.Tensor], where: str) -> None:
    missing = [key for key in _BATCH_KEYS if key not in batch]
    if missing:
        raise KeyError(f"{where}: required keys {missing} not found; batch keys: {sorted(batch)}")
    shapes = {key: tuple(batch[key].shape) for key in _BATCH_KEYS}
    if len(set(shapes.values())) != 1 or len(shapes["input_ids"]) != 2:
        raise ValueError(f"{where}: input_ids, attention_mask and loss_mask must share one (B, T) shape; got {shapes}")


def _require_eval(model: nn.Module, what: str) -> None:
    if model.training:
        raise ValueError(f"{what} needs deterministic forward passes; call model.eval() first (dropout is active)")


def validation_gradient(
    model: nn.Module, batches: Iterable[Mapping[str, torch.Tensor]], params: Mapping[str, nn.Parameter]
) -> dict[str, torch.Tensor]:
    """Gradient of the mean validation loss w.r.t. ``params`` only (g_target, paper App. B.1).

    The validation loss is the SFT objective with unit weights: the mean over validation examples of each example's
    mean supervised-token loss (:func:`raycurate.algorithms.losses.example_losses`); examples without supervised
    positions do not count.  Per-batch gradients of the summed example losses are accumulated and divided by the
    total example count, so the result does not depend on how the validation set is batched.  During the call only
    ``params`` require grad (no graph through the other parameters); the flags are restored afterwards, and
    ``.grad`` fields are not touched.

    Args:
        model: The causal LM at the scoring checkpoint theta_bar, in eval mode.
        batches: Iterable of dicts with ``input_ids``, ``attention_mask``, ``loss_mask`` (B, T) on the model device.
        params: ``{name: parameter}`` of ``model`` (e.g. :func:`scoring_parameters`).

    Returns:
        ``{name: gradient}`` float32 tensors shaped like the parameters.
    """
    _require_eval(model, "validation_gradient")
    if not params:
        raise ValueError("params is empty; pass scoring_parameters(model, last_layers)")
    names, tensors = list(params), list(params.values())
    wanted = {id(p) for p in tensors}
    flags = [(p, p.requires_grad) for p in model.parameters()]
    total = [torch.zeros_like(p, dtype=torch.float32) for p in tensors]
    n_examples = 0
    try:
        for p, _ in flags:
            p.requires_grad_(id(p) in wanted)
        for batch in batches:
            _check_batch(batch, "validation_gradient")
            ids, loss_mask = batch["input_ids"], batch["loss_mask"]
            logits = model(input_ids=ids, attention_mask=batch["attention_mask"], use_cache=False).logits
            per_example = example_losses(logits, ids, loss_mask)  # (B,)
            n_examples += int((loss_mask[:, 1:] != 0).any(dim=1).sum())
            grads = torch.autograd.grad(per_example.sum(), tensors, allow_unused=True)
            for acc, grad in zip(total, grads):
                if grad is not None:
                    acc += grad.float()
    finally:
        for p, flag in flags:
            p.requires_grad_(flag)
    if n_examples == 0:
        raise ValueError("no validation example has a supervised position (loss_mask is 0 everywhere past t=0)")
    return {name: acc / n_examples for name, acc in zip(names, total)}


def _check_same_keys(first: Mapping[str, torch.Tensor], second: Mapping[str, torch.Tensor], what: str) -> None:
    if set(first) != set(second):
        only_a, only_b = sorted(set(first) - set(second)), sorted(set(second) - set(first))
        raise KeyError(
            f"{what}: parameter names differ; only in the first: {only_a[:5]}, only in the second: {only_b[:5]}"
        )
    bad = [name for name in first if first[name].shape != second[name].shape]
    if bad:
        raise ValueError(f"{what}: shapes differ for {bad[:5]}; both must come from the same architecture")


def anchor_direction(
    theta_bar_params: Mapping[str, torch.Tensor], theta_old_params: Mapping[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """L2 retention anchor g_anchor = theta_bar - theta_old on the restricted parameters (paper App. B.3).

    Args:
        theta_bar_params: ``{name: tensor}`` of the warmup (scoring) checkpoint.
        theta_old_params: ``{name: tensor}`` of the pretrained checkpoint, same names and shapes.

    Returns:
        ``{name: theta_bar - theta_old}`` as detached float32 tensors, in ``theta_bar_params`` order.
    """
    _check_same_keys(theta_bar_params, theta_old_params, "anchor_direction")
    return {
        name: theta_bar_params[name].detach().float() - theta_old_params[name].detach().to(
            device=theta_bar_params[name].device, dtype=torch.float32
        )
        for name in theta_bar_params
    }


def global_norm(tensors: Mapping[str, torch.Tensor]) -> float:
    """L2 norm of all tensors concatenated into one vector (accumulated in float64)."""
    if not tensors:
        raise ValueError("global_norm of an empty parameter set; pass at least one tensor")
    return math.sqrt(sum(float((t.detach().double() ** 2).sum()) for t in tensors.values()))


def scoring_direction(
    g_target: Mapping[str, torch.Tensor],
    g_anchor: Mapping[str, torch.Tensor] | None,
    lam: float = 0.2,
    eps: float = 1e-12,
) -> dict[str, torch.Tensor]:
    """The BRIDGE scoring direction v (paper §4.2; docs/bridge.md).

    ``v = (1 - lam) g_target / (||g_target|| + eps) + lam g_anchor / (||g_anchor|| + eps)``; each norm is the
    global L2 norm over the whole restricted parameter set (not per tensor).

    Args:
        g_target: ``{name: tensor}`` validation gradient (:func:`validation_gradient`).
        g_anchor: ``{name: tensor}`` anchor (:func:`anchor_direction`), same names and shapes; may be ``None`` only
            when ``lam == 0``.
        lam: Anchor weight in [0, 1] (paper default 0.2).
        eps: Stabiliser added to each norm.

    Returns:
        ``{name: v}`` float32 tensors in ``g_target`` order; ``||v|| <= 1`` (= 1 when lam is 0 or 1 and the
        gradient is non-zero, up to eps).
    """
    if not 0.0 <= lam <= 1.0:
        raise ValueError(f"lam={lam} must lie in [0, 1] (paper default 0.2)")
    if eps < 0:
        raise ValueError(f"eps={eps} must be >= 0")
    if g_anchor is None:
        if lam != 0.0:
            raise ValueError(f"g_anchor is None but lam={lam}; pass anchor_direction(...) or set lam=0")
        g_anchor = {name: torch.zeros_like(t) for name, t in g_target.items()}
    _check_same_keys(g_target, g_anchor, "scoring_direction")
    c_target = (1.0 - lam) / (global_norm(g_target) + eps)
    c_anchor = lam / (global_norm(g_anchor) + eps)
    return {
        name: c_target * g_target[name].detach().float() + c_anchor * g_anchor[name].detach().float().to(
            g_target[name].device
        )
        for name in g_target
    }


# ---------------------------------------------------------------------------------------------- utilities


def _check_direction(model: nn.Module, direction: Mapping[str, torch.Tensor]) -> dict[str, nn.Parameter]:
    if not direction:
        raise ValueError("direction is empty; build it with scoring_direction(...) on scoring_parameters(model)")
    params = dict(model.named_parameters())
    unknown = [name for name in direction if name not in params]
    if unknown:
        raise KeyError(f"direction names {unknown[:5]} are not parameters of the model; use scoring_parameters(model)")
    bad = [name for name in direction if direction[name].shape != params[name].shape]
    if bad:
        raise ValueError(f"direction shapes differ from the parameters for {bad[:5]}")
    return {name: params[name] for name in direction}


def _carries_tangent(value: object) -> bool:
    import torch.autograd.forward_ad as fwad

    return isinstance(value, torch.Tensor) and fwad.unpack_dual(value).tangent is not None


@contextmanager
def _math_sdpa_from_first_dual_layer(model: nn.Module) -> Iterator[None]:
    """Leave SDPA's fused kernels on for the decoder layers before the first one that carries a tangent.

    Only layers whose input hidden states or own (dual, swapped-in) parameters carry a tangent need the MATH
    backend; the layers before them run a plain forward, and the fused CPU kernel is faster there (L = 4 of 16
    layers: the 12 first layers run at forward speed).  Once a layer switches to MATH, every later layer's input
    carries a tangent, so the switch is made once and undone on exit.  Models without ``model.model.layers`` use
    MATH throughout.
    """
    from torch.nn.attention import SDPBackend, sdpa_kernel

    try:
        _, layers = decoder_layers(model)
    except ValueError:
        with sdpa_kernel([SDPBackend.MATH]):
            yield
        return
    with ExitStack() as math_backend:
        switched = False

        def switch_once(layer: nn.Module, args: tuple, kwargs: dict) -> None:
            nonlocal switched
            hidden = args[0] if args else kwargs.get("hidden_states")
            if not switched and (_carries_tangent(hidden) or any(map(_carries_tangent, layer.parameters()))):
                math_backend.enter_context(sdpa_kernel([SDPBackend.MATH]))
                switched = True

        handles = [layer.register_forward_pre_hook(switch_once, with_kwargs=True) for layer in layers]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()


@contextmanager
def _forward_ad_attention(model: nn.Module) -> Iterator[None]:
    """Run attention through forward-AD-capable kernels: SDPA's MATH backend, or eager as a fallback.

    With SDPA the MATH backend is switched on from the first decoder layer that carries a tangent
    (:func:`_math_sdpa_from_first_dual_layer`); eager attention is differentiable in forward mode throughout.
    """
    config = getattr(model, "config", None)
    current = getattr(config, "_attn_implementation", "eager")
    switch = current not in _MATH_SDPA_COMPATIBLE
    if switch:
        model.set_attn_implementation("eager")
    try:
        with _math_sdpa_from_first_dual_layer(model):
            yield
    finally:
        if switch:
            model.set_attn_implementation(current)


def _supervised(attention_mask: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """(B, T) bool: positions that carry a loss (position 0 never does)."""
    mask = (loss_mask != 0) & (attention_mask != 0)
    mask[:, 0] = False
    return mask


def token_utilities(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    loss_mask: torch.Tensor,
    direction: Mapping[str, torch.Tensor],
    *,
    hand_written: bool = True,
) -> torch.Tensor:
    """Token utilities a_t = v . grad l_t at every supervised position, in one forward-mode pass.

    Computed as the JVP of the per-position losses (:func:`raycurate.algorithms.losses.token_losses`) along ``v``:
    the parameters named in ``direction`` become dual tensors (primal theta_bar, tangent v) swapped into the model
    with ``torch.func.functional_call``; every other tensor has no tangent, so layers before the restricted ones
    run as a plain forward.  Logits are formed only for the window of positions that predict a supervised token
    (``logits_to_keep``), so prompt positions cost no vocabulary projection.  Sign: large positive = useful (see the
    module docstring).

    Args:
        model: Causal LM at theta_bar, in eval mode (Llama/Qwen2/Mistral/Gemma-style ``XxxForCausalLM``).
        input_ids: (B, T) token ids, right-padded.
        attention_mask: (B, T) 1 on real tokens, 0 on padding.
        loss_mask: (B, T) 1 where ``input_ids[:, t]`` is a supervised target (the response side).
        direction: ``{parameter name: v}`` (:func:`scoring_direction`); missing parameters get a zero tangent.
        hand_written: Use the hand-written layer rules where the model fits them (the default); False forces
            torch's generic forward-mode AD (the reference the rules are tested against).

    Returns:
        (B, T) float32 utilities; exactly 0 at unsupervised, padded and t = 0 positions.
    """
    _require_eval(model, "token_utilities")
    for name, tensor in (("attention_mask", attention_mask), ("loss_mask", loss_mask)):
        if tensor.shape != input_ids.shape:
            raise ValueError(f"{name} has shape {tuple(tensor.shape)} but input_ids has {tuple(input_ids.shape)}")
    params = _check_direction(model, direction)
    supervised = _supervised(attention_mask, loss_mask)  # (B, T)
    utilities = torch.zeros(input_ids.shape, dtype=torch.float32, device=input_ids.device)
    window = logit_window(supervised)  # logits at [start, stop) predict [start + 1, stop]
    if window is None:
        return utilities
    start, stop = window
    keep = torch.arange(start, stop, device=input_ids.device)  # (W,)
    window_ids, window_mask = input_ids[:, start:stop], supervised[:, start:stop]  # (B, W)
    kwargs = {"input_ids": input_ids, "attention_mask": attention_mask, "use_cache": False, "logits_to_keep": keep}
    head = plain_lm_head(model, params)
    plan = None
    if hand_written and head is not None and _eager_or_sdpa(model):
        plan = plan_dual_layers(model, direction)
    if plan is not None and head is not None:  # hand-written layer rules: no forward-mode AD at all
        window_tangent = _hand_written_window_tangent(model, plan, head, input_ids, attention_mask, window_ids,
                                                      window_mask, slice(start, stop - 1))
    else:
        window_tangent = _forward_ad_window_tangent(model, params, direction, head, kwargs, window_ids, window_mask)
    if window_tangent is None:  # the losses do not depend on the direction's parameters
        return utilities
    utilities[:, start:stop] = torch.where(window_mask, window_tangent.float(), 0.0)
    return utilities


def _hand_written_window_tangent(model: nn.Module, plan: DualPlan, head: nn.Linear, input_ids: torch.Tensor,
                                 attention_mask: torch.Tensor, window_ids: torch.Tensor, window_mask: torch.Tensor,
                                 rows: slice) -> torch.Tensor | None:
    """(B, W) loss tangents of the window through :mod:`raycurate.algorithms.bridge.dual_layers` (None: no tangent).

    ``rows`` are the positions that predict ``window_ids[:, 1:]``; the last layer computes only those.
    """
    with torch.no_grad():
        with patched_dual_layers(model, plan, rows) as carry:
            hidden = model.model(input_ids=input_ids, attention_mask=attention_mask,
                                 use_cache=False).last_hidden_state  # (B, T, H), final norm applied
        if carry.output is None or carry.tangent is None:
            return None
        tangent = rms_norm_jvp(model.model.norm, carry.output, carry.tangent, None)[input_ids.shape[0]:]  # (B, R, H)
        return window_loss_tangents(hidden[:, rows], tangent, window_ids, window_mask, head.weight)


def _forward_ad_window_tangent(model: nn.Module, params: Mapping[str, nn.Parameter],
                               direction: Mapping[str, torch.Tensor], head: nn.Linear | None, kwargs: dict,
                               window_ids: torch.Tensor, window_mask: torch.Tensor) -> torch.Tensor | None:
    """(B, W) loss tangents of the window by torch's generic forward-mode AD (None: the losses carry none)."""
    import torch.autograd.forward_ad as fwad
    from torch.func import functional_call

    start = int(kwargs["logits_to_keep"][0])
    stop = start + window_ids.shape[1]
    with torch.no_grad(), _forward_ad_attention(model), warnings.catch_warnings(), fwad.dual_level():
        # torch loads its forward-AD decompositions through the deprecated torch.jit.script on first use.
        warnings.filterwarnings("ignore", message=".*torch.jit.script.*is deprecated", category=DeprecationWarning)
        duals = {
            name: fwad.make_dual(param.detach(), direction[name].detach().to(param.device, param.dtype))
            for name, param in params.items()
        }
        if head is not None:  # the decoder is model.model: its parameters' names lose the "model." prefix
            decoder_duals = {name.removeprefix("model."): dual for name, dual in duals.items()}
            hidden = functional_call(model.model, decoder_duals, args=(), kwargs={
                "input_ids": kwargs["input_ids"], "attention_mask": kwargs["attention_mask"],
                "use_cache": False}).last_hidden_state
            primal, tangent = fwad.unpack_dual(hidden[:, start:stop - 1])
            window_tangent = None if tangent is None else window_loss_tangents(
                primal, tangent, window_ids, window_mask, head.weight)
        else:
            logits = functional_call(model, duals, args=(), kwargs=kwargs).logits  # (B, W, V)
            losses = token_losses(logits, window_ids, window_mask)  # (B, W); entry w: the loss of window_ids[:, w]
            window_tangent = fwad.unpack_dual(losses).tangent  # (B, W) = d losses / d e along v
    return window_tangent


def _eager_or_sdpa(model: nn.Module) -> bool:
    """True when the model's attention masks are tensors the hand-written rules read (not e.g. flex BlockMasks)."""
    return getattr(getattr(model, "config", None), "_attn_implementation", None) in ("sdpa", "eager")


def reference_token_utilities(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    loss_mask: torch.Tensor,
    direction: Mapping[str, torch.Tensor],
) -> torch.Tensor:
    """Per-token backward reference for :func:`token_utilities` (tests and benchmarks only; O(#tokens) passes).

    For each example: one forward of that example, then one ``autograd.grad`` of each supervised token's loss
    w.r.t. the direction's parameters, dotted with ``v``.

    Args:
        model: Causal LM in eval mode.
        input_ids: (B, T) token ids, right-padded.
        attention_mask: (B, T) 1 on real tokens.
        loss_mask: (B, T) supervised-target mask.
        direction: ``{parameter name: v}``.

    Returns:
        (B, T) float32 utilities, 0 at unsupervised positions.
    """
    _require_eval(model, "reference_token_utilities")
    params = _check_direction(model, direction)
    names = list(params)
    tensors = [params[name] for name in names]
    vectors = [direction[name].detach().to(params[name].device, torch.float32) for name in names]
    supervised = _supervised(attention_mask, loss_mask)  # (B, T)
    utilities = torch.zeros(input_ids.shape, dtype=torch.float32, device=input_ids.device)
    for b in range(input_ids.shape[0]):
        positions = supervised[b].nonzero().squeeze(1).tolist()
        if not positions:
            continue
        row = slice(b, b + 1)
        logits = model(input_ids=input_ids[row], attention_mask=attention_mask[row], use_cache=False).logits
        losses = token_losses(logits, input_ids[row], supervised[row])[0]  # (T,)
        for t in positions:
            grads = torch.autograd.grad(losses[t], tensors, retain_graph=True, allow_unused=True)
            utilities[b, t] = sum(
                (g.float() * vec).sum() for g, vec in zip(grads, vectors) if g is not None
            )
    return utilities


# ------------------------------------------------------------------------- prompt knock-out derivative


def _window_losses(logits: torch.Tensor, window_ids: torch.Tensor, window_mask: torch.Tensor) -> torch.Tensor:
    """:func:`token_losses` computed in the logits' precision when that is float32 or wider (float64 tests)."""
    dtype = torch.promote_types(logits.dtype, torch.float32)
    batch, width, _ = logits.shape
    losses = logits.new_zeros((batch, width), dtype=dtype)
    if width < 2:
        return losses
    pred = logits[:, :-1].to(dtype).reshape(-1, logits.shape[-1])  # (B*(W-1), V)
    shifted = nn.functional.cross_entropy(pred, window_ids[:, 1:].reshape(-1), reduction="none")
    return torch.cat([losses[:, :1], shifted.view(batch, width - 1)], dim=1) * window_mask.to(dtype)


def knockout_prompt_scores(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    prompt_mask: torch.Tensor,
    response_weights: torch.Tensor,
    direction: Mapping[str, torch.Tensor],
) -> torch.Tensor:
    """First-order prompt knock-out proxy: ``d/ds_i sum_t w_t a_t(s)`` at ``s = 1`` for every prompt position ``i``.

    ``s`` (B, T) are per-token attention key scales applied in EVERY layer (additive ``log s_i`` on the attention
    scores of key ``i``, :class:`raycurate.models.loading.key_log_scales`); ``s_i = 0`` knocks token ``i`` out of
    attention, so ``-score_i`` is the first-order change of the weighted utility sum when token ``i`` is knocked
    out, the derivative counterpart of the exact leave-one-out ``Delta_p^exact(i | S_r) = sum_{j in S_r}
    [a_j(P) - a_j(T_i(P))]`` (:mod:`raycurate.algorithms.bridge.fidelity`).  Large positive = the prompt token supports
    useful response tokens.  ``sum_t w_t a_t = v . grad (sum_t w_t l_t)`` is formed by one backward pass with
    ``create_graph`` (gradients w.r.t. the direction's parameters only), and its derivative w.r.t. ``log s`` by ONE
    more reverse pass (a Hessian-vector-product pattern), so every prompt token of every example is scored at once
    (no per-token loop).  Reverse-over-forward through :func:`token_utilities`' JVP is not used: torch 2.13 has no
    forward-AD rule for ``silu_backward`` and log-softmax's forward-AD formula writes in place.  Examples do not
    interact, so one batch gives each example's own scores.

    Args:
        model: Causal LM at theta_bar, in eval mode (Llama/Qwen2-style, attention through ``AttentionInterface``).
        input_ids: (B, T) token ids, right-padded.
        attention_mask: (B, T) 1 on real tokens, 0 on padding.
        prompt_mask: (B, T) bool, True at the prompt positions to score (e.g. the eligible ones; BOS excluded).
        response_weights: (B, T) weights ``w_t`` of the response tokens' utilities (e.g. 1 on the conditioning
            subset S_r); 0 elsewhere.  Padded positions and t = 0 are ignored.
        direction: ``{parameter name: v}`` (:func:`scoring_direction`).

    Returns:
        (B, T) float32 scores, 0 outside ``prompt_mask`` (and on padding).
    """
    from raycurate.models.loading import key_log_scales

    _require_eval(model, "knockout_prompt_scores")
    for name, tensor in (("attention_mask", attention_mask), ("prompt_mask", prompt_mask),
                         ("response_weights", response_weights)):
        if tensor.shape != input_ids.shape:
            raise ValueError(f"{name} has shape {tuple(tensor.shape)} but input_ids has {tuple(input_ids.shape)}")
    params = _check_direction(model, direction)
    weights = torch.where(_supervised(attention_mask, response_weights), response_weights, 0).float()  # (B, T)
    prompt = (prompt_mask != 0) & (attention_mask != 0)
    scores = torch.zeros(input_ids.shape, dtype=torch.float32, device=input_ids.device)
    if not weights.any() or not prompt.any():
        return scores
    window = logit_window(weights)  # logits at [start, stop) predict [start + 1, stop]
    if window is None:  # only column 0 is supervised: no logit predicts it
        return scores
    start, stop = window
    names = list(params)
    tensors = [params[name] for name in names]
    vectors = [direction[name].detach().to(params[name].device, params[name].dtype) for name in names]
    log_s = torch.zeros(input_ids.shape, dtype=tensors[0].dtype, device=input_ids.device, requires_grad=True)
    wanted = {id(t) for t in tensors}
    flags = [(q, q.requires_grad) for q in model.parameters()]
    try:
        for q, _ in flags:
            q.requires_grad_(id(q) in wanted)
        with torch.enable_grad(), key_log_scales(model, log_s):
            logits = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False,
                           logits_to_keep=torch.arange(start, stop, device=input_ids.device)).logits  # (B, W, V)
            window = weights[:, start:stop]  # (B, W)
            losses = _window_losses(logits, input_ids[:, start:stop], window != 0)  # (B, W)
            objective = (losses * window.to(losses.dtype)).sum()  # sum_t w_t l_t
            grads = torch.autograd.grad(objective, tensors, create_graph=True, allow_unused=True)
            utility = sum((g * vec).sum() for g, vec in zip(grads, vectors) if g is not None)  # sum_t w_t a_t
            if not torch.is_tensor(utility) or not utility.requires_grad:
                return scores
            (grad,) = torch.autograd.grad(utility, log_s, allow_unused=True)  # (B, T) d/dlog s = d/ds at s = 1
    finally:
        for q, flag in flags:
            q.requires_grad_(flag)
    if grad is not None:
        scores = torch.where(prompt, grad.detach().float(), 0.0)
    return scores
