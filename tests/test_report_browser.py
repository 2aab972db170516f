"""The HTML report in headless Chromium: it loads without console errors and shows every section it renders.

Needs a Chromium binary (``bash scripts/install_chromium.sh`` installs Debian's ``chromium``); skipped without one.
The screenshot is saved as ``report.png`` in the run directory.
"""

from __future__ import annotations

import json
import re
import struct
from pathlib import Path

import pytest
from browser import Chromium, find_chromium

from raycurate.report.html import write_run_report

pytestmark = pytest.mark.skipif(
    find_chromium() is None,
    reason="no Chromium on PATH; install it with `bash scripts/install_chromium.sh` (Debian package chromium)",
)

# Sections the synthetic run below must produce; sections added to the report later are checked too (every
# <h2 id> in the file must render), but only once the synthetic manifest carries their data.
EXPECTED_SECTIONS = {"summary", "rows", "timings", "results", "lm_eval", "bridge", "p2d", "bilevel", "tune", "corpus"}

SECTION_BOXES_JS = """[...document.querySelectorAll('h2[id]')].map(h => {
  const box = h.getBoundingClientRect();
  return {id: h.id, text: h.textContent.trim(), width: box.width, height: box.height};
})"""


def _stage(seconds: float, metrics: dict | None = None, status: str = "done") -> dict:
    return {"status": status, "seconds": seconds, "config_hash": f"h{int(seconds * 10):04d}", "outputs": {},
            "metrics": metrics or {}}


def _word_offsets(text: str) -> list[int]:
    """Flattened ``start, end`` character offsets of the space-separated words of ``text``."""
    return [value for match in re.finditer(r"\S+", text) for value in match.span()]


def _selection_row() -> dict:
    prompt = "Ann buys 3 bags of 4 apples. Bob is tall. How many apples does Ann have?"
    response = "She buys 3 * 4 = 12 apples.\n#### 12"
    prompt_offsets, response_offsets = _word_offsets(prompt), _word_offsets(response)
    n_prompt, n_response = len(prompt_offsets) // 2, len(response_offsets) // 2
    keep = [0 if word in ("Bob", "is", "tall.") else 1 for word in prompt.split()]
    supervised = [0 if word == "She" else 1 for word in response.split()]
    return {"id": "bench-000001", "domain": "math", "prompt": prompt, "response": response, "prompt_len": n_prompt,
            "prompt_offsets": prompt_offsets, "response_offsets": response_offsets, "sel_prompt_keep": keep,
            "sel_loss_mask": [0] * n_prompt + supervised, "sel_kept_prompt": sum(keep),
            "sel_eligible_prompt": n_prompt, "sel_supervised_response": sum(supervised),
            "sel_eligible_response": n_response}


def synthetic_run(root: Path) -> Path:
    """A run directory with a manifest (and side files) that exercises every report section."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    root.mkdir(parents=True)
    (root / "config.yaml").write_text("pipeline: bridge\n")
    select_metrics = {"prompt_budget_ratio": 0.7, "response_budget_ratio": 0.7, "budget_exact_share": 1.0,
                      "final_answer_coverage_closure": 1.0, "final_answer_coverage_score_only": 0.95,
                      "distractor_dropped_share": 0.62, "relevant_dropped_share": 0.08, "u_sur_independent": 1.2,
                      "u_sur_one_pass": 1.4, "u_sur_alternating": 1.5}
    stages = {
        "corpus": _stage(0.4, {"summary": {"domains": {"math": 60, "code": 20, "instruction": 20},
                                           "corruptions": {"none": 70, "wrong_final_answer": 6, "truncated": 6}}}),
        "ingest": _stage(1.2),
        "tokenize": _stage(2.5),
        "train_mixed": _stage(30.0, {"steps": 10}),
        "bridge_select": _stage(4.2, select_metrics),
        "bridge_compact": _stage(1.1, {"executed_token_ratio": 0.74}),
        "eval_mixed": _stage(3.0),
        "eval_bridge": _stage(3.1, status="failed"),
        "p2d_heads": dict(_stage(2.0, {"selected": 2}), outputs={"heads": "p2d_heads/heads.json"}),
        "p2d_select": _stage(5.0, {"pool": 100, "selected": 10, "precision_selected": 0.9,
                                   "precision_random": 0.7, "precision_pool": 0.7}),
        "lm_eval_bridge": dict(_stage(6.0, {"raycurate_heldout_em/exact_match/none": 0.25, "general_avg": 0.4,
                                            "target": 0.2, "overall_avg": 0.3}),
                               outputs={"lm_eval": "lm_eval_bridge/lm_eval.json"}),
    }
    heldout = {name: {"rows": 10, "exact_match": em, "gold_loss": loss, "answer_format_rate": 0.9,
                      "equation_accuracy": 0.8, "unsafe_rate": 0.0}
               for name, em, loss in (("base", 0.1, 2.3), ("mixed", 0.3, 1.2), ("bridge", 0.4, 1.1))}
    tune_rows = [{"trial": i, "param.bridge.rho_p": rho, "metric": loss, "rung": 1, "status": "done"}
                 for i, (rho, loss) in enumerate(((0.5, 1.3), (0.75, 1.2), (1.0, 1.25)))]
    extra = {
        "p2d": {"aer": {"selection_seconds": 7.0, "adaptation_seconds": 10.0, "full_sft_seconds": 30.0,
                        "aer": 17 / 30}},
        "bilevel": {"methods": {"bds": {"auroc": 0.85, "weights_by_label": {"clean": [1.2, 1.1, 1.3],
                                                                             "corrupted": [0.4, 0.6]},
                                        "top": [{"id": "ex1", "sigma": 1.3, "clean": True}],
                                        "bottom": [{"id": "ex9", "sigma": 0.4, "clean": False,
                                                    "corruption": "wrong_final_answer"}]}},
                    "losses": {"bds": {"validation_loss": 1.1, "train_loss": 1.3}}},
        "tune": {"name": "budgets", "trials": 3, "finished": 3, "search": "grid", "scheduler": "none",
                 "metric": "results.heldout.bridge.gold_loss", "mode": "min", "params": ["bridge.rho_p"],
                 "rows": tune_rows, "best": tune_rows[1], "best_config": "tune/best.yaml"},
    }
    (root / "p2d_heads").mkdir()
    (root / "p2d_heads" / "heads.json").write_text(json.dumps({
        "method": "w1", "tau": 0.1, "ratio": 0.1, "n_layers": 2, "n_heads": 4,
        "heads": [{"layer": layer, "head": head, "score": 0.1 * (layer * 4 + head), "rank": 8 - (layer * 4 + head),
                   "selected": layer * 4 + head >= 6} for layer in range(2) for head in range(4)]}))
    manifest = {"run": root.name, "pipeline": "bridge", "stages": stages, "results": {"heldout": heldout}, **extra,
                "rows": {"input": 108, "accepted": 100, "rejected": 8,
                         "rejected_by_reason": {"bad_json": 3, "over_length": 5},
                         "rejected_files": ["ingest/rejected.jsonl"]}}
    (root / "manifest.json").write_text(json.dumps(manifest, indent=2))
    (root / "bridge_diagnostics").mkdir()
    fidelity = {"examples": 4,
                "table": [{"side": side, "proxy": "attention", "spearman": 0.8, "top_b_overlap": 0.7, "jaccard": 0.6,
                           "normalized_regret": 0.1} for side in ("prompt", "response")],
                "ranking_shift": {"retention": [0.25, 0.5, 1.0], "prompt_shift": [0.3, 0.2, 0.0],
                                  "response_shift": [0.2, 0.1, 0.0]}}
    (root / "bridge_diagnostics" / "fidelity.json").write_text(json.dumps(fidelity))
    (root / "bridge_select" / "selection").mkdir(parents=True)
    pq.write_table(pa.Table.from_pylist([_selection_row()]), root / "bridge_select" / "selection" / "part-0.parquet")
    return root


def png_size(path: Path) -> tuple[int, int]:
    """(width, height) from a PNG's IHDR chunk."""
    data = path.read_bytes()[:24]
    assert data[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    return struct.unpack(">II", data[16:24])


def test_report_renders_every_section_without_console_errors(tmp_path):
    run_dir = synthetic_run(tmp_path / "browser-demo")
    report = write_run_report(run_dir)
    rendered_ids = re.findall(r"<h2 id='([^']+)'", report.read_text())
    missing = EXPECTED_SECTIONS - set(rendered_ids)
    assert not missing, f"the synthetic run does not produce sections {missing}"

    with Chromium() as browser:
        page = browser.open(report)
        boxes = page.evaluate(SECTION_BOXES_JS)
        tables, charts = page.evaluate("document.querySelectorAll('table').length"), page.evaluate(
            "[...document.querySelectorAll('svg')].filter(s => s.getBoundingClientRect().height > 0).length")
        title = page.evaluate("document.title")
        screenshot = page.screenshot(run_dir / "report.png")
        errors = list(page.errors)

    assert errors == [], f"the report logged errors in Chromium: {errors}"
    assert title == "raycurate: browser-demo"
    assert [box["id"] for box in boxes] == rendered_ids
    hidden = [box["id"] for box in boxes if not (box["width"] > 0 and box["height"] > 0 and box["text"])]
    assert hidden == [], f"sections without a visible heading: {hidden}"
    assert tables >= 6 and charts >= 4
    width, height = png_size(screenshot)
    assert width > 0 and height > 900  # the whole page, taller than the 900-pixel viewport
    print(f"screenshot: {screenshot}")


def test_driver_reports_console_errors_exceptions_and_failed_loads(tmp_path):
    page_file = tmp_path / "broken.html"
    page_file.write_text("<!doctype html><html><body><h2 id='only'>x</h2><img src='missing.png'>"
                         "<script>console.error('boom', 7); notDefined();</script></body></html>")
    with Chromium() as browser:
        page = browser.open(page_file)
        ids = page.evaluate("[...document.querySelectorAll('h2[id]')].map(h => h.id)")
    assert ids == ["only"]
    assert any(e == "console.error: boom 7" for e in page.errors), page.errors
    assert any("ReferenceError" in e and "notDefined" in e for e in page.errors), page.errors
    assert any("missing.png" in e for e in page.errors), page.errors
