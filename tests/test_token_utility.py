"""BRIDGE scoring parameters, validation gradient, direction and JVP token utilities (bridge.token_utility)."""

from __future__ import annotations

import math
import random

import pytest

torch = pytest.importorskip("torch")

from raycurate.algorithms.bridge import token_utility as tu  # noqa: E402
from raycurate.algorithms.losses import example_losses  # noqa: E402
from raycurate.models.tiny import build_tiny_model  # noqa: E402
from raycurate.models.tokenizer import train_tokenizer  # noqa: E402

WORDS = "the a cat dog sat ran on to mat park with ball add two three numbers sum is then multiply".split()
PRESETS = ("tiny-llama", "tiny-qwen2")


@pytest.fixture(scope="module")
def tokenizer():
    rng = random.Random(0)
    texts = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 12))) for _ in range(200)]
    return train_tokenizer(texts, vocab_size=320)


@pytest.fixture(scope="module")
def models(tokenizer):
    return {preset: build_tiny_model(preset, tokenizer, seed=3) for preset in PRESETS}


def padded_batch(vocab: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """Three right-padded rows: lengths 24, 18, 11; prompt sides 9, 12, 5 tokens; response side supervised."""
    gen = torch.Generator().manual_seed(seed)
    lengths, prompts = (24, 18, 11), (9, 12, 5)
    input_ids = torch.full((3, 24), 2, dtype=torch.long)  # pad id 2
    attention_mask = torch.zeros((3, 24), dtype=torch.long)
    loss_mask = torch.zeros((3, 24), dtype=torch.long)
    for b, (n, p) in enumerate(zip(lengths, prompts)):
        input_ids[b, :n] = torch.randint(7, vocab, (n,), generator=gen)
        attention_mask[b, :n] = 1
        loss_mask[b, p:n] = 1
    return {"input_ids": input_ids, "attention_mask": attention_mask, "loss_mask": loss_mask}


def random_direction(params: dict[str, torch.nn.Parameter], seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {name: torch.randn(p.shape, generator=gen) for name, p in params.items()}


def inputs(batch):
    return batch["input_ids"], batch["attention_mask"], batch["loss_mask"]


# --- scoring parameters -----------------------------------------------------------------------------------------


def test_scoring_parameters_are_exactly_the_last_layers(models):
    model = models["tiny-llama"]
    params = tu.scoring_parameters(model, last_layers=2)
    expected = {
        f"model.layers.{i}.{name}": p for i in (2, 3) for name, p in model.model.layers[i].named_parameters()
    }
    assert list(params) == list(expected)
    assert all(params[name] is expected[name] for name in expected)
    all_layers = tu.scoring_parameters(model, last_layers=4)
    assert len(all_layers) == 2 * len(params)
    assert not any("embed" in name or "lm_head" in name or name == "model.norm.weight" for name in all_layers)


def test_scoring_parameters_reject_bad_inputs(models):
    with pytest.raises(ValueError, match="out of range"):
        tu.scoring_parameters(models["tiny-llama"], last_layers=5)
    with pytest.raises(ValueError, match="out of range"):
        tu.scoring_parameters(models["tiny-llama"], last_layers=0)
    with pytest.raises(ValueError, match="model.model.layers"):
        tu.scoring_parameters(torch.nn.Linear(2, 2))


# --- direction --------------------------------------------------------------------------------------------------


def test_direction_norms_are_global_over_the_parameter_set():
    g_target = {"a": torch.tensor([3.0]), "b": torch.tensor([4.0])}
    g_anchor = {"a": torch.tensor([0.0]), "b": torch.tensor([2.0])}
    v0 = tu.scoring_direction(g_target, g_anchor, lam=0.0)
    assert torch.allclose(v0["a"], torch.tensor([0.6])) and torch.allclose(v0["b"], torch.tensor([0.8]))
    v1 = tu.scoring_direction(g_target, g_anchor, lam=1.0)
    assert torch.allclose(v1["a"], torch.tensor([0.0])) and torch.allclose(v1["b"], torch.tensor([1.0]))
    v = tu.scoring_direction(g_target, g_anchor, lam=0.2)
    assert torch.allclose(v["a"], torch.tensor([0.8 * 0.6])) and torch.allclose(v["b"], torch.tensor([0.8 * 0.8 + 0.2]))
    assert tu.global_norm(v0) == pytest.approx(1.0) and tu.global_norm(v1) == pytest.approx(1.0)


def test_direction_of_orthogonal_parts_has_the_pythagorean_norm():
    g_target = {"w": torch.tensor([10.0, 0.0])}
    g_anchor = {"w": torch.tensor([0.0, -0.5])}
    v = tu.scoring_direction(g_target, g_anchor, lam=0.2)
    assert torch.allclose(v["w"], torch.tensor([0.8, -0.2]))
    assert tu.global_norm(v) == pytest.approx(math.hypot(0.8, 0.2))


def test_direction_survives_a_zero_anchor_and_rejects_bad_arguments():
    g_target = {"w": torch.tensor([0.0, 2.0])}
    v = tu.scoring_direction(g_target, {"w": torch.zeros(2)}, lam=0.2)  # theta_bar == theta_old
    assert torch.allclose(v["w"], torch.tensor([0.0, 0.8]))
    assert torch.allclose(tu.scoring_direction(g_target, None, lam=0.0)["w"], torch.tensor([0.0, 1.0]))
    with pytest.raises(ValueError, match="lam"):
        tu.scoring_direction(g_target, None, lam=0.2)
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        tu.scoring_direction(g_target, g_target, lam=1.5)
    with pytest.raises(KeyError, match="names differ"):
        tu.scoring_direction(g_target, {"u": torch.zeros(2)})


def test_anchor_direction_is_theta_bar_minus_theta_old():
    bar = {"w": torch.tensor([1.0, 2.0]), "b": torch.tensor([0.5])}
    old = {"w": torch.tensor([0.5, 2.5]), "b": torch.tensor([0.5])}
    anchor = tu.anchor_direction(bar, old)
    assert list(anchor) == ["w", "b"]
    assert torch.equal(anchor["w"], torch.tensor([0.5, -0.5])) and torch.equal(anchor["b"], torch.tensor([0.0]))
    with pytest.raises(ValueError, match="shapes differ"):
        tu.anchor_direction(bar, {"w": torch.zeros(3), "b": torch.zeros(1)})


# --- validation gradient ----------------------------------------------------------------------------------------


def test_validation_gradient_is_the_mean_example_loss_gradient_and_batch_invariant(models, tokenizer):
    model = models["tiny-qwen2"]
    params = tu.scoring_parameters(model, last_layers=1)
    batch = padded_batch(len(tokenizer), seed=1)
    whole = tu.validation_gradient(model, [batch], params)
    split = [{key: value[rows] for key, value in batch.items()} for rows in (slice(0, 1), slice(1, 3))]
    pieces = tu.validation_gradient(model, split, params)

    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    loss = example_losses(logits, batch["input_ids"], batch["loss_mask"]).mean()
    expected = torch.autograd.grad(loss, list(params.values()))
    for (name, grad), ref in zip(whole.items(), expected):
        assert torch.allclose(grad, ref, atol=1e-6, rtol=1e-4), name
        assert torch.allclose(pieces[name], grad, atol=1e-6, rtol=1e-4), name
    assert all(p.grad is None for p in model.parameters())


def test_validation_gradient_freezes_other_parameters_and_restores_flags(models, tokenizer):
    model = models["tiny-llama"]
    params = tu.scoring_parameters(model, last_layers=1)
    embed = model.model.embed_tokens.weight
    frozen = model.model.layers[0].mlp.up_proj.weight
    frozen.requires_grad_(False)
    seen = []
    handle = model.model.embed_tokens.register_forward_pre_hook(lambda *_: seen.append(embed.requires_grad))
    try:
        tu.validation_gradient(model, [padded_batch(len(tokenizer))], params)
    finally:
        handle.remove()
        restored = (embed.requires_grad, frozen.requires_grad)
        frozen.requires_grad_(True)
    assert seen == [False]
    assert restored == (True, False)
    assert all(p.requires_grad for p in params.values())


def test_validation_gradient_needs_supervised_positions(models, tokenizer):
    batch = padded_batch(len(tokenizer))
    batch["loss_mask"] = torch.zeros_like(batch["loss_mask"])
    model = models["tiny-llama"]
    with pytest.raises(ValueError, match="no validation example"):
        tu.validation_gradient(model, [batch], tu.scoring_parameters(model, 1))
    with pytest.raises(KeyError, match="loss_mask"):
        tu.validation_gradient(model, [{"input_ids": batch["input_ids"]}], tu.scoring_parameters(model, 1))


# --- token utilities --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("last_layers", [2, 4])
def test_jvp_utilities_equal_the_per_token_backward_reference(models, tokenizer, preset, last_layers):
    model = models[preset]
    batch = padded_batch(len(tokenizer), seed=2)
    direction = random_direction(tu.scoring_parameters(model, last_layers), seed=last_layers)
    fast = tu.token_utilities(model, *inputs(batch), direction)
    reference = tu.reference_token_utilities(model, *inputs(batch), direction)
    supervised = batch["loss_mask"].bool()
    assert fast.shape == (3, 24) and fast.dtype == torch.float32
    assert reference[supervised].abs().min() > 0  # the reference is not trivially zero
    assert (fast - reference).abs().max() <= 1e-4 * reference.abs().max()
    assert torch.equal(fast[~supervised], torch.zeros_like(fast[~supervised]))
    assert model.config._attn_implementation == "sdpa"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_hand_written_loss_tangent_equals_generic_forward_mode(models, tokenizer, monkeypatch, dtype):
    """The closed-form tangent of the log-softmax loss (one matmul from the hidden tangent) gives the numbers of the
    generic forward-mode pass through the LM head and log-softmax; a head with a tangent of its own (a tied
    embedding inside the direction) takes the generic path."""
    import copy

    model = copy.deepcopy(models["tiny-llama"]).to(dtype)
    batch = padded_batch(len(tokenizer), seed=6)
    direction = random_direction(tu.scoring_parameters(model, 2), seed=13)
    assert tu.plain_lm_head(model, tu.scoring_parameters(model, 2)) is not None
    fast = tu.token_utilities(model, *inputs(batch), direction, hand_written=False)  # generic layers, closed-form loss
    monkeypatch.setattr(tu, "plain_lm_head", lambda model, params: None)
    generic = tu.token_utilities(model, *inputs(batch), direction, hand_written=False)
    tolerance = 1e-5 if dtype == torch.float32 else 3e-2  # bf16: both round the logits' tangent differently
    assert (fast - generic).abs().max() <= tolerance * generic.abs().max()
    assert torch.equal(fast == 0, generic == 0)

    monkeypatch.undo()
    head = model.get_output_embeddings().weight
    name = next(n for n, p in model.named_parameters() if p is head)
    assert tu.plain_lm_head(model, {name: head}) is None


def _hand_written_vs_generic(model, batch, direction) -> tuple[torch.Tensor, torch.Tensor]:
    return (tu.token_utilities(model, *inputs(batch), direction),
            tu.token_utilities(model, *inputs(batch), direction, hand_written=False))


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("last_layers", [1, 3])
def test_hand_written_layer_rules_equal_generic_forward_mode(models, tokenizer, monkeypatch, preset, dtype,
                                                            last_layers):
    """RMSNorm, rotary GQA attention (Qwen2: with q/k/v biases) and SwiGLU carry the tangent by hand: the same
    utilities as torch's forward-mode AD through the model (fp32 to 1e-5 relative), without entering it."""
    import copy

    model = copy.deepcopy(models[preset]).to(dtype)
    batch = padded_batch(len(tokenizer), seed=6)
    direction = random_direction(tu.scoring_parameters(model, last_layers), seed=13)
    plan = tu.plan_dual_layers(model, direction)
    assert plan is not None and plan.first == 4 - last_layers
    generic = tu.token_utilities(model, *inputs(batch), direction, hand_written=False)
    monkeypatch.setattr(tu, "_forward_ad_window_tangent", lambda *a: pytest.fail("took the forward-AD path"))
    fast = tu.token_utilities(model, *inputs(batch), direction)
    tolerance = 1e-5 if dtype == torch.float32 else 3e-2
    assert generic.abs().max() > 0
    assert (fast - generic).abs().max() <= tolerance * generic.abs().max()
    assert torch.equal(fast == 0, generic == 0)
    assert all("forward" not in layer.__dict__ for layer in model.model.layers)  # the patched forwards are gone


def test_hand_written_rules_cover_partial_directions_masks_and_eager(models, tokenizer):
    """Direction on a few tensors of one layer (the layers after it still carry the tangent), a bias, a norm
    weight; an unpadded batch (no mask tensor); eager attention (an additive float mask)."""
    model = models["tiny-qwen2"]
    batch = padded_batch(len(tokenizer), seed=7)
    params = dict(model.named_parameters())
    for names in (["model.layers.1.mlp.up_proj.weight"], ["model.layers.2.self_attn.k_proj.bias"],
                  ["model.layers.2.post_attention_layernorm.weight", "model.layers.3.self_attn.v_proj.weight"],
                  ["model.layers.3.input_layernorm.weight"]):
        direction = random_direction({n: params[n] for n in names}, seed=3)
        fast, generic = _hand_written_vs_generic(model, batch, direction)
        assert generic.abs().max() > 0 and (fast - generic).abs().max() <= 1e-5 * generic.abs().max(), names
    direction = random_direction(tu.scoring_parameters(model, 2), seed=4)
    full = {key: value[:2, :18] for key, value in batch.items()}  # rows of length 24 and 18: no padding left
    fast, generic = _hand_written_vs_generic(model, full, direction)
    assert (fast - generic).abs().max() <= 1e-5 * generic.abs().max()
    eager = build_tiny_model("tiny-llama", tokenizer, seed=3, attn_implementation="eager")
    direction = random_direction(tu.scoring_parameters(eager, 2), seed=5)
    fast, generic = _hand_written_vs_generic(eager, batch, direction)
    assert (fast - generic).abs().max() <= 1e-5 * generic.abs().max()


def test_directions_outside_the_decoder_layers_take_the_generic_path(models):
    model = models["tiny-llama"]
    params = dict(model.named_parameters())
    assert tu.plan_dual_layers(model, {"model.norm.weight": params["model.norm.weight"]}) is None
    embed = "model.embed_tokens.weight"
    layer = "model.layers.3.mlp.down_proj.weight"
    assert tu.plan_dual_layers(model, {embed: params[embed], layer: params[layer]}) is None
    assert tu.plan_dual_layers(model, {layer: params[layer]}).first == 3


def test_utilities_are_the_directional_derivative_of_token_losses(tokenizer):
    """Central differences of l_t(theta + e v) in float64: an independent check of the definition and its sign.

    (Llama's RMSNorm computes in float32 even in a float64 model, so the step cannot shrink below ~1e-4 before
    rounding dominates; at 1e-4 the truncation error is ~5e-5 of the largest utility.)
    """
    import torch.nn.functional as F
    from torch.func import functional_call

    model = build_tiny_model("tiny-llama", tokenizer, seed=5).double()
    batch = padded_batch(len(tokenizer), seed=4)
    params = tu.scoring_parameters(model, 2)
    direction = {name: v.double() for name, v in random_direction(params, seed=7).items()}
    a = tu.token_utilities(model, *inputs(batch), direction)

    def losses(eps: float) -> torch.Tensor:  # (B, T-1) float64 loss of input_ids[:, 1:]
        shifted = {name: p.detach() + eps * direction[name] for name, p in params.items()}
        kwargs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
        with torch.no_grad():
            logits = functional_call(model, shifted, args=(), kwargs=kwargs).logits  # (B, T, V) float64
        return F.cross_entropy(logits[:, :-1].transpose(1, 2), batch["input_ids"][:, 1:], reduction="none")

    eps = 1e-4
    finite = (losses(eps) - losses(-eps)) / (2 * eps) * batch["loss_mask"][:, 1:]
    assert torch.allclose(a[:, 1:].double(), finite, atol=1e-4 * float(finite.abs().max()), rtol=0)


def test_utilities_are_linear_in_the_direction(models, tokenizer):
    model = models["tiny-qwen2"]
    batch = padded_batch(len(tokenizer), seed=5)
    params = tu.scoring_parameters(model, 2)
    v1, v2 = random_direction(params, 11), random_direction(params, 12)
    a1 = tu.token_utilities(model, *inputs(batch), v1)
    a2 = tu.token_utilities(model, *inputs(batch), v2)
    both = tu.token_utilities(model, *inputs(batch), {name: 2 * v1[name] - v2[name] for name in params})
    assert torch.allclose(both, 2 * a1 - a2, atol=1e-4 * float(both.abs().max()))


def test_utilities_are_zero_without_supervision_and_only_on_the_response(models, tokenizer):
    model = models["tiny-llama"]
    batch = padded_batch(len(tokenizer), seed=6)
    direction = random_direction(tu.scoring_parameters(model, 1), seed=1)
    none = dict(batch, loss_mask=torch.zeros_like(batch["loss_mask"]))
    assert torch.equal(tu.token_utilities(model, *inputs(none), direction), torch.zeros(3, 24))
    one = torch.zeros_like(batch["loss_mask"])
    one[1, 15] = 1
    one[2, 20] = 1  # a padded position: never supervised
    a = tu.token_utilities(model, batch["input_ids"], batch["attention_mask"], one, direction)
    assert a.nonzero().tolist() == [[1, 15]]


def test_token_utilities_reject_misuse(models, tokenizer):
    model = models["tiny-llama"]
    batch = padded_batch(len(tokenizer))
    with pytest.raises(KeyError, match="not parameters"):
        tu.token_utilities(model, *inputs(batch), {"nope.weight": torch.zeros(1)})
    model.train()
    try:
        with pytest.raises(ValueError, match="model.eval"):
            tu.token_utilities(model, *inputs(batch), random_direction(tu.scoring_parameters(model, 1), 0))
    finally:
        model.eval()


def test_eager_models_stay_eager(tokenizer):
    model = build_tiny_model("tiny-llama", tokenizer, seed=3, attn_implementation="eager")
    batch = padded_batch(len(tokenizer), seed=2)
    direction = random_direction(tu.scoring_parameters(model, 2), seed=2)
    fast = tu.token_utilities(model, *inputs(batch), direction)
    assert model.config._attn_implementation == "eager"
    reference = tu.reference_token_utilities(model, *inputs(batch), direction)
    assert (fast - reference).abs().max() <= 1e-4 * reference.abs().max()


def test_only_layers_with_tangents_run_sdpa_through_the_math_backend(models, tokenizer):
    # The generic forward-mode path. L = 2 of 4: layers 0-1 run a plain forward with the fused kernels allowed,
    # layers 2-3 carry tangents (MATH).
    model = models["tiny-llama"]
    batch = padded_batch(len(tokenizer), seed=2)
    direction = random_direction(tu.scoring_parameters(model, 2), seed=2)
    fused_allowed = []
    record = lambda *_: fused_allowed.append(torch.backends.cuda.flash_sdp_enabled())  # noqa: E731
    hooks = [layer.self_attn.register_forward_pre_hook(record) for layer in model.model.layers]
    try:
        tu.token_utilities(model, *inputs(batch), direction, hand_written=False)
    finally:
        for hook in hooks:
            hook.remove()
    assert fused_allowed == [True, True, False, False]
    assert torch.backends.cuda.flash_sdp_enabled()  # restored
    assert all(not layer._forward_pre_hooks for layer in model.model.layers)
