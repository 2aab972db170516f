"""BRIDGE routing weights, interaction terms and single-layer attention (algorithms.bridge.routing)."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")

from raycurate.algorithms.bridge import routing  # noqa: E402
from raycurate.models.tiny import build_tiny_model  # noqa: E402
from raycurate.models.tokenizer import train_tokenizer  # noqa: E402


def hand_attention() -> torch.Tensor:
    """(H=2, T=6) causal attention; example of n=5 real tokens, prompt side p=3 (positions 0-2), response 3-4.

    Rows 3 and 4 (the input positions of response tokens 0 and 1) are hand-set; the others are uniform causal.
    """
    attn = torch.zeros(2, 6, 6)
    for t in range(6):
        attn[:, t, : t + 1] = 1.0 / (t + 1)
    attn[0, 3, :4] = torch.tensor([0.1, 0.2, 0.3, 0.4])
    attn[1, 3, :4] = torch.tensor([0.3, 0.3, 0.2, 0.2])
    attn[0, 4, :5] = torch.tensor([0.1, 0.1, 0.2, 0.2, 0.4])
    attn[1, 4, :5] = torch.tensor([0.3, 0.1, 0.0, 0.4, 0.2])
    return attn


def test_routing_weights_on_a_hand_built_tensor():
    a_p, c = routing.routing_weights(hand_attention(), prompt_len=3, n=5)
    # query row 3 (head mean [0.2, 0.25, 0.25 | self 0.3]); query row 4 ([0.2, 0.1, 0.1 | 0.3 | self 0.3])
    assert torch.allclose(a_p, torch.tensor([[0.2, 0.25, 0.25], [0.2, 0.1, 0.1]]))
    assert torch.allclose(c, torch.tensor([0.0, 0.3]))
    # not renormalised: prompt mass + history + self weight = 1
    self_weight = torch.tensor([0.3, 0.3])
    assert torch.allclose(a_p.sum(1) + c + self_weight, torch.ones(2))


def test_interaction_terms_on_the_hand_built_example():
    a_p, c = routing.routing_weights(hand_attention(), prompt_len=3, n=5)
    beta, gamma = routing.interaction_terms(a_p, torch.tensor([2.0, -1.0]), c)
    assert beta.shape == (3, 2)
    assert torch.allclose(beta, torch.tensor([[0.4, -0.2], [0.5, -0.1], [0.5, -0.1]]))
    assert torch.allclose(gamma, torch.tensor([0.0, -0.3]))
    with pytest.raises(ValueError, match="shapes"):
        routing.interaction_terms(a_p, torch.ones(3), torch.ones(3))


def test_routing_weights_reject_bad_lengths():
    with pytest.raises(ValueError, match="prompt_len"):
        routing.routing_weights(hand_attention(), prompt_len=5, n=5)
    with pytest.raises(ValueError, match=r"\(H, T, T\)"):
        routing.routing_weights(torch.zeros(2, 6, 5), prompt_len=2, n=5)


def random_causal_attention(batch: int, heads: int, length: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    scores = torch.randn(batch, heads, length, length, generator=gen)
    causal = torch.ones(length, length, dtype=torch.bool).tril()
    return torch.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1)


def test_batched_routing_equals_the_per_example_function():
    attn = random_causal_attention(3, 4, 9, seed=0)
    attention_mask = torch.tensor([[1] * 9, [1] * 6 + [0] * 3, [1] * 4 + [0] * 5])
    prompt_lens = torch.tensor([3, 4, 1])
    out = routing.routing_weights_batch(attn, prompt_lens, attention_mask)
    assert out["A_p"].shape == (3, 6, 4) and out["c"].shape == (3, 6)
    for b, (p, n) in enumerate([(3, 9), (4, 6), (1, 4)]):
        a_p, c = routing.routing_weights(attn[b], p, n)
        r = n - p
        assert torch.allclose(out["A_p"][b, :r, :p], a_p) and torch.allclose(out["c"][b, :r], c)
        assert out["A_p"][b, r:].abs().sum() == 0 and out["A_p"][b, :, p:].abs().sum() == 0
        assert out["c"][b, r:].abs().sum() == 0
        assert out["response_mask"][b].tolist() == [j < r for j in range(6)]
        assert out["prompt_mask"][b].tolist() == [i < p for i in range(4)]


def test_batched_routing_requires_right_padding():
    attn = random_causal_attention(1, 2, 5, seed=1)
    with pytest.raises(ValueError, match="right-padded"):
        routing.routing_weights_batch(attn, torch.tensor([2]), torch.tensor([[0, 1, 1, 1, 1]]))
    with pytest.raises(ValueError, match="non-empty response"):
        routing.routing_weights_batch(attn, torch.tensor([5]), torch.ones(1, 5, dtype=torch.long))


# --- attention from the model -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny():
    """(tiny-qwen2 model, vocabulary size)."""
    rng = random.Random(0)
    words = "the a cat dog sat ran on to mat park".split()
    tokenizer = train_tokenizer([" ".join(rng.choice(words) for _ in range(8)) for _ in range(100)], vocab_size=300)
    return build_tiny_model("tiny-qwen2", tokenizer, seed=0), len(tokenizer)


def test_attention_is_materialised_for_the_requested_layer_only(tiny):
    model, vocab = tiny
    shapes = {}
    hooks = [
        layer.self_attn.register_forward_hook(
            lambda module, args, output, i=i: shapes.__setitem__(i, tuple(output[1].shape))
        )
        for i, layer in enumerate(model.model.layers)
    ]
    gen = torch.Generator().manual_seed(0)
    input_ids = torch.randint(7, vocab, (2, 10), generator=gen)
    attention_mask = torch.ones(2, 10, dtype=torch.long)
    attention_mask[1, 7:] = 0
    try:
        attn = routing.attention_for_layer(model, input_ids, attention_mask, layer=2)
    finally:
        for hook in hooks:
            hook.remove()
    assert attn.shape == (2, 4, 10, 10)
    assert shapes == {0: (2, 4, 0, 0), 1: (2, 4, 0, 0), 2: (2, 4, 10, 10), 3: (2, 4, 0, 0)}
    assert model.config._attn_implementation == "sdpa"
    assert torch.allclose(attn.sum(-1), torch.ones(2, 4, 10), atol=1e-5)
    assert attn.triu(diagonal=1).abs().max() == 0  # causal
    assert attn[1, :, :7, 7:].abs().max() == 0  # padding keys masked for real queries

    model.set_attn_implementation("eager")  # the same probabilities as full eager attention
    try:
        with torch.no_grad():
            full = model(input_ids=input_ids, attention_mask=attention_mask, output_attentions=True).attentions[2]
    finally:
        model.set_attn_implementation("sdpa")
    assert torch.allclose(attn[:, :, :7], full[:, :, :7], atol=1e-6)
    assert torch.allclose(routing.attention_for_layer(model, input_ids, attention_mask, layer=-2), attn)


def test_attention_for_layer_rejects_bad_layers(tiny):
    model, _ = tiny
    with pytest.raises(ValueError, match="out of range"):
        routing.attention_for_layer(model, torch.ones(1, 3, dtype=torch.long), torch.ones(1, 3), layer=4)


def test_default_routing_layer_is_the_last_full_attention_layer(tiny):
    model, _ = tiny
    assert routing.default_routing_layer(model) == 3
    gemma_like = SimpleNamespace(
        config=SimpleNamespace(num_hidden_layers=4, layer_types=["sliding_attention", "full_attention",
                                                                 "sliding_attention", "sliding_attention"])
    )
    assert routing.default_routing_layer(gemma_like) == 1
    none = SimpleNamespace(config=SimpleNamespace(num_hidden_layers=2, layer_types=["sliding_attention"] * 2))
    with pytest.raises(ValueError, match="no full-attention layer"):
        routing.default_routing_layer(none)
