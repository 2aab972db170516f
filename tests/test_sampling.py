"""Seeded sampling with generation-time log-probs (raycurate.models.sampling)."""

from __future__ import annotations

import hashlib

import pytest

torch = pytest.importorskip("torch")

from raycurate.models.generation import generate_greedy, generate_greedy_hf  # noqa: E402
from raycurate.models.sampling import derive_seed, draw_tokens, nucleus_probs, sample_responses  # noqa: E402
from raycurate.models.tiny import build_tiny_model  # noqa: E402
from raycurate.models.tokenizer import train_tokenizer  # noqa: E402

WORDS = "the a cat dog sat ran on to mat park with ball add two three numbers sum is then multiply result by".split()
EOS, PAD, END = 1, 2, 6  # fixed special-token ids of raycurate.models.tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    texts = [" ".join(WORDS[(i * 7 + k) % len(WORDS)] for k in range(4 + i % 9)) + "." for i in range(200)]
    return train_tokenizer(texts, vocab_size=400)


@pytest.fixture(scope="module")
def model(tokenizer):
    return build_tiny_model("tiny-llama", tokenizer, seed=0)


@pytest.fixture(scope="module")
def prompts(tokenizer):
    texts = ["add two and three", "the cat sat on the mat with a ball then ran to the park", "multiply the sum"]
    return [[0, 3] + tokenizer(t).input_ids + [6, 4] for t in texts]


class EosBiased(torch.nn.Module):
    """Test double: the wrapped model with ``bias`` added to the EOS logit, so responses end at varied lengths."""

    def __init__(self, inner: torch.nn.Module, bias: float):
        super().__init__()
        self.inner, self.bias = inner, bias

    def forward(self, **kwargs):
        out = self.inner(**kwargs)
        out.logits[..., EOS] += self.bias
        return out


def generators(*seeds: int) -> list[torch.Generator]:
    return [torch.Generator().manual_seed(s) for s in seeds]


def sample(model, prompts, seeds, **overrides):
    kwargs = dict(n=2, temperature=0.8, max_new_tokens=12, eos_ids=[EOS, END], pad_id=PAD, top_p=1.0)
    kwargs.update(overrides)
    gen = generators(*seeds) if isinstance(seeds, (list, tuple)) else torch.Generator().manual_seed(seeds)
    return sample_responses(model, prompts, generator=gen, **kwargs)


def teacher_forced_logprobs(model, prompt: list[int], response: list[int]) -> torch.Tensor:
    """log pi(y_t | x, y_<t) at temperature 1 from one unpadded, uncached forward pass."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + response]), use_cache=False).logits[0].float()
    logprobs = torch.log_softmax(logits[len(prompt) - 1:-1], dim=-1)  # position t predicts token t + 1
    return logprobs.gather(-1, torch.tensor(response).unsqueeze(-1)).squeeze(-1)


def as_ids(result) -> list[list[list[int]]]:
    return [[s.response_ids for s in samples] for samples in result]


# --- primitives ------------------------------------------------------------------------------------------------


def test_draw_tokens_is_the_inverse_cdf_and_never_picks_a_zero_probability_token():
    probs = torch.tensor([[0.2, 0.0, 0.5, 0.3]]).repeat(6, 1)  # cdf 0.2, 0.2, 0.7, 1.0
    uniforms = torch.tensor([0.0, 0.1, 0.2, 0.69, 0.7, 0.999])
    assert draw_tokens(probs, uniforms).tolist() == [0, 0, 2, 2, 3, 3]


def test_draw_tokens_frequencies_match_the_probabilities():
    probs = torch.tensor([0.1, 0.6, 0.0, 0.3])
    uniforms = torch.rand(40_000, generator=torch.Generator().manual_seed(0))
    counts = torch.bincount(draw_tokens(probs.expand(40_000, 4), uniforms), minlength=4) / 40_000
    assert counts[2] == 0
    assert torch.allclose(counts, probs, atol=0.01)


def test_nucleus_keeps_the_smallest_set_reaching_top_p_and_renormalises():
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()
    assert torch.allclose(nucleus_probs(logits, 1.0, 1.0), torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    assert torch.allclose(nucleus_probs(logits, 1.0, 0.75), torch.tensor([[0.625, 0.375, 0.0, 0.0]]))
    assert torch.allclose(nucleus_probs(logits, 1.0, 0.4), torch.tensor([[1.0, 0.0, 0.0, 0.0]]))
    # temperature 0.5 squares the probabilities before normalising: 0.25, 0.09, 0.0225, 0.0025 (sum 0.365)
    assert torch.allclose(nucleus_probs(logits, 0.5, 1.0), torch.tensor([[0.25, 0.09, 0.0225, 0.0025]]) / 0.365)


def test_derive_seed_is_a_stable_hash_not_pythons_salted_hash():
    expected = int.from_bytes(hashlib.sha256(b"0\x1f3\x1f'q1'").digest()[:8], "big") & (2**63 - 1)
    assert derive_seed(0, 3, "q1") == expected
    variants = {derive_seed(0, 3, "q1"), derive_seed(1, 3, "q1"), derive_seed(0, 4, "q1"), derive_seed(0, 3, "q2")}
    assert len(variants) == 4


# --- sample_responses ------------------------------------------------------------------------------------------


def test_same_seed_same_samples_and_different_seeds_differ(model, prompts):
    first = sample(model, prompts, [1, 2, 3])
    again = sample(model, prompts, [1, 2, 3])
    other = sample(model, prompts, [4, 5, 6])
    assert as_ids(first) == as_ids(again)
    for got, ref in zip(first, again):  # equal up to float rounding (kernels may vary with memory alignment)
        for s, r in zip(got, ref):
            assert torch.allclose(torch.tensor(s.token_logprobs), torch.tensor(r.token_logprobs), atol=1e-6)
    assert as_ids(first) != as_ids(other)
    assert as_ids(sample(model, prompts, 7)) == as_ids(sample(model, prompts, 7))  # one shared generator
    assert as_ids(sample(model, prompts, 7)) != as_ids(sample(model, prompts, 8))
    assert all(len(g) == 2 for g in first)
    assert first[0][0].response_ids != first[0][1].response_ids  # the n samples of a prompt are different draws


def test_one_prompt_pass_repeated_for_the_n_samples_draws_what_n_prompt_passes_draw(model, prompts, monkeypatch):
    from transformers.cache_utils import DynamicCache

    shared = sample(model, prompts, [1, 2, 3], n=3)
    owner = next(k for k in DynamicCache.__mro__ if "batch_repeat_interleave" in vars(k))
    monkeypatch.delattr(owner, "batch_repeat_interleave")  # the fallback: every repeated row forwarded
    repeated = sample(model, prompts, [1, 2, 3], n=3)
    assert as_ids(shared) == as_ids(repeated)
    for got, ref in zip(shared, repeated):
        for s, r in zip(got, ref):
            assert torch.allclose(torch.tensor(s.token_logprobs), torch.tensor(r.token_logprobs), atol=1e-5)


@pytest.mark.parametrize("temperature, top_p", [(0.8, 1.0), (0.5, 0.9), (1.3, 1.0)])
def test_recorded_logprobs_are_the_policys_temperature_one_logprobs(model, prompts, temperature, top_p):
    result = sample(model, prompts, [1, 2, 3], temperature=temperature, top_p=top_p)
    for prompt, samples in zip(prompts, result):
        for s in samples:
            reference = teacher_forced_logprobs(model, prompt, s.response_ids)
            assert torch.allclose(torch.tensor(s.token_logprobs), reference, atol=1e-4)
            assert s.logprob == pytest.approx(float(reference.sum()), abs=1e-3)


def test_left_padding_and_batching_do_not_change_a_prompts_samples(model, prompts):
    short, long = prompts[0], prompts[1]
    assert len(short) < len(long)
    batched = sample(model, [short, long], [11, 12])
    alone = sample(model, [short], [11]) + sample(model, [long], [12])
    one_per_batch = sample(model, [short, long], [11, 12], batch_size=1)
    assert as_ids(batched) == as_ids(alone) == as_ids(one_per_batch)
    for got, ref in zip(batched, alone):
        for s, r in zip(got, ref):
            assert torch.allclose(torch.tensor(s.token_logprobs), torch.tensor(r.token_logprobs), atol=1e-4)


@pytest.mark.parametrize("bias", [0.0, 3.0])
def test_greedy_matches_hf_generate(model, prompts, bias):
    biased = EosBiased(model, bias=bias) if bias else model  # 3.0: some rows stop early and are pruned
    result = sample(biased, prompts, [0, 0, 0], temperature=0.0, n=1, max_new_tokens=10)
    kwargs = dict(max_new_tokens=10, pad_id=PAD, eos_ids=[EOS, END])
    reference = generate_greedy_hf(model if not bias else HfEosBiased(model, bias), prompts, **kwargs)
    # generate_greedy drops the stop token, sample_responses keeps it
    assert [g[0].response_ids[:-1] if g[0].finished else g[0].response_ids for g in result] == reference
    assert generate_greedy(biased, prompts, **kwargs) == reference
    assert generate_greedy(biased, prompts, prune_finished=False, **kwargs) == reference


class HfEosBiased(EosBiased):
    """EosBiased that Hugging Face ``generate`` can drive (it needs the wrapped model's generation mixin)."""

    def generate(self, **kwargs):
        from transformers import LogitsProcessor, LogitsProcessorList

        bias = self.bias

        class AddEos(LogitsProcessor):
            def __call__(self, input_ids, scores):
                scores[:, EOS] += bias
                return scores

        return self.inner.generate(logits_processor=LogitsProcessorList([AddEos()]), **kwargs)


class WidthRecorder(torch.nn.Module):
    """Test double: the wrapped model, recording the batch size of every forward."""

    def __init__(self, inner: torch.nn.Module):
        super().__init__()
        self.inner, self.batch_sizes = inner, []

    def forward(self, **kwargs):
        self.batch_sizes.append(kwargs["input_ids"].shape[0])
        return self.inner(**kwargs)


def test_pruning_finished_rows_keeps_every_token_and_logprob(model, prompts):
    """Finished rows leave the decoding batch, and each row's tokens and log-probs are those of the unpruned loop:
    every prompt's generator draws for all its rows at every step."""
    biased = EosBiased(model, bias=3.0)
    recorder = WidthRecorder(biased)
    pruned = sample(recorder, prompts, [1, 2, 3], n=4, max_new_tokens=12)
    full = sample(biased, prompts, [1, 2, 3], n=4, max_new_tokens=12, prune_finished=False)
    assert as_ids(pruned) == as_ids(full)
    for got, ref in zip(pruned, full):
        for s, r in zip(got, ref):
            assert torch.allclose(torch.tensor(s.token_logprobs), torch.tensor(r.token_logprobs), atol=1e-4)
    assert recorder.batch_sizes[0] == 3  # the prompt pass: one row per prompt, repeated 4 times in the cache
    assert recorder.batch_sizes[1] <= 12 and min(recorder.batch_sizes[1:]) < 12  # rows were dropped
    assert recorder.batch_sizes[1:] == sorted(recorder.batch_sizes[1:], reverse=True)


def test_eos_ends_a_response_and_is_kept_with_its_logprob(model, prompts):
    biased = EosBiased(model, bias=3.0)
    result = sample(biased, prompts, [1, 2, 3], n=4, max_new_tokens=8)
    samples = [s for g in result for s in g]
    finished = [s for s in samples if s.finished]
    assert finished and len(finished) < len(samples)  # the bias makes some, not all, responses stop early
    assert len({len(s.response_ids) for s in finished}) > 1
    for s in samples:
        assert len(s.response_ids) == len(s.token_logprobs)
        stops = [i for i, tok in enumerate(s.response_ids) if tok in (EOS, END)]
        if s.finished:
            assert stops == [len(s.response_ids) - 1] and len(s.response_ids) <= 8
        else:
            assert stops == [] and len(s.response_ids) == 8
    for prompt, group in zip(prompts, result):
        for s in group:
            reference = teacher_forced_logprobs(biased, prompt, s.response_ids)
            assert torch.allclose(torch.tensor(s.token_logprobs), reference, atol=1e-4)


@pytest.mark.parametrize(
    "overrides, match",
    [({"n": 0}, "n=0"), ({"max_new_tokens": 0}, "max_new_tokens"), ({"temperature": -1.0}, "temperature"),
     ({"top_p": 0.0}, "top_p"), ({"batch_size": 0}, "batch_size")],
)
def test_bad_arguments_are_rejected(model, prompts, overrides, match):
    with pytest.raises(ValueError, match=match):
        sample(model, prompts, [1, 2, 3], **overrides)


def test_empty_prompt_and_generator_count_mismatch_are_rejected(model, prompts):
    with pytest.raises(ValueError, match="empty"):
        sample(model, [prompts[0], []], [1, 2])
    with pytest.raises(ValueError, match="2 generators for 3 prompts"):
        sample(model, prompts, [1, 2])
