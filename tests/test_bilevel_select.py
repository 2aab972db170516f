"""DSIR and LESS selection stages of the bilevel pipeline on hand-built token tables and a tiny Llama."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from train_helpers import VOCAB, write_tiny_llama

from raycurate.algorithms.less import Projector, example_gradients, gradient_features, trainable_named
from raycurate.rundir import RunDir
from raycurate.stages.base import StageOutput, output_path, run_stage
from raycurate.stages.bilevel_select import LORA_TARGETS, dsir_select_stage, less_select_stage, selection_count
from raycurate.stages.p2d import selected_ids
from raycurate.training.less_warmup import adam_moments, warmup_lora

APPLE_VALIDATION = [
    ("Tell me about apples.", "Red apples and green apples grow on apple trees in the orchard."),
    ("Which apples are sweet?", "Sweet red apples and sweet green apples grow in the orchard."),
    ("Where do apples grow?", "Apples grow on apple trees in the apple orchard."),
]
APPLE_CANDIDATES = [
    ("Where do red apples grow?", "Red apples grow on apple trees."),
    ("Are green apples sweet?", "Green apples are sweet apples."),
    ("Tell me about the orchard.", "The apple orchard has apple trees."),
    ("Which apples grow in the orchard?", "Red and green apples grow in the orchard."),
]
QUANTUM_CANDIDATES = [
    ("What is a qubit?", "A qubit holds quantum superposition."),
    ("Explain entanglement.", "Entangled qubits share one quantum state."),
    ("What is tunnelling?", "Quantum particles tunnel through barriers."),
    ("Define decoherence.", "Decoherence destroys quantum superposition."),
]


def _text_rows(pairs: list[tuple[str, str]], prefix: str, clean: bool) -> list[dict]:
    return [{"id": f"{prefix}{i}", "prompt": p, "response": r, "clean": clean} for i, (p, r) in enumerate(pairs)]


def _write_tokens(out: Path, rows: list[dict], split: str) -> StageOutput:
    """A token table with the columns of the tokenize stage (token ids are fake where a row brings none)."""
    n = len(rows)
    input_ids = [r.get("input_ids", [1, 5, 6, 7, 2]) for r in rows]
    prompt_len = [r.get("prompt_len", 2) for r in rows]
    table = pa.table({
        "id": pa.array([r["id"] for r in rows]),
        "input_ids": pa.array(input_ids, type=pa.list_(pa.int32())),
        "prompt_len": pa.array(prompt_len, type=pa.int32()),
        "loss_mask": pa.array([[0] * p + [1] * (len(t) - p) for t, p in zip(input_ids, prompt_len)],
                              type=pa.list_(pa.int8())),
        "weight": pa.array([1.0] * n, type=pa.float32()),
        "prompt": pa.array([r.get("prompt", "") for r in rows]),
        "response": pa.array([r.get("response", "") for r in rows]),
        "domain": pa.array(["test"] * n),
        "label": pa.array([{"clean": r.get("clean", True)} for r in rows],
                          type=pa.struct([("clean", pa.bool_())])),
        "split": pa.array([split] * n),
    })
    (out / "tokens").mkdir()
    pq.write_table(table, out / "tokens" / "part-00000.parquet")
    return StageOutput(outputs={"tokens": "tokens"})


def _tokens_stage(run: RunDir, stage: str, rows: list[dict], split: str) -> None:
    run_stage(run, stage, lambda out: _write_tokens(out, rows, split), config={"rows": [r["id"] for r in rows]})


def _selection(run: RunDir, stage: str) -> list[dict]:
    return pq.read_table(output_path(run, stage, "selection")).to_pylist()


# ------------------------------------------------------------------------------------------------ DSIR


@pytest.fixture
def dsir_run(tmp_path) -> RunDir:
    run = RunDir(tmp_path / "run")
    candidates = _text_rows(APPLE_CANDIDATES, "apple", True) + _text_rows(QUANTUM_CANDIDATES, "quantum", False)
    _tokens_stage(run, "candidates", candidates, "selection")
    _tokens_stage(run, "validation", _text_rows(APPLE_VALIDATION, "val", True), "validation")
    return run


def test_selection_count_rounds_halves_up_and_keeps_at_least_one():
    assert selection_count(0.5, 8) == 4 and selection_count(0.3, 8) == 2 and selection_count(0.3125, 8) == 3
    assert selection_count(0.01, 8) == 1 and selection_count(1.0, 8) == 8
    with pytest.raises(ValueError, match="select_fraction"):
        selection_count(0.0, 8)


def test_dsir_selects_the_candidates_that_share_the_validation_ngrams(dsir_run):
    record = dsir_select_stage(dsir_run, "dsir", candidate_stage="candidates", validation_stage="validation",
                               fraction=0.5, buckets=4096, seed=0)
    rows = _selection(dsir_run, "dsir")
    assert [r["id"] for r in rows] == sorted(r["id"] for r in rows)  # one row per candidate, id order
    assert selected_ids(dsir_run, "dsir") == [f"apple{i}" for i in range(4)]
    weights = {r["id"]: r["log_weight"] for r in rows}
    assert min(weights[f"apple{i}"] for i in range(4)) > max(weights[f"quantum{i}"] for i in range(4))
    metrics = record["metrics"]
    assert metrics["selected"] == 4 and metrics["candidates"] == 8
    assert metrics["precision_selected"] == 1.0 and metrics["precision_pool"] == 0.5


def test_dsir_same_seed_same_sample_and_exactly_k(dsir_run):
    # Validation = the candidates themselves: p_target == p_raw, every log weight is 0, the draw is uniform.
    candidates = _text_rows(APPLE_CANDIDATES + QUANTUM_CANDIDATES, "c", True)
    _tokens_stage(dsir_run, "same", candidates, "validation")
    picks = {}
    for stage, seed in (("a", 3), ("b", 3), ("c", 4)):
        dsir_select_stage(dsir_run, stage, candidate_stage="candidates", validation_stage="same", fraction=0.3,
                          buckets=512, seed=seed)
        assert [r["log_weight"] for r in _selection(dsir_run, stage)] == pytest.approx([0.0] * 8, abs=1e-9)
        picks[stage] = selected_ids(dsir_run, stage)
        assert len(picks[stage]) == 2  # round(0.3 * 8)
    assert picks["a"] == picks["b"]
    assert picks["c"] != picks["a"]  # the seed drives the uniform draw


def test_dsir_names_missing_text_columns(tmp_path):
    run = RunDir(tmp_path / "run")

    def body(out: Path) -> StageOutput:
        (out / "tokens").mkdir()
        pq.write_table(pa.table({"id": ["a"], "input_ids": [[1, 2]]}), out / "tokens" / "part-00000.parquet")
        return StageOutput(outputs={"tokens": "tokens"})

    run_stage(run, "bare", body, config={})
    with pytest.raises(ValueError, match=r"lacks columns \['prompt', 'response'\]"):
        dsir_select_stage(run, "dsir", candidate_stage="bare", validation_stage="bare", fraction=0.5, buckets=64,
                          seed=0)


# ------------------------------------------------------------------------------------------------ LESS


def _write_tiny_model(out: Path) -> StageOutput:
    write_tiny_llama(str(out / "model"))
    return StageOutput(outputs={"model": "model"})


def _token_rows(n: int, seed: int, first: int, tokens: tuple[int, int]) -> list[dict]:
    """``n`` rows ``c<first>..`` of random token ids drawn from ``[tokens[0], tokens[1])``; even ids are clean."""
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(first, first + n):
        length = int(rng.integers(8, 14))
        rows.append({"id": f"c{i:02d}", "input_ids": [1] + rng.integers(*tokens, size=length - 2).tolist() + [2],
                     "prompt_len": int(rng.integers(2, 4)), "clean": i % 2 == 0})
    return rows


# Nine candidates over one half of the vocabulary, three over the other half; the validation set is a copy of those
# three, so LESS (validation gradients = their gradients, other topic for the rest) must rank them first.
CANDIDATES = _token_rows(9, seed=0, first=0, tokens=(3, 34)) + _token_rows(3, seed=1, first=9, tokens=(34, VOCAB))
COPIED = ["c09", "c10", "c11"]


@pytest.fixture(scope="module")
def less_run(tmp_path_factory) -> RunDir:
    run = RunDir(tmp_path_factory.mktemp("less") / "run")
    _tokens_stage(run, "candidates", CANDIDATES, "selection")
    _tokens_stage(run, "validation", [{**r, "id": f"val_{r['id']}"} for r in CANDIDATES if r["id"] in COPIED],
                  "validation")
    run_stage(run, "base", _write_tiny_model, config={"model": "tiny"})
    return run


@pytest.fixture
def lora_model(less_run):
    """The tiny base model with a seeded r=4 LoRA on q/k/v/o, on one CPU thread."""
    import torch

    from raycurate.models.adapters import apply_adapter
    from raycurate.models.loading import load_model

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = apply_adapter(load_model(str(output_path(less_run, "base", "model")), dtype="float32"),
                          {"kind": "lora", "r": 4, "alpha": 8, "targets": LORA_TARGETS})
    yield model
    torch.set_num_threads(threads)


def _loss_rows(rows: list[dict]) -> list[dict]:
    return [{"input_ids": r["input_ids"], "loss_mask": [0] * r["prompt_len"] + [1] * (len(r["input_ids"]) -
                                                                                     r["prompt_len"])} for r in rows]


def test_plain_gradient_features_give_cosine_one_to_a_copy(lora_model):
    import torch

    from raycurate.algorithms.less import less_scores

    rows = _loss_rows(CANDIDATES[:4])
    # LoRA parameters: r=4 on q/k/v/o of 2 layers (hidden 32, kv 16): per layer 4*(32+32) + 2*4*(32+16) + 4*(32+32).
    assert sum(p.numel() for _, p in trainable_named(lora_model)) == 2 * 896
    projector = Projector(2 * 896, 8192, seed=0, device="cpu")  # P <= d: projected all the same
    feats = gradient_features(lora_model, rows, pad_id=0, projector=projector)
    assert feats.shape == (4, 8192)
    val = gradient_features(lora_model, rows[2:3], pad_id=0, projector=projector)
    torch.testing.assert_close(val[0], feats[2])
    scores = less_scores(feats, val)
    assert scores[2].item() == pytest.approx(1.0, abs=1e-5) and int(scores.argmax()) == 2


def test_adam_moments_after_one_warmup_step_are_the_first_adam_update(lora_model):
    import torch

    from raycurate.algorithms.less import adam_preconditioned

    rows = _loss_rows(CANDIDATES[:1])
    params = [p for _, p in trainable_named(lora_model)]
    (grad,) = example_gradients(lora_model, rows, params, pad_id=0, chunk=4)  # (1, P) at the initial LoRA
    optimizer, losses = warmup_lora(lora_model, rows, pad_id=0, epochs=1, lr=1e-3, batch_size=1, seed=0)
    exp_avg, exp_avg_sq = adam_moments(optimizer, params)
    # One AdamW step from zero state: m = (1 - b1) g, v = (1 - b2) g^2, in the order of trainable_named.
    torch.testing.assert_close(exp_avg, 0.1 * grad[0])
    torch.testing.assert_close(exp_avg_sq, 0.001 * grad[0] ** 2)
    assert len(losses) == 1
    # Training features are the projected Adam directions of the per-example gradients at the warmed-up LoRA.
    projector = Projector(exp_avg.numel(), 16, seed=1, device="cpu")
    feats = gradient_features(lora_model, rows, pad_id=0, projector=projector, moments=(exp_avg, exp_avg_sq))
    (now,) = example_gradients(lora_model, rows, params, pad_id=0, chunk=4)
    torch.testing.assert_close(feats, projector(adam_preconditioned(now, exp_avg, exp_avg_sq)))


LESS_ARGS = dict(candidate_stage="candidates", validation_stage="validation", base_stage="base", fraction=0.25,
                 lora_r=4, lora_alpha=8, dim=256, warmup_fraction=0.5, warmup_epochs=2, lr=1e-3, batch_size=2,
                 seed=0)


@pytest.mark.ray
def test_less_selects_the_validation_copies_and_is_seeded(ray_local, less_run):
    first = less_select_stage(less_run, "less_a", **LESS_ARGS)
    again = less_select_stage(less_run, "less_b", **LESS_ARGS)
    rows = _selection(less_run, "less_a")
    assert [r["id"] for r in rows] == [f"c{i:02d}" for i in range(12)]
    assert selected_ids(less_run, "less_a") == COPIED  # exactly k = round(0.25 * 12) = 3
    assert [r["score"] for r in _selection(less_run, "less_b")] == [r["score"] for r in rows]
    metrics = first["metrics"]
    assert metrics["selected"] == 3 and metrics["candidates"] == 12 and metrics["validation"] == 3
    assert metrics["warmup_rows"] == 6 and len(metrics["warmup_losses"]) == 2
    assert metrics["lora_parameters"] == 2 * 896
    assert metrics["precision_selected"] == pytest.approx(1 / 3) and metrics["precision_pool"] == 0.5
    assert again["metrics"]["precision_selected"] == metrics["precision_selected"]
