"""Compiled selection/closure kernels (issue #29): bit-identical to the numpy code they replace."""

from __future__ import annotations

import dataclasses
import re
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("numba")

from raycurate.algorithms.bridge import kernels  # noqa: E402
from raycurate.algorithms.bridge.closure import project_response  # noqa: E402
from raycurate.algorithms.bridge.knapsack import knapsack_dp  # noqa: E402
from raycurate.algorithms.bridge.selection import budgets, select, top_b  # noqa: E402

TEXTS = (
    ("She buys 3 toy cars at 6 dollars each, so 3 * 6 = 18 dollars.\nShe pays with 50 dollars, so 50 - 18 = 32 "
     "dollars in change. Then she walks home.\n#### 32", "math"),
    ("We solve it step by step. First, $$x + 1 = 3$$ so x = 2.\nThe answer is: 2", "math"),
    ("Thus the total is \\boxed{12}. Done.", "math"),
    ("def area(width, height):\n    result = scale(width,\n                   height)  # (\n    return result + 1",
     "code"),
    ("Use this:\n```python\nx = [1,\n  2]\nprint(x)\n```\nIt prints the list. Nothing else happens.", "code"),
    ("Here are the steps to follow today. Read them twice.\n1. Choose a slightly larger pot.\n- Add fresh soil to "
     "the bottom.\n* Water it well afterwards. Wait a day!", "instruction"),
    ("Le café coûte 3 € — très cher. Donc 3 × 2 = 6 €. Voilà!", None),
)
_WORDS = re.compile(r"[ \t]*(?:\w+|[^\w\s])|\n")


def bits(value):
    """Output value -> something whose == is bit equality (floats by their IEEE bytes)."""
    if isinstance(value, np.ndarray):
        return (value.dtype.str, value.shape, value.tobytes())
    if isinstance(value, (float, np.floating)):
        return np.float64(value).tobytes()
    if isinstance(value, (list, tuple)):
        return [bits(v) for v in value]
    if isinstance(value, dict):
        return {k: bits(v) for k, v in value.items()}
    return value


def fields(result) -> dict:
    return {f.name: bits(getattr(result, f.name)) for f in dataclasses.fields(result)}


def both_paths(fn, *args, **kwargs):
    with kernels.enabled(False):
        ref = fn(*args, **kwargs)
    with kernels.enabled(True):
        got = fn(*args, **kwargs)
    return ref, got


def _inputs(rng: np.random.Generator, k: int):
    p, r = (int(rng.integers(0, 4)) if rng.random() < 0.2 else int(rng.integers(4, 220)) for _ in range(2))
    style = k % 4
    if style == 0:
        beta, gamma = rng.normal(size=(p, r)), rng.normal(size=r)
    elif style == 1:  # exact ties everywhere
        beta, gamma = np.round(rng.normal(size=(p, r)) * 2) / 4, np.round(rng.normal(size=r)) / 2
    elif style == 2:
        beta, gamma = np.zeros((p, r)), np.where(rng.random(r) < 0.5, 0.0, -0.0)
    else:
        attn = rng.dirichlet(np.full(p + r + 1, 0.3), size=r)
        a = rng.normal(size=r) * rng.exponential(size=r)
        beta, gamma = np.ascontiguousarray((attn[:, 1 : p + 1] * a[:, None]).T), a * attn[:, p + 1 :].sum(axis=1)
    bias = None if k % 3 else np.round(rng.normal(size=p) * 4) / 8
    return beta, gamma, bias


def test_selection_identical_on_generated_cases():
    rng = np.random.default_rng(29)
    for k in range(300):
        beta, gamma, bias = _inputs(rng, k)
        p, r = beta.shape
        b_p, b_r = budgets(p, r, *(float(x) for x in rng.choice([0.0, 0.3, 0.75, 1.0], size=2)))
        schedule = ("alternating", "one_pass", "independent")[k % 3]
        ref, got = both_paths(select, beta, gamma, b_p, b_r, schedule, 1 + k % 5, prompt_bias=bias)
        assert fields(got) == fields(ref), k


def test_top_b_matches_the_stable_sort_with_ties_and_nan():
    rng = np.random.default_rng(1)
    for k in range(300):
        n = int(rng.integers(0, 60))
        scores = np.round(rng.normal(size=n)) if k % 2 else rng.normal(size=n)
        if k % 7 == 0 and n:
            scores[rng.integers(0, n)] = np.nan  # the kernel declines; the sort decides
        b = int(rng.integers(0, n + 1))
        ref, got = both_paths(top_b, scores, b)
        assert got.tolist() == ref.tolist() and int(got.sum()) == b
    # by hand: ties keep the earlier position
    with kernels.enabled(True):
        assert top_b(np.array([1.0, 2.0, 2.0, 0.0, 2.0]), 2).tolist() == [False, True, True, False, False]


def test_numpy_sum_reproduced_bit_for_bit():
    rng = np.random.default_rng(2)
    for n in [0, 1, 7, 8, 9, 127, 128, 129, 255, 256, 300, 1000, 4099]:
        x = rng.normal(size=n) * 10.0 ** rng.integers(-8, 8, size=n)
        assert kernels._np_sum(x, n) == x.sum()
        mask = rng.random(n) < 0.6
        assert kernels._masked_sum(x, mask, np.empty(n)) == x[mask].sum()


def test_knapsack_identical_including_ties():
    rng = np.random.default_rng(3)
    for k in range(200):
        m = int(rng.integers(0, 14))
        weights = rng.integers(1, 12, size=m).tolist()
        values = (np.round(rng.normal(size=m) * 2) if k % 2 else rng.normal(size=m)).tolist()
        capacity = int(rng.integers(0, 40))
        pri, pos = rng.integers(1, 4, size=m).tolist(), np.abs(rng.normal(size=m)).tolist()
        ref, got = both_paths(knapsack_dp, weights, values, capacity, priority=pri, positive=pos)
        assert got == ref


def _offsets(rng: np.random.Generator, text: str, variant: int) -> np.ndarray:
    words = np.array([m.span() for m in _WORDS.finditer(text)], dtype=np.int64)
    if variant == 1:  # character tokens
        return np.array([(i, i + 1) for i in range(len(text))], dtype=np.int64)
    if variant == 2:  # template tokens inside
        at = np.sort(rng.choice(len(words) + 1, size=3, replace=False))
        return np.insert(words, at, -1, axis=0)
    if variant == 3:  # misaligned: the projection falls back to the token mask
        bad = words.copy()
        bad[3] = bad[2][::-1]
        return bad
    return words


def test_closure_identical_on_generated_cases():
    rng = np.random.default_rng(4)
    options = ({}, {"tau": 0.0}, {"dp_capacity_limit": 4}, {"complete_budget": False},
               {"max_unit_tokens": 6, "min_unit_tokens": 2}, {"alpha": 1.0})
    count = 0
    for text, domain in TEXTS:
        for k in range(40):
            offsets = _offsets(rng, text, k % 4)
            r = len(offsets)
            scores = np.round(rng.normal(size=r) * 2) / 2 if k % 3 == 1 else rng.normal(size=r)
            b_r = int(rng.integers(0, r + 1))
            token_mask = top_b(scores, b_r) if k % 2 else None
            dom = domain if k % 5 else ("sentence", "math", "code", "instruction", None)[k % 5]
            opts = options[k % len(options)]
            ref, got = both_paths(project_response, text, dom, offsets, scores, b_r, token_mask=token_mask, **opts)
            assert fields(got) == fields(ref), (text[:20], k)
            count += 1
    assert count == 280


def test_switched_off_runs_the_numpy_code(monkeypatch):
    def boom(*args, **kwargs):
        raise AssertionError("kernel called while switched off")

    for name in ("alternate", "top_b_into", "knapsack_chosen", "build_units", "aligned_ok", "unit_sums",
                 "finish_projection"):
        monkeypatch.setattr(kernels, name, boom)
    beta = np.arange(12.0).reshape(3, 4)
    with kernels.enabled(False):
        assert select(beta, np.ones(4), 1, 2).response_mask.tolist() == [False, False, True, True]
        out = project_response(TEXTS[0][0], "math", _offsets(np.random.default_rng(0), TEXTS[0][0], 0),
                               np.ones(len(list(_WORDS.finditer(TEXTS[0][0])))), 10)
        assert out.used_budget == 10
    with kernels.enabled(True), pytest.raises(AssertionError, match="kernel called"):
        select(beta, np.ones(4), 1, 2)


@pytest.mark.slow
def test_reference_set_identical_on_both_paths():
    """The whole reference set of ``benchmarks/selection_reference.py`` (~12k cases), kernels vs numpy code."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import selection_reference as ref_set

    cases = ref_set.all_cases(0)
    with kernels.enabled(False):
        ref = ref_set.run_cases(cases)
    with kernels.enabled(True):
        got = ref_set.run_cases(cases)
    assert len(ref) > 12_000
    assert ref_set.compare(ref, got) == []


def test_overflowing_products_fall_back_to_the_sort():
    """Finite inputs whose sums overflow to inf - inf = NaN: the kernel hands the selection to the numpy code."""
    big = np.finfo(np.float64).max
    beta = np.vstack([np.array([1.0, -1.0] * 8) * big, np.arange(16.0)])  # row 0 sums to NaN (inf - inf)
    with np.errstate(over="ignore", invalid="ignore"):
        assert np.isnan(beta @ np.ones(16))[0]
        with kernels.enabled(True):
            assert kernels.alternate(beta, np.ones(16), np.zeros(2), 1, 16, 4) is None
        ref, got = both_paths(select, beta, np.ones(16), 1, 16)
    assert fields(got) == fields(ref)
