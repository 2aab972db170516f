"""Benchmark scores, the BRIDGE paper's aggregate metrics, and per-document scoring of the embedded held-out task.

:func:`benchmark_scores` reads the flat lm-eval metrics of :func:`raycurate.stages.lm_eval.run_lm_eval` through
:data:`BENCHMARK_METRICS`; :func:`general_avg`, :func:`target_score`, :func:`overall_avg` and
:func:`summarize_benchmarks` (Delta_Gen, Forget_general, Gain_target) are the paper's aggregates (§5.1, App. C,
Tables 1, 10-12; each function's docstring gives its definition, docs/tune_eval.md "Aggregates" the benchmarks per
domain); :func:`heldout_exact_match` and :func:`heldout_gold_loglikelihood` score one document of the embedded
held-out task.  Scores keep the unit they come in (lm-eval fractions, the paper's percentages).
"""

from __future__ import annotations

from typing import Mapping

from raycurate.data.answers import answers_match, extract_final_answer

DOMAINS = ("math", "code", "instruction")

# benchmark -> flat lm-eval metric keys that score it, first found wins.  ARC-C and HellaSwag use length-normalised
# accuracy, MMLU its size-weighted group accuracy, GSM8K the strict "#### n" extraction, MATH the Minerva prompt
# (math_verify, else exact match) or the plain Hendrycks prompt.
BENCHMARK_METRICS: dict[str, tuple[str, ...]] = {
    "arc_challenge": ("arc_challenge/acc_norm", "arc_challenge/acc"),
    "hellaswag": ("hellaswag/acc_norm", "hellaswag/acc"),
    "mmlu": ("mmlu/acc",),
    "humaneval": ("humaneval/pass@1/create_test", "humaneval/pass@1"),
    "gsm8k": ("gsm8k/exact_match/strict-match", "gsm8k/exact_match/flexible-extract"),
    "math": ("minerva_math/math_verify", "minerva_math/exact_match", "hendrycks_math/exact_match"),
    "ifeval_prompt_strict": ("ifeval/prompt_level_strict_acc",),
    "ifeval_inst_strict": ("ifeval/inst_level_strict_acc",),
}

GENERAL_BENCHMARKS: dict[str, tuple[str, ...]] = {
    "math": ("arc_challenge", "hellaswag", "mmlu", "humaneval"),
    "code": ("arc_challenge", "hellaswag", "mmlu", "gsm8k"),
    "instruction": ("arc_challenge", "hellaswag", "mmlu", "gsm8k"),
}

# The target score is the mean of these (one benchmark, except IFEval's two strict accuracies).
TARGET_BENCHMARKS: dict[str, tuple[str, ...]] = {
    "math": ("math",),
    "code": ("humaneval",),
    "instruction": ("ifeval_prompt_strict", "ifeval_inst_strict"),
}


def benchmark_scores(metrics: Mapping[str, float], metric_keys: Mapping[str, tuple[str, ...]] | None = None
                     ) -> dict[str, float]:
    """Pick one score per benchmark out of flat lm-eval metrics.

    Args:
        metrics: Flat metrics, e.g. ``{"arc_challenge/acc_norm": 0.43, "mmlu/acc": 0.57}``.
        metric_keys: benchmark -> candidate metric keys, first present wins (default :data:`BENCHMARK_METRICS`).

    Returns:
        benchmark -> score for every benchmark with a metric present.
    """
    metric_keys = BENCHMARK_METRICS if metric_keys is None else metric_keys
    scores = {}
    for benchmark, candidates in metric_keys.items():
        key = next((k for k in candidates if k in metrics), None)
        if key is not None:
            scores[benchmark] = float(metrics[key])
    return scores


def _check_domain(domain: str) -> None:
    if domain not in DOMAINS:
        raise ValueError(f"unknown fine-tuning domain {domain!r}; use one of {list(DOMAINS)}")


def _mean_of(scores: Mapping[str, float], names: tuple[str, ...], what: str) -> float:
    missing = [name for name in names if name not in scores]
    if missing:
        raise KeyError(f"{what} needs scores for {list(names)}; missing {missing} (run those lm-eval tasks)")
    return sum(float(scores[name]) for name in names) / len(names)


def general_avg(scores: Mapping[str, float], domain: str) -> float:
    """General Avg.: the mean of the domain's four retention benchmarks.

    Args:
        scores: benchmark -> score (see :func:`benchmark_scores`).
        domain: ``"math"``, ``"code"`` or ``"instruction"`` (the fine-tuning target).

    Raises:
        KeyError: naming the benchmarks that are missing.
    """
    _check_domain(domain)
    return _mean_of(scores, GENERAL_BENCHMARKS[domain], f"General Avg. ({domain})")


def target_score(scores: Mapping[str, float], domain: str) -> float:
    """The target-task score: MATH, HumanEval, or the mean of IFEval's two strict accuracies."""
    _check_domain(domain)
    return _mean_of(scores, TARGET_BENCHMARKS[domain], f"the {domain} target score")


def overall_avg(scores: Mapping[str, float], domain: str) -> float:
    """Overall Avg.: the mean of General Avg. and the target-task score."""
    return (general_avg(scores, domain) + target_score(scores, domain)) / 2.0


def summarize_benchmarks(scores: Mapping[str, float], domain: str,
                         pretrained: Mapping[str, float] | None = None) -> dict[str, float]:
    """Every aggregate that the available scores allow.

    Args:
        scores: benchmark -> score of the evaluated model.
        domain: Fine-tuning target domain.
        pretrained: benchmark -> score of the pretrained checkpoint, for the changes relative to it.

    Returns:
        Any of ``general_avg``, ``target``, ``overall_avg``, and with ``pretrained``: ``delta_general`` (Δ_Gen,
        fine-tuned minus pretrained), ``forget_general`` (its negation), ``gain_target``.  A key is absent when a
        benchmark it needs is missing.
    """
    _check_domain(domain)
    out: dict[str, float] = {}
    have = set(scores)
    if have.issuperset(GENERAL_BENCHMARKS[domain]):
        out["general_avg"] = general_avg(scores, domain)
    if have.issuperset(TARGET_BENCHMARKS[domain]):
        out["target"] = target_score(scores, domain)
    if "general_avg" in out and "target" in out:
        out["overall_avg"] = (out["general_avg"] + out["target"]) / 2.0
    if pretrained is not None:
        before = set(pretrained)
        if "general_avg" in out and before.issuperset(GENERAL_BENCHMARKS[domain]):
            out["delta_general"] = out["general_avg"] - general_avg(pretrained, domain)
            out["forget_general"] = -out["delta_general"]
        if "target" in out and before.issuperset(TARGET_BENCHMARKS[domain]):
            out["gain_target"] = out["target"] - target_score(pretrained, domain)
    return out


# --- per-document scoring of the local held-out tasks (lm-eval ``process_results`` hooks) --------------------


def heldout_exact_match(doc: Mapping[str, str], results: list[str]) -> dict[str, float]:
    """Score one greedy generation on an embedded held-out question.

    Args:
        doc: A held-out record with the gold final answer in ``answer``.
        results: lm-eval's generations for the doc (one for greedy decoding).

    Returns:
        ``exact_match``: 1.0 when the value after the last ``####`` equals the gold answer after normalisation;
        ``answer_format``: 1.0 when a ``####`` answer was produced at all.
    """
    predicted = extract_final_answer(results[0]) if results else None
    return {
        "exact_match": float(answers_match(predicted, doc["answer"])),
        "answer_format": float(predicted is not None),
    }


def heldout_gold_loglikelihood(doc: Mapping[str, str], results: list[tuple[float, bool]]) -> dict[str, float]:
    """Score the gold response's log-likelihood given the question.

    Args:
        doc: A held-out record with the gold ``response``.
        results: lm-eval's ``[(log-likelihood, is_greedy)]`` of the response after the prompt.

    Returns:
        ``gold_loglik``: summed log-likelihood (nats); ``gold_nll_per_byte``: negative log-likelihood per UTF-8
        byte of the response (comparable across tokenizers); ``gold_greedy``: 1.0 when greedy decoding would
        reproduce the response exactly.
    """
    loglik, is_greedy = results[0]
    n_bytes = max(1, len(doc["response"].encode("utf-8")))
    return {"gold_loglik": float(loglik), "gold_nll_per_byte": -float(loglik) / n_bytes,
            "gold_greedy": float(is_greedy)}
