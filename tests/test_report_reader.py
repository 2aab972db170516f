"""The report answers a user: paper terms explained where they appear (or replaced by plain ones), numbers rounded,
and where the outputs are and what to do next.  Built from the synthetic runs of the other report tests (no Ray)."""

from __future__ import annotations

import html
import json
import re
from pathlib import Path

from test_report_browser import synthetic_run
from test_report_honesty import _curate_run

from raycurate.report.charts import num
from raycurate.report.html import render_report

RAW_FLOAT = 0.38648293963254593


def visible_text(page: str) -> str:
    """The report's text as a reader sees it: no CSS, no SVG, tags dropped, entities decoded."""
    page = re.sub(r"<style>.*?</style>|<svg.*?</svg>", " ", page, flags=re.S)
    return html.unescape(re.sub(r"<[^>]+>", " ", page))


def _full_run(root: Path) -> Path:
    """The synthetic run with every section, plus a random-search Tune trial whose parameter is a raw float and a
    BRIDGE coverage share stored unrounded."""
    run_dir = synthetic_run(root)
    manifest = json.loads((run_dir / "manifest.json").read_text())
    manifest["tune"]["rows"].append({"trial": 3, "param.bridge.rho_p": RAW_FLOAT, "metric": 1.1234567, "rung": 1,
                                     "status": "done"})
    manifest["tune"]["best"] = manifest["tune"]["rows"][-1]
    manifest["stages"]["bridge_select"]["metrics"]["final_answer_coverage_score_only"] = RAW_FLOAT
    (run_dir / "manifest.json").write_text(json.dumps(manifest))
    return run_dir


def test_num_rounds_floats_and_leaves_the_rest():
    assert num(RAW_FLOAT) == "0.386" and num(1.0) == "1" and num(0.75) == "0.75" and num(1051.0) == "1051"
    assert num(3) == "3" and num("x") == "x" and num(True) == "True" and num(float("nan")) == "nan"


def test_no_raw_float_reaches_the_reader(tmp_path):
    text = visible_text(render_report(_full_run(tmp_path / "run")))
    assert "0.38648293963254593" not in text and "0.386" in text  # the Tune parameter and the coverage share
    assert not re.findall(r"\d\.\d{6,}", text)


def test_paper_terms_are_explained_where_they_appear(tmp_path):
    text = " ".join(visible_text(render_report(_full_run(tmp_path / "run"))).split())
    # paper figure and table numbers, and the papers' symbols, are gone
    for gone in ("Table 7", "Table 3", "Fig. 2", "Fig 2", "rho_P", "s_final", "precision_selected", "tau=",
                 "BRIDGE aggregates", "Realised budgets"):
        assert gone not in text, gone
    explained = {
        "U_sur": "The surrogate utility (U_sur) of a row's selection is BRIDGE's first-order estimate of how much "
                 "training on the selected tokens lowers the target loss",
        "AER": "seconds of fine-tuning the whole model on every row (the P2D paper's AER); below 1 P2D was cheaper",
        "W1": "the W1 (earth mover's) distance between the head's weight distributions before and after",
        "sigma(omega)": "The weight BDS learned for each row (sigma(omega), mean 1;",
        "AUROC": "(the chance that a random clean row outweighs a random corrupted one: 0.5 is chance, 1 perfect)",
        "Spearman": "Spearman: rank correlation (1 = same order)",
        "regret": "Normalised regret: share of the exact utility lost by selecting with the fast score",
        "shift": "Shift = 1 minus the rank correlation between a side's token ranking",
        "General Avg": "General Avg: mean of the general benchmarks",
        "config hash": "The config hash identifies a stage's settings and inputs",
        "rung": "Rung: how many rounds of training a trial reached",
    }
    for term, explanation in explained.items():
        assert explanation in text, term
        assert text.index(explanation) <= text.index(term) + 600, f"{term} is explained far from where it appears"


def test_curation_terms_are_explained(tmp_path):
    run_dir, _ = _curate_run(tmp_path / "curate")
    text = " ".join(visible_text(render_report(run_dir)).split())
    assert "The oracle gap, clean minus mixed, is the most that removing bad rows can gain." in text
    assert "clean (SFT on the pool's clean rows only: what perfect curation could reach)" in text
    assert ("Each of these alternatives (an arm) is cut to the same number of response tokens as the composition "
            "trains on (T = 1000)") in text
    assert "each ranking step keeps 60% of the rows it receives; BDS mode select" in text


def test_the_report_says_where_the_outputs_are_and_what_to_do_next(tmp_path):
    run_dir, manifest = _curate_run(tmp_path / "curate")
    manifest["stages"]["train_curate"] = {"status": "done", "seconds": 3.0, "outputs": {"model": "train_curate/model"}}
    manifest["rows"] = {"input": 10, "accepted": 9, "rejected": 1, "rejected_files": ["ingest/rejected.jsonl"]}
    (run_dir / "manifest.json").write_text(json.dumps(manifest))
    page = render_report(run_dir)
    assert "<a href='#outputs'>where the outputs are and what to do next</a>" in page
    outputs = page[page.index("<h2 id='outputs'>"):page.index("<h2 id='rows'>")]
    for path in ("config.yaml", "manifest.json", "train_curate/model", "eval_curate/predictions.parquet",
                 "ingest/rejected.jsonl"):
        assert f"<a href='{path}'><code>{path}</code></a>" in outputs, path
    text = " ".join(visible_text(outputs).split())
    assert "raycurate run jobs/proving_ground.yaml" in text  # one seed: repeat over several before trusting it
    assert "raycurate eval RUN_DIR --model-stage train_curate --tasks arc_challenge,hellaswag" in text
    assert "raycurate run RUN_DIR/config.yaml train.lr=1e-4 run.name=lr1e-4" in text
    assert "raycurate curate --data rows.jsonl --trusted checked.jsonl" in text


def test_a_curate_command_report_keeps_its_own_section_first_and_points_there(tmp_path):
    run_dir, manifest = _curate_run(tmp_path / "out" / "run")
    manifest["results"]["user_curate"] = {
        "out_dir": "..", "rows": {"input": 5, "kept": 3, "dropped": 1, "rejected": 1, "kept_uncurated": {},
                                  "dropped_by_step": {"bds": 1}, "rejected_by_reason": {"empty_field": 1}},
        "files": {"curated": "curated.jsonl"}, "trusted": {"accepted": 4},
        "settings": {"steps": ["bds", "bridge"], "keep_fraction": 0.6}}
    (run_dir / "manifest.json").write_text(json.dumps(manifest))
    page = render_report(run_dir, tmp_path / "out")
    assert page.index("<h2 id='your-data'>") < page.index("<h2 id='summary'>")
    assert "<h2 id='outputs'>" not in page and "<a href='#your-data'>where the outputs are" in page
    assert ("<ol><li><b>bds</b>: keep the top rows by their learned BDS weight (bilevel data selection)</li><li>"
            "<b>bridge</b>: token-level: BRIDGE token selection") in page
