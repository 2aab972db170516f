"""First-order prompt knock-out proxy (token_utility.knockout_prompt_scores, loading.key_log_scales)."""

from __future__ import annotations

import random

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from raycurate.algorithms.bridge import token_utility as tu  # noqa: E402
from raycurate.models.loading import key_log_scales  # noqa: E402
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
def models64(tokenizer):
    return {preset: build_tiny_model(preset, tokenizer, seed=3).double().eval() for preset in PRESETS}


def batch_and_direction(model, seed: int = 1):
    """Two rows (length 14 and 11, right-padded), prompt side 6 with BOS at 0, response side supervised."""
    gen = torch.Generator().manual_seed(seed)
    params = tu.scoring_parameters(model, last_layers=2)
    direction = {name: torch.randn(p.shape, generator=gen, dtype=torch.float64) for name, p in params.items()}
    ids = torch.randint(7, 320, (2, 14), generator=gen)
    attention_mask = torch.ones_like(ids)
    attention_mask[1, 11:] = 0
    prompt_mask = torch.zeros(ids.shape, dtype=torch.bool)
    prompt_mask[:, 1:6] = True  # eligible prompt tokens; BOS (0) excluded
    weights = torch.zeros(ids.shape, dtype=torch.float64)
    weights[0, 6:14] = 1.0
    weights[1, [6, 8, 9, 10]] = 1.0  # a response subset S_r
    return ids, attention_mask, prompt_mask, weights, direction


def weighted_utility(model, ids, attention_mask, weights, direction, log_s, create_graph=False):
    """sum_t w_t a_t(s) for one row by plain autograd: v . grad (sum_t w_t l_t) under key scales exp(log_s)."""
    params = tu.scoring_parameters(model, last_layers=2)
    with key_log_scales(model, log_s):
        logits = model(input_ids=ids, attention_mask=attention_mask, use_cache=False).logits
    losses = torch.nn.functional.cross_entropy(logits[0, :-1], ids[0, 1:], reduction="none")  # (T-1,)
    grads = torch.autograd.grad((losses * weights[0, 1:]).sum(), list(params.values()), create_graph=create_graph)
    return sum((g * direction[name]).sum() for g, name in zip(grads, params))


@pytest.mark.parametrize("preset", PRESETS)
def test_batched_proxy_equals_the_per_token_autograd_and_finite_difference_references(models64, preset):
    model = models64[preset]
    ids, attention_mask, prompt_mask, weights, direction = batch_and_direction(model)
    scores = tu.knockout_prompt_scores(model, ids, attention_mask, prompt_mask, weights, direction)  # (2, 14)
    assert scores.shape == ids.shape and scores.dtype == torch.float32
    for b in range(2):
        row = (ids[b:b + 1], attention_mask[b:b + 1], weights[b:b + 1], direction)
        for i in range(14):
            if not prompt_mask[b, i]:
                assert scores[b, i] == 0.0  # BOS, response side, padding
                continue
            # per-token autograd reference: d/d eps of the utility with log s = eps e_i (one token at a time)
            eps = torch.zeros((), dtype=torch.float64, requires_grad=True)
            log_s = torch.zeros((1, 14), dtype=torch.float64)
            log_s = log_s.index_put((torch.tensor([0]), torch.tensor([i])), eps.reshape(1))
            (exact,) = torch.autograd.grad(weighted_utility(model, *row, log_s, create_graph=True), eps)
            assert float(scores[b, i]) == pytest.approx(float(exact), rel=1e-5, abs=1e-5)
            # central finite difference in s_i (h = 1e-2: the RMSNorm/rotary float32 casts limit smaller steps)
            h = 1e-2
            plus, minus = torch.zeros((1, 14), dtype=torch.float64), torch.zeros((1, 14), dtype=torch.float64)
            plus[0, i], minus[0, i] = np.log1p(h), np.log1p(-h)
            fd = (weighted_utility(model, *row, plus) - weighted_utility(model, *row, minus)) / (2 * h)
            assert float(scores[b, i]) == pytest.approx(float(fd), abs=2e-3 * float(scores.abs().max()))


def test_proxy_is_linear_in_the_response_weights_and_examples_do_not_interact(models64):
    model = models64["tiny-llama"]
    ids, attention_mask, prompt_mask, weights, direction = batch_and_direction(model, seed=2)
    both = tu.knockout_prompt_scores(model, ids, attention_mask, prompt_mask, weights, direction)
    alone = tu.knockout_prompt_scores(model, ids[1:], attention_mask[1:], prompt_mask[1:], weights[1:], direction)
    torch.testing.assert_close(both[1:], alone, rtol=1e-4, atol=1e-4)  # batching (and padding) changes nothing
    first, second = weights.clone(), weights.clone()
    first[:, 8:] = 0
    second[:, :8] = 0
    split = sum(tu.knockout_prompt_scores(model, ids, attention_mask, prompt_mask, w, direction)
                for w in (first, second))
    torch.testing.assert_close(split, both, rtol=1e-4, atol=1e-4)
    zero = tu.knockout_prompt_scores(model, ids, attention_mask, prompt_mask, torch.zeros_like(weights), direction)
    assert not zero.any()


def test_proxy_rejects_misuse(models64):
    model = models64["tiny-llama"]
    ids, attention_mask, prompt_mask, weights, direction = batch_and_direction(model)
    with pytest.raises(ValueError, match="prompt_mask"):
        tu.knockout_prompt_scores(model, ids, attention_mask, prompt_mask[:, :5], weights, direction)
    model.train()
    try:
        with pytest.raises(ValueError, match="eval"):
            tu.knockout_prompt_scores(model, ids, attention_mask, prompt_mask, weights, direction)
    finally:
        model.eval()


def test_key_scales_of_one_are_the_unmodified_model_and_restore_the_implementation(models64):
    model = models64["tiny-qwen2"]
    ids, attention_mask, *_ = batch_and_direction(model)
    before = model.config._attn_implementation
    plain = model(input_ids=ids, attention_mask=attention_mask).logits
    with key_log_scales(model, torch.zeros(ids.shape, dtype=torch.float64)):
        scaled = model(input_ids=ids, attention_mask=attention_mask).logits
    assert model.config._attn_implementation == before
    real = attention_mask.bool()
    torch.testing.assert_close(scaled[real], plain[real], rtol=1e-5, atol=1e-5)


def copy_model_and_rows(tokenizer):
    """A tiny Llama trained to copy the token at position 3 after a separator: [1, x1..x6, SEP, x3]."""
    torch.manual_seed(0)
    model = build_tiny_model("tiny-llama", tokenizer, seed=0)
    gen = torch.Generator().manual_seed(0)
    optim = torch.optim.Adam(model.parameters(), lr=3e-3)

    def rows(n: int) -> torch.Tensor:
        body = torch.randint(20, 60, (n, 6), generator=gen)
        return torch.cat([torch.ones((n, 1), dtype=torch.long), body, torch.full((n, 1), 5), body[:, 2:3]], dim=1)

    model.train()
    for _ in range(150):
        batch = rows(64)
        logits = model(input_ids=batch).logits
        loss = torch.nn.functional.cross_entropy(logits[:, -2], batch[:, -1])
        optim.zero_grad()
        loss.backward()
        optim.step()
    return model.eval(), rows(32)


def test_knocking_out_the_copied_token_raises_the_response_loss(tokenizer):
    model, batch = copy_model_and_rows(tokenizer)

    def response_loss(knocked: int | None) -> float:
        log_s = torch.zeros(batch.shape)
        if knocked is not None:
            log_s[:, knocked] = float("-inf")  # s_i = 0: token i leaves every layer's attention
        with torch.no_grad(), key_log_scales(model, log_s):
            logits = model(input_ids=batch).logits
        return float(torch.nn.functional.cross_entropy(logits[:, -2], batch[:, -1]))

    base, copied = response_loss(None), response_loss(3)
    others = [response_loss(i) for i in (1, 2, 4, 5, 6)]
    assert base < 0.5  # the model learnt to copy
    assert copied > base + 2.0 and copied > max(others) + 1.0
