"""Held-out evaluation: equation checking and metric aggregation (hand-computed)."""

from __future__ import annotations

import pytest

from raycurate.data.answers import equation_counts
from raycurate.stages.model_stages import summarize_predictions


def test_equation_counts():
    assert equation_counts("3 * 4 = 12 apples, then 12 - 5 = 8.\n#### 8") == (1, 2)
    assert equation_counts("10 / 4 = 2.5 and 7 x 2 = 14 and 1 / 0 = 3") == (2, 3)
    assert equation_counts("no arithmetic here") == (0, 0)


def test_summarize_predictions():
    rows = [
        {"correct": True, "gold_loss": 1.0, "has_final_answer": True, "unsafe_marker": False,
         "equations_correct": 2, "equations_total": 2},
        {"correct": False, "gold_loss": 3.0, "has_final_answer": False, "unsafe_marker": True,
         "equations_correct": 0, "equations_total": 2},
    ]
    m = summarize_predictions(rows)
    assert m == pytest.approx({"rows": 2, "exact_match": 0.5, "gold_loss": 2.0, "answer_format_rate": 0.5,
                               "unsafe_rate": 0.5, "equation_accuracy": 0.5})
    assert summarize_predictions([]) == {"rows": 0}


def test_summarize_predictions_adds_sampled_metrics_when_rows_carry_them():
    rows = [
        {"correct": True, "gold_loss": 1.0, "has_final_answer": True, "unsafe_marker": False,
         "equations_correct": 1, "equations_total": 1, "sampled_accuracy": 0.75, "sampled_unsafe": 0.0},
        {"correct": False, "gold_loss": 1.0, "has_final_answer": True, "unsafe_marker": False,
         "equations_correct": 1, "equations_total": 1, "sampled_accuracy": 0.25, "sampled_unsafe": 0.5},
    ]
    m = summarize_predictions(rows)
    assert m["sampled_exact_match"] == pytest.approx(0.5) and m["sampled_unsafe_rate"] == pytest.approx(0.25)


class _ScriptedLM:
    """A fake causal LM over a 6-token vocabulary: after the prompt it emits '#', then digit '4' or '7' with
    probabilities 3/4 and 1/4 (a sampled model that is right 3 times in 4 when the gold answer is 4), then EOS."""

    def __init__(self):
        import torch

        self.torch = torch
        self.param = torch.nn.Parameter(torch.zeros(1))

    def parameters(self):
        return iter([self.param])

    def eval(self):
        return self

    def __call__(self, input_ids, attention_mask=None, **kwargs):
        import types

        torch = self.torch
        batch, width = input_ids.shape
        logits = torch.full((batch, width, 6), -1e4)
        last = input_ids[:, -1]
        logits[last == 1, -1, 2] = 0.0  # after the prompt's last token (1): '#'
        logits[last == 2, -1, 3] = 0.0  # after '#': '4' (p = 3/4) or '7' (p = 1/4)
        logits[last == 2, -1, 4] = float(torch.log(torch.tensor(1 / 3)))
        logits[(last == 3) | (last == 4), -1, 5] = 0.0  # then EOS
        return types.SimpleNamespace(logits=logits, past_key_values=None, cache=None)


def test_sampled_answers_are_seeded_per_question_and_estimate_the_model_distribution():
    import types

    from raycurate.stages import model_stages

    tokenizer = types.SimpleNamespace(pad_token_id=0, eos_token_id=5, decode=lambda ids, skip_special_tokens:
                                      "".join({2: "#### ", 3: "4", 4: "7"}.get(i, "") for i in ids),
                                      convert_tokens_to_ids=lambda token: None, unk_token_id=None)
    rows = [{"id": f"q{i}", "label": {"answer": "4"}} for i in range(6)]
    prompts = [[1]] * len(rows)
    kwargs = {"n": 64, "temperature": 1.0, "max_new_tokens": 4, "batch_size": 6}
    first = model_stages.sampled_answer_scores(_ScriptedLM(), tokenizer, rows, prompts, seed=0, **kwargs)
    again = model_stages.sampled_answer_scores(_ScriptedLM(), tokenizer, rows[::-1], prompts, seed=0, **kwargs)[::-1]
    assert first == again  # a question's samples depend on (seed, id), not on its batch neighbours
    mean = sum(r["sampled_accuracy"] for r in first) / len(first)
    assert mean == pytest.approx(0.75, abs=0.07)
    assert first != model_stages.sampled_answer_scores(_ScriptedLM(), tokenizer, rows, prompts, seed=1, **kwargs)
