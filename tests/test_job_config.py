"""One route to a job config (raycurate/config/job.py): layer order, provenance in errors, and the CLI and the
Python API giving equal configs for the same settings."""

from __future__ import annotations

from pathlib import Path

import pytest

from raycurate.api import job_config
from raycurate.cli.main import _load_job, _out_to_run
from raycurate.config.job import build_job_config, merge_setting
from raycurate.config.loader import ConfigError
from raycurate.errors import UserError

JOBS = Path(__file__).resolve().parents[1] / "jobs"


def test_layers_apply_in_order_job_layers_overrides_keys_pipeline(tmp_path):
    job = tmp_path / "job.yaml"
    job.write_text("pipeline: bridge\ntrain: {lr: 0.1, epochs: 4}\nbridge: {rho_p: 0.5}\n")
    cfg = build_job_config(job, layers=[{"train.lr": 0.2}, {"train": {"epochs": 5}, "bridge.rho_r": 0.4}],
                           overrides=["train.lr=0.3", "bridge.rho_r=0.3"], keys={"train.lr": 0.4, "bridge.rho_p": None},
                           pipeline="curate")
    assert (cfg.pipeline, cfg.train.lr, cfg.train.epochs) == ("curate", 0.4, 5)
    assert (cfg.bridge.rho_p, cfg.bridge.rho_r) == (0.5, 0.3)  # None keys are left out; the override beats the layer
    assert build_job_config() == build_job_config(layers=[{}], overrides=[], keys={})  # all defaults


def test_layers_are_copied_not_modified():
    section = {"split_ratios": {"warmup": 0.1, "validation": 0.2, "selection": 0.7}}
    layer = {"data": section}
    build_job_config(layers=[layer], keys={"data.split_ratios": {"warmup": 0.2, "selection": 0.6}})
    assert layer == {"data": {"split_ratios": {"warmup": 0.1, "validation": 0.2, "selection": 0.7}}}


def test_merge_setting_merges_sections_and_refuses_a_path_through_a_value():
    target = {"train": {"lr": 1.0, "epochs": 2}, "pipeline": "sft"}
    merge_setting(target, "train", {"lr": 0.5})
    merge_setting(target, "bridge.rho_p", 0.25)
    assert target == {"train": {"lr": 0.5, "epochs": 2}, "pipeline": "sft", "bridge": {"rho_p": 0.25}}
    with pytest.raises(UserError, match="'pipeline' is not a config section"):
        merge_setting(target, "pipeline.name", "x")


def test_command_line_errors_say_where_each_key_came_from(tmp_path):
    job = tmp_path / "job.yaml"
    job.write_text("train: {zero_stage: 7}\n")
    extra = {"model": {"name_or_path": 3}}
    with pytest.raises(ConfigError) as error:
        _load_job(job, ["train.lrr=1"], extra)
    problems = error.value.problems
    assert len(problems) == 3
    assert any(p.startswith("train.zero_stage: 7 is not one of") and p.endswith(f"[in {job}]") for p in problems)
    assert any(p.startswith("model.name_or_path:") and p.endswith("[from the command line]") for p in problems)
    assert any(p.startswith("train.lrr: unknown key") and p.endswith("[from the command line]") for p in problems)
    with pytest.raises(ConfigError) as error:  # an API call names itself and no origin
        job_config("curate", "curate", config={"train.zero_stage": 7})
    assert str(error.value).startswith("raycurate.curate() has 1 problem: train.zero_stage: 7 is not one of")
    assert "[from the command line]" not in str(error.value) and "[in " not in str(error.value)


def test_cli_run_and_api_curate_build_equal_configs():
    cli = _load_job(None, ["pipeline=curate", "curate.steps=[dedup, p2d, bridge]", "curate.keep_fraction=0.5",
                           "train.lr=0.001", "p2d.proxy_steps=2", "run.runs_dir=runs", "run.name=c"])
    api = job_config("curate", "curate", config={"p2d": {"proxy_steps": 2}}, sections={"train": {"lr": 1e-3}},
                     keys={"curate.steps": ["dedup", "p2d", "bridge"], "curate.keep_fraction": 0.5,
                           "curate.compare": None, "run.runs_dir": "runs", "run.name": "c"})
    assert cli == api
    assert (api.curate.steps, api.curate.keep_fraction, api.curate.compare) == (["dedup", "p2d", "bridge"], 0.5, True)


def test_cli_train_flags_equal_the_same_keys_as_overrides():
    flags = {"pipeline": "sft", "data": {"input": "d.jsonl"}, "model": {"name_or_path": "tiny-llama"},
             **_out_to_run("out/sft")}
    from_flags = _load_job(JOBS / "bridge_demo.yaml", ["train.lr=1e-5"], flags)
    from_overrides = _load_job(JOBS / "bridge_demo.yaml", [
        "pipeline=sft", "data.input=d.jsonl", "model.name_or_path=tiny-llama", "run.runs_dir=out", "run.name=sft",
        "train.lr=1e-5"])
    assert from_flags == from_overrides
    assert (from_flags.pipeline, from_flags.data.input, from_flags.run.name) == ("sft", "d.jsonl", "sft")
    assert from_flags.bridge == build_job_config(JOBS / "bridge_demo.yaml").bridge  # the job file's other keys stay
