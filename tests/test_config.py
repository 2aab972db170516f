"""Config loading: typed sections, overrides, errors that name the key, and every shipped YAML validates."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from raycurate.config.loader import ConfigError, apply_overrides, config_hash, from_dict, load_config, read_yaml
from raycurate.config.schema import JobConfig

ROOT = Path(__file__).resolve().parents[1]


def test_defaults_build():
    cfg = JobConfig()
    assert cfg.pipeline == "demo" and cfg.train.engine == "deepspeed"


def test_overrides_are_typed_and_nested():
    cfg = load_config(JobConfig, None, ["train.lr=1e-3", "train.max_steps=7", "data.split_seed=4",
                                        "run.force=[tokenize]"])
    assert cfg.train.lr == pytest.approx(1e-3) and cfg.train.max_steps == 7
    assert cfg.data.split_seed == 4 and cfg.run.force == ["tokenize"]


def test_int_is_accepted_for_float_but_not_str_for_int():
    cfg = from_dict(JobConfig, {"train": {"lr": 1}})
    assert isinstance(cfg.train.lr, float)
    with pytest.raises(ConfigError, match=r"train.num_workers: expected int, got str"):
        from_dict(JobConfig, {"train": {"num_workers": "two"}})


def test_all_problems_reported_together_with_allowed_values():
    with pytest.raises(ConfigError) as info:
        from_dict(JobConfig, {"train": {"zero_stage": 5, "lrr": 1.0}, "pipeline": "nope", "bogus": 1})
    text = str(info.value)
    assert "4 problems" in text
    assert "train.zero_stage: 5 is not one of [0, 1, 2, 3]" in text
    assert "train.lrr: unknown key (did you mean train.lr?); allowed keys in 'train':" in text
    assert "effective_batch_size" in text
    assert "pipeline: 'nope' is not one of" in text
    assert "bogus: unknown key; allowed keys in the top level" in text


def test_bool_is_not_an_int_and_int_is_not_a_bool():
    with pytest.raises(ConfigError, match="data.strict: expected true or false"):
        from_dict(JobConfig, {"data": {"strict": 1}})
    with pytest.raises(ConfigError, match="train.epochs: expected int, got bool"):
        from_dict(JobConfig, {"train": {"epochs": True}})


def test_override_without_equals_is_an_error():
    with pytest.raises(ConfigError, match="key=value"):
        apply_overrides({}, ["train.lr"])


def test_config_hash_tracks_values():
    a, b = JobConfig(), JobConfig()
    assert config_hash(a.train) == config_hash(b.train)
    b.train.lr = 0.5
    assert config_hash(a.train) != config_hash(b.train)
    assert config_hash(a.data) == config_hash(b.data)


def shipped_yaml_files() -> list[Path]:
    return sorted([*ROOT.glob("jobs/*.yaml"), ROOT / "raycurate/config/demo.yaml"])


@pytest.mark.parametrize("path", shipped_yaml_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_shipped_yaml_validates(path):
    load_config(JobConfig, path)


@pytest.mark.parametrize("path", sorted(ROOT.glob("tune/*.yaml")), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_shipped_sweep_validates_against_its_job(path):
    from raycurate.config.sweep import load_sweep

    sweep = load_sweep(path)
    assert sweep.params
    assert not sweep.metric.startswith("results.heldout")


def test_a_sweep_on_the_reported_heldout_results_is_refused(tmp_path):
    from raycurate.config.loader import ConfigError
    from raycurate.config.sweep import load_sweep

    path = tmp_path / "tune" / "peek.yaml"
    path.parent.mkdir()
    path.write_text(f"job: {ROOT / 'jobs/demo.yaml'}\nmetric: results.heldout.mixed.exact_match\nmode: max\n"
                    "params:\n  train.lr: {grid: [1.0e-4, 2.0e-4]}\n")
    with pytest.raises(ConfigError, match="eval.split=validation"):
        load_sweep(path)
    path.write_text(path.read_text().replace("results.heldout.", "results.validation."))
    assert load_sweep(path).metric == "results.validation.mixed.exact_match"


def test_sweep_errors_name_the_bad_key(tmp_path):
    from raycurate.config.loader import ConfigError
    from raycurate.config.sweep import load_sweep

    path = tmp_path / "tune" / "bad.yaml"
    path.parent.mkdir()
    path.write_text(f"job: {ROOT / 'jobs/bridge_demo.yaml'}\nparams:\n  bridge.rho_q: {{grid: [0.5]}}\n"
                    "  bridge.lam: {uniform: [0.0, 0.5]}\n")
    with pytest.raises(ConfigError) as err:
        load_sweep(path)
    assert "params.bridge.rho_q" in str(err.value) and "needs search: random" in str(err.value)


def test_packaged_demo_job_equals_jobs_demo():
    assert read_yaml(ROOT / "jobs/demo.yaml") == read_yaml(ROOT / "raycurate/config/demo.yaml")


def test_proving_ground_job_is_the_demo_over_seeds():
    demo = read_yaml(ROOT / "jobs/demo.yaml")
    job = read_yaml(ROOT / "jobs/proving_ground.yaml")
    assert job.pop("pipeline") == "proving_ground" and job.pop("proving_ground") == {"seeds": [0, 1, 2]}
    assert job["run"].pop("name") == "proving_ground"
    demo.pop("pipeline"), demo["run"].pop("name")
    assert job == demo  # keep the two in step: the proving ground must measure what the demo runs


@pytest.mark.parametrize("mix, message", [
    ({"swapped": 1}, "data.corruption_mix: Unknown corruption kinds ['swapped']"),
    ({"swapped_entity": 1}, "data.corruption_mix: The corruption mix gives no weight to any corruption of the code "
                            "domain"),
])
def test_a_bad_corruption_mix_is_a_config_problem_before_anything_runs(mix, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        from_dict(JobConfig, {"data": {"corruption_mix": mix}})


def test_runtime_only_train_settings_leave_the_stage_hash_and_result_settings_do_not():
    """threads, CPU reservations, retries and logging change speed, not the model: a re-run with other threads must
    reuse the finished stage (it re-trained seed 0's train_mixed for 10 min in #25) and resume a killed one."""
    import dataclasses
    import hashlib
    import json

    from raycurate.config.loader import to_dict
    from raycurate.config.train import TrainConfig

    base = TrainConfig()
    runtime = dataclasses.replace(base, threads_per_worker=1, cpus_per_worker=0.5, max_failures=3,
                                  log_every_steps=1, keep_checkpoints=5)
    assert config_hash(runtime, [("tokenize", "ab")]) == config_hash(base, [("tokenize", "ab")])
    assert config_hash(dataclasses.replace(base, lr=base.lr * 2)) != config_hash(base)
    assert config_hash({"stage": runtime}) == config_hash({"stage": base})  # nested, as train_stage hashes it
    # a config that sets none of them hashes as before the flag existed (finished runs stay current)
    # ... and so does one that predates the fields added later with hashed=False (train.export, length_groups)
    before = {k: v for k, v in to_dict(base).items() if k not in ("export", "length_groups")}
    old = hashlib.sha256(json.dumps([before], sort_keys=True, default=str).encode()).hexdigest()[:16]
    assert config_hash(base) == old
    assert config_hash(dataclasses.replace(base, export="merged")) == config_hash(base)
    assert config_hash(dataclasses.replace(base, length_groups=2)) == config_hash(base)
    flagged = {f.name for f in dataclasses.fields(TrainConfig) if f.metadata.get("runtime_only")}
    assert flagged == {"threads_per_worker", "cpus_per_worker", "max_failures", "log_every_steps", "keep_checkpoints",
                       "checkpoint_every_minutes", "export", "length_groups"}
    assert {f.name for f in dataclasses.fields(TrainConfig) if f.metadata.get("hashed") is False} == {
        "export", "length_groups"}
