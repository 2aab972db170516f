"""The BDS loop (raycurate.training.bds_loop / bds_step; driver raycurate.stages.bilevel_train): batch arithmetic,
one step against an independent computation, outputs, exact omega restore on resume, and (slow) omega bit-identical
across 2 Ray Train workers."""

from __future__ import annotations

import json
import os
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from train_helpers import VOCAB, Crash, LocalSession, write_tiny_llama

from raycurate.algorithms import bilevel, bmo
from raycurate.config.bilevel import BilevelConfig
from raycurate.config.train import TrainConfig
from raycurate.stages import bilevel_train as bt
from raycurate.training import bds_loop, bds_online, bds_state
from raycurate.training import bds_step as bs
from raycurate.training.batches import load_token_table
from raycurate.training.checkpoint import read_trainer_state
from raycurate.training.export import METRICS_FILE

# ------------------------------------------------------------------------------------------ fixtures


def _write_token_table(path: str, rows: int, seed: int, prefix: str) -> str:
    """Rows whose responses count up by one (learnable) or, every third row, are random (noise)."""
    rng = np.random.default_rng(seed)
    ids, input_ids, masks = [], [], []
    for i in range(rows):
        prompt_len, response_len = int(rng.integers(2, 4)), int(rng.integers(4, 7))
        start = int(rng.integers(3, VOCAB - response_len))
        noisy = prefix == "cand" and i % 3 == 0
        response = rng.integers(3, VOCAB, size=response_len).tolist() if noisy else list(
            range(start, start + response_len))
        tokens = [1] + rng.integers(3, VOCAB, size=prompt_len - 1).tolist() + response + [2]
        ids.append(f"{prefix}{i:03d}")
        input_ids.append(tokens)
        masks.append([0] * prompt_len + [1] * (len(tokens) - prompt_len))
    pq.write_table(pa.table({
        "id": pa.array(ids),
        "input_ids": pa.array(input_ids, type=pa.list_(pa.int32())),
        "loss_mask": pa.array(masks, type=pa.list_(pa.int8())),
    }), path)
    return path


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    return write_tiny_llama(str(tmp_path_factory.mktemp("tiny_llama")))


@pytest.fixture(scope="module")
def tables(tmp_path_factory) -> tuple[str, str]:
    root = tmp_path_factory.mktemp("tables")
    return (_write_token_table(str(root / "cand.parquet"), 10, seed=1, prefix="cand"),
            _write_token_table(str(root / "val.parquet"), 6, seed=2, prefix="val"))


def _cfg(**overrides) -> TrainConfig:
    base = dict(engine="ddp", micro_batch_size=2, effective_batch_size=4, epochs=2, lr=1e-2, warmup_ratio=0.0,
                num_workers=1, seed=7, log_every_steps=1)
    return TrainConfig(**{**base, **overrides})


def _job(tables, tiny_model, out: str, cfg: TrainConfig, **bds) -> bds_loop.BDSJob:
    settings = BilevelConfig(**{**dict(val_batch=2, omega_lr=0.05, seed=3), **bds})
    return bds_loop.BDSJob(tables[0], tables[1], tiny_model, out, cfg, settings)


# ------------------------------------------------------------------------------------------ batch arithmetic


def test_batch_checks_name_the_settings_to_change():
    with pytest.raises(ValueError, match=r"bilevel.val_batch=4 validation rows leave 0 candidate rows of "
                                         r"train.effective_batch_size=4"):
        bs.check_bds_batches(_cfg(), BilevelConfig(val_batch=4), 1)
    with pytest.raises(ValueError, match="multiples of num_workers=2"):
        bs.check_bds_batches(_cfg(micro_batch_size=1), BilevelConfig(val_batch=1), 2)
    with pytest.raises(ValueError, match="variant='approx' is unknown"):
        bs.check_bds_batches(_cfg(), BilevelConfig(val_batch=2, variant="approx"), 1)
    with pytest.raises(ValueError, match="needs >= 2 candidate rows per step"):
        bs.check_bds_batches(_cfg(), BilevelConfig(val_batch=3), 1)
    assert bs.check_bds_batches(_cfg(micro_batch_size=1), BilevelConfig(val_batch=2), 2) == 2
    assert bs.check_bds_batches(_cfg(micro_batch_size=1), BilevelConfig(), 2) == 2  # null: half the batch


def test_batch_split_is_val_batch_and_the_rest_of_the_effective_batch():
    assert bs.bds_batches(_cfg(effective_batch_size=32), BilevelConfig()) == (16, 16)
    assert bs.bds_batches(_cfg(effective_batch_size=32), BilevelConfig(val_batch=8)) == (8, 24)


def test_step_rows_are_seeded_cover_each_epoch_and_split_evenly():
    steps = [bs.step_rows(s, 6, 9, 2, 4, seed=5) for s in range(2)]  # 9 // 4 = 2 steps per epoch
    cand = np.concatenate([c for _, c in steps])
    assert len(set(cand.tolist())) == 8  # one permutation: distinct within the epoch
    assert all(len(set(v.tolist())) == 2 for v, _ in steps)
    again = bs.step_rows(1, 6, 9, 2, 4, seed=5)
    assert np.array_equal(again[0], steps[1][0]) and np.array_equal(again[1], steps[1][1])
    assert bs.rank_slice(np.arange(8), 1, 2).tolist() == [4, 5, 6, 7]
    assert bs.bds_total_steps(9, _cfg(epochs=3, effective_batch_size=6), BilevelConfig(val_batch=2)) == 6


# ------------------------------------------------------------------------------------------ one step by hand


def _losses_at_init(tiny_model: str, table_path: str, rows: np.ndarray) -> np.ndarray:
    from transformers import AutoModelForCausalLM

    from raycurate.algorithms.losses import example_losses
    from raycurate.training.batches import collate

    model = AutoModelForCausalLM.from_pretrained(tiny_model).eval()
    batch = collate(load_token_table(table_path), rows, pad_id=0)
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    return example_losses(logits, batch["input_ids"], batch["loss_mask"]).numpy().astype(np.float64)


@pytest.mark.parametrize("optimizer", ["adam", "sgd", "sparse_sgd", "sparse_adam"])
def test_first_step_trains_on_the_penalty_loss_and_updates_omega_from_the_gathered_losses(
        tiny_model, tables, tmp_path, optimizer):
    job = _job(tables, tiny_model, str(tmp_path / "out"), _cfg(max_steps=1), variant="detached",
               omega_optimizer=optimizer)
    metrics = bds_loop.bds_train_loop(job, LocalSession(str(tmp_path / "ckpt")))
    val_rows, cand_rows = bs.step_rows(0, 6, 10, 2, 2, job.bds.seed)
    val_losses = _losses_at_init(tiny_model, tables[1], val_rows)
    cand_losses = _losses_at_init(tiny_model, tables[0], cand_rows)
    gamma = 0.1 / 0.9
    # omega = 0 -> sigma = 1: the step minimises mean(val) + gamma * mean(cand).
    assert metrics["loss_per_step"][0] == pytest.approx(val_losses.mean() + gamma * cand_losses.mean(), rel=1e-5)
    assert metrics["val_loss_per_step"][0] == pytest.approx(val_losses.mean(), rel=1e-5)
    assert metrics["gamma_per_step"] == [pytest.approx(gamma)]
    grad = bilevel.omega_gradient(np.zeros(10), cand_rows, cand_losses, gamma)
    rows = bilevel.sampled_omega_gradient(np.zeros(10), cand_rows, cand_losses, gamma, job.bds.omega_baseline)
    if optimizer == "adam":
        expected, _ = bilevel.adam_update(np.zeros(10), grad, bilevel.AdamState.zeros(10), lr=0.05)
    elif optimizer == "sgd":
        expected = -0.05 * grad
    else:  # only the two sampled logits move
        expected = np.zeros(10)
        step = rows / (np.abs(rows) + 1e-8) if optimizer == "sparse_adam" else rows  # Adam: ~lr * sign(g)
        expected[cand_rows] = -0.05 * step
    assert metrics["weights_file"] == bds_state.WEIGHTS_FILE  # relative: the manifest must not name a temp folder
    weights = pq.read_table(os.path.join(job.output_dir, metrics["weights_file"])).to_pandas()
    assert weights["omega"].to_numpy() == pytest.approx(expected, rel=1e-5, abs=1e-9)
    assert weights["epoch"].tolist() == [0] * 10 and weights["step"].tolist() == [1] * 10
    assert metrics["omega_optimizer"] == optimizer
    by_id = weights.set_index("id")
    ids = load_token_table(tables[0]).ids
    sampled = set(ids[cand_rows].tolist())
    assert all(by_id.loc[i, "first_step"] == (0 if i in sampled else -1) for i in ids)
    assert by_id.loc[list(ids[cand_rows]), "loss"].to_numpy() == pytest.approx(cand_losses, rel=1e-5)
    assert by_id["loss"].isna().sum() == 8


def test_exact_variant_uses_losses_after_the_theta_step(tiny_model, tables, tmp_path):
    exact = bds_loop.bds_train_loop(_job(tables, tiny_model, str(tmp_path / "e"), _cfg(max_steps=2, lr=5e-2)),
                              LocalSession(str(tmp_path / "ce")))
    detached = bds_loop.bds_train_loop(
        _job(tables, tiny_model, str(tmp_path / "d"), _cfg(max_steps=2, lr=5e-2), variant="detached"),
        LocalSession(str(tmp_path / "cd")))
    assert exact["variant"] == "exact" and detached["variant"] == "detached"
    # detached: omega sees the theta^k losses of the step; exact: the same rows after the step (lower: trained on).
    assert detached["omega_loss_per_step"][0] == pytest.approx(detached["cand_loss_per_step"][0])
    assert exact["omega_loss_per_step"][0] < exact["cand_loss_per_step"][0]


# ------------------------------------------------------------------------------------------ outputs + resume


def test_bds_loop_writes_weights_and_resume_restores_omega_exactly(tiny_model, tables, tmp_path):
    # 10 candidates, cand_batch 2 -> 5 steps/epoch; 7 steps cross into epoch 1; checkpoints at 3, 6, 7.
    cfg = _cfg(max_steps=7, checkpoint_every_steps=3)
    straight_job = _job(tables, tiny_model, str(tmp_path / "straight"), cfg, omega_optimizer="sparse_adam")
    straight = bds_loop.bds_train_loop(straight_job, LocalSession(str(tmp_path / "ckpt_a")))

    resumed_job = _job(tables, tiny_model, str(tmp_path / "resumed"), cfg, omega_optimizer="sparse_adam")
    with pytest.raises(Crash):  # dies right after the step-3 checkpoint
        bds_loop.bds_train_loop(resumed_job, LocalSession(str(tmp_path / "ckpt_b"), crash_after_checkpoints=1))
    saved = bds_state.load_omega_state(os.path.join(tmp_path / "ckpt_b", "step_00003", bds_state.OMEGA_STATE_FILE),
                                bds_state.ids_digest(load_token_table(tables[0]).ids))
    assert saved.adam.step == 3 and np.any(saved.omega != 0)
    assert saved.adam.row_steps.sum() == 6 and (saved.first_step >= 0).sum() == 6  # 3 steps x 2 distinct rows
    assert np.isfinite(saved.last_loss).sum() == 6

    with LocalSession(str(tmp_path / "ckpt_b")).restore_dir() as path:
        digest = bds_state.ids_digest(load_token_table(tables[0]).ids)
        loop = bds_loop.restore_loop_state(path, read_trainer_state(path), 10, digest)
    assert np.array_equal(loop.omega.omega, saved.omega)  # bit for bit
    assert np.array_equal(loop.omega.adam.exp_avg_sq, saved.adam.exp_avg_sq)
    assert np.array_equal(loop.omega.adam.row_steps, saved.adam.row_steps)
    assert np.array_equal(loop.omega.first_step, saved.first_step)
    assert np.array_equal(loop.omega.last_loss, saved.last_loss, equal_nan=True)
    assert loop.train.step == 3 and len(loop.curves.gamma_per_step) == 3 and loop.online is None
    resumed = bds_loop.bds_train_loop(resumed_job, LocalSession(str(tmp_path / "ckpt_b")))

    assert resumed["start_step"] == 3 and resumed["steps"] == straight["steps"] == 7
    assert resumed["gamma_per_step"] == pytest.approx([0.1 / 0.9] * 5 + [0.2 / 0.8] * 2)
    assert resumed["loss_per_step"] == pytest.approx(straight["loss_per_step"], rel=1e-5)
    a = pq.read_table(os.path.join(straight_job.output_dir, bds_state.WEIGHTS_FILE)).to_pandas()
    b = pq.read_table(os.path.join(resumed_job.output_dir, bds_state.WEIGHTS_FILE)).to_pandas()
    assert np.allclose(a["omega"], b["omega"], rtol=0, atol=1e-12)
    assert a["first_step"].tolist() == b["first_step"].tolist()
    # Two snapshots: end of epoch 0 (step 5) and the last step (7, in epoch 1).
    assert a["epoch"].tolist() == [0] * 10 + [1] * 10 and a["step"].tolist() == [5] * 10 + [7] * 10
    for _, snap in a.groupby("step"):
        assert snap["sigma"].mean() == pytest.approx(1.0)
        assert sorted(snap["rank"]) == list(range(1, 11))
        assert snap.sort_values("rank")["sigma"].is_monotonic_decreasing
        assert snap["omega"].abs().max() > 0
    assert straight["omega_digests"] == [bds_state.omega_digest(a[a["step"] == 7]["omega"].to_numpy())]
    with open(os.path.join(resumed_job.output_dir, METRICS_FILE)) as f:
        assert json.load(f)["steps"] == 7
    assert os.path.exists(os.path.join(resumed_job.output_dir, "model.safetensors"))
    assert os.path.exists(os.path.join(resumed_job.output_dir, "tokenizer.json"))


def test_lora_adapter_trains_only_the_adapter_and_exports_it_alone(tiny_model, tables, tmp_path):
    from transformers import AutoModelForCausalLM

    from raycurate.models.loading import ADAPTER_CONFIG, load_model

    job = _job(tables, tiny_model, str(tmp_path / "lora"), _cfg(max_steps=2))
    job.adapter = {"kind": "lora", "r": 4, "alpha": 8, "targets": ["q_proj", "v_proj"]}
    metrics = bds_loop.bds_train_loop(job, LocalSession(str(tmp_path / "c")))
    full = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(tiny_model).parameters())
    assert metrics["adapter"] == "lora" and 0 < metrics["trainable_parameters"] < full // 10
    files = os.listdir(job.output_dir)
    assert ADAPTER_CONFIG in files and "config.json" not in files  # train.export: adapter (the default)
    merged = load_model(job.output_dir)
    assert not any("lora" in name for name in merged.state_dict())
    weights = pq.read_table(os.path.join(job.output_dir, bds_state.WEIGHTS_FILE)).to_pandas()
    assert weights["omega"].abs().max() > 0


def test_restore_rejects_omega_of_a_different_candidate_table(tmp_path):
    path = str(tmp_path / "omega.npz")
    bds_state.save_omega_state(path, bds_state.OmegaState.fresh(3), bds_state.ids_digest(np.array(["a", "b", "c"])))
    with pytest.raises(ValueError, match="different candidate table"):
        bds_state.load_omega_state(path, bds_state.ids_digest(np.array(["a", "b", "d"])))


# ------------------------------------------------------------------------------------------ online BMO


def _regenerating_hook(cand_path: str, masked: np.ndarray, calls: list, extra_random: bool = False):
    """A stand-in for the generation pool: the "generated" response of a masked question is its own offline
    response, with old log-probs from the current policy (optionally plus a second, random response)."""
    table = load_token_table(cand_path)
    rng = np.random.default_rng(0)

    def hook(step, omega, module):
        calls.append(step)
        rows = []
        for r in masked:
            requests = bt.generation_requests(table, np.array([r]))
            prompt = np.asarray(requests[0].prompt_ids)
            ids, _ = table.row(int(r))
            responses = [ids[len(prompt):]]
            if extra_random:
                responses.append(rng.integers(3, VOCAB, size=5))
            for g, response in enumerate(responses):
                full = torch.from_numpy(np.concatenate([prompt, response]))[None]
                mask = torch.cat([torch.zeros(1, len(prompt)), torch.ones(1, len(response))], dim=1)
                with torch.no_grad():
                    logits = module(input_ids=full).logits
                logp = bmo.token_logprobs(logits, full, mask)[0, len(prompt):]
                rows.append({"question_id": requests[0].question_id, "sample": g,
                             "response_ids": response.tolist(), "token_logprobs": logp.tolist()})
        return rows

    return hook


@pytest.mark.parametrize("mode", ["clip", "self_normalize"])
def test_online_with_responses_from_the_current_policy_matches_offline(tiny_model, tables, tmp_path, mode):
    # Regenerating every step with pi_old = pi_theta makes every importance weight exactly 1 and every generated
    # response equal to the offline one, so online BMO must reproduce offline BDS step for step.
    cfg = _cfg(max_steps=4)
    offline = bds_loop.bds_train_loop(_job(tables, tiny_model, str(tmp_path / "off"), cfg),
                                      LocalSession(str(tmp_path / "a")))
    calls: list = []
    masked = bmo.masked_questions_fixed(10, 0.5, seed=0)
    online = bds_loop.bds_train_loop(
        _job(tables, tiny_model, str(tmp_path / "on"), cfg, generation_every=1, importance=mode),
        LocalSession(str(tmp_path / "b")), generation_hook=_regenerating_hook(tables[0], masked, calls))
    assert calls == [0, 1, 2, 3] and online["generation_steps"] == [0, 1, 2, 3]
    assert online["method"] == "bds_online" and online["masked_questions"] == 5
    assert sum(online["online_questions_per_step"]) > 0
    assert online["loss_per_step"] == pytest.approx(offline["loss_per_step"], rel=1e-5)
    assert online["omega_loss_per_step"] == pytest.approx(offline["omega_loss_per_step"], rel=1e-5)
    a = pq.read_table(os.path.join(tmp_path / "off", bds_state.WEIGHTS_FILE)).column("omega").to_numpy()
    b = pq.read_table(os.path.join(tmp_path / "on", bds_state.WEIGHTS_FILE)).column("omega").to_numpy()
    assert np.allclose(a, b, atol=1e-7)


def test_online_responses_are_checkpointed_and_hook_runs_every_k_steps(tiny_model, tables, tmp_path):
    calls: list = []
    masked = np.array([0, 3, 6, 9])
    job = _job(tables, tiny_model, str(tmp_path / "o"), _cfg(max_steps=5, checkpoint_every_steps=5),
               generation_every=2, importance="self_normalize", variant="detached")
    metrics = bds_loop.bds_train_loop(job, LocalSession(str(tmp_path / "c")),
                                generation_hook=_regenerating_hook(tables[0], masked, calls, extra_random=True))
    assert calls == [1, 3]  # before 0-based steps 1 and 3: k = 2, 4 with k mod K_gen = 0
    assert all(np.isfinite(metrics["loss_per_step"])) and all(np.isfinite(metrics["omega_loss_per_step"]))
    saved = bds_online.load_online(os.path.join(tmp_path / "c", "step_00005", bds_online.ONLINE_STATE_FILE))
    assert saved.step == 3 and sorted(saved.sequences) == masked.tolist()
    assert all(len(seqs) == 2 for seqs in saved.sequences.values())
    ids, mask, old = saved.sequences[3][1]
    assert mask.sum() == 5 and (old[mask == 0] == 0).all() and (old[mask == 1] < 0).all()
    with pytest.raises(ValueError, match="unknown question"):
        bds_online.online_from_rows([{"question_id": "nope", "response_ids": [5], "token_logprobs": [-1.0]}],
                            load_token_table(tables[0]), 0)


# ------------------------------------------------------------------------------------------ Ray Train, 2 workers


@pytest.mark.slow
@pytest.mark.ray
@pytest.mark.parametrize("zero_stage,adapter", [(2, None), (3, {"kind": "lora", "r": 4, "alpha": 8})],
                         ids=["zero2-full", "zero3-lora"])
def test_omega_is_bit_identical_on_two_deepspeed_workers(ray_local, tiny_model, tables, tmp_path, zero_stage,
                                                         adapter):
    out = str(tmp_path / "model")
    cfg = TrainConfig(engine="deepspeed", zero_stage=zero_stage, num_workers=2, micro_batch_size=1,
                      effective_batch_size=4, max_steps=4, lr=1e-2, log_every_steps=1)
    metrics = bt.run_bds(tables[0], tables[1], tiny_model, out, cfg,
                         BilevelConfig(val_batch=2, omega_lr=0.05),
                         storage_dir=str(tmp_path / "rs"), name="bds", adapter=adapter)
    assert metrics["world_size"] == 2 and metrics["steps"] == 4
    digests = metrics["omega_digests"]
    assert len(digests) == 2 and digests[0] == digests[1]
    weights = pq.read_table(os.path.join(out, bds_state.WEIGHTS_FILE)).to_pandas()
    final = weights[weights["step"] == 4]["omega"].to_numpy()
    assert bds_state.omega_digest(final) == digests[0] and np.abs(final).max() > 0


@pytest.mark.slow
@pytest.mark.ray
def test_online_bds_through_the_task_launcher_matches_the_in_process_loop(ray_local, tiny_model, tables, tmp_path):
    # The generation hook travels to the task; regenerating from the current policy reproduces offline BDS
    # (see the in-process test above), so the task's curves must equal the in-process offline loop's.
    cfg = _cfg(max_steps=3, checkpoint_every_steps=2, launcher="task")
    offline = bds_loop.bds_train_loop(_job(tables, tiny_model, str(tmp_path / "off"), cfg),
                                      LocalSession(str(tmp_path / "a")))
    masked = bmo.masked_questions_fixed(10, 0.5, seed=0)
    settings = BilevelConfig(val_batch=2, omega_lr=0.05, seed=3, generation_every=1)
    storage = str(tmp_path / "storage")
    started = time.perf_counter()
    task = bt.run_bds(tables[0], tables[1], tiny_model, str(tmp_path / "task"), cfg, settings, storage_dir=storage,
                      name="bds", generation_hook=_regenerating_hook(tables[0], masked, []))
    print(f"[timing] launcher=task online BDS 3 steps: {time.perf_counter() - started:.1f} s")
    assert task["world_size"] == 1 and task["steps"] == 3 and task["generation_steps"] == [0, 1, 2]
    assert task["method"] == "bds_online" and sum(task["online_questions_per_step"]) > 0
    assert task["loss_per_step"] == pytest.approx(offline["loss_per_step"], rel=1e-5)
    assert task["omega_loss_per_step"] == pytest.approx(offline["omega_loss_per_step"], rel=1e-5)
    assert sorted(os.listdir(os.path.join(storage, "bds"))) == ["checkpoint_step_00000002",
                                                                "checkpoint_step_00000003"]
    assert os.path.exists(os.path.join(storage, "bds", "checkpoint_step_00000003", bds_state.OMEGA_STATE_FILE))
    a = pq.read_table(os.path.join(tmp_path / "off", bds_state.WEIGHTS_FILE)).column("omega").to_numpy()
    b = pq.read_table(os.path.join(tmp_path / "task", bds_state.WEIGHTS_FILE)).column("omega").to_numpy()
    assert np.allclose(a, b, atol=1e-7)
