"""`raycurate demo` end to end on a small corpus: row accounting, resume, downstream-only re-runs, report."""

from __future__ import annotations

import json

import pytest
from tiny_demo import copy_tiny_demo

from raycurate.cli.main import main

# The shared tiny demo (tests/tiny_demo.py: six trainings, six evaluations) runs once per session; these
# tests read it, re-run a copy and render its report.
# Under pytest -n 2 this module and test_bridge_score_select run on one worker (tests/xdist_units.py).
pytestmark = [pytest.mark.slow, pytest.mark.ray, pytest.mark.timeout(1800)]


def _finished(run_dir) -> dict[str, float]:
    manifest = json.loads((run_dir / "manifest.json").read_text())
    return {name: rec["finished"] for name, rec in manifest["stages"].items()}


def test_demo_end_to_end_resume_and_rerun_downstream_only(tiny_demo, tmp_path):
    run_dir, _, out = tiny_demo
    assert "report:" in out and "held-out clean" in out

    manifest = json.loads((run_dir / "manifest.json").read_text())
    rows = manifest["rows"]
    assert rows["input"] == 168 and rows["accepted"] == 160 and rows["rejected"] == 8
    assert rows["input"] == rows["accepted"] + rows["rejected"]
    assert rows["rejected_by_reason"] == {
        "malformed_json": 1, "missing_field": 1, "empty_field": 1, "wrong_type": 1, "duplicate_id": 1,
        "unknown_domain": 1, "non_utf8": 1, "over_length": 1,
    }
    rejected = [json.loads(line) for f in rows["rejected_files"] for line in (run_dir / f).read_text().splitlines()]
    assert len(rejected) == 8 and all(r["reason"] and r["line"] for r in rejected)
    methods = ("mixed", "clean", "bridge", "random", "token_cleaning")
    expected = {"corpus", "base_model", "ingest", "tokenize", "subset_clean", "eval_base",
                *(f"train_{m}" for m in methods), *(f"eval_{m}" for m in methods),
                "trusted", "tokenize_trusted",  # BRIDGE's direction reads the trusted set, not a validation split
                "bridge_warmup_rows", "bridge_selection_rows", "bridge_warmup",
                "bridge_direction", "bridge_score", "bridge_select", "bridge_compact", "bridge_diagnostics",
                *(f"baseline_{b}_{k}" for b in ("random", "token_cleaning") for k in ("masks", "compact")),
                *(f"lm_eval_{m}" for m in ("base", "mixed", "clean", "bridge"))}
    assert set(manifest["stages"]) == expected
    assert all(rec["status"] == "done" and rec["seconds"] >= 0 for rec in manifest["stages"].values())
    assert manifest["stages"]["train_mixed"]["metrics"]["steps"] == 2
    assert (run_dir / "train_mixed/model/config.json").exists()
    assert (run_dir / "config.yaml").exists()
    heldout = manifest["results"]["heldout"]
    assert set(heldout) == {"base", *methods} and all(m["rows"] == 10 for m in heldout.values())
    select = manifest["stages"]["bridge_select"]["metrics"]
    assert select["budget_exact_share"] == 1.0
    assert select["final_answer_coverage_closure"] >= max(0.9, select["final_answer_coverage_score_only"])
    assert select["u_sur_alternating"] >= select["u_sur_one_pass"] - 1e-9
    assert manifest["stages"]["bridge_diagnostics"]["metrics"]["examples"] == 4
    report = (run_dir / "report.html").read_text()
    for section in ("Row accounting", "Stage timings", "Held-out evaluation", "Embedded corpus"):
        assert section in report

    # Re-runs work on a copy in another folder: nothing in a stage's key depends on where the run directory is.
    copy = tmp_path / "demo_copy"
    args = copy_tiny_demo(tiny_demo, copy)
    before = _finished(copy)
    assert main(args) == 0
    assert _finished(copy) == before, "an unchanged re-run must skip every stage"

    assert main([*args, "eval.lm_eval_limit=5"]) == 0
    after = _finished(copy)
    rerun = {name for name in before if after[name] != before[name]}
    assert rerun == {name for name in before if name.startswith("lm_eval_")}, "only lm-eval reads lm_eval_limit"


def test_demo_report_renders_in_chromium_without_errors(tiny_demo, tmp_path):
    """The demo's own report (not a synthetic one) in headless Chromium."""
    from browser import Chromium, find_chromium

    if find_chromium() is None:
        pytest.skip("no chromium on PATH (scripts/install_chromium.sh installs it)")
    run_dir, _, _ = tiny_demo
    with Chromium() as browser:
        page = browser.open(run_dir / "report.html")
        ids = page.evaluate("[...document.querySelectorAll('h2[id]')].map(h => h.id)")
        page.screenshot(tmp_path / "report.png")
    assert not page.errors, page.errors
    assert {"summary", "rows", "timings", "results", "lm_eval", "corpus"} <= set(ids)
    assert (tmp_path / "report.png").stat().st_size > 10_000
