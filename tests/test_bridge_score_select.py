"""BRIDGE scoring split from selection (issue #15): the stored-score path selects exactly what the in-memory combined
path selects, and a budget change re-runs only ``bridge_select``."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from raycurate.algorithms.bridge.rows import (
    RowScores,
    SelectionSettings,
    dequantize,
    quantize,
    round_trip,
    score_and_select_rows,
)

SEL_COMPARED = ("prompt_keep", "loss_mask", "response_scores", "u_sur", "b_p", "b_r", "kept_prompt",
                "supervised_response", "rounds_run", "closure_fallback", "final_answer_kept", "utility_retained")


@pytest.fixture(scope="module")
def embedded(tmp_path_factory):
    """The committed 2-layer model, a random direction on its last layer and 6 tokenized corpus rows."""
    from safetensors.torch import save_file

    from raycurate.algorithms.bridge.token_utility import scoring_parameters
    from raycurate.data.corpus import generate_corpus
    from raycurate.data.tokenize import token_table, tokenize_record
    from raycurate.models.loading import embedded_model_dir, load_model, load_tokenizer

    work = tmp_path_factory.mktemp("bridge_split")
    model_dir = embedded_model_dir()
    tokenizer = load_tokenizer(model_dir)
    rows = [tokenize_record(tokenizer, r, 384) for r in generate_corpus(6, seed=0)]
    rows = [r for r in rows if "input_ids" in r]
    model = load_model(model_dir, dtype="float32", device="cpu").eval()
    gen = torch.Generator().manual_seed(0)
    direction = {k: torch.randn(v.shape, generator=gen) * 1e-2 for k, v in scoring_parameters(model, 1).items()}
    direction_path = work / "direction.safetensors"
    save_file(direction, str(direction_path))
    return {"model_dir": model_dir, "model": model, "direction": direction, "direction_path": str(direction_path),
            "rows": rows, "table": token_table(rows), "pad_id": tokenizer.pad_token_id or 0, "work": work}


def test_quantize_round_trip():
    x = np.array([3e-7, -2.5e3, 1.0, 0.0], dtype=np.float32)
    values, scale = quantize(x, "float32")
    assert scale == 1.0 and dequantize(values, scale) is values
    values, scale = quantize(x, "float16")
    assert values.dtype == np.float16 and scale == pytest.approx(2.5e3)
    back = dequantize(values, scale)
    assert np.all(np.abs(back - x) <= 2.0 ** -11 * 2.5e3)  # no overflow though 2.5e3 * scale-free fp16 would fit
    assert quantize(np.zeros(3, np.float32), "float16")[1] == 1.0
    with pytest.raises(ValueError, match="score dtype"):
        quantize(x, "bfloat16")
    scores = RowScores(np.ones(2, np.float32), np.ones((2, 3), np.float32), np.ones(2, np.float32), None)
    assert round_trip(scores, "float16").prompt_scores is None


def _split_path(embedded, settings: SelectionSettings, dtype: str):
    """BridgeScoreUDF -> parquet -> BridgeSelectUDF, as the two stages run them (minus Ray)."""
    import pyarrow.parquet as pq

    from raycurate.stages.bridge import BridgeScoreUDF, BridgeSelectUDF

    udf = BridgeScoreUDF(embedded["model_dir"], embedded["direction_path"], None, settings, micro_batch=4, threads=1,
                         score_dtype=dtype)
    scored = udf(embedded["table"])
    path = embedded["work"] / f"scores-{dtype}-{settings.prompt_proxy}.parquet"
    pq.write_table(scored, path)
    stored = pq.read_table(path)
    assert stored.schema.field("score_routing").type.value_type.bit_width == (16 if dtype == "float16" else 32)
    selected = BridgeSelectUDF(settings)(stored.slice(1))  # a slice, as a sharded map hands batches over
    assert not [c for c in selected.column_names if c.startswith("score_")]
    return selected.to_pylist()


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("proxy", ["routing", "knockout_grad"])
def test_split_path_selects_exactly_what_the_combined_path_selects(embedded, dtype, proxy):
    from raycurate.algorithms.bridge.routing import default_routing_layer

    settings = SelectionSettings(rho_p=0.5, rho_r=0.75, prompt_proxy=proxy)
    combined = score_and_select_rows(embedded["model"], embedded["direction"], default_routing_layer(embedded["model"]),
                                     embedded["rows"], settings, pad_id=embedded["pad_id"], micro_batch=4,
                                     score_dtype=dtype)[1:]
    split = _split_path(embedded, settings, dtype)
    assert len(split) == len(combined) > 0
    for got, want in zip(split, combined):
        for key in SEL_COMPARED:
            value = want[key].tolist() if hasattr(want[key], "tolist") else want[key]
            if isinstance(value, float) and np.isnan(value):
                assert np.isnan(got[f"sel_{key}"])
            else:
                assert got[f"sel_{key}"] == value, key  # bit for bit
        assert got["sel_u_sur_alternating"] == want["u_sur_by_schedule"]["alternating"]


def test_float32_storage_is_the_unquantized_selection(embedded):
    """score_dtype=float32 reproduces the pre-split combined path (no rounding anywhere)."""
    from raycurate.algorithms.bridge.routing import default_routing_layer
    from raycurate.algorithms.bridge.rows import score_rows, select_rows

    settings = SelectionSettings(rho_p=0.5, rho_r=0.5)
    layer = default_routing_layer(embedded["model"])
    scores = score_rows(embedded["model"], embedded["direction"], layer, embedded["rows"], settings,
                        pad_id=embedded["pad_id"], micro_batch=4)
    raw = select_rows(embedded["rows"], scores, settings)
    stored = score_and_select_rows(embedded["model"], embedded["direction"], layer, embedded["rows"], settings,
                                   pad_id=embedded["pad_id"], micro_batch=4)
    for a, b in zip(raw, stored):
        assert a["loss_mask"].tolist() == b["loss_mask"].tolist()
        assert a["prompt_keep"].tolist() == b["prompt_keep"].tolist()
        assert a["u_sur"] == b["u_sur"]


def _record(run, stage, files, config):
    """A finished upstream stage whose outputs are copies of ``files`` ({output name: source path})."""
    from raycurate.stages.base import StageOutput, run_stage

    def body(out):
        outputs = {}
        for name, src in files.items():
            src = __import__("pathlib").Path(src)
            (shutil.copytree if src.is_dir() else shutil.copy)(src, out / src.name)
            outputs[name] = src.name
        return StageOutput(outputs=outputs)

    return run_stage(run, stage, body, config=config)


@pytest.mark.ray
def test_a_budget_change_reruns_only_bridge_select(embedded, tmp_path, ray_local):
    import dataclasses

    import pyarrow.parquet as pq

    from raycurate.config.bridge import BridgeConfig
    from raycurate.config.pool import ActorPoolConfig
    from raycurate.rundir import RunDir
    from raycurate.stages.bridge import read_token_rows, score_stage, select_stage

    tokens = tmp_path / "tokens"
    tokens.mkdir()
    pq.write_table(embedded["table"], tokens / "part-0.parquet")
    run = RunDir(tmp_path / "run", lock=True)
    _record(run, "rows", {"tokens": tokens}, {"rows": 1})
    _record(run, "warmup", {"model": embedded["model_dir"]}, {"model": 1})
    _record(run, "direction", {"direction": embedded["direction_path"]}, {"last_layers": 1})
    pool = ActorPoolConfig(num_actors=1, batch_size=4, shard_rows=3)
    cfg = BridgeConfig(rho_p=0.5, rho_r=0.75, micro_batch=4, select_actors=1)  # first: CPU actors

    def both(cfg):
        score_stage(run, tokens_stage="rows", warmup_stage="warmup", direction_stage_name="direction",
                    bridge_cfg=cfg, pool_cfg=pool, progress=False)
        select_stage(run, score_stage_name="bridge_score", bridge_cfg=cfg, pool_cfg=pool, progress=False)
        return json.loads(run.manifest_path.read_text())["stages"]

    from raycurate.algorithms.bridge.routing import default_routing_layer
    from raycurate.stages.bridge import selection_settings

    def check_against_combined(cfg):
        """The selection stage's output is what the combined in-memory path selects, bit for bit."""
        combined = score_and_select_rows(embedded["model"], embedded["direction"],
                                         default_routing_layer(embedded["model"]), embedded["rows"],
                                         selection_settings(cfg), pad_id=embedded["pad_id"], micro_batch=4,
                                         score_dtype=cfg.score_dtype)
        selected = read_token_rows(run.root / "bridge_select" / "selection")
        assert [r["sel_loss_mask"] for r in selected] == [c["loss_mask"].tolist() for c in combined]
        assert [r["sel_prompt_keep"] for r in selected] == [c["prompt_keep"].tolist() for c in combined]
        assert [r["row_index"] for r in selected] == list(range(len(combined)))

    first = both(cfg)
    assert first["bridge_score"]["executions"] == 1 and first["bridge_select"]["executions"] == 1
    assert first["bridge_score"]["metrics"]["rows_scored"] == len(embedded["rows"])
    assert first["bridge_select"]["metrics"]["select_actors"] == 1
    check_against_combined(cfg)

    second_cfg = dataclasses.replace(cfg, rho_p=0.75, rho_r=0.5, select_actors=None)  # small: in the driver
    second = both(second_cfg)
    assert second["bridge_select"]["metrics"]["select_actors"] == 0
    check_against_combined(second_cfg)
    assert second["bridge_score"]["finished"] == first["bridge_score"]["finished"], "the model ran again"
    assert second["bridge_score"]["executions"] == 1
    assert second["bridge_select"]["executions"] == 2
    assert second["bridge_select"]["metrics"]["response_budget_ratio"] < first["bridge_select"]["metrics"][
        "response_budget_ratio"]

    # the knock-out proxy's prompt scores are conditioned on the routing S_r, so its budgets do re-score
    third = both(dataclasses.replace(cfg, prompt_proxy="knockout_grad"))
    assert third["bridge_score"]["executions"] == 2
    fourth = both(dataclasses.replace(cfg, prompt_proxy="knockout_grad", rho_r=0.5))
    assert fourth["bridge_score"]["executions"] == 3


@pytest.mark.slow
@pytest.mark.ray
@pytest.mark.timeout(1800)
def test_bridge_pipeline_rerun_with_another_budget_skips_the_model(tiny_demo, tmp_path):
    """The shared tiny demo (tests/tiny_demo.py) re-run on a copy with other budgets: warmup, direction and
    bridge_score are skipped (manifest executions and finish times unchanged); bridge_select and what reads it
    re-run (the baselines are left out of the re-run, so their stages keep their first results)."""
    from tiny_demo import copy_tiny_demo

    from raycurate.cli.main import main

    args = copy_tiny_demo(tiny_demo, tmp_path / "demo")
    before = json.loads((tmp_path / "demo" / "manifest.json").read_text())["stages"]
    assert main([*args, "bridge.rho_p=0.5", "bridge.rho_r=0.5", "bridge.baselines=[]"]) == 0
    after = json.loads((tmp_path / "demo" / "manifest.json").read_text())["stages"]
    for stage in ("bridge_warmup", "bridge_direction", "bridge_score"):
        assert after[stage]["executions"] == 1 and after[stage]["finished"] == before[stage]["finished"], stage
    rerun = {name for name in before if after[name]["finished"] != before[name]["finished"]}
    assert rerun == {"bridge_select", "bridge_compact", "bridge_diagnostics", "train_bridge", "eval_bridge",
                     "lm_eval_bridge"}
    assert after["bridge_select"]["executions"] == 2
    assert after["bridge_select"]["metrics"]["response_budget_ratio"] < before["bridge_select"]["metrics"][
        "response_budget_ratio"]
