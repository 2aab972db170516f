"""Head geometry: which q/k/v/o slices a query head owns, GQA-correct (P2D head identification, SPEC §5)."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, Qwen2Config

from raycurate.algorithms.p2d.head_scoring import score_heads
from raycurate.models.heads import head_param_slices, head_vectors, iter_head_vectors, kv_group, layer_head_vectors

HIDDEN, HEAD_DIM = 12, 3


def gqa_config() -> LlamaConfig:
    """4 query heads / 2 KV heads (heads 0, 1 -> group 0; heads 2, 3 -> group 1), head_dim 3 != 12 / 4."""
    return LlamaConfig(
        vocab_size=16,
        hidden_size=HIDDEN,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=HEAD_DIM,
        intermediate_size=8,
    )


def mha_config() -> Qwen2Config:
    return Qwen2Config(
        vocab_size=16,
        hidden_size=HIDDEN,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        intermediate_size=8,
    )


def random_state(config, seed: int = 0) -> dict[str, torch.Tensor]:
    """Attention weights only, with HF names and shapes (out, in)."""
    gen = torch.Generator().manual_seed(seed)
    n_heads, n_kv = config.num_attention_heads, config.num_key_value_heads
    dim = getattr(config, "head_dim", None) or config.hidden_size // n_heads
    shapes = {
        "q_proj": (n_heads * dim, config.hidden_size),
        "k_proj": (n_kv * dim, config.hidden_size),
        "v_proj": (n_kv * dim, config.hidden_size),
        "o_proj": (config.hidden_size, n_heads * dim),
    }
    return {
        f"model.layers.{layer}.self_attn.{name}.weight": torch.randn(shape, generator=gen)
        for layer in range(config.num_hidden_layers)
        for name, shape in shapes.items()
    }


def hand_vector(state, layer: int, head: int, group: int, dim: int, include_o: bool) -> torch.Tensor:
    """Head vector built by explicit row/column indexing."""
    prefix = f"model.layers.{layer}.self_attn"
    rows = list(range(head * dim, (head + 1) * dim))
    group_rows = list(range(group * dim, (group + 1) * dim))
    parts = [
        state[f"{prefix}.q_proj.weight"][rows].flatten(),
        state[f"{prefix}.k_proj.weight"][group_rows].flatten(),
        state[f"{prefix}.v_proj.weight"][group_rows].flatten(),
    ]
    if include_o:
        parts.append(state[f"{prefix}.o_proj.weight"][:, rows].T.flatten())
    return torch.cat(parts)


def test_gqa_slices_use_the_kv_group_not_the_query_index():
    config = gqa_config()
    assert [kv_group(config, head) for head in range(4)] == [0, 0, 1, 1]
    slices = head_param_slices(config, layer=1, head=3)
    assert slices == {
        "q": ("model.layers.1.self_attn.q_proj.weight", 0, slice(9, 12)),
        "k": ("model.layers.1.self_attn.k_proj.weight", 0, slice(3, 6)),
        "v": ("model.layers.1.self_attn.v_proj.weight", 0, slice(3, 6)),
        "o": ("model.layers.1.self_attn.o_proj.weight", 1, slice(9, 12)),
    }
    assert head_param_slices(config, 0, 1, include_o=False)["k"][2] == slice(0, 3)
    assert "o" not in head_param_slices(config, 0, 1, include_o=False)


def test_mha_slices_use_the_head_index_for_k_and_v():
    config = mha_config()  # head_dim = 12 / 4 = 3
    for head in range(4):
        slices = head_param_slices(config, 0, head)
        assert slices["k"][2] == slices["q"][2] == slice(3 * head, 3 * head + 3)


def test_slices_reject_out_of_range_heads():
    with pytest.raises(ValueError, match="head 4 is out of range"):
        head_param_slices(gqa_config(), 0, 4)
    with pytest.raises(ValueError, match="layer 2 is out of range"):
        head_param_slices(gqa_config(), 2, 0)


@pytest.mark.parametrize("include_o", [False, True])
@pytest.mark.parametrize("make_config, groups", [(gqa_config, [0, 0, 1, 1]), (mha_config, [0, 1, 2, 3])])
def test_head_vectors_match_hand_indexed_weights(make_config, groups, include_o):
    config = make_config()
    state = random_state(config)
    vectors = head_vectors(state, config, include_o=include_o)
    assert vectors.shape == (2, 4, (4 if include_o else 3) * HEAD_DIM * HIDDEN)
    for layer in range(2):
        for head in range(4):
            expected = hand_vector(state, layer, head, groups[head], HEAD_DIM, include_o)
            assert torch.equal(vectors[layer, head], expected)


def test_head_vectors_agree_with_head_param_slices():
    config = gqa_config()
    state = random_state(config, seed=1)
    vectors = layer_head_vectors(state, config, layer=1, include_o=True)
    for head in range(4):
        parts = []
        for name, dim, index in head_param_slices(config, 1, head).values():
            block = state[name][index] if dim == 0 else state[name][:, index].T
            parts.append(block.flatten())
        assert torch.equal(vectors[head], torch.cat(parts))


def test_head_vectors_read_a_module_and_a_layer_subset():
    config = gqa_config()
    torch.manual_seed(0)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(config)
    state = {name: p.detach() for name, p in model.named_parameters()}
    assert torch.equal(head_vectors(model, config, layers=[1]), head_vectors(state, config)[1:])
    assert [layer for layer, _ in iter_head_vectors(model, config, layers=[1, 0])] == [1, 0]


def test_missing_parameter_error_names_the_prefix_fix():
    config = gqa_config()
    state = {k.replace("model.layers", "model.language_model.layers"): v for k, v in random_state(config).items()}
    with pytest.raises(KeyError, match="prefix="):
        head_vectors(state, config)
    assert head_vectors(state, config, prefix="model.language_model.layers").shape[:2] == (2, 4)


def alps_style_vector(state, layer: int, head: int, dim: int) -> torch.Tensor:
    """The public ALPS slicing: K/V rows taken with the *query* index (wrong under GQA)."""
    prefix = f"model.layers.{layer}.self_attn"
    rows = slice(head * dim, (head + 1) * dim)
    return torch.cat([state[f"{prefix}.{name}.weight"][rows].flatten() for name in ("q_proj", "k_proj", "v_proj")])


def test_alps_query_index_slicing_is_wrong_under_gqa():
    config = gqa_config()
    base = random_state(config)
    correct = head_vectors(base, config)[0]
    # head 1 reads KV group 0, but the query index selects group 1's rows
    assert not torch.equal(alps_style_vector(base, 0, 1, HEAD_DIM), correct[1])
    # heads 2, 3 index past the 2 KV heads: the K/V slices come back empty, the head is scored on Q alone
    assert alps_style_vector(base, 0, 3, HEAD_DIM).numel() == HEAD_DIM * HIDDEN
    # Only KV group 0 (of layer 0) moves: heads 0 and 1 are the sensitive ones.
    proxy = {name: tensor.clone() for name, tensor in base.items()}
    proxy["model.layers.0.self_attn.k_proj.weight"][:HEAD_DIM] += 0.5
    right = score_heads(head_vectors(base, config)[0], head_vectors(proxy, config)[0], method="l2")
    assert right[0] > 0 and right[1] > 0 and right[2] == 0 and right[3] == 0
    alps = torch.stack(
        [
            torch.linalg.vector_norm(alps_style_vector(proxy, 0, h, HEAD_DIM) - alps_style_vector(base, 0, h, HEAD_DIM))
            for h in range(4)
        ]
    )
    assert alps[0] > 0 and alps[1] == 0  # ALPS misses head 1, which shares the changed group
