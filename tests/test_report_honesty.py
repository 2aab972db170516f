"""The report answers "did curation help?" honestly: it says plainly when no fine-tuned arm beats the base model,
never reads a share of the oracle gap as success when there is no gap, shows the curate run's absolute scores,
oracle gap, BDS alone vs random rows and share of the gap closed, names every chart's axes, says which seeds it
pooled and prints no absolute path of the machine.  Built from hand-made held-out predictions (no Ray)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from test_report_browser import synthetic_run

from raycurate.pipelines.proving_ground import summarize_seeds
from raycurate.report.composition import section_composition
from raycurate.report.curation import curation_comparisons, metric_block, oracle_sentence, section_curation
from raycurate.report.html import render_report
from raycurate.report.proving_ground import render_proving_ground, seeds_text

N = 200


def _first(k: int) -> np.ndarray:
    """(N,) 0/1 scores: the first ``k`` questions right (mean k / N)."""
    return (np.arange(N) < k).astype(float)


def _write_eval(root: Path, stages: dict, model: str, greedy: np.ndarray, sampled: np.ndarray) -> None:
    folder = root / f"eval_{model}"
    folder.mkdir(parents=True)
    pq.write_table(pa.table({"id": [f"q{i:03d}" for i in range(N)], "correct": greedy.astype(bool).tolist(),
                             "sampled_accuracy": sampled.tolist()}), folder / "predictions.parquet")
    stages[f"eval_{model}"] = {"status": "done", "seconds": 1.0,
                               "outputs": {"predictions": f"eval_{model}/predictions.parquet"}}


def _demo_run(root: Path, scores: dict[str, tuple[np.ndarray, np.ndarray]]) -> tuple[Path, dict]:
    stages: dict = {}
    for model, (greedy, sampled) in scores.items():
        _write_eval(root, stages, model, greedy, sampled)
    manifest = {"run": "t", "pipeline": "demo", "stages": stages}
    (root / "manifest.json").write_text(json.dumps(manifest))
    return root, manifest


def test_base_beating_every_arm_is_said_plainly_for_greedy_and_sampled(tmp_path):
    # base 0.60; mixed 0.40, clean 0.50 (a real oracle gap of +0.10), bridge 0.45: half the gap, all below base
    run_dir, manifest = _demo_run(tmp_path, {m: (_first(k), _first(k)) for m, k in (
        ("base", 120), ("mixed", 80), ("clean", 100), ("bridge", 90), ("random", 80))})
    html = section_curation(run_dir, manifest)
    for metric in ("greedy exact match", "sampled exact match"):
        assert f"No fine-tuned arm beats the base model in {metric}</b>: base model 0.600 [" in html
    assert html.index("No fine-tuned arm beats") < html.index("Oracle gap")  # the answer comes first
    assert "clean, scores 0.500" in html and "clean minus base -0.100 [" in html
    assert "the clean model itself does not beat the base model" in html
    # the gap is real (+0.10), so bridge's share is 0.5, but it is not read as a gain: it is below base
    assert "0.50 (not above base)" in html
    (bridge,) = curation_comparisons(run_dir, manifest)["methods"]
    assert bridge["gap_closed"] == pytest.approx(0.5) and bridge["vs_base"]["value"] == pytest.approx(-0.15)


def test_arms_that_beat_base_are_named_with_their_paired_interval(tmp_path):
    run_dir, manifest = _demo_run(tmp_path, {m: (_first(k), _first(k)) for m, k in (
        ("base", 40), ("mixed", 80), ("clean", 100))})
    html = section_curation(run_dir, manifest)
    assert "2 of 2 fine-tuned arms beat the base model in greedy exact match</b>" in html
    assert "mixed +0.200 [" in html and "clean +0.300 [" in html and "No fine-tuned arm" not in html


def test_oracle_interval_including_zero_means_no_share_of_the_gap_closed(tmp_path):
    mixed = _first(80)
    clean = mixed.copy()
    clean[:5], clean[80:85] = 0.0, 1.0  # same mean, five questions swapped each way: the gap is noise
    run_dir, manifest = _demo_run(tmp_path, {"base": (_first(20), _first(20)), "mixed": (mixed, mixed),
                                             "clean": (clean, clean), "bridge": (_first(120), _first(120)),
                                             "random": (mixed, mixed)})
    comparisons = curation_comparisons(run_dir, manifest)
    assert comparisons["oracle"]["low"] < 0 < comparisons["oracle"]["high"]
    assert "gap_closed" not in comparisons["methods"][0]
    assert all(block["gap_closed"] == {} for block in comparisons["by_metric"].values())
    html = section_curation(run_dir, manifest)
    assert html.count("No oracle gap: its interval includes 0") == 2  # greedy and sampled
    assert "share of the gap closed is not meaningful" in html and "n/a: no oracle gap" in html
    assert "A method can close at most this gap" not in html


def test_oracle_below_zero_is_said_to_lie_below_zero():
    block = metric_block("greedy exact match", {"mixed": _first(100), "clean": _first(60)})
    assert block["oracle"]["high"] < 0 and block["gap_closed"] == {} and block["vs_base"] == {}
    assert "its interval lies below 0" in oracle_sentence(block)


def _curate_run(root: Path) -> tuple[Path, dict]:
    """A curate run: base 0.40, mixed 0.40, clean 0.60, composition 0.55, BDS alone 0.50, random rows 0.40 (greedy);
    sampled scores are half of those."""
    stages: dict = {}
    scores = {"base": 80, "mixed": 80, "clean": 120, "curate": 110, "curate_bds": 100, "curate_random": 80}
    for model, k in scores.items():
        _write_eval(root, stages, model, _first(k), 0.5 * _first(k))
    arms = {name: {"model": model, "rows": 50, "response_tokens": 1000, "clean_share": 0.9}
            for name, model in (("composition", "curate"), ("bds", "curate_bds"), ("random", "curate_random"))}
    manifest = {"run": "c", "pipeline": "curate", "stages": stages, "results": {"composition": {
        "steps": ["bds", "bridge"], "keep_fraction": 0.6, "bds_mode": "select", "budget_tokens": 1000,
        "metric": "sampled_accuracy", "metric_label": "sampled exact match", "questions": N, "arms": arms}}}
    (root / "manifest.json").write_text(json.dumps(manifest))
    return root, manifest


def test_curate_page_shows_absolute_scores_oracle_gap_bds_vs_random_and_share_closed(tmp_path):
    run_dir, manifest = _curate_run(tmp_path)
    html = section_composition(run_dir, manifest)
    assert "<h3>Absolute scores</h3>" in html
    for name, greedy, sampled in (("base model", "0.400", "0.200"), ("mixed (all pool rows)", "0.400", "0.200"),
                                  ("clean (clean pool rows)", "0.600", "0.300"), ("composition", "0.550", "0.275"),
                                  ("BDS alone", "0.500", "0.250"), ("random rows", "0.400", "0.200")):
        assert re.search(rf"<td>{re.escape(name)}</td><td>{greedy} \[[^<]*</td><td>[^<]*</td><td>{sampled} \[", html)
    assert "Oracle gap in greedy exact match (SFT on the clean rows minus SFT on all rows): <b>+0.200 [" in html
    assert "Oracle gap in sampled exact match (SFT on the clean rows minus SFT on all rows): <b>+0.100 [" in html
    assert "BDS alone +0.100 [" in html and "BDS alone +0.050 [" in html  # minus random rows, greedy and sampled
    # (arm - mixed) / (clean - mixed) = (0.55 - 0.4) / 0.2, (0.5 - 0.4) / 0.2, 0
    assert "composition 0.75; BDS alone 0.50; random rows 0.00" in html
    assert "3 of 5 fine-tuned arms beat the base model in greedy exact match" in html  # clean, composition, BDS
    assert "The other 2 (mixed (all pool rows), random rows) do not." in html


def test_curate_page_without_references_says_the_share_is_undefined(tmp_path):
    run_dir, manifest = _curate_run(tmp_path)
    for model in ("base", "mixed", "clean"):
        del manifest["stages"][f"eval_{model}"]
    html = section_composition(run_dir, manifest)
    assert "the base model was not evaluated" in html and "no oracle gap measured" in html
    assert "share of the gap closed is undefined" in html and "BDS alone +0.100 [" in html


def test_rendered_report_carries_no_absolute_path(tmp_path):
    run_dir, _ = _curate_run(tmp_path / "curate-run")
    html = render_report(run_dir) + render_report(synthetic_run(tmp_path / "browser-demo"))
    assert str(tmp_path) not in html
    for prefix in ("/work/", "/tmp/", "/home/", "/root/", "/Users/"):
        assert prefix not in html


def test_every_chart_has_a_title_and_both_axis_labels(tmp_path):
    html = render_report(synthetic_run(tmp_path / "browser-demo"))
    charts = re.findall(r"<svg.*?</svg>", html, flags=re.S)
    assert len(charts) >= 6  # timings, gold loss, U_sur, corpus x2, heatmap, histogram, tune scatter
    for chart in charts:
        for cls in ("chart-title", "x-label", "y-label"):
            assert re.search(rf"<text class='{cls}'[^>]*>[^<]+</text>", chart), (cls, chart[:200])
        assert re.search(r"aria-label='[^']+'", chart)
    titles = re.findall(r"<text class='chart-title'[^>]*>([^<]+)</text>", html)
    assert "Wall time per stage (lower is better)" in titles
    assert "Held-out gold-response loss per model (lower is better)" in titles
    assert any(t.endswith("vs bridge.rho_p (lower is better)") for t in titles)  # the sweep minimises its metric


def test_seed_wording_says_which_seeds_and_how_many():
    assert seeds_text([0, 1, 2]) == "seeds 0, 1, 2 (3 seeds)"
    assert seeds_text([7]) == "1 seed (seed 7)"
    base, mixed, clean = _first(120), _first(80), _first(100)
    summary = summarize_seeds({7: ("greedy exact match", {"base": base, "mixed": mixed, "clean": clean})})
    html = render_proving_ground(summary)
    assert "pooled over 1 seed (seed 7)" in html and "seeds != 0" not in html and "the 1 seeds" not in html
    assert "No fine-tuned arm beats the base model in greedy exact match</b> (pooled)" in html
    assert summary["comparisons"]["clean vs base"]["pooled"]["value"] == pytest.approx(-0.1)


def test_curate_run_report_opens_with_the_base_verdict_over_every_arm(tmp_path):
    run_dir, _ = _curate_run(tmp_path)
    html = render_report(run_dir)
    top = html[html.index("Did curation help?"):html.index("<h2 id='composition'>")]
    assert "3 of 5 fine-tuned arms beat the base model in greedy exact match" in top
    assert "composition +0.150 [" in top and "BDS alone +0.100 [" in top
    assert "Oracle gap in greedy exact match" in top and "href='#composition'" in top


def test_pool_only_pools_the_seed_runs_on_disk_without_running_them(tmp_path):
    from raycurate.config.loader import from_dict
    from raycurate.config.schema import JobConfig
    from raycurate.errors import UserError
    from raycurate.pipelines.proving_ground import run_proving_ground

    for seed, clean in ((0, 150), (1, 140)):
        folder = tmp_path / "pg" / f"seed-{seed}"
        folder.mkdir(parents=True)
        _demo_run(folder, {"base": (_first(10), _first(5)), "mixed": (_first(100), _first(80)),
                           "clean": (_first(clean), _first(clean - 20))})
    cfg = from_dict(JobConfig, {"pipeline": "proving_ground", "run": {"name": "pg", "runs_dir": str(tmp_path)},
                                "proving_ground": {"seeds": [0, 1], "pool_only": True}})

    def never_run(cfg):
        pytest.fail("pool_only ran a pipeline")

    summary = run_proving_ground(cfg, never_run)
    oracle = summary["comparisons"]["oracle: clean vs mixed"]
    assert sorted(oracle["per_seed"]) == ["0", "1"]
    assert oracle["per_seed"]["0"]["value"] == pytest.approx(0.25)  # greedy (no sampling recorded): 150 - 100 of 200
    assert (tmp_path / "pg" / "report.html").is_file()
    cfg = from_dict(JobConfig, {"pipeline": "proving_ground", "run": {"name": "pg", "runs_dir": str(tmp_path)},
                                "proving_ground": {"seeds": [0, 2], "pool_only": True}})
    with pytest.raises(UserError, match="seed-2/manifest.json does not exist"):
        run_proving_ground(cfg, never_run)


def test_curate_page_shows_how_well_the_steps_ranking_finds_each_corruption_kind(tmp_path):
    run_dir, manifest = _curate_run(tmp_path)
    assert "Which bad rows the steps found" not in section_composition(run_dir, manifest)  # unlabelled: no table
    manifest["results"]["composition"]["separation"] = {
        "auroc": 0.915, "auroc_by_kind": {"near_duplicate": {"auroc": 0.955, "ci95": [0.91, 0.99], "rows": 58},
                                          "swapped_entity": {"auroc": 0.851, "ci95": None, "rows": 120}}}
    html = section_composition(run_dir, manifest)
    assert "Which bad rows the steps found" in html and "overall 0.92" in html  # rounded for a reader
    assert "<td>near_duplicate</td><td>58</td><td>0.95</td><td>[0.91, 0.99]</td>" in html
    assert "<td>swapped_entity</td><td>120</td><td>0.85</td><td></td>" in html
