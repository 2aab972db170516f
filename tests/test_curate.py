"""Composable curation (pipeline curate): config validation, step ordering, the matched token budget, the
composition table of the report and the seed summary's composition comparisons (no Ray)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from raycurate.algorithms.composition import (
    Step,
    compose,
    keep_count,
    matched_response_ratio,
    normalised_weights,
    ranked_ids,
    rows_until_tokens,
)
from raycurate.config.loader import ConfigError, load_config
from raycurate.config.schema import JobConfig

ROOT = Path(__file__).resolve().parents[1]


# --------------------------------------------------------------------------------------------- config


@pytest.mark.parametrize("steps, message", [
    ("[]", "curate.steps: is empty"),
    ("[bridge, bds]", "'bridge' must be the last step"),
    ("[bds, bds, bridge]", "['bds'] appear more than once"),
    ("[bds, lesss]", "unknown step(s) ['lesss']"),
])
def test_bad_steps_are_rejected_naming_the_field(steps, message):
    with pytest.raises(ConfigError) as err:
        load_config(JobConfig, None, ["pipeline=curate", f"curate.steps={steps}"])
    assert "curate.steps" in str(err.value) and message in str(err.value)


@pytest.mark.parametrize("override, key", [
    ("curate.keep_fraction=0", "curate.keep_fraction: 0.0 must be > 0"),
    ("curate.keep_fraction=1.5", "curate.keep_fraction: 1.5 must be <= 1"),
    ("curate.bds_mode=soft", "curate.bds_mode: 'soft' is not one of ['select', 'weight']"),
    ("bilevel.candidate_split=warmup", "bilevel.candidate_split: curate's bds step ranks the 'selection' split"),
    ("data.input=rows.jsonl", "curate.compare: comparing arms needs the embedded corpus"),
])
def test_other_curate_problems_name_the_field(override, key, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError) as err:
        load_config(JobConfig, None, ["pipeline=curate", "curate.steps=[bds]", override])
    assert key in str(err.value)


def test_curate_needs_the_splits_its_steps_use():
    with pytest.raises(ConfigError) as err:
        load_config(JobConfig, None, ["pipeline=curate", "curate.steps=[bds, bridge]",
                                      "data.split_ratios={validation: 0.1, selection: 0.9}"])
    assert "pipeline 'curate' needs a split named 'warmup'" in str(err.value)
    cfg = load_config(JobConfig, None, ["pipeline=curate", "curate.steps=[dedup, p2d]"])
    assert cfg.runs("p2d") and cfg.runs("bilevel") and not cfg.runs("bridge")


def test_shipped_curate_job_is_the_proving_ground_with_curate_over_seeds():
    from raycurate.config.loader import read_yaml

    job = read_yaml(ROOT / "jobs/curate_proving_ground.yaml")
    ground = read_yaml(ROOT / "jobs/proving_ground.yaml")
    for section in ("data", "model", "train", "eval"):
        assert job[section] == ground[section], section  # the same benchmark as the demo's proving ground
    cfg = load_config(JobConfig, ROOT / "jobs/curate_proving_ground.yaml")
    assert cfg.proving_ground.pipeline == "curate" and cfg.proving_ground.seeds == [0, 1, 2]
    assert cfg.curate.steps == ["bds", "bridge"] and cfg.curate.compare
    assert load_config(JobConfig, ROOT / "jobs/proving_ground.yaml").proving_ground.pipeline == "demo"


# --------------------------------------------------------------------------------------------- ranking and steps


def test_ranking_is_by_score_with_a_seeded_tie_break():
    scores = {"a": 1.0, "b": 3.0, "c": 2.0, "d": 2.0}
    first = ranked_ids(["d", "c", "b", "a"], scores, seed=0)
    assert first[0] == "b" and first[-1] == "a" and set(first[1:3]) == {"c", "d"}
    assert ranked_ids(["a", "b", "c", "d"], scores, seed=0) == first  # the caller's order does not matter
    orders = {tuple(ranked_ids(list("abcdefgh"), dict.fromkeys("abcdefgh", 0.0), seed=s)) for s in range(5)}
    assert len(orders) > 1  # a constant score is a seeded random order
    with pytest.raises(ValueError, match="1 of 2 rows have no score"):
        ranked_ids(["a", "z"], scores, seed=0)


def test_keep_count_rounds_halves_up_and_keeps_at_least_one():
    assert [keep_count(0.5, n) for n in (0, 1, 3, 4, 5)] == [0, 1, 2, 2, 3]
    assert keep_count(0.6, 10) == 6 and keep_count(0.01, 10) == 1 and keep_count(1.0, 7) == 7


def test_each_step_filters_what_the_previous_step_kept_so_order_matters():
    pool = [f"r{i}" for i in range(8)]
    bds = Step("bds", scores={f"r{i}": float(i) for i in range(8)})          # r7 best
    p2d = Step("p2d", scores={f"r{i}": float(i % 4) for i in range(8)})      # r3, r7 best; r0, r4 worst
    dedup = Step("dedup", dropped=frozenset({"r7", "r6"}))
    # bds keeps r4..r7; p2d keeps the top half of those by i % 4: r7 (3), r6 (2)
    assert compose(pool, [bds, p2d], 0.5, seed=0) == [["r4", "r5", "r6", "r7"], ["r6", "r7"]]
    # p2d first keeps i % 4 in {2, 3}: r2 r3 r6 r7; bds then keeps r6, r7 -- here the same rows
    assert compose(pool, [p2d, bds], 0.5, seed=0)[-1] == ["r6", "r7"]
    # dedup first removes r6, r7, so bds then keeps r3, r4, r5 (round(0.5 * 6) = 3)
    assert compose(pool, [dedup, bds], 0.5, seed=0) == [["r0", "r1", "r2", "r3", "r4", "r5"], ["r3", "r4", "r5"]]
    # dedup last only removes the duplicates among bds's top half
    assert compose(pool, [bds, dedup], 0.5, seed=0)[-1] == ["r4", "r5"]


def test_a_step_is_either_a_ranking_or_a_filter():
    with pytest.raises(ValueError, match="exactly one"):
        Step("bad")
    with pytest.raises(ValueError, match="exactly one"):
        Step("bad", scores={}, dropped=frozenset())


# --------------------------------------------------------------------------------------------- token budget


def test_rows_until_tokens_takes_the_prefix_closest_to_the_budget():
    tokens = [10, 20, 30, 40]  # prefix sums 0, 10, 30, 60, 100
    assert rows_until_tokens(tokens, 30) == 2
    assert rows_until_tokens(tokens, 44) == 2  # |30 - 44| = 14 < |60 - 44| = 16
    assert rows_until_tokens(tokens, 46) == 3
    assert rows_until_tokens(tokens, 45) == 2  # a tie takes the shorter prefix
    assert rows_until_tokens(tokens, 0) == 0
    assert rows_until_tokens(tokens, 1000) == 4  # the pool holds fewer than T: everything
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 50, size=500)
    for budget in (137, 5000, int(lengths.sum()) - 3):
        k = rows_until_tokens(lengths, budget)
        assert abs(int(lengths[:k].sum()) - budget) <= lengths[k - 1:k + 1].max() / 2  # within half a row
    with pytest.raises(ValueError):
        rows_until_tokens(tokens, -1)


def test_matched_response_ratio_counts_fixed_tokens_outside_the_budget():
    # 2 rows with 9 and 19 eligible response tokens + 1 EOS each: rho 0.5 supervises round(4.5) + round(9.5) + 2
    assert matched_response_ratio(16, eligible=28, fixed=2) == pytest.approx(0.5)
    assert matched_response_ratio(30, eligible=28, fixed=2) == 1.0
    with pytest.raises(ValueError, match="no BRIDGE response ratio"):
        matched_response_ratio(2, eligible=28, fixed=2)


def test_normalised_weights_have_mean_one_over_the_kept_rows():
    w = normalised_weights({"a": 2.0, "b": 6.0, "c": 100.0}, ["a", "b"])
    assert w == {"a": 0.5, "b": 1.5}


# --------------------------------------------------------------------------------------------- report and summary

N = 100


def _write_eval(root: Path, stages: dict, model: str, sampled: np.ndarray) -> None:
    folder = root / f"eval_{model}"
    folder.mkdir()
    pq.write_table(pa.table({"id": [f"q{i:03d}" for i in range(N)], "correct": [False] * N,
                             "sampled_accuracy": sampled.tolist()}), folder / "predictions.parquet")
    stages[f"eval_{model}"] = {"status": "done", "outputs": {"predictions": f"eval_{model}/predictions.parquet"}}


def _curate_run(root: Path, gain: float) -> dict:
    from raycurate.report.composition import score_arms

    stages: dict = {}
    base = np.r_[np.full(N // 2, 0.5), np.zeros(N // 2)]  # mean 0.25
    _write_eval(root, stages, "curate", base + gain)
    _write_eval(root, stages, "curate_bds", base)
    _write_eval(root, stages, "curate_random", np.zeros(N))
    manifest = {"stages": stages}
    arms = {"composition": {"model": "curate", "rows": 60, "response_tokens": 1000},
            "bds": {"model": "curate_bds", "rows": 80, "response_tokens": 1004},
            "random": {"model": "curate_random", "rows": 81, "response_tokens": 998}}
    separation = {"auroc": 0.9, "auroc_ci95": [0.85, 0.95],
                  "auroc_by_kind": {"swapped_entity": {"auroc": 0.93, "rows": 10, "ci95": [0.9, 0.96]},
                                    "truncated": {"auroc": 0.81, "rows": 4, "ci95": [0.7, 0.9]}}}
    manifest["results"] = {"composition": {"steps": ["bds", "bridge"], "keep_fraction": 0.6, "bds_mode": "select",
                                           "budget_tokens": 1000, "separation": separation,
                                           **score_arms(root, manifest, arms)}}
    (root / "manifest.json").write_text(json.dumps(manifest))
    return manifest


def test_composition_minus_each_arm_is_paired_on_questions(tmp_path):
    from raycurate.report.html import render_report

    block = _curate_run(tmp_path, gain=0.25)["results"]["composition"]
    arms = block["arms"]
    assert block["questions"] == N and block["metric"] == "sampled_accuracy"
    assert arms["composition"]["score"]["value"] == pytest.approx(0.5) and "vs_composition" not in arms["composition"]
    # composition = bds + 0.25 on every question: the paired interval is a point
    assert arms["bds"]["vs_composition"] == {"value": pytest.approx(0.25), "low": pytest.approx(0.25),
                                             "high": pytest.approx(0.25), "n": N}
    assert arms["random"]["vs_composition"]["value"] == pytest.approx(0.5)
    html = render_report(tmp_path)
    assert "<h2 id='composition'>Composition</h2>" in html and "1004 (1.004)" in html
    assert html.index("Composition") < html.index("Stage timings")


def test_seed_summary_pools_composition_minus_arms(tmp_path):
    from raycurate.pipelines.proving_ground import summarize_seeds
    from raycurate.report.curation import aligned_scores, evaluated_models

    per_seed = {}
    for seed, gain in ((0, 0.25), (1, 0.0)):
        root = tmp_path / f"seed-{seed}"
        root.mkdir()
        manifest = _curate_run(root, gain)
        assert evaluated_models(manifest) == ["curate", "curate_bds", "curate_random"]
        _, label, scores = aligned_scores(root, manifest, evaluated_models(manifest))
        per_seed[seed] = (label, scores)
    summary = summarize_seeds(per_seed)
    assert set(summary["comparisons"]) == {"composition vs bds (matched tokens)",
                                           "composition vs random (matched tokens)",
                                           "BDS alone vs random rows (matched tokens)"}
    # BDS alone (0.25) minus random rows (0) on both seeds
    assert summary["comparisons"]["BDS alone vs random rows (matched tokens)"]["pooled"]["value"] == pytest.approx(
        0.25)
    bds = summary["comparisons"]["composition vs bds (matched tokens)"]
    assert bds["per_seed"]["0"]["value"] == pytest.approx(0.25) and bds["per_seed"]["1"]["value"] == 0.0
    assert bds["pooled"]["value"] == pytest.approx(0.125) and bds["seeds_excluding_zero"] == 1


def test_proving_ground_runs_the_configured_pipeline_per_seed(tmp_path, monkeypatch):
    from raycurate.config.schema import ProvingGroundConfig, RunConfig
    from raycurate.pipelines import curate, proving_ground, run_pipeline

    seen = []

    def fake_curate(cfg):
        seen.append((cfg.pipeline, cfg.data.corpus_seed))
        root = Path(cfg.run.runs_dir) / cfg.run.name
        root.mkdir(parents=True)
        return _curate_run(root, 0.25)

    monkeypatch.setattr(curate, "run_curate", fake_curate)
    cfg = JobConfig(pipeline="proving_ground", run=RunConfig(name="pg", runs_dir=str(tmp_path)),
                    proving_ground=ProvingGroundConfig(seeds=[3], pipeline="curate"))
    summary = proving_ground.run_proving_ground(cfg, run_pipeline)
    assert seen == [("curate", 3)] and summary["pipeline"] == "curate"
    assert summary["composition_budgets"]["3"]["arms"]["bds"] == {"rows": 80, "response_tokens": 1004,
                                                                  "clean_share": None}
    assert summary["separation"]["3"]["auroc_by_kind"]["truncated"]["auroc"] == 0.81
    html = (tmp_path / "pg" / "report.html").read_text()
    assert "composition vs bds (matched tokens)" in html
    assert "<td>truncated</td><td>0.81 (4)</td><td>0.81</td>" in html


def test_proving_ground_report_shows_the_lowest_auroc_of_each_kind_over_the_runs():
    from raycurate.report.proving_ground import render_proving_ground

    def kinds(swapped: float, truncated: float | None) -> dict:
        by_kind = {"swapped_entity": {"auroc": swapped, "rows": 10, "ci95": [0, 1]}}
        if truncated is not None:
            by_kind["truncated"] = {"auroc": truncated, "rows": 4, "ci95": [0, 1]}
        return {"auroc": (swapped + (truncated or swapped)) / 2, "auroc_by_kind": by_kind}

    summary = {"metric": "m", "seeds": [0, 1], "comparisons": {},
               "separation": {"0": kinds(0.95, 0.9), "1": kinds(0.91, None)}}
    html = render_proving_ground(summary)
    assert "<th>run 0</th><th>run 1</th><th>lowest</th>" in html
    assert "<td>swapped_entity</td><td>0.95 (10)</td><td>0.91 (10)</td><td>0.91</td>" in html
    assert "<td>truncated</td><td>0.90 (4)</td><td></td><td>0.90</td>" in html  # a run without the kind: blank
    assert "<td>all corrupted rows</td><td>0.93</td><td>0.91</td><td>0.91</td>" in html
    assert "Which bad rows" not in render_proving_ground({**summary, "separation": {}})


def test_arms_must_be_steps_or_random():
    from raycurate.config.curate import CurateConfig

    assert CurateConfig(steps=["dedup", "reference"], arms=["random", "reference"]).config_problems() == []
    assert CurateConfig(steps=["dedup", "reference"], arms=["bds"]).config_problems() == [
        "curate.arms: ['bds'] are not steps of curate.steps ['dedup', 'reference'] nor random"]


def test_a_step_with_a_minimum_score_keeps_the_rows_scoring_at_least_it():
    from raycurate.algorithms.composition import Step, apply_step

    step = Step("reference", scores={"a": -0.2, "b": -0.99, "c": -0.5}, min_score=-0.5)
    assert apply_step(["a", "b", "c"], step, keep_fraction=0.1, seed=0) == ["a", "c"]  # keep_fraction unused
    with pytest.raises(ValueError, match="min_score needs scores"):
        Step("dedup", dropped=frozenset(), min_score=0.0)


def test_matched_train_steps_give_a_subset_the_whole_pools_optimizer_steps(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from raycurate.config.curate import CurateConfig
    from raycurate.config.schema import JobConfig
    from raycurate.config.train import TrainConfig
    from raycurate.pipelines.curate import subset_train_config
    from raycurate.rundir import RunDir
    from raycurate.stages.base import StageOutput, run_stage

    def table(n):
        def body(out):
            (out / "tokens").mkdir()
            pq.write_table(pa.table({"id": [f"r{i:03d}" for i in range(n)]}), out / "tokens" / "part-00000.parquet")
            return StageOutput(outputs={"tokens": "tokens"})
        return body

    run = RunDir(tmp_path / "run")
    run_stage(run, "curate_pool_rows", table(883), config={})
    run_stage(run, "kept", table(401), config={})
    train = TrainConfig(epochs=1, effective_batch_size=8)
    cfg = JobConfig(train=train, curate=CurateConfig(train_steps="matched"))
    matched = subset_train_config(run, cfg, "kept")
    assert (matched.epochs, matched.max_steps) == (3, 110)  # 883 // 8 = 110 steps; 401 // 8 = 50 per epoch
    assert subset_train_config(run, JobConfig(train=train), "kept") == matched  # matched is the default
    assert subset_train_config(run, JobConfig(train=train, curate=CurateConfig(train_steps="epochs")), "kept") is train
    assert subset_train_config(run, cfg, "kept", whole_stage="kept").max_steps == 50  # matched to another whole


def test_composition_scores_rank_survivors_above_dropped_rows_then_by_the_last_score():
    from raycurate.algorithms.composition import Step, compose, composition_scores

    pool = ["a", "b", "c", "d", "e"]
    steps = [Step("dedup", dropped=frozenset({"b"})),
             Step("reference", scores={"a": 0.1, "b": 0.9, "c": 0.5, "d": 0.3, "e": 0.2})]
    history = compose(pool, steps, 0.5, seed=0)  # dedup keeps a c d e; reference keeps the top 2 of 4: c d
    assert history == [["a", "c", "d", "e"], ["c", "d"]]
    scores = composition_scores(pool, steps, history)
    # survived 2 steps: c, d; one step: a, e; none: b (its high reference score does not lift it)
    assert sorted(pool, key=lambda i: -scores[pool.index(i)]) == ["c", "d", "e", "a", "b"]
    assert composition_scores(pool, steps[:1], history[:1]).tolist() == [1, 0, 1, 1, 1]


def test_reference_losses_sorted_into_micro_batches_come_back_in_row_order():
    """supervised_losses cuts micro-batches from the rows sorted by length; each row's losses are those of the row
    scored alone, in the caller's order."""
    torch = pytest.importorskip("torch")
    from raycurate.models.tiny import build_tiny_model
    from raycurate.models.tokenizer import train_tokenizer
    from raycurate.stages.reference import supervised_losses

    tokenizer = train_tokenizer([f"row {i} has {i % 7} words here." for i in range(50)], vocab_size=300)
    model = build_tiny_model("tiny-llama", tokenizer, seed=0).eval()
    generator = torch.Generator().manual_seed(0)
    rows = []
    for length in (9, 3, 12, 5, 7, 4):
        ids = torch.randint(10, 200, (length,), generator=generator).tolist()
        rows.append({"input_ids": ids, "loss_mask": [0] * (length // 2) + [1] * (length - length // 2)})
    batched = supervised_losses({"m": model}, rows, pad_id=2, micro_batch=4)
    alone = supervised_losses({"m": model}, rows, pad_id=2, micro_batch=1)
    assert [len(x) for x in batched["m"]] == [sum(r["loss_mask"]) for r in rows]
    for got, want in zip(batched["m"], alone["m"]):
        assert got == pytest.approx(want, abs=1e-5)
