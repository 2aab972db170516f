"""The Python API (raycurate/api.py): config validation, input conversion, workspaces, and the README example."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

import raycurate
from raycurate.config.loader import ConfigError
from raycurate.errors import InputError, UserError

README = Path(__file__).resolve().parents[1] / "README.md"


def rows(n: int = 40, seed: int = 0) -> list[dict]:
    from raycurate.data.corpus import generate_corpus

    return generate_corpus(n, seed=seed)


# ------------------------------------------------------------------------------------------ no Ray needed


def test_bad_keywords_raise_the_config_error_before_anything_runs(tmp_path):
    with pytest.raises(ConfigError, match=r"raycurate\.bridge_select\(\) has 1 problem: bridge\.rho_p: 1\.5 must be "):
        raycurate.bridge_select(rows(), rho_p=1.5, workdir=tmp_path / "w")
    with pytest.raises(ConfigError, match=r"train\.lrr: unknown key \(did you mean train\.lr\?\)"):
        raycurate.train(rows(), train={"lrr": 1e-3}, workdir=tmp_path / "w")
    with pytest.raises(ConfigError, match=r"train\.effective_batch_size: 6 must be a multiple"):
        raycurate.train(rows(), config={"train.effective_batch_size": 6}, workdir=tmp_path / "w")
    with pytest.raises(ConfigError, match=r"needs a split named 'warmup'"):
        raycurate.bridge_select(rows(), config={"data": {"split_ratios": {"selection": 1.0}}}, workdir=tmp_path / "w")
    assert not (tmp_path / "w").exists()  # nothing written


def test_curate_checks_steps_and_keywords_before_anything_runs(tmp_path):
    with pytest.raises(ConfigError, match=r"raycurate\.curate\(\) has 1 problem: curate\.steps: 'bridge' must be the "
                                          r"last step"):
        raycurate.curate(rows(), steps=["bridge", "dedup"], workdir=tmp_path / "w")
    with pytest.raises(ConfigError, match=r"curate\.keep_fraction: 0\.0 must be > 0"):
        raycurate.curate(rows(), keep_fraction=0.0, workdir=tmp_path / "w")
    with pytest.raises(ConfigError, match=r"compare must be a bool, got str 'no'"):
        raycurate.curate(rows(), compare="no", workdir=tmp_path / "w")
    assert not (tmp_path / "w").exists()  # nothing written


def test_job_config_layers_and_section_dataclasses():
    from raycurate.api import job_config
    from raycurate.config.train import TrainConfig

    cfg = job_config("train", "sft", defaults={"train.lr": 1.0}, config={"train": {"epochs": 3}},
                     sections={"train": TrainConfig(lr=0.5, epochs=2), "bridge": {"last_layers": 2}},
                     keys={"train.lr": 0.25, "train.epochs": None})
    assert (cfg.train.lr, cfg.train.epochs, cfg.bridge.last_layers, cfg.pipeline) == (0.25, 2, 2, "sft")


def test_write_source_is_content_addressed(tmp_path):
    import pyarrow as pa

    from raycurate.stages.tables import write_source

    data = rows(10)
    first = write_source(data, tmp_path)
    mtime = (Path(first) / "rows.jsonl").stat().st_mtime_ns
    assert write_source([dict(r) for r in data], tmp_path) == first  # same rows, same folder, file untouched
    assert (Path(first) / "rows.jsonl").stat().st_mtime_ns == mtime
    table = write_source(pa.Table.from_pylist(data), tmp_path)
    assert table != first and (Path(table) / "rows.parquet").is_file()
    assert [p.name for p in tmp_path.iterdir()] == [Path(table).name]  # earlier inputs removed
    with pytest.raises(InputError, match="cannot read int as rows"):
        write_source(3, tmp_path)


def test_heldout_rows_from_every_source(tmp_path):
    import pyarrow as pa

    from raycurate.data.corpus import generate_heldout
    from raycurate.stages.tables import source_rows

    held = generate_heldout(3, seed=0)
    path = tmp_path / "h.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in held))
    assert source_rows(path) == held == source_rows(held)
    assert [r["id"] for r in source_rows(pa.Table.from_pylist(held))] == [r["id"] for r in held]
    with pytest.raises(InputError, match="is not a file"):
        source_rows(tmp_path / "missing.jsonl")


# ------------------------------------------------------------------------------------------ Ray (Ray Data only)


@pytest.mark.ray
def test_ingest_in_memory_rows_into_a_resumable_workspace(ray_local, tmp_path):
    data = rows(40) + [{"id": "bad", "prompt": "", "response": "x"}]
    work = tmp_path / "ws"
    result = raycurate.ingest(data, workdir=work, max_length=384, tokenize={"num_actors": 1})
    assert result.stage == "tokenize" and Path(result.workdir) == work.resolve()
    assert result.metrics["rows"]["input"] == 41 and result.metrics["rows"]["rejected"] == 1
    table = result.table
    assert table.num_rows == result.metrics["rows"]["accepted"] == 40
    assert {"id", "split", "input_ids", "loss_mask", "prompt_len", "label"} <= set(table.column_names)
    assert result.dataset.count() == 40

    again = raycurate.ingest(ray_local.data.from_items(data), workdir=work, max_length=384,
                             tokenize={"num_actors": 1})
    assert again.metrics["rows"]["accepted"] == 40 and again.table.num_rows == 40
    with pytest.raises(UserError, match="re-run with another config"):
        result.table  # noqa: B018 - the workspace's tokenize stage now holds the Ray Dataset's rows
    raycurate.ingest(data, workdir=work, max_length=384, tokenize={"num_actors": 1})
    result = raycurate.ingest(data, workdir=work, max_length=384, tokenize={"num_actors": 1})
    manifest = json.loads((work / "manifest.json").read_text())
    # other input re-runs ingest and tokenize, never the base model; the same rows again skip everything
    assert manifest["stages"]["base_model"]["executions"] == 1
    assert manifest["stages"]["tokenize"]["executions"] == 3

    with pytest.raises(UserError, match="describe how rows are prepared"):
        raycurate.train(result, config={"data.max_length": 128})
    with pytest.raises(UserError, match="tokenized for model 'embedded'"):
        raycurate.train(result, model="tiny-llama")
    with pytest.raises(UserError, match="result of a workspace already"):
        raycurate.ingest(result)


# ------------------------------------------------------------------------------------------ README example


def readme_example() -> str:
    """The python code block of README.md's "Python API" section with the building blocks (bridge_select)."""
    section = README.read_text().split("## Python API", 1)[1].split("\n## ", 1)[0]
    blocks = [b for b in re.findall(r"```python\n(.*?)```", section, re.S) if "raycurate.bridge_select(" in b]
    assert len(blocks) == 1, "README.md's Python API section needs one python block that calls bridge_select"
    return blocks[0]


def test_readme_example_is_extracted():
    code = readme_example()
    compile(code, "README.md", "exec")
    for call in ("raycurate.ingest(", "raycurate.bridge_select(", "raycurate.train(", "raycurate.evaluate("):
        assert call in code


@pytest.mark.slow
@pytest.mark.ray
def test_readme_example_runs(ray_local, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    exec(compile(readme_example(), "README.md", "exec"), namespace)  # noqa: S102 - our own README
    scores = namespace["scores"]
    assert scores.metrics["rows"] > 0 and 0.0 <= scores.metrics["exact_match"] <= 1.0
    selected = namespace["selected"]
    assert 0 < selected.metrics["response_budget_ratio"] <= 0.55
    manifest = json.loads((Path(scores.workdir) / "manifest.json").read_text())
    assert {"tokenize", "bridge_select", "bridge_compact", "train_bridge", "eval_bridge"} <= set(manifest["stages"])


def readme_curate_example() -> str:
    """The python code block of README.md's "Python API" section that calls ``raycurate.curate``."""
    section = README.read_text().split("## Python API", 1)[1].split("\n## ", 1)[0]
    blocks = [b for b in re.findall(r"```python\n(.*?)```", section, re.S) if "raycurate.curate(" in b]
    assert len(blocks) == 1, "README.md's Python API section needs one python block that calls raycurate.curate"
    return blocks[0]


def test_readme_curate_example_is_extracted():
    code = readme_curate_example()
    compile(code, "README.md", "exec")
    assert 'trusted="checked.jsonl"' in code and 'out="curated"' in code


@pytest.mark.slow
@pytest.mark.ray
def test_readme_curate_example_runs(ray_local, tmp_path, monkeypatch):
    """The README's raycurate.curate example: the default recipe (dedup, then the reference step) on a file and a
    trusted file, every row accounted for in the outputs."""
    from raycurate.config.curate import CurateConfig

    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    exec(compile(readme_curate_example(), "README.md", "exec"), namespace)  # noqa: S102 - our own README
    summary = namespace["curated"].metrics["summary"]
    assert summary["settings"]["steps"] == CurateConfig().steps == ["dedup", "reference"]
    rows = summary["rows"]
    kept = (tmp_path / "curated/curated.jsonl").read_text().splitlines()
    dropped = (tmp_path / "curated/dropped.jsonl").read_text().splitlines()
    assert rows["input"] == 200 == len(kept) + len(dropped) + rows["rejected"] and 0 < len(kept) < 200
    manifest = json.loads((tmp_path / "curated/run/manifest.json").read_text())
    assert manifest["stages"]["curate_trusted_fit"]["metrics"]["rows_kept"] == 45  # 60 minus 25% held out to calibrate


@pytest.mark.slow
@pytest.mark.ray
def test_identify_heads_then_p2d_select_reuse_the_workspace(ray_local, tmp_path):
    train_cfg = {"engine": "ddp", "num_workers": 1, "micro_batch_size": 8, "effective_batch_size": 8, "lr": 2e-3}
    p2d = {"proxy_examples": 16, "proxy_steps": 2, "rounds": 1}
    data = raycurate.ingest(rows(120, seed=1), max_length=384, workdir=tmp_path / "ws", tokenize={"num_actors": 1})
    heads = raycurate.identify_heads(data, head_ratio=0.25, train=train_cfg, p2d=p2d)
    assert len(heads.heads) == 2 and heads.table.num_rows == 8  # 2 layers x 4 query heads
    selected = raycurate.p2d_select(data, head_ratio=0.25, data_ratio=0.2, train=train_cfg, p2d=p2d,
                                    p2d_pool={"num_actors": 1})
    assert selected.metrics["pool"] == 120 and selected.tokens.num_rows == selected.metrics["selected"] == 24
    assert selected.adapter == {"kind": "head_delta", "heads": heads.heads, "train_o": False}
    manifest = json.loads((tmp_path / "ws" / "manifest.json").read_text())
    assert manifest["stages"]["p2d_proxy"]["executions"] == 1  # the heads were not recomputed
