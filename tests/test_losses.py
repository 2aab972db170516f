"""Masked, weighted causal-LM losses: hand-computed values and the single-shift convention."""

from __future__ import annotations

import math

import pytest
import torch

from raycurate.algorithms.losses import (
    example_losses,
    grouped_model_token_losses,
    logit_window,
    mean_supervised_loss,
    model_token_losses,
    token_losses,
    weighted_batch_loss,
    window_token_losses,
)


def _log_softmax_at(row: list[float], index: int) -> float:
    return row[index] - math.log(sum(math.exp(v) for v in row))


def test_token_losses_hand_computed_v3():
    # One example, T=3, V=3. Position t is predicted by logits[t-1].
    logits = torch.tensor([[[0.0, 0.0, 0.0], [1.0, 2.0, 3.0], [5.0, 5.0, 5.0]]])  # (1, 3, 3)
    input_ids = torch.tensor([[2, 1, 0]])
    loss_mask = torch.tensor([[1, 1, 1]])
    got = token_losses(logits, input_ids, loss_mask)
    expected = [0.0, -_log_softmax_at([0.0, 0.0, 0.0], 1), -_log_softmax_at([1.0, 2.0, 3.0], 0)]
    assert got.shape == (1, 3)
    assert got[0].tolist() == pytest.approx(expected, abs=1e-6)
    assert expected[1] == pytest.approx(math.log(3.0))


def test_token_losses_match_independent_loop_not_double_shift():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 6, 5, generator=gen)
    input_ids = torch.randint(0, 5, (2, 6), generator=gen)
    loss_mask = torch.tensor([[0, 0, 1, 1, 1, 1], [0, 1, 1, 0, 1, 0]])
    got = token_losses(logits, input_ids, loss_mask)
    log_probs = torch.log_softmax(logits, dim=-1)
    for b in range(2):
        for t in range(6):
            expected = -log_probs[b, t - 1, input_ids[b, t]].item() if t > 0 and loss_mask[b, t] else 0.0
            assert got[b, t].item() == pytest.approx(expected, abs=1e-5), (b, t)
    # A second shift (predicting input_ids[t+1] from logits[t-1]) would give different numbers.
    double = -log_probs[0, 1, input_ids[0, 3]].item()
    assert got[0, 2].item() != pytest.approx(double, abs=1e-3)


def test_masked_positions_contribute_zero_and_do_not_change_example_loss():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(1, 5, 4, generator=gen)
    input_ids = torch.tensor([[0, 1, 2, 3, 1]])
    mask = torch.tensor([[0, 0, 1, 0, 1]])
    per_token = token_losses(logits, input_ids, mask)
    assert per_token[0, [0, 1, 3]].tolist() == [0.0, 0.0, 0.0]
    changed = logits.clone()
    changed[0, 2] += 100.0  # logits[2] predict position 3, which is masked out
    assert example_losses(changed, input_ids, mask).item() == pytest.approx(
        example_losses(logits, input_ids, mask).item(), abs=1e-6
    )
    expected = (per_token[0, 2] + per_token[0, 4]).item() / 2
    assert example_losses(logits, input_ids, mask).item() == pytest.approx(expected, abs=1e-6)


def test_example_without_supervised_positions_has_zero_loss():
    logits = torch.randn(2, 3, 4)
    input_ids = torch.tensor([[1, 2, 3], [1, 2, 3]])
    mask = torch.tensor([[1, 0, 0], [0, 0, 1]])  # row 0: only position 0, which has no prediction
    losses = example_losses(logits, input_ids, mask)
    assert losses[0].item() == 0.0
    assert losses[1].item() > 0.0


def test_weighted_batch_loss_unit_weights_is_mean_and_weights_stay_per_sample():
    per_example = torch.tensor([1.0, 2.0, 6.0])
    assert weighted_batch_loss(per_example, torch.ones(3)).item() == pytest.approx(3.0)
    assert weighted_batch_loss(per_example, None).item() == pytest.approx(3.0)
    # (0*1 + 1*2 + 0.5*6) / 3, not renormalised by the weight sum.
    assert weighted_batch_loss(per_example, torch.tensor([0.0, 1.0, 0.5])).item() == pytest.approx(5.0 / 3.0)
    with pytest.raises(ValueError, match="one weight per example"):
        weighted_batch_loss(per_example, torch.ones(2))


def test_gradient_flows_only_through_supervised_logits():
    logits = torch.randn(1, 4, 3, requires_grad=True)
    input_ids = torch.tensor([[0, 1, 2, 0]])
    mask = torch.tensor([[0, 0, 1, 0]])
    weighted_batch_loss(example_losses(logits, input_ids, mask)).backward()
    grad_norm_per_position = logits.grad[0].abs().sum(dim=-1)  # (T,)
    assert grad_norm_per_position[1].item() > 0  # logits[1] predict the supervised position 2
    assert grad_norm_per_position[[0, 2, 3]].tolist() == [0.0, 0.0, 0.0]


def test_logit_window_spans_first_to_last_supervised_column_and_ignores_column_0():
    mask = torch.tensor([[1, 0, 0, 1, 1, 0, 0], [0, 0, 1, 1, 0, 0, 0]])  # column 0 has no prediction
    assert logit_window(mask) == (1, 5)  # logits 1..4 predict targets 2..5; the window ends at the last target
    assert logit_window(torch.tensor([[1, 0, 0]])) is None
    assert logit_window(torch.zeros(2, 4)) is None


def test_window_token_losses_equal_token_losses_on_the_full_logits():
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(3, 9, 7, generator=gen)
    input_ids = torch.randint(0, 7, (3, 9), generator=gen)
    mask = torch.tensor([[0, 0, 0, 1, 1, 1, 0, 0, 0], [0, 0, 0, 0, 0, 1, 1, 1, 1], [0, 0, 0, 0, 1, 0, 1, 0, 0]])
    start, stop = logit_window(mask)
    assert (start, stop) == (2, 9)
    got = window_token_losses(logits[:, start:stop], input_ids, mask, (start, stop))
    assert torch.equal(got, token_losses(logits, input_ids, mask))


def _tiny_causal_lm(kind: str) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config_cls, model_cls = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM)}[kind]
    config = config_cls(vocab_size=40, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32)
    return model_cls(config).eval()


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_model_token_losses_equal_the_full_logits_losses_and_their_gradients(kind):
    model = _tiny_causal_lm(kind)
    gen = torch.Generator().manual_seed(4)
    input_ids = torch.randint(1, 40, (3, 12), generator=gen)
    attention_mask = torch.ones(3, 12, dtype=torch.long)
    attention_mask[1, 9:] = 0  # right padding
    input_ids[1, 9:] = 0
    loss_mask = torch.zeros(3, 12, dtype=torch.long)
    loss_mask[0, 5:] = 1
    loss_mask[1, 4:9] = 1
    loss_mask[2, 7:11] = 1
    windowed = model_token_losses(model, input_ids, attention_mask, loss_mask)
    full = token_losses(model(input_ids=input_ids, attention_mask=attention_mask).logits, input_ids, loss_mask)
    assert torch.allclose(windowed, full, atol=1e-6, rtol=0)
    assert (windowed[loss_mask == 0] == 0).all()

    grads = []
    for per_token in (windowed, full):
        model.zero_grad()
        mean_supervised_loss(per_token, loss_mask).sum().backward()
        grads.append(model.model.embed_tokens.weight.grad.clone())
    assert torch.allclose(grads[0], grads[1], atol=1e-6)
    assert mean_supervised_loss(full, loss_mask).tolist() == pytest.approx(
        example_losses(model(input_ids=input_ids, attention_mask=attention_mask).logits, input_ids,
                       loss_mask).tolist(), abs=1e-6)


def test_model_token_losses_without_supervised_positions_skip_the_model():
    def forbidden(**_):
        raise AssertionError("no forward is needed when nothing is supervised")

    got = model_token_losses(forbidden, torch.ones(2, 5, dtype=torch.long), torch.ones(2, 5), torch.zeros(2, 5))
    assert got.shape == (2, 5) and not got.any()


def test_grouped_forwards_give_the_padded_batch_losses_and_gradients_in_place():
    """Rows of lengths 12, 4, 9, 6, 11 in 2 groups (sorted: 4, 6, 9 | 11, 12): each row's losses land in its own row
    and equal one padded forward's, and so do the gradients of the summed loss."""
    model = _tiny_causal_lm("llama")
    gen = torch.Generator().manual_seed(7)
    lengths = [12, 4, 9, 6, 11]
    input_ids = torch.randint(1, 40, (5, 12), generator=gen)
    attention_mask = torch.zeros(5, 12, dtype=torch.long)
    loss_mask = torch.zeros(5, 12, dtype=torch.long)
    for row, length in enumerate(lengths):
        input_ids[row, length:] = 0
        attention_mask[row, :length] = 1
        loss_mask[row, length // 2:length] = 1
    calls = []
    model.register_forward_pre_hook(lambda _, args, kwargs: calls.append(tuple(kwargs["input_ids"].shape)),
                                    with_kwargs=True)
    padded = model_token_losses(model, input_ids, attention_mask, loss_mask)
    grouped = grouped_model_token_losses(model, input_ids, attention_mask, loss_mask, groups=2)
    assert calls == [(5, 12), (3, 9), (2, 12)]  # tensor_split puts the remainder in the first group
    assert torch.allclose(grouped, padded, atol=1e-6, rtol=0)
    assert (grouped[loss_mask == 0] == 0).all()
    grads = []
    for per_token in (padded, grouped):
        model.zero_grad()
        per_token.sum().backward(retain_graph=True)
        grads.append([p.grad.clone() for p in model.parameters()])
    for a, b in zip(*grads):
        assert torch.allclose(a, b, atol=1e-5, rtol=1e-5)


def test_more_groups_than_rows_is_one_forward_a_row_and_one_group_is_the_padded_forward():
    model = _tiny_causal_lm("llama")
    input_ids = torch.tensor([[3, 4, 5, 6], [7, 8, 0, 0]])
    attention_mask = (input_ids != 0).long()
    loss_mask = attention_mask.clone()
    padded = model_token_losses(model, input_ids, attention_mask, loss_mask)
    assert torch.equal(grouped_model_token_losses(model, input_ids, attention_mask, loss_mask, groups=1), padded)
    assert torch.allclose(grouped_model_token_losses(model, input_ids, attention_mask, loss_mask, groups=5), padded,
                          atol=1e-6, rtol=0)
