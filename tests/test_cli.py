"""CLI: --help everywhere, ingest with row accounting and rejects, inspect, config errors as exit code 2."""

from __future__ import annotations

import json
import re

import pytest

from raycurate.cli.main import build_parser, main

SUBCOMMANDS = ("demo", "run", "ingest", "train", "curate", "report", "inspect")


@pytest.mark.parametrize("command", ("", *SUBCOMMANDS))
def test_help_on_every_subcommand(command, capsys):
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args([command, "--help"] if command else ["--help"])
    assert exit_info.value.code == 0
    assert "usage: raycurate" in capsys.readouterr().out


def _write_input(path) -> None:
    rows = [
        {"id": "a", "prompt": "What is 2 + 3?", "response": "2 + 3 = 5\n#### 5", "domain": "math"},
        {"id": "b", "prompt": "Say hi.", "response": "Hi!", "domain": "instruction"},
        {"id": "a", "prompt": "dup", "response": "dup"},
        {"id": "c", "prompt": "", "response": "empty prompt"},
    ]
    lines = [json.dumps(r) for r in rows] + ['{"id": "d", "prompt": "broken"']
    path.write_text("\n".join(lines) + "\n")


def test_ingest_command_accounts_for_every_row(tmp_path, capsys):
    data = tmp_path / "data.jsonl"
    _write_input(data)
    run_dir = tmp_path / "run"
    assert main(["ingest", "--input", str(data), "--out", str(run_dir)]) == 0
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["rows"]["input"] == 5 and manifest["rows"]["accepted"] == 2
    assert manifest["rows"]["rejected"] == 3
    lines = (run_dir / "ingest/rejected.jsonl").read_text().splitlines()
    reasons = sorted(json.loads(line)["reason"] for line in lines)
    assert reasons == ["duplicate_id", "empty_field", "malformed_json"]
    capsys.readouterr()
    assert main(["inspect", str(run_dir)]) == 0
    out = capsys.readouterr().out
    assert "rows: input=5 accepted=2 rejected=3" in out and "ingest" in out and "done" in out


def test_strict_ingest_names_file_line_and_field(tmp_path, capsys):
    data = tmp_path / "data.jsonl"
    _write_input(data)

    assert main(["ingest", "--input", str(data), "--out", str(tmp_path / "run"), "--strict"]) == 2
    err = capsys.readouterr().err
    assert re.search(r"^raycurate: .*data.jsonl:3: .*id", err, re.M) and "Traceback" not in err


def test_missing_input_and_bad_override_exit_with_a_message(tmp_path, capsys):
    assert main(["ingest", "--input", str(tmp_path / "nope.jsonl"), "--out", str(tmp_path / "run")]) == 2
    assert "nope.jsonl" in capsys.readouterr().err
    assert main(["run", "--help-config"]) == 0
    capsys.readouterr()
    assert main(["demo", "--out", str(tmp_path / "d"), "train.zero_stage=7"]) == 2
    assert "train.zero_stage: 7 is not one of [0, 1, 2, 3]" in capsys.readouterr().err


def test_ray_out_of_memory_ends_in_one_line_that_says_what_to_do(monkeypatch, capsys):
    import ray.exceptions

    import raycurate.cli.main as cli

    def killed(args):
        oom = ray.exceptions.OutOfMemoryError(
            "Task was killed due to the node running low on memory.\nMemory on the node (IP: 10.0.0.1) was "
            "22.17GB used / 23.54GB limit (0.941790)")
        raise RuntimeError("stage train_bridge failed") from oom

    monkeypatch.setattr(cli, "cmd_demo", killed)
    assert main(["demo"]) == 3
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "ran out of memory (node memory 22.17GB of 23.54GB)" in err
    assert "run the same command again" in err

    def other(args):
        raise RuntimeError("a bug")

    monkeypatch.setattr(cli, "cmd_demo", other)
    with pytest.raises(RuntimeError, match="a bug"):
        main(["demo"])
