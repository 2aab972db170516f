"""Head-delta adapter: same update as masked full training, frozen elsewhere, optimizer state on the slices only."""

from __future__ import annotations

import copy
import functools

import pytest
import torch
import transformers
from transformers import AutoModelForCausalLM

from raycurate.models.head_adapter import (
    attach_head_delta,
    head_delta_state_dict,
    merge_head_delta,
    merge_head_delta_state_dict,
    trainable_parameter_count,
)
from raycurate.models.heads import head_param_slices
from raycurate.models.tiny import TINY_PRESETS

VOCAB = 61
# layer 2 holds heads 0 and 1, which share KV group 0: one k/v delta for both
HEADS = [(0, 1), (2, 0), (2, 1), (3, 3)]


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny models gain nothing from intra-op threads, and on a shared 2-core machine they lose a lot."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@functools.cache
def _built(preset: str) -> torch.nn.Module:
    class_name, overrides = TINY_PRESETS[preset]
    config = getattr(transformers, class_name)(
        vocab_size=VOCAB, bos_token_id=1, eos_token_id=2, pad_token_id=0, **overrides
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return AutoModelForCausalLM.from_config(config, dtype=torch.float64).eval()


def tiny_model(preset: str = "tiny-llama", dtype: torch.dtype = torch.float64) -> torch.nn.Module:
    """A fresh copy of the tiny preset geometry (hidden 128, 4 layers, 4 q / 2 kv heads, head_dim 32), vocab 61."""
    return copy.deepcopy(_built(preset)).to(dtype)


def batch(seed: int = 1) -> torch.Tensor:
    return torch.randint(3, VOCAB, (2, 12), generator=torch.Generator().manual_seed(seed))


def lm_loss(model, input_ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=input_ids, labels=input_ids).loss


def slice_masks(model, heads, train_o: bool) -> dict[str, torch.Tensor]:
    """Per parameter, True on the entries the selected heads own (the masked-gradient reference)."""
    masks = {name: torch.zeros_like(p, dtype=torch.bool) for name, p in model.named_parameters()}
    for layer, head in heads:
        for name, dim, index in head_param_slices(model.config, layer, head, include_o=train_o).values():
            if dim == 0:
                masks[name][index] = True
            else:
                masks[name][:, index] = True
    return masks


def train_masked_full(model, masks, steps: int, lr: float):
    for p in model.parameters():
        p.requires_grad_(True)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    named = dict(model.named_parameters())
    for step in range(steps):
        optimizer.zero_grad()
        lm_loss(model, batch(step)).backward()
        for name, p in named.items():
            p.grad.mul_(masks[name])
        optimizer.step()


def train_adapter(model, heads, train_o: bool, steps: int, lr: float):
    optimizer = torch.optim.SGD(attach_head_delta(model, heads, train_o=train_o), lr=lr)
    for step in range(steps):
        optimizer.zero_grad()
        lm_loss(model, batch(step)).backward()
        optimizer.step()


@pytest.mark.parametrize("train_o", [False, True])
@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-qwen2"])
def test_adapter_update_equals_masked_full_training_and_leaves_the_rest_bit_identical(preset, train_o):
    original = tiny_model(preset)
    full, adapted = copy.deepcopy(original), copy.deepcopy(original)
    masks = slice_masks(original, HEADS, train_o)
    train_masked_full(full, masks, steps=3, lr=0.5)
    train_adapter(adapted, HEADS, train_o, steps=3, lr=0.5)
    merge_head_delta(adapted)

    before, after_full, after_adapter = (dict(m.named_parameters()) for m in (original, full, adapted))
    assert after_adapter.keys() == before.keys()
    changed = 0
    for name, mask in masks.items():
        frozen = ~mask
        assert torch.equal(after_adapter[name].detach()[frozen], before[name].detach()[frozen]), name
        assert torch.equal(after_full[name].detach()[frozen], before[name].detach()[frozen]), name
        if mask.any():
            torch.testing.assert_close(after_adapter[name][mask], after_full[name][mask], rtol=0, atol=1e-12)
            changed += int((after_adapter[name][mask] != before[name][mask]).all())
    assert changed == 3 * (4 if train_o else 3)  # every entry of q, k, v (and o) slices of layers 0, 2, 3 moved


@pytest.mark.parametrize("train_o, expected", [(False, 40960), (True, 57344)])
def test_trainable_parameter_count_by_hand(train_o, expected):
    # head block = head_dim * hidden = 32 * 128 = 4096.  q: 4 heads; k, v: groups {0} in L0, {0} in L2, {1} in L3
    # -> (4 + 3 + 3) * 4096 = 40960; o columns add 4 * 4096.
    model = tiny_model()
    params = attach_head_delta(model, HEADS + [(0, 1)], train_o=train_o)  # duplicate pair counts once
    assert sum(p.numel() for p in params) == trainable_parameter_count(model) == expected
    assert len(params) == 3 * (4 if train_o else 3)
    assert {name.split(".head_delta")[0] for name, p in model.named_parameters() if p.requires_grad} == {
        f"model.layers.{layer}.self_attn" for layer in (0, 2, 3)
    }


def test_merged_model_reproduces_the_hooked_model_and_saves_a_plain_checkpoint(tmp_path):
    model = tiny_model()
    base_keys = set(model.state_dict())
    input_ids = batch()
    with torch.no_grad():
        base_logits = model(input_ids=input_ids).logits
        params = attach_head_delta(model, HEADS, train_o=True)
        assert torch.equal(model(input_ids=input_ids).logits, base_logits)  # zero deltas change nothing
        gen = torch.Generator().manual_seed(0)
        for p in params:
            p.copy_(0.05 * torch.randn(p.shape, generator=gen, dtype=p.dtype))
        hooked_logits = model(input_ids=input_ids).logits
    assert not torch.allclose(hooked_logits, base_logits)
    merged_state = merge_head_delta_state_dict(model.state_dict())
    merge_head_delta(model)
    assert set(model.state_dict()) == base_keys and trainable_parameter_count(model) == 0
    assert all(torch.equal(merged_state[k], v) for k, v in model.state_dict().items())
    model.save_pretrained(tmp_path)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float64, local_files_only=True)
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=input_ids).logits, hooked_logits, rtol=0, atol=1e-12)
        torch.testing.assert_close(reloaded(input_ids=input_ids).logits, hooked_logits, rtol=0, atol=1e-12)


def test_optimizer_state_covers_only_the_deltas():
    def adamw_state_bytes(model, params) -> tuple[int, torch.optim.Optimizer]:
        optimizer = torch.optim.AdamW(params, lr=1e-3)
        lm_loss(model, batch()).backward()
        optimizer.step()
        tensors = [t for state in optimizer.state.values() for t in state.values() if t.dim() > 0]
        return sum(t.numel() * t.element_size() for t in tensors), optimizer

    model = tiny_model(dtype=torch.float32)
    params = attach_head_delta(model, HEADS)
    adapter_bytes, optimizer = adamw_state_bytes(model, params)
    assert set(map(id, optimizer.state)) == set(map(id, params))
    assert adapter_bytes == 2 * 40960 * 4  # exp_avg + exp_avg_sq, float32
    full = tiny_model(dtype=torch.float32)
    full_bytes, _ = adamw_state_bytes(full, list(full.parameters()))
    assert full_bytes == 2 * sum(p.numel() for p in full.parameters()) * 4
    assert adapter_bytes / full_bytes < 0.15


@pytest.mark.parametrize("delta_dtype", [None, torch.float32])
def test_adapter_trains_on_bf16_weights(delta_dtype):
    model = tiny_model(dtype=torch.bfloat16)
    input_ids = batch()
    with torch.no_grad():
        base_logits = model(input_ids=input_ids).logits
    params = attach_head_delta(model, HEADS, train_o=True, dtype=delta_dtype)
    assert {p.dtype for p in params} == {delta_dtype or torch.bfloat16}
    logits = model(input_ids=input_ids).logits
    assert logits.dtype == torch.bfloat16 and torch.equal(logits, base_logits)
    lm_loss(model, input_ids).backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in params)
    assert all(p.grad is None for name, p in model.named_parameters() if "head_delta" not in name)


def test_state_dict_and_errors():
    model = tiny_model()
    attach_head_delta(model, [(1, 2)])
    state = head_delta_state_dict(model)
    assert sorted(state) == [
        f"model.layers.1.self_attn.head_delta.slices.{key}.{what}" for key in "kqv" for what in ("delta", "index")
    ]
    assert state["model.layers.1.self_attn.head_delta.slices.k.index"].tolist() == list(range(32, 64))  # group 1
    assert state["model.layers.1.self_attn.head_delta.slices.q.index"].tolist() == list(range(64, 96))
    with pytest.raises(RuntimeError, match="already attached"):
        attach_head_delta(model, [(0, 0)])
    merge_head_delta(model)
    with pytest.raises(RuntimeError, match="no head-delta adapter"):
        merge_head_delta(model)
    with pytest.raises(ValueError, match="out of range"):
        attach_head_delta(tiny_model(), [(4, 0)])
    with pytest.raises(ValueError, match="no heads selected"):
        attach_head_delta(tiny_model(), [])


def test_deltas_get_gradients_under_gradient_checkpointing():
    model = tiny_model().train()
    params = attach_head_delta(model, HEADS)
    model.gradient_checkpointing_enable()
    model.config.use_cache = False
    lm_loss(model, batch()).backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in params)
