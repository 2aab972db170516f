"""Every config value that would fail inside a Ray task or a training worker fails when the config is built (or,
for settings the base model decides, when the model is known), in one line naming the key and the fix, before
anything runs.  Each check is compared with the worker-side check it anticipates: the config accepts exactly what
the worker accepts."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest

from raycurate.config.job import build_job_config
from raycurate.config.loader import ConfigError


def _problems(*overrides: str, job: str | None = None) -> list[str]:
    try:
        build_job_config(job, overrides=list(overrides))
    except ConfigError as exc:
        return exc.problems
    return []


def _one_problem(*overrides: str) -> str:
    problems = _problems(*overrides)
    assert len(problems) == 1, problems
    return problems[0]


@pytest.mark.parametrize("rho0, rho_max", list(itertools.product([0.0, 0.1, 0.5], [0.0, 0.2, 0.9])))
def test_bilevel_rho_is_accepted_exactly_when_gamma_is_defined(rho0, rho_max):
    from raycurate.algorithms.bilevel import gamma_schedule

    problems = _problems(f"bilevel.rho0={rho0}", f"bilevel.rho_max={rho_max}")
    try:
        gamma_schedule(0, rho0, 0.1, rho_max)
        worker_ok = True
    except ValueError:
        worker_ok = False
    assert (not problems) == worker_ok, problems
    if rho0 == 0:
        assert "bilevel.rho0: 0.0 must be > 0" in problems


BDS_GRID = [(batch, micro, workers, val) for batch, micro, workers in
            [(8, 4, 2), (8, 1, 4), (4, 1, 4), (6, 3, 2), (12, 1, 3), (32, 16, 1), (3, 1, 1)]
            for val in (None, 1, 2, 3, 4, 6, 7, 8, 31, 32)]


@pytest.mark.parametrize("batch, micro, workers, val", BDS_GRID)
def test_bds_batches_are_accepted_exactly_when_the_workers_accept_them(batch, micro, workers, val):
    from raycurate.config.schema import JobConfig
    from raycurate.training.bds_step import check_bds_batches

    overrides = ["pipeline=bilevel", "train.launcher=ray_train", f"train.num_workers={workers}",
                 f"train.micro_batch_size={micro}", f"train.effective_batch_size={batch}",
                 f"bilevel.val_batch={'null' if val is None else val}"]
    if batch % (micro * workers):
        return  # the train section's own check (test_config)
    problems = [p for p in _problems(*overrides) if p.startswith("bilevel.")]
    cfg = JobConfig()
    cfg.train.num_workers, cfg.train.micro_batch_size, cfg.train.effective_batch_size = workers, micro, batch
    cfg.bilevel.val_batch = val
    try:
        check_bds_batches(cfg.train, cfg.bilevel, workers)
        worker_ok = True
    except ValueError:
        worker_ok = False
    assert (not problems) == worker_ok, (problems, worker_ok)
    assert len(problems) <= 1 and all(p.startswith("bilevel.val_batch: ") for p in problems)


def test_bds_batch_message_names_the_fix_and_applies_only_where_bds_trains():
    multi = ["train.launcher=ray_train", "train.num_workers=4", "train.micro_batch_size=1",
             "train.effective_batch_size=4"]
    text = _one_problem("pipeline=bilevel", *multi)
    assert text.startswith("bilevel.val_batch: 2 validation + 2 candidate rows per step (bilevel.val_batch is null: "
                           "half the batch) must each be a multiple of train.num_workers=4")
    assert "set bilevel.val_batch to a multiple of 4, or train.effective_batch_size to a multiple of 8" in text
    assert "bilevel.val_batch: 32 leaves no candidate rows" in _one_problem("pipeline=bilevel", "bilevel.val_batch=32")
    # no BDS training: the same batches are fine
    assert not _problems("pipeline=bilevel", "bilevel.methods=[random, dsir]", "bilevel.val_batch=32")
    assert not _problems("pipeline=curate", "curate.steps=[dedup, bridge]", "bilevel.val_batch=32")
    assert _problems("pipeline=curate", "curate.steps=[bds, bridge]", "bilevel.val_batch=32")
    assert _problems("pipeline=demo", "demo.methods=[curate]", "curate.steps=[bds]", "bilevel.val_batch=32")
    assert not _problems("pipeline=demo", "demo.methods=[sft]", "bilevel.val_batch=32")


@pytest.mark.parametrize("rows, workers", [(100, 2), (100, 3), (99, 3), (16, 4), (18, 4)])
def test_p2d_proxy_examples_are_accepted_exactly_when_the_full_batch_proxy_is(rows, workers):
    from raycurate.config.schema import JobConfig
    from raycurate.config.train import full_batch_train_config

    problems = _problems("pipeline=p2d", "train.launcher=ray_train", f"train.num_workers={workers}",
                         "train.micro_batch_size=1", f"train.effective_batch_size={workers}",
                         f"p2d.proxy_examples={rows}")
    train = JobConfig().train
    train.num_workers, train.micro_batch_size, train.effective_batch_size = workers, 1, workers
    try:
        full_batch_train_config(train, rows, 2, 1e-4)
        worker_ok = True
    except ValueError:
        worker_ok = False
    assert (not problems) == worker_ok, problems
    if problems:
        assert problems[0].startswith(f"p2d.proxy_examples: {rows} is not a multiple of train.num_workers={workers}")
        assert f"use {rows - rows % workers}" in problems[0]
    # a given task model skips the proxy
    assert not _problems("pipeline=p2d", "train.launcher=ray_train", "train.num_workers=3",
                         "train.micro_batch_size=1", "train.effective_batch_size=3", "p2d.proxy_examples=100",
                         "p2d.task_model=/some/model")


@pytest.mark.parametrize("row_floor, rho_r", [(0.0, 0.5), (0.5, 0.5), (0.6, 0.5), (1.0, 0.75)])
def test_bridge_row_floor_is_accepted_exactly_when_the_selection_is(row_floor, rho_r):
    from raycurate.algorithms.bridge.rows import SelectionSettings

    problems = _problems(f"bridge.row_floor={row_floor}", f"bridge.rho_r={rho_r}")
    try:
        SelectionSettings(rho_r=rho_r, row_floor=row_floor)
        worker_ok = True
    except ValueError:
        worker_ok = False
    assert (not problems) == worker_ok, problems
    if problems:
        assert problems == [f"bridge.row_floor: {row_floor} is above bridge.rho_r={rho_r} (it is the share of every "
                            "row supervised before the corpus-wide allocation); set it to at most rho_r"]


def test_evaluation_needs_its_questions():
    assert _one_problem("eval.split=validation").startswith(
        "eval.split: validation questions exist only on the embedded corpus, with data.validation_questions > 0")
    assert not _problems("eval.split=validation", "data.validation_questions=20")
    assert _one_problem("data.heldout_rows=0").startswith(
        "data.heldout_rows: 0 leaves no held-out questions to evaluate the trained models on")
    two = _problems("data.heldout_rows=0", "eval.lm_eval_tasks=[raycurate_heldout_em]")
    assert len(two) == 2 and two[1].startswith("eval.lm_eval_tasks: ['raycurate_heldout_em'] run over the embedded "
                                               "corpus's held-out questions")


def test_code_executing_lm_eval_tasks_need_the_permission():
    from raycurate.stages import lm_eval

    text = _one_problem("eval.lm_eval_tasks=[humaneval, arc_challenge]")
    assert text == ("eval.lm_eval_tasks: ['humaneval'] run model-written code; set "
                    "eval.lm_eval_allow_code_execution=true (on an isolated machine) or drop them")
    assert not _problems("eval.lm_eval_tasks=[humaneval]", "eval.lm_eval_allow_code_execution=true")
    with pytest.raises(ValueError, match="execute model-written code"):  # what the lm-eval task would raise
        lm_eval.run_lm_eval("/unused", ["humaneval"])


def test_lora_needs_targets_and_sweeps_need_a_working_scheduler(tmp_path):
    from raycurate.config.sweep import load_sweep

    assert _one_problem("train.adapter=lora", "train.lora_targets=[]").startswith(
        "train.lora_targets: empty, so LoRA would wrap no layer")
    assert not _problems("train.lora_targets=[]")  # full fine-tuning does not read them
    sweep = tmp_path / "sweep.yaml"
    sweep.write_text("job: jobs/demo.yaml\nmetric: results.validation.bridge.gold_loss\nparams: {train.lr: "
                     "{grid: [1e-4]}}\nscheduler: {type: asha, rung_steps: 0, reduction_factor: 1}\nnum_samples: 0\n")
    with pytest.raises(ConfigError) as info:
        load_sweep(sweep)
    assert sorted(p.split(":")[0] for p in info.value.problems) == [
        "num_samples", "scheduler.reduction_factor", "scheduler.rung_steps"]


# --------------------------------------------------------------------------- settings the base model decides


def _model_problems(*overrides: str) -> list[str]:
    from raycurate.pipelines.common import check_model_settings

    try:
        check_model_settings(build_job_config("jobs/demo.yaml", overrides=list(overrides)))
    except ConfigError as exc:
        assert str(exc).startswith("the job config (model ")
        return exc.problems
    return []


def test_bridge_layers_are_checked_against_the_models_layer_count():
    import torch

    from raycurate.algorithms.bridge.token_utility import scoring_parameters
    from raycurate.models.loading import load_model, resolve_model_path

    n_layers = json.loads((Path(resolve_model_path("embedded")) / "config.json").read_text())["num_hidden_layers"]
    assert n_layers == 2
    assert _model_problems("pipeline=bridge", "bridge.last_layers=3") == [
        "bridge.last_layers: 3 is more than the 2 layers of model embedded; set bridge.last_layers=2 or less"]
    assert not _model_problems("pipeline=bridge", "bridge.last_layers=2")
    assert not _model_problems("pipeline=sft", "bridge.last_layers=3")  # BRIDGE does not run
    assert _model_problems("pipeline=demo", "demo.methods=[curate]", "curate.steps=[dedup, bridge]",
                           "bridge.last_layers=3")  # the demo's curation runs BRIDGE as its token step
    assert _model_problems("pipeline=bridge", "bridge.routing_layer=2") == [
        "bridge.routing_layer: model embedded has layers 0-1, not 2; set it below that, or null (its last "
        "full-attention layer)"]
    assert _model_problems("pipeline=bridge", "model.name_or_path=tiny-llama", "bridge.last_layers=5")[0].startswith(
        "bridge.last_layers: 5 is more than the 4 layers of model tiny-llama")
    torch.set_num_threads(1)
    model = load_model("embedded")
    assert scoring_parameters(model, 2)
    with pytest.raises(ValueError, match="last_layers=3 is out of range"):  # what the scoring task would raise
        scoring_parameters(model, 3)


def test_lora_targets_are_checked_against_the_models_modules():
    problems = _model_problems("pipeline=sft", "train.adapter=lora", "train.lora_targets=[q_proj, kproj, mlp.up_proj]")
    assert problems == ["train.lora_targets: ['kproj'] name no module of model embedded; choose among down_proj, "
                        "gate_proj, k_proj, lm_head, o_proj, q_proj, up_proj, v_proj"]
    assert not _model_problems("pipeline=sft", "train.adapter=lora")


def test_a_bad_setting_ends_the_command_in_one_line_before_anything_is_written(tmp_path, capsys):
    from raycurate.cli.main import main

    out = tmp_path / "runs"
    assert main(["run", "jobs/demo.yaml", "pipeline=bilevel", "bilevel.rho0=0", f"run.runs_dir={out}"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "bilevel.rho0: 0.0 must be > 0 [from the command line]" in err
    assert main(["run", "jobs/demo.yaml", "pipeline=bridge", "bridge.last_layers=30", f"run.runs_dir={out}"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "bridge.last_layers: 30 is more than the 2 layers of model embedded" in err
    assert not out.exists()
