"""The embedded base model's recipe: episode mixture, block-length curriculum, the committed checkpoint."""

from __future__ import annotations

import json
import os
import re

import pytest

from raycurate.data import pretrain_texts as pt
from raycurate.models import pretrain
from raycurate.models.loading import embedded_model_dir, load_model, load_tokenizer, resolve_model_path

EXAMPLE = re.compile(r"<\|user\|>(.*?)<\|end\|><\|assistant\|>(.*?)<\|end\|><\|eos\|>", re.S)


def examples_of(episode: str) -> list[tuple[str, str]]:
    return EXAMPLE.findall(episode)


def test_mixture_is_seeded():
    first = pt.pretraining_mixture(60, seed=3)
    assert first == pt.pretraining_mixture(60, seed=3)
    assert first != pt.pretraining_mixture(60, seed=4)


def test_every_episode_is_whole_chat_examples():
    for episode in pt.pretraining_mixture(80, seed=0):
        body = episode.split("\n\n", 1)[1] if not episode.startswith("<|user|>") else episode
        examples = examples_of(body)
        assert examples, episode[:200]
        assert "".join(pt.render_example(p, r) for p, r in examples) == body


def test_lookup_answer_is_one_of_the_prompt_facts():
    import random

    for prompt, response in pt.lookup_episode(random.Random(1), 20):
        fact = response.split("\n")[0]  # "<name>'s <attribute> is <value>."
        assert fact in prompt
        assert response.endswith("#### " + fact.rsplit(" is ", 1)[1].rstrip("."))


def test_rule_episode_keeps_one_hidden_rule():
    import random

    examples = pt.rule_episode(random.Random(5), 8)
    constants = set()
    for prompt, response in examples:
        x = int(re.search(r"(\d+)\.$", prompt).group(1))
        work, answer = response.split("\n#### ")
        assert str(eval(work.split(" = ")[0])) == answer  # the shown work computes the answer
        constants.add(work.split(" = ")[0].replace(str(x), "x", 1))  # the same expression up to x
    assert len(constants) == 1


def test_mapping_episode_repeats_one_table():
    import random

    table = {}
    for prompt, response in pt.mapping_episode(random.Random(2), 30):
        key, value = response.split("\n")[0].split(" -> ")
        assert prompt == f"Code word for {key}?"
        assert table.setdefault(key, value) == value


def test_unknown_kind_is_an_error():
    with pytest.raises(ValueError, match="unknown episode kinds"):
        pt.pretraining_mixture(10, seed=0, mix={"poetry": 1.0})


def test_curriculum_schedule_adds_up():
    assert pretrain.curriculum_schedule(20, ((0.6, 128, 8), (0.25, 512, 2), (0.15, 1024, 1))) == [
        (12, 128, 8), (5, 512, 2), (3, 1024, 1)]
    with pytest.raises(ValueError):
        pretrain.curriculum_schedule(2, ((0.5, 64, 1), (0.3, 64, 1), (0.2, 64, 1)))


def test_curriculum_runs_phases_in_order_and_stops_on_a_prefix():
    from raycurate.models.tiny import build_tiny_model
    from raycurate.models.tokenizer import train_tokenizer

    texts = pt.pretraining_mixture(40, seed=0, mix={"lookup": 1.0, "mapping": 1.0})
    tokenizer = train_tokenizer(texts, vocab_size=300)
    phases = ((0.5, 16, 2), (0.5, 32, 1))
    seen = []
    model = build_tiny_model("tiny-llama-2l", tokenizer, seed=0)
    losses = pretrain.pretrain_curriculum(model, tokenizer, texts, steps=6, phases=phases, lr=1e-3,
                                          on_step=lambda step, length, loss: seen.append((step, length)))
    assert seen == [(0, 16), (1, 16), (2, 16), (3, 32), (4, 32), (5, 32)]
    prefix = pretrain.pretrain_curriculum(build_tiny_model("tiny-llama-2l", tokenizer, seed=0), tokenizer, texts,
                                          steps=6, phases=phases, lr=1e-3, stop_after=4)
    assert prefix == pytest.approx(losses[:4], abs=1e-5)


def test_embedded_name_resolves_to_the_package_folder(tmp_path, monkeypatch):
    assert resolve_model_path("embedded") == embedded_model_dir()
    monkeypatch.chdir(tmp_path)
    (tmp_path / "embedded").mkdir()
    assert resolve_model_path("embedded") == "embedded"  # a local folder of that name wins
    assert resolve_model_path("tiny-llama") == "tiny-llama"


needs_checkpoint = pytest.mark.skipif(not os.path.isfile(os.path.join(embedded_model_dir(), "config.json")),
                                      reason="embedded checkpoint not present")


@needs_checkpoint
def test_embedded_checkpoint_is_a_small_gqa_llama_with_long_context():
    model = load_model("embedded")
    tokenizer = load_tokenizer("embedded")
    config = model.config
    assert config.model_type == "llama"
    assert config.num_key_value_heads < config.num_attention_heads
    assert config.max_position_embeddings >= 2048
    assert sum(p.numel() for p in model.parameters()) <= 2_000_000
    assert config.vocab_size == len(tokenizer)
    size = sum(os.path.getsize(os.path.join(embedded_model_dir(), f)) for f in os.listdir(embedded_model_dir()))
    assert size <= 25 * 2**20
    recipe = json.loads(open(os.path.join(embedded_model_dir(), pretrain.RECIPE_FILE)).read())
    assert recipe["context"] >= 1024 and len(recipe["losses"]) == recipe["steps"]


@pytest.mark.slow
@needs_checkpoint
def test_recipe_reproduces_the_embedded_checkpoints_early_loss():
    """The recorded data hash is the recipe's, and its first 60 steps give the recorded losses (same seed)."""
    import torch

    from raycurate.models.tiny import build_tiny_model
    from raycurate.models.tokenizer import train_tokenizer

    recipe = json.loads(open(os.path.join(embedded_model_dir(), pretrain.RECIPE_FILE)).read())
    texts = pretrain.recipe_texts(recipe["n_episodes"], recipe["seed"], recipe["mix"])
    assert pretrain.texts_fingerprint(texts) == recipe["data_sha256"]
    tokenizer = train_tokenizer(texts, vocab_size=2048, chat_template=True)
    assert len(tokenizer) == recipe["vocab_size"]
    model = build_tiny_model(recipe["preset"], tokenizer, seed=recipe["seed"])
    with torch.random.fork_rng(devices=[]):
        losses = pretrain.pretrain_curriculum(
            model, tokenizer, texts, steps=recipe["steps"], phases=tuple(tuple(p) for p in recipe["phases"]),
            lr=recipe["lr"], seed=recipe["seed"], num_threads=1, stop_after=60)
    recorded = recipe["losses"][:60]
    assert sum(losses[-20:]) / 20 == pytest.approx(sum(recorded[-20:]) / 20, abs=0.05)
    assert losses[0] == pytest.approx(recorded[0], abs=0.01)


@needs_checkpoint
def test_base_model_stage_uses_the_embedded_checkpoint_without_pretraining(tmp_path):
    from raycurate.config.model import ModelConfig
    from raycurate.rundir import RunDir
    from raycurate.stages.model_stages import base_model_stage

    def no_texts():
        raise AssertionError("the embedded model must not pre-train")

    assert ModelConfig().name_or_path == "embedded"
    run = RunDir(tmp_path / "run")
    result = base_model_stage(run, ModelConfig(cache_dir=str(tmp_path / "cache")), pretrain_texts=no_texts,
                              data_key="unit")
    info = json.loads((tmp_path / "run" / "base_model" / "base_model.json").read_text())
    assert info["model_dir"] == os.path.realpath(embedded_model_dir())
    assert info["pretrain"]["context"] >= 1024 and "losses" not in info["pretrain"]
    assert result is not None
