"""SFT stage: DeepSpeed config arithmetic, data order, the worker loop in-process, and Ray Train launches."""

from __future__ import annotations

import json
import os
import shutil
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from train_helpers import VOCAB, Crash, LocalSession, write_tiny_llama

from raycurate.config.train import TrainConfig
from raycurate.models.optim import cosine_with_warmup
from raycurate.stages.train import SFTJob, train_loop
from raycurate.training.batches import collate, load_token_table
from raycurate.training.deepspeed_config import deepspeed_config, grad_accum_steps
from raycurate.training.export import METRICS_FILE
from raycurate.training.order import CheckpointClock, epoch_order, micro_batch_rows, total_steps

# ------------------------------------------------------------------------------------------ fixtures


def _write_token_table(path: str, rows: int = 16, with_weight: bool = True) -> str:
    rng = np.random.default_rng(0)
    ids, input_ids, prompt_lens, masks, weights = [], [], [], [], []
    for i in range(rows):
        length, prompt_len = int(rng.integers(6, 13)), int(rng.integers(2, 5))
        tokens = [1] + rng.integers(3, VOCAB, size=length - 2).tolist() + [2]
        ids.append(f"ex{i:03d}")
        input_ids.append(tokens)
        prompt_lens.append(prompt_len)
        masks.append([0] * prompt_len + [1] * (length - prompt_len))
        weights.append(0.5 + (i % 3) * 0.5)
    columns = {
        "id": pa.array(ids),
        "input_ids": pa.array(input_ids, type=pa.list_(pa.int32())),
        "prompt_len": pa.array(prompt_lens, type=pa.int32()),
        "loss_mask": pa.array(masks, type=pa.list_(pa.int8())),
    }
    if with_weight:
        columns["weight"] = pa.array(weights, type=pa.float32())
    pq.write_table(pa.table(columns), path)
    return path


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    return write_tiny_llama(str(tmp_path_factory.mktemp("tiny_llama")))


@pytest.fixture(scope="module")
def token_table(tmp_path_factory) -> str:
    return _write_token_table(str(tmp_path_factory.mktemp("table") / "train.parquet"))


def _weights(model_dir: str) -> dict[str, torch.Tensor]:
    """The model's weights; an adapter-only export merged onto its base (as every stage loads it)."""
    from raycurate.models.loading import load_model

    return {k: v.detach().clone() for k, v in load_model(model_dir).state_dict().items()}


# ------------------------------------------------------------------------------------------ DeepSpeed config


def test_deepspeed_config_traces_the_train_config():
    cfg = TrainConfig(micro_batch_size=2, effective_batch_size=16, zero_stage=3, grad_clip=0.5)
    ds = deepspeed_config(cfg, world_size=2, bf16=True)
    assert ds["train_micro_batch_size_per_gpu"] == 2
    assert ds["gradient_accumulation_steps"] == 4
    assert ds["train_batch_size"] == 16 == 2 * 4 * 2
    assert ds["zero_optimization"]["stage"] == 3
    assert ds["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] is True
    assert ds["gradient_clipping"] == 0.5
    assert ds["bf16"] == {"enabled": True}
    assert ds["zero_allow_untested_optimizer"] is True
    assert ds["steps_per_print"] >= 10**6
    assert "optimizer" not in ds and "scheduler" not in ds  # client AdamW + LambdaLR
    ds2 = deepspeed_config(TrainConfig(zero_stage=2), world_size=2, bf16=False)
    assert ds2["zero_optimization"]["stage"] == 2 and ds2["bf16"]["enabled"] is False
    assert "stage3_gather_16bit_weights_on_model_save" not in ds2["zero_optimization"]


@pytest.mark.parametrize("effective", [6, 2])
def test_batch_divisibility_error_says_how_to_fix(effective):
    cfg = TrainConfig(micro_batch_size=2, effective_batch_size=effective)
    with pytest.raises(ValueError, match=r"multiple of micro_batch_size \* num_workers = 2 \* 2 = 4; set "
                                         r"effective_batch_size to 4, 8, 16"):
        grad_accum_steps(cfg, world_size=2)
    with pytest.raises(ValueError, match="effective_batch_size"):
        deepspeed_config(cfg, world_size=2, bf16=False)


# ------------------------------------------------------------------------------------------ data order


def test_micro_batches_are_equal_per_rank_disjoint_and_drop_only_the_remainder():
    order = epoch_order(23, seed=3, epoch=0)
    rows = micro_batch_rows(order, world_size=2, micro_batch_size=2, accum=2)  # 8 rows per step
    assert rows.shape == (2, 2, 2, 2)
    used = rows.reshape(-1)
    assert len(set(used.tolist())) == 16
    assert used.tolist() == order[:16].tolist()  # the 23 mod 8 = 7 trailing rows wait for the next epoch
    assert np.array_equal(epoch_order(23, 3, 0), order)
    assert not np.array_equal(epoch_order(23, 3, 1), order)


def test_total_steps_counts_epochs_and_max_steps():
    assert total_steps(17, TrainConfig(micro_batch_size=1, effective_batch_size=4, epochs=3)) == 12
    assert total_steps(17, TrainConfig(micro_batch_size=1, effective_batch_size=4, epochs=3, max_steps=5)) == 5
    with pytest.raises(ValueError, match="fewer than one effective batch"):
        total_steps(3, TrainConfig(micro_batch_size=1, effective_batch_size=4))


def test_cosine_with_warmup_values():
    assert cosine_with_warmup(0, 2, 10) == pytest.approx(1 / 3)
    assert cosine_with_warmup(1, 2, 10) == pytest.approx(2 / 3)
    assert cosine_with_warmup(2, 2, 10) == pytest.approx(1.0)
    assert cosine_with_warmup(6, 2, 10) == pytest.approx(0.5)  # halfway through the 8 decay steps
    assert cosine_with_warmup(0, 0, 4) == pytest.approx(1.0)


def test_token_table_sorted_by_id_default_weight_and_collate(tmp_path):
    path = str(tmp_path / "t.parquet")
    pq.write_table(pa.table({
        "id": ["b", "a"],
        "input_ids": pa.array([[1, 5, 6, 2], [1, 7, 2]], type=pa.list_(pa.int32())),
        "loss_mask": pa.array([[0, 0, 1, 1], [0, 1, 1]], type=pa.list_(pa.int8())),
        "prompt_len": pa.array([2, 1], type=pa.int32()),
    }), path)
    table = load_token_table(path)
    assert table.ids.tolist() == ["a", "b"]
    assert table.weights.tolist() == [1.0, 1.0]
    batch = collate(table, np.array([0, 1]), pad_id=0)
    assert batch["input_ids"].tolist() == [[1, 7, 2, 0], [1, 5, 6, 2]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 0], [1, 1, 1, 1]]
    assert batch["loss_mask"].tolist() == [[0, 1, 1, 0], [0, 0, 1, 1]]
    pq.write_table(pa.table({"id": ["a"], "input_ids": [[1, 2]]}), path)
    with pytest.raises(ValueError, match=r"lacks columns \['loss_mask'\]"):
        load_token_table(path)


# ------------------------------------------------------------------------------------------ loop, in-process


def test_wall_clock_checkpoint_lets_a_one_epoch_run_resume_mid_epoch(tiny_model, token_table, tmp_path, monkeypatch):
    """One epoch (4 steps), no step cadence: only train.checkpoint_every_minutes can save before the end. A fake
    clock passes 10 minutes during step 2, so the run killed after that checkpoint resumes at step 2, not 0."""
    from raycurate.training import bookkeeping
    from raycurate.training.order import CheckpointClock

    ticks = iter([0.0, 60.0, 660.0] + [700.0 + i for i in range(100)])  # start, step 1, step 2 (due), saved, ...
    monkeypatch.setattr(bookkeeping, "CheckpointClock",
                        lambda minutes: CheckpointClock(minutes, now=lambda: next(ticks)))
    cfg = TrainConfig(engine="ddp", micro_batch_size=2, effective_batch_size=4, epochs=1, max_steps=4, lr=1e-2,
                      warmup_ratio=0.0, checkpoint_every_minutes=10.0, num_workers=1, seed=7, log_every_steps=1)
    job = SFTJob(token_table, tiny_model, str(tmp_path / "run"), cfg, False, 1.0)
    with pytest.raises(Crash):
        train_loop(job, LocalSession(str(tmp_path / "ckpt"), crash_after_checkpoints=1))
    assert os.listdir(tmp_path / "ckpt") == ["step_00002"]
    resumed = train_loop(job, LocalSession(str(tmp_path / "ckpt")))
    assert resumed["start_step"] == 2 and resumed["steps"] == 4


def test_checkpoint_clock_is_due_after_its_interval_and_restarts_on_save():
    now = [0.0]
    clock = CheckpointClock(2.0, now=lambda: now[0])
    now[0] = 119.0
    assert clock.due_flag() == 0.0
    now[0] = 120.0
    assert clock.due_flag() == 1.0
    clock.saved()
    assert clock.due_flag() == 0.0
    assert CheckpointClock(None, now=lambda: 1e9).due_flag() == 0.0


def test_resumed_loop_matches_uninterrupted_run(tiny_model, token_table, tmp_path):
    # 16 rows, effective batch 4 -> 4 steps/epoch; 6 steps cross an epoch; accumulation of 2 micro-batches.
    cfg = TrainConfig(engine="ddp", micro_batch_size=2, effective_batch_size=4, epochs=2, max_steps=6, lr=1e-2,
                      warmup_ratio=0.2, checkpoint_every_steps=3, num_workers=1, seed=7, log_every_steps=1)
    straight_job = SFTJob(token_table, tiny_model, str(tmp_path / "straight"), cfg, False, 1.0)
    straight = train_loop(straight_job, LocalSession(str(tmp_path / "ckpt_a")))

    resumed_job = SFTJob(token_table, tiny_model, str(tmp_path / "resumed"), cfg, False, 1.0)
    with pytest.raises(Crash):  # dies right after the step-3 checkpoint, mid-epoch 0
        train_loop(resumed_job, LocalSession(str(tmp_path / "ckpt_b"), crash_after_checkpoints=1))
    assert not os.path.exists(resumed_job.output_dir)
    resumed = train_loop(resumed_job, LocalSession(str(tmp_path / "ckpt_b")))

    assert straight["start_step"] == 0 and resumed["start_step"] == 3
    assert resumed["steps"] == straight["steps"] == 6
    assert resumed["loss_per_step"] == pytest.approx(straight["loss_per_step"], rel=1e-5)
    assert resumed["lr_per_step"] == pytest.approx(straight["lr_per_step"])
    assert straight["lr_per_step"][0] == pytest.approx(1e-2 / 2)  # warmup of round(0.2 * 6) = 1 step
    assert straight["examples"] == 24
    a, b, init = _weights(straight_job.output_dir), _weights(resumed_job.output_dir), _weights(tiny_model)
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=1e-5, atol=1e-6)
    assert any(not torch.equal(a[k], init[k]) for k in a)
    with open(os.path.join(resumed_job.output_dir, METRICS_FILE)) as f:
        assert json.load(f)["loss_per_step"] == resumed["loss_per_step"]
    assert os.path.exists(os.path.join(resumed_job.output_dir, "tokenizer.json"))


# ------------------------------------------------------------------------------------------ Ray Train launches


def _launch(label: str, *args, **kwargs) -> dict:
    from raycurate.stages.train import run_sft

    started = time.perf_counter()
    metrics = run_sft(*args, **kwargs)
    print(f"[timing] {label}: {time.perf_counter() - started:.1f} s")
    return metrics


@pytest.fixture(scope="module")
def zero2_resumed(ray_local, tiny_model, token_table, tmp_path_factory) -> dict:
    """ZeRO-2 on 2 workers: 2 steps (checkpoint at step 2), then the same storage and output resumed to step 4.

    Run once per module: the checkpoint/resume test reads it, and the ZeRO-3 offload test compares against it. Weight
    decay 0.1 (matrices only) is what the ZeRO-3 comparison needs; the checkpoint/resume facts do not depend on it.
    """
    root = tmp_path_factory.mktemp("zero2_resumed")
    out, storage = str(root / "model"), str(root / "ray_storage")
    # 2 workers x micro 1 x accum 2 = effective 4 -> 4 steps per epoch.
    first = _launch("deepspeed zero2 2 steps", token_table, tiny_model, out, _zero_cfg(weight_decay=0.1),
                    storage_dir=storage, name="sft")
    checkpoints_after_first = sorted(os.listdir(os.path.join(storage, "sft")))
    second = _launch("deepspeed zero2 resume to 4", token_table, tiny_model, out,
                     _zero_cfg(weight_decay=0.1, max_steps=4), storage_dir=storage, name="sft")
    return {"first": first, "second": second, "checkpoints_after_first": checkpoints_after_first, "out": out}


@pytest.mark.slow
@pytest.mark.ray
def test_deepspeed_zero2_two_workers_checkpoint_and_resume(zero2_resumed, tiny_model):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    first, second, out = zero2_resumed["first"], zero2_resumed["second"], zero2_resumed["out"]
    assert first["start_step"] == 0 and first["steps"] == 2 and first["world_size"] == 2
    assert "checkpoint_step_00000002" in zero2_resumed["checkpoints_after_first"]

    assert second["start_step"] == 2 and second["steps"] == 4
    assert len(second["loss_per_step"]) == 4
    assert second["loss_per_step"][:2] == first["loss_per_step"]
    # The extended run follows its own 4-step cosine (no warmup: warmup_ratio 0) from step 3 on.
    assert second["lr_per_step"][2:] == pytest.approx([1e-2 * cosine_with_warmup(s, 0, 4) for s in (2, 3)])
    assert all(np.isfinite(second["loss_per_step"]))

    model = AutoModelForCausalLM.from_pretrained(out)
    assert os.path.exists(os.path.join(out, "model.safetensors"))
    assert AutoTokenizer.from_pretrained(out).eos_token == "</s>"
    init = _weights(tiny_model)
    assert any(not torch.equal(v, init[k]) for k, v in model.state_dict().items())


@pytest.mark.slow
@pytest.mark.ray
def test_ddp_two_workers_trains_and_exports(ray_local, tiny_model, token_table, tmp_path):
    from transformers import AutoModelForCausalLM

    out = str(tmp_path / "model")
    cfg = TrainConfig(engine="ddp", num_workers=2, micro_batch_size=2, effective_batch_size=4, max_steps=2,
                      lr=1e-2)
    metrics = _launch("ddp 2 steps", token_table, tiny_model, out, cfg, storage_dir=str(tmp_path / "rs"),
                      name="ddp")
    assert metrics["steps"] == 2 and metrics["engine"] == "ddp"
    assert metrics["examples"] == 8
    init = _weights(tiny_model)
    model = AutoModelForCausalLM.from_pretrained(out)
    assert any(not torch.equal(v, init[k]) for k, v in model.state_dict().items())


@pytest.mark.slow
@pytest.mark.ray
@pytest.mark.parametrize("engine", [{"engine": "ddp"}, {"engine": "deepspeed", "zero_stage": 2}],
                         ids=["ddp", "deepspeed-zero2"])
def test_task_launcher_matches_ray_train_and_resumes(ray_local, tiny_model, token_table, tmp_path, engine):
    # One worker either way: the same seed, data order, thread count (1) and 1-rank gloo group, so the task must
    # reproduce Ray Train's losses bit for bit.
    base = dict(num_workers=1, micro_batch_size=2, effective_batch_size=4, max_steps=2, checkpoint_every_steps=2,
                lr=1e-2, seed=5, log_every_steps=1, **engine)
    label = engine["engine"]
    ray_train = _launch(f"launcher=ray_train {label} 2 steps", token_table, tiny_model, str(tmp_path / "m_ray"),
                        TrainConfig(**base), storage_dir=str(tmp_path / "s_ray"), name="sft")
    storage, out = str(tmp_path / "s_task"), str(tmp_path / "m_task")
    task = _launch(f"launcher=task {label} 2 steps", token_table, tiny_model, out,
                   TrainConfig(launcher="task", **base), storage_dir=storage, name="sft")
    assert task["world_size"] == 1 and task["steps"] == 2 and task["examples"] == 8
    assert task["loss_per_step"] == ray_train["loss_per_step"]
    assert task["lr_per_step"] == ray_train["lr_per_step"]
    _assert_same_weights(out, str(tmp_path / "m_ray"), atol=0)
    assert sorted(os.listdir(os.path.join(storage, "sft"))) == ["checkpoint_step_00000002"]

    resumed = _launch(f"launcher=task {label} resume to 4", token_table, tiny_model, out,
                      TrainConfig(launcher="task", **{**base, "max_steps": 4}), storage_dir=storage, name="sft")
    assert resumed["start_step"] == 2 and resumed["steps"] == 4
    assert resumed["loss_per_step"][:2] == task["loss_per_step"]
    assert all(np.isfinite(resumed["loss_per_step"]))
    assert sorted(os.listdir(os.path.join(storage, "sft"))) == ["checkpoint_step_00000002",
                                                                "checkpoint_step_00000004"]
    # Same folder names: a task also resumes the checkpoint Ray Train wrote.
    crossed = _launch(f"launcher=task {label} resume Ray Train's run to 4", token_table, tiny_model,
                      str(tmp_path / "m_ray"), TrainConfig(launcher="task", **{**base, "max_steps": 4}),
                      storage_dir=str(tmp_path / "s_ray"), name="sft")
    assert crossed["start_step"] == 2 and crossed["loss_per_step"] == resumed["loss_per_step"]


@pytest.mark.slow
def test_task_worker_runs_deepspeed_twice_in_one_process(tiny_model, token_table, tmp_path):
    # Ray reuses a task's process: the second run must get a fresh process group and DeepSpeed state.
    from raycurate.stages.train import sft_entry, task_worker

    cfg = TrainConfig(launcher="task", engine="deepspeed", zero_stage=2, num_workers=1, micro_batch_size=2,
                      effective_batch_size=4, max_steps=2, lr=1e-2, seed=5)
    threads, runs = torch.get_num_threads(), []
    try:
        for i in range(2):
            job = SFTJob(token_table, tiny_model, str(tmp_path / f"model_{i}"), cfg, False, 1.0)
            task_worker(sft_entry, {"job": job}, str(tmp_path / f"storage_{i}" / "sft"), 2, False,
                        {"DS_ACCELERATOR": "cpu"})
            with open(os.path.join(job.output_dir, METRICS_FILE)) as f:
                runs.append(json.load(f))
    finally:
        torch.set_num_threads(threads)  # prepare_worker set this process's threads to the task's 1 CPU
    assert not torch.distributed.is_initialized()
    assert runs[0]["steps"] == runs[1]["steps"] == 2
    assert runs[0]["loss_per_step"] == runs[1]["loss_per_step"]
    assert os.path.isdir(tmp_path / "storage_1" / "sft" / "checkpoint_step_00000002")
    from deepspeed.comm import comm as ds_comm

    assert ds_comm.cdb is not None and ds_comm.cdb.shm_comm_op is None  # never JIT-built (engines.py says why)


def test_resync_schedule_puts_an_extended_run_on_its_new_schedule():
    from raycurate.training.engines import optimizer_and_schedule, resync_schedule

    model = torch.nn.Linear(2, 2)
    old_opt, old_sched = optimizer_and_schedule(model, TrainConfig(lr=1.0, warmup_ratio=0.0), run_steps=2)
    for _ in range(2):
        old_opt.step()
        old_sched.step()
    assert old_opt.param_groups[0]["lr"] == pytest.approx(0.0)  # end of the 2-step cosine
    new_opt, new_sched = optimizer_and_schedule(model, TrainConfig(lr=0.5, warmup_ratio=0.0), run_steps=4)
    new_opt.load_state_dict(old_opt.state_dict())
    new_sched.load_state_dict(old_sched.state_dict())
    resync_schedule(new_sched, 0.5)
    expected = 0.5 * cosine_with_warmup(2, 0, 4)  # = 0.25
    assert [g["lr"] for g in new_opt.param_groups] == pytest.approx([expected, expected])
    new_opt.step()
    new_sched.step()
    assert new_opt.param_groups[0]["lr"] == pytest.approx(0.5 * cosine_with_warmup(3, 0, 4))


@pytest.mark.gpu
@pytest.mark.ray
@pytest.mark.parametrize("zero", [{"zero_stage": 2}, {"zero_stage": 3, "offload_optimizer": True,
                                                      "offload_params": True}], ids=["zero2", "zero3_offload"])
def test_deepspeed_bf16_on_gpu_trains_and_exports(ray_local, tiny_model, token_table, tmp_path, zero):
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    out = str(tmp_path / "model")
    cfg = TrainConfig(engine="deepspeed", num_workers=1, micro_batch_size=2, effective_batch_size=4,
                      max_steps=2, lr=1e-2, use_gpu=True, **zero)
    metrics = _launch(f"deepspeed bf16 gpu {zero}", token_table, tiny_model, out, cfg,
                      storage_dir=str(tmp_path / "rs"), name="gpu")
    assert metrics["steps"] == 2 and all(np.isfinite(metrics["loss_per_step"]))
    with safe_open(os.path.join(out, "model.safetensors"), "pt") as f:  # consolidated fp32 masters cast to bf16
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.bfloat16}
    model = AutoModelForCausalLM.from_pretrained(out)
    init = _weights(tiny_model)
    assert any(not torch.equal(v.float(), init[k].float()) for k, v in model.state_dict().items())


# ------------------------------------------------------------------------------------------ adapters


def test_lora_loop_trains_only_the_adapter_and_exports_a_merged_checkpoint(tiny_model, token_table, tmp_path):
    cfg = TrainConfig(engine="ddp", micro_batch_size=2, effective_batch_size=4, max_steps=3, lr=5e-2,
                      num_workers=1, seed=3, log_every_steps=1, export="merged")
    spec = {"kind": "lora", "r": 4, "alpha": 8, "targets": ["q_proj", "v_proj"]}
    job = SFTJob(token_table, tiny_model, str(tmp_path / "lora"), cfg, False, 1.0, adapter=spec)
    metrics = train_loop(job, LocalSession(str(tmp_path / "ckpt")))

    # 2 layers x (q: 32->32, v: 32->16) x (A: r x in + B: out x r) with r = 4
    assert metrics["trainable_parameters"] == 2 * (4 * 32 + 32 * 4 + 4 * 32 + 16 * 4)
    assert metrics["adapter"] == "lora"
    merged, init = _weights(job.output_dir), _weights(tiny_model)
    assert set(merged) == set(init)  # a plain HF checkpoint: no lora_A / lora_B keys
    changed = {k for k in init if not torch.equal(merged[k], init[k])}
    assert changed and all(("q_proj" in k or "v_proj" in k) for k in changed)
    assert os.path.exists(os.path.join(job.output_dir, "adapter", "adapter_config.json"))


def test_lora_adapter_only_export_loads_as_the_merged_model_everywhere(tiny_model, token_table, tmp_path):
    """train.export=adapter writes the PEFT adapter alone, naming its base; every loader (stages, training init,
    P2D's weight reader, generation's stop tokens, the source check) sees the same model as the merged export."""
    from raycurate.models.loading import ADAPTER_CONFIG, adapter_base, check_model_source, load_model
    from raycurate.stages.generation import stop_and_pad_ids
    from raycurate.stages.p2d import _weights as p2d_weights

    outputs = {}
    for export in ("adapter", "merged"):
        cfg = TrainConfig(engine="ddp", micro_batch_size=2, effective_batch_size=4, max_steps=3, lr=5e-2,
                          num_workers=1, seed=3, adapter="lora", lora_r=4, lora_alpha=8,
                          lora_targets=["q_proj", "v_proj"], export=export)
        job = SFTJob(token_table, tiny_model, str(tmp_path / export), cfg, False, 1.0, adapter=cfg.adapter_spec())
        train_loop(job, LocalSession(str(tmp_path / f"ckpt_{export}")))
        outputs[export] = job.output_dir
    folder = outputs["adapter"]
    files = set(os.listdir(folder))
    assert {ADAPTER_CONFIG, "adapter_model.safetensors", METRICS_FILE, "tokenizer.json"} <= files
    assert "config.json" not in files and "model.safetensors" not in files
    assert adapter_base(folder) == os.path.abspath(tiny_model) and adapter_base(outputs["merged"]) is None
    check_model_source(folder)

    adapted, merged, base = _weights(folder), _weights(outputs["merged"]), _weights(tiny_model)
    assert set(adapted) == set(base)
    for key in base:
        torch.testing.assert_close(adapted[key], merged[key], rtol=1e-5, atol=1e-6)
    assert any(not torch.equal(adapted[k], base[k]) for k in base)
    ids = torch.tensor([[1, 5, 9, 3]])
    with torch.no_grad():
        torch.testing.assert_close(load_model(folder)(ids).logits, load_model(outputs["merged"])(ids).logits,
                                   rtol=1e-5, atol=1e-5)
    with p2d_weights(folder) as lazy:
        key = next(k for k in base if "q_proj" in k)
        torch.testing.assert_close(lazy[key], merged[key], rtol=1e-5, atol=1e-6)
    assert stop_and_pad_ids(folder) == stop_and_pad_ids(tiny_model)

    # a second LoRA run started from the adapter-only folder names that folder as its base: the chain loads
    cfg = TrainConfig(engine="ddp", micro_batch_size=2, effective_batch_size=4, max_steps=1, lr=5e-2, num_workers=1,
                      adapter="lora", lora_r=2, lora_alpha=4, lora_targets=["q_proj"])
    chained = SFTJob(token_table, folder, str(tmp_path / "chained"), cfg, False, 1.0, adapter=cfg.adapter_spec())
    train_loop(chained, LocalSession(str(tmp_path / "ckpt_chained")))
    assert adapter_base(chained.output_dir) == os.path.abspath(folder)
    with open(os.path.join(chained.output_dir, ADAPTER_CONFIG)) as f:
        assert json.load(f)["base_model_name_or_path"] == "../adapter"  # a stage folder of the same run: relative
    assert set(_weights(chained.output_dir)) == set(base)


def test_an_adapter_names_a_base_in_its_run_folder_relatively():
    from raycurate.training.export import adapter_base_reference

    assert adapter_base_reference("/runs/a/seed-0/base_model/model", "/runs/a/seed-0/train_mixed/model") == \
        "../../base_model/model"
    assert adapter_base_reference("/cache/smollm2", "/runs/a/seed-0/train_mixed/model") == "/cache/smollm2"


def test_lora_checkpoint_holds_the_adapter_only_and_resumes_like_an_uninterrupted_run(tiny_model, token_table,
                                                                                       tmp_path):
    cfg = TrainConfig(engine="ddp", micro_batch_size=2, effective_batch_size=4, max_steps=4, lr=5e-2,
                      checkpoint_every_steps=2, num_workers=1, seed=1, adapter="lora", lora_r=4, lora_alpha=8,
                      lora_targets=["q_proj", "v_proj"])
    spec = cfg.adapter_spec()
    assert spec == {"kind": "lora", "r": 4, "alpha": 8, "targets": ["q_proj", "v_proj"]}
    straight_job = SFTJob(token_table, tiny_model, str(tmp_path / "straight"), cfg, False, 1.0, adapter=spec)
    straight = train_loop(straight_job, LocalSession(str(tmp_path / "ckpt_a")))
    resumed_job = SFTJob(token_table, tiny_model, str(tmp_path / "resumed"), cfg, False, 1.0, adapter=spec)
    with pytest.raises(Crash):
        train_loop(resumed_job, LocalSession(str(tmp_path / "ckpt_b"), crash_after_checkpoints=1))
    saved = torch.load(os.path.join(tmp_path, "ckpt_b", "step_00002", "ddp_state.pt"), weights_only=True)["model"]
    assert saved and all("lora_" in k for k in saved)  # no frozen base weight in the checkpoint
    resumed = train_loop(resumed_job, LocalSession(str(tmp_path / "ckpt_b")))
    assert resumed["start_step"] == 2
    assert resumed["loss_per_step"] == pytest.approx(straight["loss_per_step"], rel=1e-5)
    a, b = _weights(straight_job.output_dir), _weights(resumed_job.output_dir)
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=1e-5, atol=1e-6)


def test_lora_export_of_a_bf16_base_is_fp32_and_keeps_the_whole_update(tiny_model, token_table, tmp_path):
    """A merged export in the bf16 base's dtype would round small adapter updates away (SmolLM2, one epoch: 23-78%
    of each layer's update lost); the export is fp32 and equals base + scale * B @ A exactly."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    base = str(tmp_path / "bf16_base")
    AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.bfloat16).save_pretrained(base)
    for name in os.listdir(tiny_model):
        if name.startswith(("tokenizer", "special_tokens")):
            shutil.copy2(os.path.join(tiny_model, name), base)
    cfg = TrainConfig(engine="ddp", micro_batch_size=2, effective_batch_size=4, max_steps=1, lr=1e-3, num_workers=1,
                      adapter="lora", lora_r=2, lora_alpha=4, lora_targets=["q_proj"], export="merged")
    job = SFTJob(token_table, base, str(tmp_path / "out"), cfg, False, 1.0, adapter=cfg.adapter_spec())
    train_loop(job, LocalSession(str(tmp_path / "ckpt")))
    merged, init = _weights(job.output_dir), _weights(base)
    assert {v.dtype for v in merged.values()} == {torch.float32}
    adapter = load_file(os.path.join(job.output_dir, "adapter", "adapter_model.safetensors"))
    for key_a in (k for k in adapter if "lora_A" in k):
        update = 2.0 * adapter[key_a.replace("lora_A", "lora_B")].float() @ adapter[key_a].float()  # alpha / r = 2
        weight = key_a.split("base_model.model.")[-1].replace(".lora_A.weight", ".weight")
        torch.testing.assert_close(merged[weight] - init[weight].float(), update, rtol=1e-5, atol=1e-7)
        assert update.abs().max() > 0


@pytest.mark.slow
@pytest.mark.ray
def test_deepspeed_lora_checkpoint_skips_frozen_weights_and_resume_matches(ray_local, token_table, tmp_path,
                                                                           monkeypatch):
    """With tied embeddings (as SmolLM2): the frozen embedding's second name, lm_head.weight, is not saved either."""
    from raycurate.training.session import FAULT_ENV

    tiny_model = write_tiny_llama(str(tmp_path / "tied"), tie_word_embeddings=True)
    cfg = _zero_cfg(num_workers=1, max_steps=4, max_failures=1, adapter="lora", lora_r=4, lora_alpha=8,
                    lora_targets=["q_proj", "v_proj"])
    straight_out = str(tmp_path / "straight")
    straight = _launch("zero2 lora 4 steps", token_table, tiny_model, straight_out, cfg,
                       storage_dir=str(tmp_path / "s1"), name="sft")
    marker = tmp_path / "killed"
    monkeypatch.setenv(FAULT_ENV, f"0:3:{marker}")  # the worker dies after step 3 (checkpoint at step 2)
    killed_out = str(tmp_path / "killed_run")
    killed = _launch("zero2 lora, killed after step 3", token_table, tiny_model, killed_out, cfg,
                     storage_dir=str(tmp_path / "s2"), name="sft")
    assert marker.exists() and killed["start_step"] == 2 and killed["adapter"] == "lora"
    assert killed["loss_per_step"] == pytest.approx(straight["loss_per_step"], rel=1e-6)
    _assert_same_weights(killed_out, straight_out, atol=1e-6)
    states = [os.path.join(root, f) for root, _, files in os.walk(tmp_path / "s2") for f in files
              if f.endswith("model_states.pt")]
    assert states
    for path in states:  # DeepSpeed's own pickle format (our test wrote it): weights_only cannot read it
        module = torch.load(path, weights_only=False)["module"]
        assert module and all("lora_" in k for k in module)


@pytest.mark.slow
@pytest.mark.ray
@pytest.mark.parametrize("adapter", [{"kind": "lora", "r": 4, "alpha": 8},
                                     {"kind": "head_delta", "heads": [[0, 1], [1, 2]], "train_o": True}],
                         ids=["lora", "head_delta"])
def test_deepspeed_zero3_two_workers_trains_adapters_and_exports_merged(ray_local, tiny_model, token_table, tmp_path,
                                                                          adapter):
    out = str(tmp_path / "model")
    cfg = TrainConfig(engine="deepspeed", zero_stage=3, num_workers=2, micro_batch_size=1, effective_batch_size=4,
                      max_steps=2, lr=5e-2, log_every_steps=1)
    metrics = _launch(f"deepspeed zero3 {adapter['kind']}", token_table, tiny_model, out, cfg,
                      storage_dir=str(tmp_path / "ray_storage"), name="sft", adapter=adapter)
    assert metrics["steps"] == 2 and metrics["zero_stage"] == 3 and metrics["adapter"] == adapter["kind"]
    assert all(np.isfinite(metrics["loss_per_step"]))
    merged, init = _weights(out), _weights(tiny_model)
    assert set(merged) == set(init)  # a plain HF checkpoint
    changed = {k for k in init if not torch.equal(merged[k], init[k])}
    assert changed and all("self_attn" in k for k in changed)


# ------------------------------------------------------------------------------------------ scale-out: offload,
# zero_to_fp32 export, resume on another worker count, worker failure


def _assert_same_weights(dir_a: str, dir_b: str, atol: float) -> None:
    a, b = _weights(dir_a), _weights(dir_b)
    assert set(a) == set(b)
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=0, atol=atol, msg=key)


def _extend(token_table, tiny_model, tmp_path, label, first: TrainConfig, second: TrainConfig) -> dict:
    """Train ``first`` (2 steps) into a fresh storage folder, then resume it with ``second`` (to 4 steps)."""
    return _extend_each(token_table, tiny_model, tmp_path, label, first, {label: second})[label]


def _extend_each(token_table, tiny_model, tmp_path, label, first: TrainConfig,
                 seconds: dict[str, TrainConfig]) -> dict[str, dict]:
    """Train ``first`` (2 steps) once, then resume a copy of its storage folder with each of ``seconds``.

    The copies resume like the original: Ray Train's checkpoint snapshot names its checkpoints relative to the
    run folder.
    """
    storage = tmp_path / f"storage_{label}"
    _launch(f"{label}: 2 steps", token_table, tiny_model, str(tmp_path / f"model_{label}"), first,
            storage_dir=str(storage), name="sft")
    arms = {}
    for arm, second in seconds.items():
        arm_storage, out = tmp_path / f"storage_{arm}", str(tmp_path / f"model_{arm}")
        if arm_storage != storage:
            shutil.copytree(storage, arm_storage)
        metrics = _launch(f"{arm}: resume to 4", token_table, tiny_model, out, second, storage_dir=str(arm_storage),
                          name="sft")
        arms[arm] = {"metrics": metrics, "out": out}
    return arms


def _zero_cfg(**overrides) -> TrainConfig:
    base = dict(engine="deepspeed", zero_stage=2, num_workers=2, micro_batch_size=1, effective_batch_size=4,
                max_steps=2, checkpoint_every_steps=2, lr=1e-2, warmup_ratio=0.0, log_every_steps=1)
    return TrainConfig(**{**base, **overrides})


def test_needs_universal_resume_only_for_partitioned_shards_of_another_layout():
    from raycurate.training.checkpoint import TrainState
    from raycurate.training.session import needs_universal_resume

    zero2 = TrainConfig(engine="deepspeed", zero_stage=2)
    assert not needs_universal_resume(None, zero2, 2)
    assert not needs_universal_resume(TrainState(world_size=2, zero_stage=2), zero2, 2)
    assert needs_universal_resume(TrainState(world_size=2, zero_stage=2), zero2, 1)
    assert needs_universal_resume(TrainState(world_size=4, zero_stage=3), TrainConfig(zero_stage=3), 2)
    with pytest.raises(ValueError, match="train.zero_stage=3"):
        needs_universal_resume(TrainState(world_size=2, zero_stage=3), zero2, 2)
    assert not needs_universal_resume(TrainState(world_size=2, zero_stage=0), TrainConfig(zero_stage=0), 4)
    assert not needs_universal_resume(TrainState(world_size=2, zero_stage=None), TrainConfig(engine="ddp"), 1)
    assert not needs_universal_resume(TrainState(world_size=0, zero_stage=None), zero2, 1)  # pre-stamp checkpoint


@pytest.mark.slow
@pytest.mark.ray
def test_zero2_offload_resumes_on_one_worker_like_on_two(ray_local, tiny_model, token_table, tmp_path):
    # One run trains 2 steps on 2 workers (ZeRO-2, optimizer offloaded to CPU); two copies of it continue to step 4:
    # one on 2 workers (same layout), one on 1 worker (universal checkpoint). Each step sees the same 4 rows.
    arms = _extend_each(token_table, tiny_model, tmp_path, "offload", _zero_cfg(offload_optimizer=True),
                        {"2->2": _zero_cfg(offload_optimizer=True, max_steps=4),
                         "2->1": _zero_cfg(offload_optimizer=True, max_steps=4, num_workers=1)})
    two, one = arms["2->2"], arms["2->1"]
    assert one["metrics"]["start_step"] == 2 and one["metrics"]["world_size"] == 1
    assert one["metrics"]["loss_per_step"][:2] == two["metrics"]["loss_per_step"][:2]
    assert one["metrics"]["loss_per_step"] == pytest.approx(two["metrics"]["loss_per_step"], rel=1e-5)
    assert one["metrics"]["lr_per_step"] == pytest.approx(two["metrics"]["lr_per_step"])
    _assert_same_weights(one["out"], two["out"], atol=1e-5)
    # The export was consolidated from the persisted shards: the fp32 master weights, every parameter present.
    assert set(_weights(one["out"])) == set(_weights(tiny_model))


@pytest.mark.slow
@pytest.mark.ray
def test_zero3_param_and_optimizer_offload_resume_on_one_worker(ray_local, tiny_model, token_table, tmp_path,
                                                                zero2_resumed):
    # Weight decay on the matrices only: the resume must keep the no-decay group's 0 (DeepSpeed's stage-3
    # universal loader copies the first group's hyper-parameters into every group; we repair that).
    reference = {"metrics": zero2_resumed["second"], "out": zero2_resumed["out"]}  # zero2 2->2, weight decay 0.1
    zero3 = dict(zero_stage=3, offload_optimizer=True, offload_params=True, weight_decay=0.1)
    resumed = _extend(token_table, tiny_model, tmp_path, "zero3 offload 2->1", _zero_cfg(**zero3),
                      _zero_cfg(**zero3, max_steps=4, num_workers=1))
    assert resumed["metrics"]["start_step"] == 2 and resumed["metrics"]["zero_stage"] == 3
    assert resumed["metrics"]["loss_per_step"][:2] == pytest.approx(reference["metrics"]["loss_per_step"][:2],
                                                                    rel=1e-6)
    assert resumed["metrics"]["loss_per_step"] == pytest.approx(reference["metrics"]["loss_per_step"], rel=1e-5)
    # Without repair_zero3_universal_load the shared Adam step counter put the weights ~5e-4 off here (about 5% of
    # one step's update at lr 1e-2).
    _assert_same_weights(resumed["out"], reference["out"], atol=1e-5)


@pytest.mark.slow
@pytest.mark.ray
def test_killed_worker_restarts_from_the_latest_checkpoint(ray_local, tiny_model, token_table, tmp_path,
                                                           monkeypatch):
    from raycurate.training.session import FAULT_ENV

    cfg = _zero_cfg(max_steps=4, max_failures=1)
    straight_out = str(tmp_path / "straight")
    straight = _launch("zero2 4 steps", token_table, tiny_model, straight_out, cfg,
                       storage_dir=str(tmp_path / "s1"), name="sft")
    marker = tmp_path / "killed"
    monkeypatch.setenv(FAULT_ENV, f"1:3:{marker}")  # rank 1 dies hard after step 3 (checkpoint at step 2)
    killed_out = str(tmp_path / "killed_run")
    killed = _launch("zero2 4 steps, rank 1 killed after step 3", token_table, tiny_model, killed_out, cfg,
                     storage_dir=str(tmp_path / "s2"), name="sft")
    assert marker.exists()  # the kill happened
    assert killed["start_step"] == 2 and killed["steps"] == 4  # the restarted group resumed from step 2
    assert killed["loss_per_step"] == pytest.approx(straight["loss_per_step"], rel=1e-6)
    _assert_same_weights(killed_out, straight_out, atol=1e-6)


def test_deepspeed_config_offload_blocks_and_errors():
    ds = deepspeed_config(TrainConfig(zero_stage=3, offload_optimizer=True, offload_params=True), 2, bf16=True,
                          on_gpu=True)
    zero = ds["zero_optimization"]
    assert zero["offload_optimizer"] == {"device": "cpu", "pin_memory": True}
    assert zero["offload_param"] == {"device": "cpu", "pin_memory": True}
    assert ds["zero_force_ds_cpu_optimizer"] is False and "checkpoint" not in ds
    plain = deepspeed_config(TrainConfig(zero_stage=2), 2, bf16=False, load_universal=True)
    assert "offload_optimizer" not in plain["zero_optimization"] and "zero_force_ds_cpu_optimizer" not in plain
    assert plain["checkpoint"] == {"load_universal": True}
    with pytest.raises(ValueError, match="zero_stage=3"):
        deepspeed_config(TrainConfig(zero_stage=2, offload_params=True), 2, bf16=False)
    with pytest.raises(ValueError, match="engine=deepspeed"):
        deepspeed_config(TrainConfig(zero_stage=0, offload_optimizer=True), 2, bf16=False)


def test_engine_step_loss_and_gradients_equal_the_full_logit_sft_loss(tiny_model, token_table):
    from transformers import AutoModelForCausalLM

    from raycurate.algorithms.losses import example_losses, weighted_batch_loss
    from raycurate.training.batches import sft_loss
    from raycurate.training.engines import build_engine

    table = load_token_table(token_table)
    batch = collate(table, np.array([0, 3, 5, 8]), pad_id=0)  # prompts of 2-4 tokens, right padding
    reference = AutoModelForCausalLM.from_pretrained(tiny_model)
    logits = reference(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits  # (B, T, V)
    expected = weighted_batch_loss(example_losses(logits, batch["input_ids"], batch["loss_mask"]), batch["weight"])
    expected.backward()

    cfg = TrainConfig(engine="ddp", num_workers=1, micro_batch_size=4, effective_batch_size=4, lr=0.0,
                      warmup_ratio=0.0, grad_clip=0.0)
    engine = build_engine(AutoModelForCausalLM.from_pretrained(tiny_model), cfg, run_steps=1,
                          device=torch.device("cpu"), bf16=False)
    loss = engine.train_micro_batch(batch, sft_loss, is_boundary=False)  # no optimizer step: keep the gradients
    assert float(loss) == pytest.approx(float(expected), rel=1e-6)
    for (name, got), want in zip(engine.module.named_parameters(), reference.parameters()):
        assert torch.allclose(got.grad, want.grad, atol=1e-6), name


def test_trainable_state_dict_drops_every_alias_of_a_frozen_tied_embedding():
    from transformers import LlamaConfig, LlamaForCausalLM

    from raycurate.models.adapters import apply_adapter
    from raycurate.training.engines import load_trainable_state_dict, trainable_state_dict

    config = LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True)
    model = apply_adapter(LlamaForCausalLM(config), {"kind": "lora", "r": 2, "targets": ["q_proj"]})
    state = trainable_state_dict(model)
    assert sorted(state) == sorted(k for k in model.state_dict() if "lora_" in k)  # no lm_head / embed alias
    load_trainable_state_dict(model, state)
    with pytest.raises(RuntimeError, match="missing trainable keys"):
        load_trainable_state_dict(model, {k: v for k, v in state.items() if "lora_A" not in k})


def test_lora_on_a_bf16_frozen_base_trains_fp32_adapters_close_to_the_fp32_run(tiny_model, token_table, tmp_path):
    from raycurate.stages.train import SFTJob as Job
    from raycurate.training.engines import build_model_engine

    base = dict(engine="ddp", micro_batch_size=2, effective_batch_size=4, max_steps=2, lr=5e-2, num_workers=1,
                seed=1, adapter="lora", lora_r=4, lora_alpha=8, lora_targets=["q_proj", "v_proj"])
    runs = {}
    for dtype in ("float32", "bfloat16"):
        cfg = TrainConfig(frozen_dtype=dtype, **base)
        job = Job(token_table, tiny_model, str(tmp_path / dtype), cfg, False, 1.0, adapter=cfg.adapter_spec())
        engine, _, _ = build_model_engine(job, 2, torch.device("cpu"))
        dtypes = {(p.requires_grad, p.dtype) for p in engine.module.parameters()}
        frozen = torch.bfloat16 if dtype == "bfloat16" else torch.float32
        assert dtypes == {(True, torch.float32), (False, frozen)}
        runs[dtype] = train_loop(job, LocalSession(str(tmp_path / f"ckpt_{dtype}")))
    assert runs["bfloat16"]["loss_per_step"] == pytest.approx(runs["float32"]["loss_per_step"], rel=2e-2)
    assert {v.dtype for v in _weights(str(tmp_path / "bfloat16")).values()} == {torch.float32}  # merged in fp32


def test_frozen_dtype_applies_to_lora_only():
    from raycurate.training.engines import load_dtype

    cpu, cfg = torch.device("cpu"), TrainConfig(frozen_dtype="bfloat16")
    assert load_dtype(cfg, {"kind": "lora", "r": 2}, cpu, bf16=False) == torch.bfloat16
    assert load_dtype(cfg, None, cpu, bf16=False) == torch.float32  # full fine-tuning trains every weight
    assert load_dtype(cfg, {"kind": "head_delta", "heads": [[0, 0]]}, cpu, bf16=False) == torch.float32
    assert load_dtype(TrainConfig(), {"kind": "lora"}, cpu, bf16=False) == torch.float32


def test_frozen_dtype_auto_is_bf16_only_where_bf16_matmuls_are_fast(monkeypatch):
    from raycurate.models import precision
    from raycurate.training.engines import load_dtype

    cfg, lora = TrainConfig(frozen_dtype="auto"), {"kind": "lora", "r": 2}
    measured = precision.cpu_bf16_speedup()
    assert measured > 0 and precision.cpu_bf16_speedup() == measured  # measured once per process
    monkeypatch.setattr(precision, "cpu_bf16_speedup", lambda: 0.44)  # AVX512-BF16 without AMX (this VM)
    assert not precision.fast_bf16("cpu") and precision.fast_bf16("cuda")
    assert load_dtype(cfg, lora, torch.device("cpu"), bf16=False) == torch.float32
    monkeypatch.setattr(precision, "cpu_bf16_speedup", lambda: 1.7)
    assert load_dtype(cfg, lora, torch.device("cpu"), bf16=False) == torch.bfloat16
    assert load_dtype(cfg, None, torch.device("cpu"), bf16=False) == torch.float32  # full fine-tuning


def test_length_groups_need_one_forward_per_backward_engines():
    assert TrainConfig(length_groups=2, engine="deepspeed", zero_stage=2).config_problems() == []
    assert TrainConfig(length_groups=2, engine="ddp", num_workers=1, launcher="task").config_problems() == []
    for bad in (dict(engine="deepspeed", zero_stage=3), dict(engine="ddp", num_workers=2)):
        problems = TrainConfig(length_groups=2, **bad).config_problems()
        assert len(problems) == 1 and problems[0].startswith("train.length_groups=2: several forwards"), bad


@pytest.mark.parametrize("engine", ["ddp", "deepspeed"])
def test_a_step_on_length_groups_is_the_step_on_the_padded_batch(tiny_model, token_table, tmp_path, engine,
                                                                  monkeypatch):
    """Two optimizer steps of 4 rows in one forward or in 2 length groups: the same losses and weights (DeepSpeed
    ZeRO-2 in the task launcher's 1-rank process group, as the real proving ground trains)."""
    from raycurate.algorithms import losses
    from raycurate.stages.train import sft_entry, task_worker

    seen, grouped = [], losses.grouped_model_token_losses
    monkeypatch.setattr(losses, "grouped_model_token_losses", lambda *a: seen.append(a[-1]) or grouped(*a))
    exported, threads = {}, torch.get_num_threads()
    try:
        for groups in (1, 2):
            cfg = TrainConfig(engine=engine, launcher="task", micro_batch_size=4, effective_batch_size=4,
                              max_steps=2, lr=5e-2, num_workers=1, seed=5, length_groups=groups)
            job = SFTJob(token_table, tiny_model, str(tmp_path / f"m{groups}"), cfg, False, 1.0)
            task_worker(sft_entry, {"job": job}, str(tmp_path / f"storage{groups}" / "sft"), 1, False,
                        {"DS_ACCELERATOR": "cpu"})
            with open(os.path.join(job.output_dir, METRICS_FILE)) as f:
                exported[groups] = (json.load(f)["loss_per_step"], _weights(job.output_dir))
    finally:
        torch.set_num_threads(threads)  # prepare_worker set this process's threads to the task's 1 CPU
    assert seen == [1, 1, 2, 2]  # the engine passed train.length_groups to each step's forward
    assert exported[2][0] == pytest.approx(exported[1][0], rel=1e-5)
    for key, value in exported[1][1].items():  # Adam's sign-like first steps: see the accumulation test above
        apart = (value - exported[2][1][key]).abs() > 1e-3
        assert apart.float().mean() <= 0.01, f"{key}: {int(apart.sum())} of {apart.numel()} weights differ by > 1e-3"


@pytest.mark.slow
@pytest.mark.ray
def test_deepspeed_lora_on_a_bf16_frozen_base_trains_and_exports(ray_local, tiny_model, token_table, tmp_path):
    lora = dict(num_workers=1, max_steps=2, adapter="lora", lora_r=4, lora_alpha=8, lora_targets=["q_proj", "v_proj"])
    runs = {dtype: _launch(f"zero2 lora frozen {dtype}", token_table, tiny_model, str(tmp_path / dtype),
                           _zero_cfg(frozen_dtype=dtype, **lora), storage_dir=str(tmp_path / f"s_{dtype}"),
                           name="sft")
            for dtype in ("float32", "bfloat16")}
    assert runs["bfloat16"]["loss_per_step"] == pytest.approx(runs["float32"]["loss_per_step"], rel=2e-2)
    merged, init = _weights(str(tmp_path / "bfloat16")), _weights(tiny_model)
    changed = {k for k in init if not torch.equal(merged[k], init[k])}
    assert changed and all(("q_proj" in k or "v_proj" in k) for k in changed)


# ------------------------------------------------------------------------------------------ loss normalisation


def test_supervised_counts_skip_position_zero_and_unsupervised_tokens(token_table):
    from raycurate.training.batches import supervised_counts

    table = load_token_table(token_table)
    expected = [int((np.asarray(table.row(i)[1])[1:] != 0).sum()) for i in range(len(table))]
    assert supervised_counts(table).tolist() == expected
    assert min(expected) >= 2  # the fixture's rows supervise their whole response


def test_token_loss_of_one_micro_batch_is_the_weighted_token_mean(token_table):
    from raycurate.training.batches import token_sft_loss

    table = load_token_table(token_table)
    batch = collate(table, np.arange(4))
    per_token = torch.rand(batch["input_ids"].shape) * (batch["loss_mask"] != 0)
    per_token[:, 0] = 0
    supervised = int((batch["loss_mask"][:, 1:] != 0).sum())
    batch["token_norm"] = torch.tensor(float(supervised))
    expected = sum(float(batch["weight"][i]) * float(per_token[i].sum()) for i in range(4)) / supervised
    assert float(token_sft_loss(per_token, batch)) == pytest.approx(expected, rel=1e-6)


@pytest.mark.parametrize("normalization", ["token", "example"])
def test_a_step_is_the_same_with_or_without_gradient_accumulation(tiny_model, token_table, tmp_path, normalization):
    """The effective batch defines the loss: 4 rows in one micro-batch or in 2 x 2 give the same update. For token
    normalisation this holds only because every micro-batch is divided by the whole step's token count (a per
    micro-batch token mean would weigh the tokens of a short micro-batch more)."""
    exported = {}
    for micro in (4, 2):
        cfg = TrainConfig(engine="ddp", micro_batch_size=micro, effective_batch_size=4, max_steps=1, lr=5e-2,
                          num_workers=1, seed=5, loss_normalization=normalization)
        job = SFTJob(token_table, tiny_model, str(tmp_path / f"m{micro}"), cfg, False, 1.0)
        metrics = train_loop(job, LocalSession(str(tmp_path / f"ckpt{micro}")))
        exported[micro] = (metrics["loss_per_step"][0], _weights(job.output_dir))
        table = load_token_table(token_table)
        step_rows = epoch_order(len(table), 5, 0)[:4]
        assert metrics["supervised_tokens"] == sum(int((table.row(int(i))[1][1:] != 0).sum()) for i in step_rows)
    assert exported[4][0] == pytest.approx(exported[2][0], rel=1e-5)
    # Adam's first step moves each weight by ~lr * sign(grad): a gradient differing in direction moves weights by
    # ~0.1. Where a gradient is near zero (|g| ~ Adam's eps) the sign is decided by rounding, which differs between
    # CPUs (one weight of 512 moved by 3e-3 on an AMD EPYC): such weights must stay rare, all others agree to 1e-3.
    for key, value in exported[4][1].items():
        apart = (value - exported[2][1][key]).abs() > 1e-3
        assert apart.float().mean() <= 0.01, f"{key}: {int(apart.sum())} of {apart.numel()} weights differ by > 1e-3"


def test_token_and_example_normalisation_differ_on_rows_of_different_lengths(tiny_model, token_table, tmp_path):
    losses = {}
    for normalization in ("token", "example"):
        cfg = TrainConfig(engine="ddp", micro_batch_size=4, effective_batch_size=4, max_steps=1, lr=5e-2,
                          num_workers=1, seed=5, loss_normalization=normalization)
        job = SFTJob(token_table, tiny_model, str(tmp_path / normalization), cfg, False, 1.0)
        losses[normalization] = train_loop(job, LocalSession(str(tmp_path / f"c{normalization}")))["loss_per_step"][0]
    assert losses["token"] != pytest.approx(losses["example"], rel=1e-4)


def test_training_processes_stay_for_small_models_and_exit_for_real_ones(tiny_model, tmp_path):
    from raycurate.models.loading import SMALL_CHECKPOINT_BYTES
    from raycurate.stages.train import training_max_calls

    big = tmp_path / "big"
    big.mkdir()
    with open(big / "model.safetensors", "wb") as f:  # sparse: a real model's size, no disk
        f.truncate(SMALL_CHECKPOINT_BYTES + 1)
    assert training_max_calls(tiny_model) == 0
    assert training_max_calls(str(big)) == 1
