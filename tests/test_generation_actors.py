"""Generation actors and pool for BMO (raycurate.stages.generation): HF on CPU through Ray, vLLM on a GPU."""

from __future__ import annotations

import os

import pytest

torch = pytest.importorskip("torch")

from raycurate.models.tiny import build_tiny_model  # noqa: E402
from raycurate.models.tokenizer import train_tokenizer  # noqa: E402
from raycurate.stages import generation as gen  # noqa: E402

WORDS = "the a cat dog sat ran on to mat park with ball add two three numbers sum is then multiply result by".split()
QUESTIONS = ["add two and three", "the cat sat on the mat", "multiply the sum by two", "the dog ran to the park"]
SETTINGS = dict(n=2, temperature=0.8, max_new_tokens=8, step=3)


def save_tiny(path, tokenizer, seed: int) -> str:
    model = build_tiny_model("tiny-llama", tokenizer, seed=seed)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def save_lora_adapter(path, tokenizer, base_seed: int, lora_seed: int) -> str:
    """A PEFT LoRA adapter on the tiny base with random (non-zero) A and B, saved by peft's save_pretrained."""
    from peft import LoraConfig, get_peft_model

    peft_model = get_peft_model(build_tiny_model("tiny-llama", tokenizer, seed=base_seed),
                                LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]))
    g = torch.Generator().manual_seed(lora_seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_" in name:
                param.copy_(0.2 * torch.randn(param.shape, generator=g))
    peft_model.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def tokenizer():
    texts = [" ".join(WORDS[(i * 5 + k) % len(WORDS)] for k in range(4 + i % 9)) + "." for i in range(200)]
    return train_tokenizer(texts, vocab_size=400)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory, tokenizer):
    root = tmp_path_factory.mktemp("generation")
    return {
        "base": save_tiny(root / "base", tokenizer, seed=0),
        "other": save_tiny(root / "other", tokenizer, seed=1),
        "adapter": save_lora_adapter(root / "adapter", tokenizer, base_seed=0, lora_seed=7),
    }


@pytest.fixture(scope="module")
def requests_(tokenizer):
    return [gen.GenerationRequest(f"q{k}", [0, 3] + tokenizer(q).input_ids + [6, 4]) for k, q in enumerate(QUESTIONS)]


@pytest.fixture(scope="module")
def actor(dirs):
    return gen.HFGenerationActor(dirs["base"], seed=0)


def ids_of(rows) -> list[tuple[str, int, list[int]]]:
    return [(r["question_id"], r["sample"], r["response_ids"]) for r in rows]


def assert_same_samples(rows, expected) -> None:
    """Same tokens and other fields; log-probs equal up to float rounding (kernels may reduce in another order when
    batch shapes, thread counts or memory alignment differ)."""
    assert ids_of(rows) == ids_of(expected)
    for row, ref in zip(rows, expected):
        assert torch.allclose(torch.tensor(row["token_logprobs"]), torch.tensor(ref["token_logprobs"]), atol=1e-5)
        assert {k: v for k, v in row.items() if "logprob" not in k} == {
            k: v for k, v in ref.items() if "logprob" not in k
        }


def teacher_forced(model, prompt: list[int], response: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + response]), use_cache=False).logits[0].float()
    return torch.log_softmax(logits[len(prompt) - 1:-1], -1).gather(-1, torch.tensor(response)[:, None])[:, 0]


# --- pure helpers ----------------------------------------------------------------------------------------------


def test_split_contiguous_is_in_order_and_near_equal():
    assert gen.split_contiguous(list(range(7)), 3) == [[0, 1, 2], [3, 4], [5, 6]]
    assert gen.split_contiguous([1, 2], 4) == [[1], [2]]
    assert gen.split_contiguous([], 2) == []


def test_backend_resolution():
    assert gen.resolve_backend("auto", total_gpus=0, vllm_available=True) == "hf"
    assert gen.resolve_backend("auto", total_gpus=2, vllm_available=False) == "hf"
    assert gen.resolve_backend("auto", total_gpus=1, vllm_available=True) == "vllm"
    with pytest.raises(ValueError, match="needs a GPU"):
        gen.resolve_backend("vllm", total_gpus=0, vllm_available=True)
    with pytest.raises(ValueError, match="valid backends"):
        gen.resolve_backend("tgi", total_gpus=0, vllm_available=False)


def test_policy_kind_and_bad_directories(dirs, tmp_path):
    assert gen.policy_kind(dirs["adapter"]) == "adapter"
    assert gen.policy_kind(dirs["base"]) == "checkpoint"
    with pytest.raises(FileNotFoundError, match="adapter_config.json"):
        gen.policy_kind(str(tmp_path))


def test_stop_and_pad_ids_come_from_the_checkpoint(dirs):
    assert gen.stop_and_pad_ids(dirs["base"]) == ([1, 6], 2)  # EOS and <|end|>; pad <|pad|>


# --- HF actor in process ---------------------------------------------------------------------------------------


def test_rows_are_complete_and_consistent(actor, requests_, dirs):
    rows = actor.generate(requests_, **SETTINGS)
    assert [(r["question_id"], r["sample"]) for r in rows] == [(f"q{k}", g) for k in range(4) for g in range(2)]
    for row in rows:
        assert row["step"] == 3 and row["policy"] == dirs["base"]
        assert 1 <= len(row["response_ids"]) == len(row["token_logprobs"]) <= 8
        assert row["logprob"] == pytest.approx(sum(row["token_logprobs"]))
        assert row["finished"] == (row["response_ids"][-1] in (1, 6))


def test_a_questions_samples_do_not_depend_on_its_batch(actor, requests_):
    together = actor.generate(requests_, **SETTINGS)
    apart = [row for r in reversed(requests_) for row in actor.generate([r], **SETTINGS)]
    assert ids_of(together) == ids_of(sorted(apart, key=lambda r: (r["question_id"], r["sample"])))
    assert ids_of(actor.generate(requests_, **{**SETTINGS, "step": 4})) != ids_of(together)  # step is in the seed


def test_adapter_is_applied_swapped_and_removed_without_stacking(actor, requests_, dirs, tokenizer, tmp_path):
    from peft import PeftModel

    base = actor.generate(requests_, **SETTINGS)
    adapted = actor.generate(requests_, adapter_dir=dirs["adapter"], **SETTINGS)
    assert ids_of(adapted) != ids_of(base)
    assert all(r["policy"] == dirs["adapter"] for r in adapted)
    reference = PeftModel.from_pretrained(build_tiny_model("tiny-llama", tokenizer, seed=0), dirs["adapter"]).eval()
    for row in adapted:
        prompt = next(r.prompt_ids for r in requests_ if r.question_id == row["question_id"])
        expected = teacher_forced(reference, prompt, row["response_ids"])
        assert torch.allclose(torch.tensor(row["token_logprobs"]), expected, atol=1e-4)
    # a second adapter replaces the first (logprobs of the same adapter afterwards are unchanged: no stacking)
    second = save_lora_adapter(tmp_path / "second", tokenizer, base_seed=0, lora_seed=8)
    assert ids_of(actor.generate(requests_, adapter_dir=second, **SETTINGS)) != ids_of(adapted)
    assert_same_samples(actor.generate(requests_, adapter_dir=dirs["adapter"], **SETTINGS), adapted)
    assert_same_samples(actor.generate(requests_, **SETTINGS), base)


def test_rewritten_adapter_directory_is_reloaded(actor, requests_, tokenizer, tmp_path):
    path = save_lora_adapter(tmp_path / "policy", tokenizer, base_seed=0, lora_seed=1)
    first = actor.generate(requests_, adapter_dir=path, **SETTINGS)
    save_lora_adapter(tmp_path / "policy", tokenizer, base_seed=0, lora_seed=2)  # the trainer's next version
    os.utime(os.path.join(path, "adapter_model.safetensors"), ns=(1, 1))  # a new stamp even on a coarse clock
    assert ids_of(actor.generate(requests_, adapter_dir=path, **SETTINGS)) != ids_of(first)


def test_full_checkpoint_directory_is_sampled_instead_of_the_base(actor, requests_, dirs):
    base = actor.generate(requests_, **SETTINGS)
    other = actor.generate(requests_, adapter_dir=dirs["other"], **SETTINGS)
    assert ids_of(other) != ids_of(base) and all(r["policy"] == dirs["other"] for r in other)
    assert_same_samples(gen.HFGenerationActor(dirs["other"], seed=0).generate(requests_, **SETTINGS), other)


def test_duplicate_question_ids_are_rejected(actor, requests_):
    with pytest.raises(ValueError, match="duplicate question ids"):
        actor.generate([requests_[0], requests_[0]], **SETTINGS)


# --- generations.parquet ---------------------------------------------------------------------------------------


def test_write_generations_round_trips(actor, requests_, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = actor.generate(requests_, **SETTINGS)
    rows = [{**r, "response": f"text {i}", "importance_weight": 1.0} for i, r in enumerate(rows)]
    path = gen.write_generations(rows, tmp_path / "out" / "generations.parquet")
    table = pq.read_table(path)
    assert table.num_rows == 8 and table.schema.field("response_ids").type == pa.list_(pa.int32())
    assert set(table.column_names) == set(gen.GENERATION_COLUMNS) | {"importance_weight"}
    back = table.to_pylist()
    assert [b["response_ids"] for b in back] == [r["response_ids"] for r in rows]
    assert [b["logprob"] for b in back] == [r["logprob"] for r in rows]
    assert sorted(p.name for p in path.parent.iterdir()) == ["generations.parquet"]  # no temp file left
    with pytest.raises(ValueError, match="lack columns"):
        gen.write_generations([{"question_id": "q"}], tmp_path / "bad.parquet")


# --- through Ray -----------------------------------------------------------------------------------------------


@pytest.mark.ray
def test_pool_of_two_hf_actors_matches_one_actor_and_handles_adapters(ray_local, actor, requests_, dirs):
    pool = gen.GenerationPool(dirs["base"], backend="hf", num_actors=2, seed=0)
    try:
        assert pool.backend == "hf" and len(pool.actors) == 2
        base = pool.generate(requests_, **SETTINGS)
        assert_same_samples(base, actor.generate(requests_, **SETTINGS))  # whichever actor served a question
        adapted = pool.generate(requests_, adapter_dir=dirs["adapter"], **SETTINGS)
        assert ids_of(adapted) != ids_of(base)
        assert_same_samples(pool.generate(requests_, adapter_dir=dirs["adapter"], **SETTINGS), adapted)
        assert_same_samples(pool.generate(requests_, **SETTINGS), base)
        assert ids_of(pool.generate(requests_, **{**SETTINGS, "seed": 1})) != ids_of(base)
        ray_local.kill(pool.actors[0], no_restart=False)  # a crash: Ray restarts the actor and retries the call
        assert_same_samples(pool.generate(requests_, **SETTINGS), base)
    finally:
        pool.shutdown()


# --- vLLM output parsing (no GPU) ------------------------------------------------------------------------------


def test_vllm_outputs_are_read_by_sample_index_with_the_sampled_tokens_logprob():
    from types import SimpleNamespace as NS

    def step(token, logprob):
        return {token: NS(logprob=logprob, rank=1)}

    output = NS(outputs=[
        NS(index=1, token_ids=[5, 9], logprobs=[step(5, -1.5), step(9, -0.5)], finish_reason="length"),
        NS(index=0, token_ids=[7, 1], logprobs=[step(7, -2.0), step(1, -0.25)], finish_reason="stop"),
    ])
    assert gen.vllm_completion_samples(output) == [([7, 1], [-2.0, -0.25], True), ([5, 9], [-1.5, -0.5], False)]
    missing = NS(outputs=[NS(index=0, token_ids=[7], logprobs=None, finish_reason="stop")])
    with pytest.raises(RuntimeError, match="logprobs=0"):
        gen.vllm_completion_samples(missing)


def test_missing_vllm_names_the_install_command(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "vllm", None)
    with pytest.raises(ImportError, match=r"raycurate\[gpu\]"):
        gen.import_vllm()


# --- vLLM (GPU) ------------------------------------------------------------------------------------------------


@pytest.mark.gpu
def test_vllm_actor_same_interface_with_lora(dirs, requests_, tokenizer):
    pytest.importorskip("vllm")
    from peft import PeftModel

    actor = gen.VLLMGenerationActor(dirs["base"], seed=0, gpu_memory_utilization=0.3, max_lora_rank=8,
                                    dtype="bfloat16", enforce_eager=True)
    base = actor.generate(requests_, **SETTINGS)
    assert [(r["question_id"], r["sample"]) for r in base] == [(f"q{k}", g) for k in range(4) for g in range(2)]
    assert ids_of(actor.generate(requests_, **SETTINGS)) == ids_of(base)  # per-request seeds
    adapted = actor.generate(requests_, adapter_dir=dirs["adapter"], **SETTINGS)
    assert ids_of(adapted) != ids_of(base)
    reference = PeftModel.from_pretrained(build_tiny_model("tiny-llama", tokenizer, seed=0), dirs["adapter"]).eval()
    for row in adapted:  # raw (temperature-1) policy log-probs, as the HF actor records them; bf16 tolerance
        prompt = next(r.prompt_ids for r in requests_ if r.question_id == row["question_id"])
        expected = teacher_forced(reference, prompt, row["response_ids"])
        assert torch.allclose(torch.tensor(row["token_logprobs"]), expected, atol=0.1)
        assert row["finished"] == (row["response_ids"][-1] in (1, 6))
    with pytest.raises(ValueError, match="full checkpoint"):
        actor.generate(requests_, adapter_dir=dirs["other"], **SETTINGS)
