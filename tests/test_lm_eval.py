"""lm-eval stage: local held-out tasks on the tiny model, fail-fast on missing harness data, BRIDGE aggregates."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("lm_eval")
torch = pytest.importorskip("torch")

from raycurate.algorithms.eval_summary import (  # noqa: E402
    benchmark_scores,
    general_avg,
    heldout_exact_match,
    heldout_gold_loglikelihood,
    overall_avg,
    summarize_benchmarks,
    target_score,
)
from raycurate.data.corpus import generate_heldout, generate_pretraining_texts  # noqa: E402
from raycurate.stages.lm_eval import (  # noqa: E402
    EXACT_MATCH_TASK,
    GOLD_LOGLIK_TASK,
    BenchmarkDataMissing,
    flatten_results,
    force_offline,
    load_named_tasks,
    local_task_names,
    run_lm_eval,
    write_local_tasks,
)

REPO = Path(__file__).resolve().parents[1]
MAX_GEN_TOKS = 12
N_HELDOUT = 4


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    """An untrained tiny Llama with the project tokenizer (chat template, BOS/EOS/pad), saved as a checkpoint."""
    from raycurate.models.tiny import build_tiny_model
    from raycurate.models.tokenizer import train_tokenizer

    path = tmp_path_factory.mktemp("tiny-llama")
    tokenizer = train_tokenizer(generate_pretraining_texts(200, seed=0), vocab_size=512)
    build_tiny_model("tiny-llama", tokenizer, seed=0).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def heldout_rows() -> list[dict]:
    return generate_heldout(N_HELDOUT, seed=3)


@pytest.fixture
def offline(monkeypatch):
    """Offline Hugging Face flags for one test, restored afterwards (force_offline would leak them)."""
    import datasets.config
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)


# ------------------------------------------------------------------------------- local task files


def test_write_local_tasks_writes_docs_and_yaml(tmp_path, heldout_rows):
    names = write_local_tasks(heldout_rows, tmp_path / "tasks", max_gen_toks=7)
    assert names == [EXACT_MATCH_TASK, GOLD_LOGLIK_TASK]
    assert local_task_names(tmp_path / "tasks") == sorted(names)
    docs = [json.loads(line) for line in (tmp_path / "tasks" / "heldout.jsonl").read_text().splitlines()]
    assert [d["id"] for d in docs] == [r["id"] for r in heldout_rows]
    assert [d["answer"] for d in docs] == [r["label"]["answer"] for r in heldout_rows]
    assert [d["prompt"] for d in docs] == [r["prompt"] for r in heldout_rows]
    em_yaml = (tmp_path / "tasks" / f"{EXACT_MATCH_TASK}.yaml").read_text()
    assert "max_gen_toks: 7" in em_yaml and str(tmp_path / "tasks" / "heldout.jsonl") in em_yaml


def test_write_local_tasks_rejects_unusable_rows(tmp_path, heldout_rows):
    with pytest.raises(ValueError, match="no held-out rows"):
        write_local_tasks([], tmp_path)
    broken = [dict(heldout_rows[0], label={**heldout_rows[0]["label"], "answer": ""})]
    with pytest.raises(ValueError, match=heldout_rows[0]["id"]):
        write_local_tasks(broken, tmp_path)


# ------------------------------------------------------------------------------- per-document hooks


def test_exact_match_hook_by_hand():
    doc = {"answer": "12"}
    assert heldout_exact_match(doc, ["so 3 * 4 = 12.\n#### 12.0"]) == {"exact_match": 1.0, "answer_format": 1.0}
    assert heldout_exact_match(doc, ["#### 12\nthen #### 13"]) == {"exact_match": 0.0, "answer_format": 1.0}
    assert heldout_exact_match(doc, ["twelve"]) == {"exact_match": 0.0, "answer_format": 0.0}


def test_gold_loglikelihood_hook_by_hand():
    scores = heldout_gold_loglikelihood({"response": "abcd"}, [(-8.0, True)])
    assert scores == {"gold_loglik": -8.0, "gold_nll_per_byte": 2.0, "gold_greedy": 1.0}
    assert heldout_gold_loglikelihood({"response": "é"}, [(-3.0, False)])["gold_nll_per_byte"] == 1.5  # 2 bytes


def test_flatten_results_by_hand():
    results = {
        "results": {"gsm8k": {"alias": "gsm8k", "exact_match,strict-match": 0.25, "exact_match_stderr,strict-match":
                              "N/A", "sample_len": 4},
                    "mmlu": {"acc,none": 0.5, "acc_stderr,none": 0.01}},
        "n-samples": {"gsm8k": {"original": 1319, "effective": 4}},
    }
    assert flatten_results(results) == {"gsm8k/exact_match/strict-match": 0.25, "mmlu/acc": 0.5,
                                        "mmlu/acc_stderr": 0.01, "gsm8k/samples": 4.0}


# ------------------------------------------------------------------------------- lm-eval on the tiny model


def _direct_gold_loglik(model, tokenizer, prompt_ids: list[int], response: str) -> float:
    """Sum of log p(response tokens | prompt) from one forward pass (the quantity lm-eval reports)."""
    response_ids = tokenizer(response, add_special_tokens=False).input_ids
    ids = torch.tensor([prompt_ids + response_ids])
    with torch.no_grad():
        logprobs = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float(), dim=-1)  # (T-1, V)
    targets = ids[0, 1:]
    picked = logprobs.gather(1, targets[:, None])[:, 0]  # (T-1,)
    return float(picked[len(prompt_ids) - 1:].sum())


def test_local_tasks_score_the_tiny_model_like_the_heldout_evaluation(tmp_path, model_dir, heldout_rows):
    from raycurate.data.tokenize import tokenize_record
    from raycurate.models.loading import load_model, load_tokenizer
    from raycurate.stages.model_stages import evaluate_rows

    names = write_local_tasks(heldout_rows, tmp_path / "tasks", max_gen_toks=MAX_GEN_TOKS)
    samples_path = tmp_path / "samples.jsonl"
    metrics = run_lm_eval(model_dir, names, local_task_dir=str(tmp_path / "tasks"), limit=N_HELDOUT,
                          batch_size=1, device="cpu", samples_path=str(samples_path))

    assert metrics[f"{EXACT_MATCH_TASK}/samples"] == metrics[f"{GOLD_LOGLIK_TASK}/samples"] == N_HELDOUT
    assert 0.0 <= metrics[f"{EXACT_MATCH_TASK}/exact_match"] <= 1.0
    samples = [json.loads(line) for line in samples_path.read_text().splitlines()]
    by_task = {task: {s["id"]: s for s in samples if s["task"] == task} for task in names}
    assert all(len(rows) == N_HELDOUT for rows in by_task.values())

    # Same prompt tokens, same greedy text and same exact match as the held-out evaluation stage.
    tokenizer, model = load_tokenizer(model_dir), load_model(model_dir)
    reference = evaluate_rows(model, tokenizer, heldout_rows, max_length=512, max_new_tokens=MAX_GEN_TOKS,
                              batch_size=1)
    for row, ref in zip(heldout_rows, reference):
        record = tokenize_record(tokenizer, row, 512)
        prompt_ids = record["input_ids"][: record["prompt_len"]]
        em = by_task[EXACT_MATCH_TASK][row["id"]]
        assert tokenizer(em["context"], add_special_tokens=False).input_ids == prompt_ids
        assert em["response"] == ref["generated"]
        assert em["exact_match"] == float(ref["correct"])
        ll = by_task[GOLD_LOGLIK_TASK][row["id"]]
        assert ll["response"][0] == pytest.approx(_direct_gold_loglik(model, tokenizer, prompt_ids,
                                                                      row["response"]), abs=1e-3)
    assert metrics[f"{EXACT_MATCH_TASK}/exact_match"] == sum(r["correct"] for r in reference) / N_HELDOUT
    expected_nll = sum(-by_task[GOLD_LOGLIK_TASK][r["id"]]["response"][0] / len(r["response"].encode())
                       for r in heldout_rows) / N_HELDOUT
    assert metrics[f"{GOLD_LOGLIK_TASK}/gold_nll_per_byte"] == pytest.approx(expected_nll, rel=1e-6)
    assert metrics[f"{GOLD_LOGLIK_TASK}/gold_loglik"] < 0


# ------------------------------------------------------------------------------- harness tasks without data


def test_missing_dataset_names_the_task(tmp_path, offline):
    from lm_eval.tasks import TaskManager

    (tmp_path / "fake_hub_task.yaml").write_text(textwrap.dedent("""\
        task: fake_hub_task
        dataset_path: raycurate-tests/no-such-dataset
        output_type: multiple_choice
        test_split: test
        doc_to_text: "{{question}}"
        doc_to_target: 0
        doc_to_choice: ["a", "b"]
        """))
    manager = TaskManager(include_path=str(tmp_path), include_defaults=False)
    with pytest.raises(BenchmarkDataMissing, match="'fake_hub_task'.*HF_DATASETS_CACHE"):
        load_named_tasks(manager, ["fake_hub_task"])
    with pytest.raises(ValueError, match="unknown lm-eval tasks.*fake_hub_task"):
        load_named_tasks(manager, ["fake_hub_tsak"])


def test_code_tasks_need_explicit_permission():
    with pytest.raises(ValueError, match="allow_code_execution"):
        run_lm_eval("/nonexistent-model", ["humaneval"])


def test_force_offline_flips_flags_frozen_at_import(monkeypatch):
    import datasets.config
    import huggingface_hub.constants

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_OFFLINE", False)
    force_offline()
    assert os.environ["HF_HUB_OFFLINE"] == os.environ["HF_DATASETS_OFFLINE"] == "1"
    assert huggingface_hub.constants.is_offline_mode()
    assert datasets.config.HF_HUB_OFFLINE and datasets.config.HF_DATASETS_OFFLINE


@pytest.mark.slow  # ~12 s alone: a fresh interpreter plus lm-eval's index of its ~10k task files
def test_named_task_without_local_data_fails_fast_before_loading_the_model(tmp_path):
    """In a fresh process whose HF libraries were imported online (like a reused Ray worker), with an empty cache."""
    script = textwrap.dedent("""\
        import datasets, transformers  # imported before any offline flag is set
        from raycurate.stages.lm_eval import BenchmarkDataMissing, run_lm_eval
        try:
            run_lm_eval("/nonexistent-model", ["arc_challenge"])
        except BenchmarkDataMissing as exc:
            print("MISSING:", exc)
        """)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "TRANSFORMERS_"))}
    env["HF_HOME"] = str(tmp_path / "hf-home")
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    message = done.stdout.split("MISSING:", 1)[-1]
    assert "MISSING:" in done.stdout, done.stdout[-2000:] + done.stderr[-2000:]
    assert "'arc_challenge'" in message and "allenai/ai2_arc" in message and "HF_DATASETS_CACHE" in message
    assert "OfflineModeIsEnabled" in message  # it never tried the network


# ------------------------------------------------------------------------------- BRIDGE aggregates

# BRIDGE paper, Llama-3.2-3B rows (percent): Table 1 (math), Table 10 (code), Table 11 (instruction).
LLAMA_PRETRAINED = {"arc_challenge": 43.17, "hellaswag": 54.20, "mmlu": 56.64, "humaneval": 28.05, "math": 0.62,
                    "gsm8k": 28.28, "ifeval_prompt_strict": 7.39, "ifeval_inst_strict": 12.58}
LLAMA_BRIDGE_MATH = {"arc_challenge": 43.06, "hellaswag": 55.95, "mmlu": 55.32, "humaneval": 32.32, "math": 15.96}


def test_general_and_overall_avg_match_the_paper_tables():
    # math: (43.17 + 54.20 + 56.64 + 28.05) / 4 = 45.515; (45.515 + 0.62) / 2 = 23.0675  (paper: 45.52, 23.07)
    assert general_avg(LLAMA_PRETRAINED, "math") == pytest.approx(45.515)
    assert overall_avg(LLAMA_PRETRAINED, "math") == pytest.approx(23.0675)
    # code: GSM8K replaces HumanEval in the general set; (43.17 + 54.20 + 56.64 + 28.28) / 4 = 45.5725;
    # overall (45.5725 + 28.05) / 2 = 36.81125  (paper: 45.57, 36.81)
    assert general_avg(LLAMA_PRETRAINED, "code") == pytest.approx(45.5725)
    assert overall_avg(LLAMA_PRETRAINED, "code") == pytest.approx(36.81125)
    # instruction: target = (7.39 + 12.58) / 2 = 9.985; overall (45.5725 + 9.985) / 2 = 27.77875  (paper: 27.78)
    assert target_score(LLAMA_PRETRAINED, "instruction") == pytest.approx(9.985)
    assert overall_avg(LLAMA_PRETRAINED, "instruction") == pytest.approx(27.77875)


def test_summary_against_the_pretrained_checkpoint():
    summary = summarize_benchmarks(LLAMA_BRIDGE_MATH, "math", pretrained=LLAMA_PRETRAINED)
    # General (43.06 + 55.95 + 55.32 + 32.32) / 4 = 46.6625 (paper 46.66); Δ_Gen = 46.6625 - 45.515 = 1.1475
    # (paper +1.14 from the rounded averages); Gain_target = 15.96 - 0.62 = 15.34.
    assert summary == pytest.approx({"general_avg": 46.6625, "target": 15.96, "overall_avg": 31.31125,
                                     "delta_general": 1.1475, "forget_general": -1.1475, "gain_target": 15.34})


def test_summary_skips_what_the_scores_cannot_support():
    partial = {"arc_challenge": 40.0, "hellaswag": 50.0, "math": 10.0}
    assert summarize_benchmarks(partial, "math") == {"target": 10.0}
    with pytest.raises(KeyError, match=r"missing \['mmlu', 'humaneval'\]"):
        general_avg(partial, "math")
    with pytest.raises(ValueError, match="unknown fine-tuning domain"):
        general_avg(partial, "biology")


def test_benchmark_scores_take_the_first_listed_metric():
    flat = {"arc_challenge/acc": 0.40, "arc_challenge/acc_norm": 0.45, "mmlu/acc": 0.5,
            "gsm8k/exact_match/flexible-extract": 0.3, "raycurate_heldout_em/exact_match": 0.9}
    assert benchmark_scores(flat) == {"arc_challenge": 0.45, "mmlu": 0.5, "gsm8k": 0.3}
    assert math.isclose(benchmark_scores(flat, {"arc": ("arc_challenge/acc",)})["arc"], 0.40)


# ------------------------------------------------------------------------------- the stage on Ray


@pytest.mark.slow
@pytest.mark.ray
def test_lm_eval_stage_records_metrics_and_skips_when_current(ray_local, tmp_path, model_dir, heldout_rows):
    import shutil

    from raycurate.rundir import RunDir
    from raycurate.stages.base import StageOutput, run_stage
    from raycurate.stages.lm_eval import lm_eval_stage

    run = RunDir(tmp_path / "run")

    def corpus(out: Path) -> StageOutput:
        (out / "heldout.jsonl").write_text("".join(json.dumps(r) + "\n" for r in heldout_rows))
        return StageOutput(outputs={"heldout": "heldout.jsonl"})

    def model(out: Path) -> StageOutput:
        shutil.copytree(model_dir, out / "model")
        return StageOutput(outputs={"model": "model"})

    run_stage(run, "corpus", corpus, config={"rows": N_HELDOUT})
    run_stage(run, "base_model", model, config={"model": "tiny"})
    record = lm_eval_stage(run, "lm_eval_base", model_stage="base_model", heldout_stage="corpus", limit=2,
                           max_gen_toks=4, batch_size=2)
    assert record["status"] == "done"
    assert record["metrics"][f"{EXACT_MATCH_TASK}/samples"] == 2
    assert 0.0 <= record["metrics"][f"{EXACT_MATCH_TASK}/exact_match"] <= 1.0
    saved = json.loads((run.root / record["outputs"]["lm_eval"]).read_text())
    assert saved["metrics"] == {k: v for k, v in record["metrics"].items()} and saved["summary"] == {}
    assert len((run.root / record["outputs"]["samples"]).read_text().splitlines()) == 4  # 2 docs x 2 tasks
    again = lm_eval_stage(run, "lm_eval_base", model_stage="base_model", heldout_stage="corpus", limit=2,
                          max_gen_toks=4, batch_size=2)
    assert again["finished"] == record["finished"]
