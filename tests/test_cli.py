"""CLI: --help everywhere, ingest with row accounting and rejects, inspect, config errors as exit code 2."""

from __future__ import annotations

import json
import re

import pytest

from raycurate.cli.main import build_parser, main

SUBCOMMANDS = ("demo", "run", "tune", "eval", "ingest", "train", "curate", "report", "inspect", "model fetch")
RAW_REST = re.compile(r"``|::|:func:|:class:|:mod:|SPEC §|issue #?\d|\(#\d+\)")


def _help(argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(argv)
    assert exit_info.value.code == 0
    return capsys.readouterr().out


@pytest.mark.parametrize("command", ("", *SUBCOMMANDS))
def test_help_on_every_subcommand_is_plain_text_with_an_example(command, capsys):
    out = _help([*command.split(), "--help"], capsys)
    assert "usage: raycurate" in out
    assert not RAW_REST.search(out), RAW_REST.search(out)
    # an example per command, in its epilog
    examples = out[out.index("\nexample"):]
    assert re.search(r"^  raycurate " + (command or "demo"), examples, re.M)


def _arguments(parser):
    import argparse

    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from ((f"{name} {where}", a) for where, a in _arguments(sub))
        elif not isinstance(action, argparse._HelpAction):
            yield "", action


def test_every_argument_is_described():
    undescribed = [f"{where}{action.dest}" for where, action in _arguments(build_parser())
                   if not (action.help or "").strip()]
    assert not undescribed


def test_help_config_prints_one_section_readably(capsys):
    out = _help(["run", "--help-config", "curate"], capsys)
    lines = out.splitlines()
    assert lines[0].startswith("curate: Composable curation")
    keys = re.findall(r"^  (\S+)  \(", out, re.M)
    assert keys and all(k.startswith("curate.") for k in keys) and "curate.keep_fraction" in keys
    assert "  curate.keep_fraction  (float, default 0.6; > 0 and <= 1)" in lines
    assert max(len(line) for line in lines if not line.startswith("  curate.")) <= 100
    # every command that takes overrides has it; ingest lists its data section
    assert _help(["curate", "--help-config", "train.lr"], capsys).splitlines()[1:] == [
        "  train.lr  (float, default 2e-05; > 0)", "      Peak learning rate of AdamW."]
    assert set(re.findall(r"^  (\w+)\.", _help(["ingest", "--help-config"], capsys), re.M)) == {"data"}


def test_help_config_lists_every_key_without_spec_or_issue_numbers(capsys):
    from raycurate.config.loader import all_keys
    from raycurate.config.schema import JobConfig

    out = _help(["run", "--help-config"], capsys)
    listed = set(re.findall(r"^  (\S+)  \(", out, re.M))
    leaves = {k for k in all_keys(JobConfig) if not any(o.startswith(k + ".") for o in all_keys(JobConfig))}
    assert listed == leaves
    assert not re.search(r"SPEC|issue ?#?\d|\(#\d+\)|, #\d+", out)
    assert "default=" not in out and "NoneType" not in out


def test_help_config_unknown_section_is_one_line_with_a_suggestion(capsys):
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(["run", "--help-config", "curat"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "did you mean curate?" in err and "sections: run, ray, data" in err


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


def test_ingest_takes_full_dotted_keys(tmp_path, capsys):
    data = tmp_path / "data.jsonl"
    _write_input(data)

    def ingest_record(name: str) -> dict:
        return json.loads((tmp_path / name / "manifest.json").read_text())["stages"]["ingest"]

    assert main(["ingest", "--input", str(data), "--out", str(tmp_path / "a"), "data.split_seed=3",
                 "data.split_ratios={x: 0.5, y: 0.5}"]) == 0
    assert "warning" not in capsys.readouterr().err
    assert set(ingest_record("a")["metrics"]["accepted_by_split"]) <= {"x", "y"}
    # the old form still works, with a one-line deprecation warning, and means the same
    assert main(["ingest", "--input", str(data), "--out", str(tmp_path / "b"), "split_seed=3",
                 "data.split_ratios={x: 0.5, y: 0.5}"]) == 0
    warnings = [line for line in capsys.readouterr().err.splitlines() if "warning" in line]
    assert warnings == ["raycurate: warning: ingest override 'split_seed=3' without the data. prefix is deprecated; "
                        "write data.split_seed=3"]
    assert ingest_record("b")["config_hash"] == ingest_record("a")["config_hash"]
    # another section's key, and a misspelt data key, are one-line errors
    assert main(["ingest", "--input", str(data), "--out", str(tmp_path / "c"), "train.lr=1"]) == 2
    assert "train.lr is not a data.* key" in capsys.readouterr().err
    assert main(["ingest", "--input", str(data), "--out", str(tmp_path / "c"), "data.split_sed=3"]) == 2
    assert "data.split_sed: unknown key (did you mean data.split_seed?)" in capsys.readouterr().err


def test_strict_ingest_names_file_line_and_field(tmp_path, capsys):
    data = tmp_path / "data.jsonl"
    _write_input(data)

    assert main(["ingest", "--input", str(data), "--out", str(tmp_path / "run"), "--strict"]) == 2
    err = capsys.readouterr().err
    assert re.search(r"^raycurate: .*data.jsonl:3: .*id", err, re.M) and "Traceback" not in err


def test_missing_input_and_bad_override_exit_with_a_message(tmp_path, capsys):
    assert main(["ingest", "--input", str(tmp_path / "nope.jsonl"), "--out", str(tmp_path / "run")]) == 2
    assert "nope.jsonl" in capsys.readouterr().err
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
