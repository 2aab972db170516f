"""benchmarks/cost_model.py: its arithmetic on cases small enough to work out by hand."""

from __future__ import annotations

import importlib.util
import sys

import pytest
from benchmark_scripts import BENCHMARKS


def _load():
    """The script as module ``cost_model``, registered first (its dataclasses look their module up)."""
    spec = importlib.util.spec_from_file_location("cost_model", BENCHMARKS / "cost_model.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("cost_model", module)
    spec.loader.exec_module(module)
    return module


cm = _load()

# 1,000 weights, one layer of width 10, a tied 10 x 10 lm_head: 100 head weights, 900 body weights
TOY = cm.Shape("toy", params=1000, layers=1, hidden=10, vocab=10, tied=True, kv_heads=1, head_dim=10)


def test_flops_per_token_by_hand():
    assert (TOY.head, TOY.body) == (100, 900)
    assert cm.Shape("untied", 1200, 1, 10, 10, False, 1, 10).body == 1000  # embedding and lm_head both out
    assert cm.forward_flops(TOY, ctx=0) == 2 * 900 + 2 * 100
    assert cm.forward_flops(TOY, ctx=5, logit_frac=0.5) == 1800 + 100 + 4 * 1 * 10 * 5
    assert cm.train_full_flops(TOY, ctx=0) == 6000
    # LoRA: forward + input gradients of the frozen weights (2 forwards), the attention scores' full backward, and
    # forward + both gradients of the adapter's 10 weights
    assert cm.train_lora_flops(TOY, ctx=5, adapter_params=10) == 2 * 2200 + 200 + 60
    # g_target into the last layer of one: forward + weight and input gradients of the body + input grads of head
    assert cm.direction_flops(TOY, ctx=0, logit_frac=1.0, last_layers=1) == 2000 + 3600 + 200
    assert TOY.kv_bytes_per_token(2) == 2 * 1 * 1 * 10 * 2


def test_stage_seconds_by_hand():
    rows = cm.Batches(rows=10, real=80, padded=100, window=100, mean_len=0.0)
    stage = cm.full_sft("sft", TOY, rows, epochs=2)
    assert stage.flops == 2 * 100 * 6000
    cpu = cm.Cpu(train_rate=1e4, fp32_over_train=0.5, bf16_over_fp32=4.0, startup_train_s=20.0, startup_pool_s=1.0)
    assert cpu.seconds(stage) == pytest.approx(20 + 1.2e6 / 1e4)
    one = cm.Stage("one", stage.parts, layout="train", threads="one")
    assert cpu.seconds(one) == pytest.approx(20 + 120 * 1.8)
    # a forward pool over 2 actors, 4 equal batches: each actor does half the work at half the machine
    fwd = cm.Stage("fwd", [cm.Part("forward", "float32", 4e4)], units=[1.0] * 4, workers=2)
    assert cpu.seconds(fwd) == pytest.approx(1 + 0.5 * 4e4 / (5e3 / 2))
    bf16 = cm.Stage("fwd", [cm.Part("forward", "bfloat16", 4e4)], units=[1.0] * 4, workers=2)
    assert cpu.seconds(bf16) == pytest.approx(1 + 0.5 * 4e4 / (2e4 / 2))
    gpus = cm.GpuCluster(gpus=8, peak_bf16=1e5, mfu_train=0.5, startup_train_s=0.0, comm_overlap=1.0)
    assert gpus.seconds(stage) == pytest.approx(1.2e6 / (8 * 5e4))
    assert cm.GpuCluster(gpus=8).cpus == 192 and cm.GpuCluster(gpus=64).nodes == 8


def test_sync_and_decode_roofline_by_hand():
    stage = cm.Stage("sft", [cm.Part("train", "bfloat16", 0.0)], layout="train", sync_rows=640, sync_params=1e9)
    one_node = cm.GpuCluster(gpus=8, startup_train_s=0.0, nvlink_bytes_per_s=4e9, comm_overlap=0.5)
    assert one_node.effective_batch == 64
    assert one_node.seconds(stage) == pytest.approx(10 * 4e9 / 4e9 * 0.5)  # 10 steps x 4 bytes per weight
    eight_nodes = cm.GpuCluster(gpus=64, startup_train_s=0.0, efa_bytes_per_s=4e9, comm_overlap=0.0)
    assert eight_nodes.seconds(stage) == pytest.approx(2 * 1.0)  # ceil(640 / 512) steps
    gpu = cm.GpuCluster(gpus=1, peak_bf16=1e6, mfu_forward=1.0, hbm_bytes_per_s=1e3, hbm_efficiency=1.0)
    assert gpu.part_seconds(cm.Part("decode", "bfloat16", 1e6, bytes=5e3)) == pytest.approx(5.0)  # memory-bound
    assert gpu.part_seconds(cm.Part("decode", "bfloat16", 1e7, bytes=5e3)) == pytest.approx(10.0)  # compute-bound


def test_shard_makespan_follows_the_round_robin_schedule():
    # 905 rows in shards of 256 on 2 actors: actor 0 gets shards 0 and 2 (512 rows), actor 1 shards 1 and 3 (393)
    assert cm.shard_makespan([256, 256, 256, 137], 2) == pytest.approx(512 / 905)
    assert cm.shard_makespan([1.0] * 4, 2) == pytest.approx(0.5)
    assert cm.shard_makespan([1.0] * 5, 2) == pytest.approx(3 / 5)
    assert cm.shard_makespan([1.0, 1.0], 8) == pytest.approx(0.5)  # no more actors than shards
    # a queued shard stays with its actor (two in flight each): 3 + 1 on actor 0 against 1 + 1 on actor 1
    assert cm.shard_makespan([3.0, 1.0, 1.0, 1.0], 2) == pytest.approx(4 / 6)
    # shards not yet queued go to whichever actor frees first: actor 1 takes both of the last two
    assert cm.shard_makespan([3.0, 1.0, 1.0, 1.0, 1.0, 1.0], 2) == pytest.approx(4 / 8)


def test_eval_parts_count_prefills_decodes_and_the_gold_pass():
    prompts = cm.Batches(rows=4, real=40, padded=40, window=0.0, mean_len=0.0)
    gold = cm.Batches(rows=4, real=80, padded=80, window=40, mean_len=0.0)
    parts = cm.eval_parts(TOY, "float32", prompts, gold, samples=2, new_tokens=3, batch=2)
    prefill = 40 * 1800 + 4 * 200  # body over every prompt position, lm_head at each prompt's last
    gold_pass = 80 * (1800 + 200 * 0.5)
    ctx = 10 + 1.5  # mean prompt + half the new tokens
    decode = 4 * 3 * (2000 + 40 * ctx)
    assert [p.flops for p in parts] == pytest.approx([prefill, gold_pass, decode, 2 * decode, prefill])
    steps = 2 * 3  # 2 batches of 2 questions x 3 decode steps, greedy and sampled alike
    assert parts[2].bytes == pytest.approx(steps * 4000 + 4 * 3 * ctx * 80)  # fp32 weights, KV 80 bytes a token


def test_calibration_reproduces_the_calibration_stage_and_the_check_runs(capsys):
    cpu = cm.calibrated_cpu()
    assert cpu.seconds(cm.cpu_train_stage("train_mixed", cm.ALL_B8)) == pytest.approx(cm.CALIBRATION[1])
    assert cm.pct(120.0, 100.0) == pytest.approx(20.0)
    assert cm.main([]) == 0
    out = capsys.readouterr().out
    assert "within 25%:" in out and "Qwen2.5-7B / 64 GPUs" in out
