"""Structure-aware closure projection (paper App. G.1): units, alignment, q(u), DP/greedy, budget, fallback."""

from __future__ import annotations

import itertools
import re

import numpy as np
import pytest

from raycurate.algorithms.bridge.alignment import pairs_from_flat, spans_from_flat, verify_alignment
from raycurate.algorithms.bridge.closure import (
    closure_projection,
    final_answer_covered,
    project_response,
    top_b_mask,
    unit_quality,
)
from raycurate.algorithms.bridge.knapsack import greedy_density, knapsack_dp
from raycurate.algorithms.bridge.units import Unit, structural_units, units_and_core

MATH = (
    "She buys 3 toy cars at 6 dollars each, so 3 * 6 = 18 dollars.\n"
    "She pays with 50 dollars, so 50 - 18 = 32 dollars in change.\n"
    "#### 32"
)
CODE = (
    "def area(width, height):\n"
    "    result = scale(width,\n"
    "                   height)\n"
    "    return result + 1"
)
INSTRUCTION = (
    "Here are the steps to follow today. Read them twice.\n"
    "1. Choose a slightly larger pot.\n"
    "- Add fresh soil to the bottom.\n"
    "* Water it well afterwards."
)


def toy_offsets(text: str) -> list[tuple[int, int]]:
    """Word-level tokens with their leading whitespace, like a byte-level BPE: ``" word"``, ``" ="``, ``"\\n"``."""
    return [m.span() for m in re.finditer(r"[ \t]*(?:\w+|[^\w\s])|\n", text)]


def unit_texts(text: str, offsets, units) -> list[str]:
    out = []
    for u in units:
        spans = [offsets[k] for k in range(u.token_start, u.token_end) if offsets[k] != (-1, -1)]
        out.append(text[spans[0][0] : spans[-1][1]].strip() if spans else "")
    return out


def partition(sizes, mandatory=()) -> list[Unit]:
    units, start = [], 0
    for i, n in enumerate(sizes):
        units.append(Unit(start, start + n, "answer" if i in mandatory else "step", i in mandatory,
                          3 if i in mandatory else 1))
        start += n
    return units


def random_instance(rng: np.random.Generator, with_answer: bool = True):
    sizes = rng.integers(1, 15, size=rng.integers(1, 12)).tolist()
    mandatory = (len(sizes) - 1,) if with_answer else ()
    units = partition(sizes, mandatory)
    r = sum(sizes)
    scores = rng.normal(size=r)
    b_r = int(rng.integers(0, r + 1))
    return scores, units, b_r


# ------------------------------------------------------------------------------------------------ units


def test_math_units_on_toy_tokens():
    offsets = toy_offsets(MATH)
    units = structural_units(MATH, "math", offsets)
    assert unit_texts(MATH, offsets, units) == [
        "She buys 3 toy cars at 6 dollars each, so 3 * 6 = 18 dollars.",
        "She pays with 50 dollars, so 50 - 18 = 32 dollars in change.",
        "#### 32",
    ]
    assert [u.kind for u in units] == ["equation", "equation", "answer"]
    assert [u.mandatory for u in units] == [False, False, True]
    answer = units[-1]
    assert answer.size == 5  # "#" x4 and " 32" (toy tokens split punctuation)
    assert [MATH[slice(*offsets[k])].strip() for k in answer.key] == ["32"]
    assert units[0].token_start == 0 and units[-1].token_end == len(offsets)


def test_boxed_answer_absorbs_its_sentence_and_is_mandatory():
    text = "We add the two parts. The total is \\boxed{4 + \\frac{1}{2}} so we stop. Done and checked here."
    offsets = toy_offsets(text)
    units = structural_units(text, "math", offsets)
    texts = unit_texts(text, offsets, units)
    assert texts[1] == "The total is \\boxed{4 + \\frac{1}{2}} so we stop."
    assert [u.mandatory for u in units] == [False, True, False]
    assert "".join(text[slice(*offsets[k])] for k in units[1].key).strip() == "4 + \\frac{1}{2}"


def test_answer_is_line_is_a_final_answer_unit():
    text = "First 2 + 3 = 5 apples in total.\nThe answer is: 5"
    units = structural_units(text, "math", toy_offsets(text))
    assert [(u.kind, u.mandatory) for u in units] == [("equation", False), ("answer", True)]


def test_code_statements_keep_open_brackets_together():
    offsets = toy_offsets(CODE)
    units = structural_units(CODE, "code", offsets)
    assert unit_texts(CODE, offsets, units) == [
        "def area(width, height):",
        "result = scale(width,\n                   height)",
        "return result + 1",
    ]
    assert {u.kind for u in units} == {"statement"}


def test_instruction_sentences_and_list_items():
    offsets = toy_offsets(INSTRUCTION)
    units = structural_units(INSTRUCTION, "instruction", offsets)
    assert unit_texts(INSTRUCTION, offsets, units) == [
        "Here are the steps to follow today.",
        "Read them twice.",
        "1. Choose a slightly larger pot.",
        "- Add fresh soil to the bottom.",
        "* Water it well afterwards.",
    ]
    assert [u.kind for u in units] == ["sentence", "sentence", "list_item", "list_item", "list_item"]


def test_unknown_domain_cuts_sentences():
    text = "One sentence here now. Another sentence follows it! A question then?"
    offsets = toy_offsets(text)
    for domain in (None, "", "poetry"):
        units = structural_units(text, domain, offsets)
        assert len(units) == 3 and {u.kind for u in units} == {"sentence"}


def test_short_units_merge_into_the_smaller_neighbour():
    # sentences of 6, 2 ("Yes."), 9 tokens: the short one joins the smaller (left) neighbour
    text = "This is the first one. Yes. Then a much longer sentence comes right here."
    offsets = toy_offsets(text)
    units = structural_units(text, None, offsets, min_unit_tokens=4)
    assert [u.size for u in units] == [8, 9]
    assert unit_texts(text, offsets, units)[0] == "This is the first one. Yes."
    # the first unit is short and has only a right neighbour
    text = "Hi. This is a long enough sentence."
    units = structural_units(text, None, toy_offsets(text), min_unit_tokens=4)
    assert [u.size for u in units] == [9]


def test_short_unit_prefers_a_non_mandatory_neighbour():
    text = "We add 2 and 3 to get 5 here.\nOk.\n#### 5"
    offsets = toy_offsets(text)
    units = structural_units(text, "math", offsets)
    assert unit_texts(text, offsets, units) == ["We add 2 and 3 to get 5 here.\nOk.", "#### 5"]
    assert units[1].mandatory and units[1].size == 5  # "Ok", ".", "\n" (3 < 4) went left, not into the answer


def test_long_units_split_into_near_equal_chunks():
    text = " ".join(f"w{i}" for i in range(200)) + "."
    units = structural_units(text, None, toy_offsets(text), max_unit_tokens=96)
    assert [u.size for u in units] == [67, 67, 67]  # 201 tokens -> ceil(201 / 96) = 3 chunks
    assert all(u.kind == "sentence" for u in units)


def test_protected_answer_is_never_split():
    text = "#### " + " ".join(str(i) for i in range(120))
    units = structural_units(text, "math", toy_offsets(text), max_unit_tokens=96)
    assert len(units) == 1 and units[0].mandatory and units[0].size == 124


def test_units_partition_and_respect_limits_on_random_texts():
    rng = np.random.default_rng(0)
    words = ["alpha", "beta", "x", "=", "3", ".", "\n", "- ", "1. ", "(", ")", "so", "#### 7"]
    for _ in range(40):
        text = " ".join(rng.choice(words, size=int(rng.integers(1, 400))))
        offsets = toy_offsets(text)
        for domain in ("math", "code", "instruction", None):
            units = structural_units(text, domain, offsets, max_unit_tokens=20, min_unit_tokens=3)
            assert units[0].token_start == 0 and units[-1].token_end == len(offsets)
            assert all(a.token_end == b.token_start for a, b in zip(units, units[1:]))
            assert all(u.size <= 20 for u in units if not u.mandatory)
            if len(units) > 1:
                assert all(u.size >= 3 for u in units if not u.mandatory)


def test_units_with_unaligned_template_tokens_join_the_previous_unit():
    text = "One two three four.\nFive six seven eight."
    offsets = toy_offsets(text) + [(-1, -1)]  # an end-of-turn marker before the (excluded) EOS
    units = structural_units(text, None, offsets)
    assert units[-1].token_end == len(offsets) and len(units) == 2
    assert len(offsets) - 1 not in units[-1].core


# ------------------------------------------------------------------------------------------------ alignment


def test_verify_alignment_accepts_good_offsets():
    assert verify_alignment(MATH, toy_offsets(MATH)).ok
    assert verify_alignment("a  b", [(0, 1), (-1, -1), (1, 4)]).ok


@pytest.mark.parametrize(
    ("offsets", "fragment"),
    [
        ([(0, 1)], "character 3"),  # "b" not covered
        ([(0, 1), (3, 9)], "outside"),
        ([(3, 4), (0, 1)], "goes back"),
        ([(0, 1), (2, 2), (3, 4)], "outside"),  # empty span
    ],
)
def test_verify_alignment_rejects_bad_offsets(offsets, fragment):
    check = verify_alignment("a  b", offsets)
    assert not check.ok and fragment in check.reason


def test_misalignment_falls_back_to_the_token_mask():
    offsets = toy_offsets(MATH)[:-2]  # the answer "32" is not covered
    scores = np.arange(len(offsets), dtype=float)
    token_mask = top_b_mask(scores, 10)
    result = project_response(MATH, "math", offsets, scores, 10, token_mask=token_mask)
    assert result.fallback and result.solver == "fallback" and "not covered" in result.fallback_reason
    assert np.array_equal(result.mask, token_mask) and result.used_budget == 10
    assert result.utility_retained == 1.0
    with pytest.raises(ValueError, match="project_response"):
        structural_units(MATH, "math", offsets)


# ------------------------------------------------------------------------------------------------ quality


def test_unit_quality_by_hand():
    scores = np.array([1.0, -5.0, 2.0, 0.5, 9.0])
    units = [Unit(0, 3, "step"), Unit(3, 5, "step", core=(3,))]
    q = unit_quality(scores, units, tau=1.0, alpha=0.5, eps=1.0)
    assert q == pytest.approx([(1 - 1 + 2) / 2.0, 0.5 / np.sqrt(2.0)])
    q0 = unit_quality(scores, units, tau=10.0, alpha=0.0, eps=1e-6)
    assert q0 == pytest.approx([-2.0, 0.5])
    # default tau = mean |s| = 17.5 / 5 = 3.5 -> -5 is clipped to -3.5
    assert unit_quality(scores, units[:1], alpha=0.0)[0] == pytest.approx(1 - 3.5 + 2)
    assert unit_quality(scores, [Unit(0, 2, "step", core=())])[0] == 0.0


# ------------------------------------------------------------------------------------------------ solvers


def brute_force(weights, values, capacity) -> float:
    best = 0.0
    for k in range(len(weights) + 1):
        for subset in itertools.combinations(range(len(weights)), k):
            if sum(weights[i] for i in subset) <= capacity:
                best = max(best, sum(values[i] for i in subset))
    return best


def test_dp_is_optimal_against_brute_force():
    rng = np.random.default_rng(1)
    for _ in range(150):
        m = int(rng.integers(1, 13))
        weights = rng.integers(1, 20, size=m).tolist()
        values = rng.normal(size=m).tolist()
        capacity = int(rng.integers(0, sum(weights) + 1))
        chosen = knapsack_dp(weights, values, capacity)
        assert sum(weights[i] for i in chosen) <= capacity
        tol = 1e-9 * (1 + sum(abs(v) for v in values))  # the documented tie tolerance
        assert sum(values[i] for i in chosen) >= brute_force(weights, values, capacity) - tol


def test_dp_tie_breaks_priority_then_positive_utility_then_position():
    assert knapsack_dp([2, 2], [1.0, 1.0], 2, priority=[1, 2]) == [1]
    assert knapsack_dp([2, 2], [1.0, 1.0], 2, priority=[1, 1], positive=[0.5, 0.7]) == [1]
    assert knapsack_dp([2, 2], [1.0, 1.0], 2) == [0]
    # subsets tied on value: {0, 1} vs {2}
    assert knapsack_dp([1, 1, 2], [1.0, 1.0, 2.0], 2, priority=[1, 1, 1]) == [0, 1]
    assert knapsack_dp([1, 1, 2], [1.0, 1.0, 2.0], 2, priority=[1, 1, 3]) == [2]
    assert knapsack_dp([1, 1, 2], [1.0, 1.0, 2.0], 2, priority=[1, 1, 2], positive=[0.1, 0.1, 0.3]) == [2]
    assert knapsack_dp([1, 1, 2], [0.1, 0.1, 2.0], 2, priority=[3, 3, 1]) == [2]  # value before priority
    assert knapsack_dp([3, 1, 1], [2.5, 1.0, 1.0], 3) == [0]
    assert knapsack_dp([3, 1, 1], [1.5, 1.0, 1.0], 3) == [1, 2]
    assert knapsack_dp([3], [5.0], 2) == []


def test_greedy_by_density_skips_what_does_not_fit():
    # densities 1.0, 0.9, 0.5, 2.0 (negative value never taken)
    assert greedy_density([4, 10, 2, 1], [4.0, 9.0, 1.0, -2.0], 7) == [0, 2]
    assert greedy_density([2, 2], [1.0, 1.0], 2, priority=[1, 3]) == [1]


def test_projection_uses_greedy_above_the_dp_capacity_limit():
    scores = np.array([5.0, 5.0, 0.1, 0.1, 0.1, 0.1, 3.0, 3.0])
    units = partition([2, 4, 2])
    dp = closure_projection(scores, units, 4, alpha=0.0, tau=0.0, complete_budget=False)
    greedy = closure_projection(scores, units, 4, alpha=0.0, tau=0.0, complete_budget=False, dp_capacity_limit=3)
    assert dp.solver == "dp" and greedy.solver == "greedy"
    assert dp.chosen_units == [0, 2] == greedy.chosen_units


# ------------------------------------------------------------------------------------------------ projection


def test_never_exceeds_budget_and_completes_it():
    rng = np.random.default_rng(2)
    for _ in range(300):
        scores, units, b_r = random_instance(rng, with_answer=bool(rng.integers(0, 2)))
        token_mask = top_b_mask(scores, b_r)
        for complete in (True, False):
            result = closure_projection(scores, units, b_r, token_mask=token_mask, complete_budget=complete,
                                        dp_capacity_limit=int(rng.integers(0, 40)))
            assert result.used_budget == int(result.mask.sum()) <= b_r
            if complete:
                assert result.used_budget == b_r
            for i in result.chosen_units:
                assert result.mask[units[i].token_start : units[i].token_end].all()


def test_keeps_the_final_answer_whenever_it_fits():
    rng = np.random.default_rng(3)
    for _ in range(300):
        scores, units, b_r = random_instance(rng)
        scores[units[-1].token_start :] -= 10.0  # score-only selection would drop the answer
        result = closure_projection(scores, units, b_r)
        assert result.has_final_answer
        assert result.final_answer_kept == (units[-1].size <= b_r)
        if units[-1].size <= b_r:
            assert len(units) - 1 in result.chosen_units


def test_mandatory_unit_over_budget_keeps_its_payload_first():
    scores = np.array([1.0, 1.0, 1.0, 1.0, -3.0, 0.0, -2.0, 2.0, -1.0])
    units = [Unit(0, 4, "step"), Unit(4, 9, "answer", True, 3, core=(5, 6, 7), key=(6,))]
    result = closure_projection(scores, units, 2)
    assert result.partial_mandatory and not result.final_answer_kept
    assert np.flatnonzero(result.mask).tolist() == [6, 7]  # payload 6, then the best other core position 7
    assert final_answer_covered(result.mask, units) is False


def test_projection_by_hand():
    # units: A=[0,3) strong, B=[3,5) weak, C=[5,7) answer (mandatory, negative scores)
    scores = np.array([2.0, 2.0, 2.0, 0.5, 0.5, -1.0, -1.0])
    units = [Unit(0, 3, "step"), Unit(3, 5, "step"), Unit(5, 7, "answer", True, 3)]
    token_mask = top_b_mask(scores, 4)  # score-only: positions 0, 1, 2, 3 -> answer dropped
    assert final_answer_covered(token_mask, units) is False
    result = closure_projection(scores, units, 4, token_mask=token_mask)
    # the answer takes 2 of 4 first; A (size 3) no longer fits; B (q = 1 / sqrt(3) > 0) fills the rest
    assert result.final_answer_kept and result.chosen_units == [1, 2] and result.solver == "dp"
    assert np.flatnonzero(result.mask).tolist() == [3, 4, 5, 6] and result.completed_positions == 0
    assert result.utility_retained == pytest.approx((0.5 + 0.5 - 2.0) / 6.5)
    roomy = closure_projection(scores, units, 5, token_mask=top_b_mask(scores, 5))
    assert roomy.chosen_units == [0, 2] and np.flatnonzero(roomy.mask).tolist() == [0, 1, 2, 5, 6]


def test_projection_completes_with_single_positions():
    scores = np.array([3.0, 3.0, 3.0, 0.1, -1.0, 2.0])
    units = [Unit(0, 3, "step"), Unit(3, 6, "step")]
    result = closure_projection(scores, units, 4, tau=0.0, alpha=0.0)
    # unit 0 (q = 9) fills 3 of 4; the best single position left is 5 (score 2.0)
    assert result.chosen_units == [0] and result.completed_positions == 1
    assert np.flatnonzero(result.mask).tolist() == [0, 1, 2, 5]
    assert result.utility_retained == pytest.approx(11.0 / 11.0)
    partial = closure_projection(scores, units, 4, tau=0.0, alpha=0.0, complete_budget=False)
    assert partial.used_budget == 3 and partial.utility_retained == pytest.approx(9.0 / 11.0)


def test_input_errors_say_what_to_do():
    units = partition([2, 2])
    with pytest.raises(ValueError, match="b_r=5"):
        closure_projection(np.zeros(4), units, 5)
    with pytest.raises(ValueError, match="partition"):
        closure_projection(np.zeros(4), [Unit(0, 2, "step"), Unit(3, 4, "step")], 2)
    with pytest.raises(ValueError, match="at most b_r"):
        closure_projection(np.zeros(4), units, 1, token_mask=np.ones(4, dtype=bool))
    with pytest.raises(ValueError, match="finite"):
        closure_projection(np.array([0.0, np.nan, 0.0, 0.0]), units, 1)


def test_deterministic():
    rng = np.random.default_rng(4)
    scores, units, b_r = random_instance(rng)
    scores = np.round(scores, 1)  # many ties
    first = closure_projection(scores, units, b_r)
    second = closure_projection(scores.copy(), list(units), b_r)
    assert np.array_equal(first.mask, second.mask) and first.chosen_units == second.chosen_units


# ------------------------------------------------------------------------------------------------ real tokenizer


@pytest.fixture(scope="module")
def tokenized():
    from raycurate.data.corpus import generate_corpus
    from raycurate.data.tokenize import tokenize_record
    from raycurate.models.tokenizer import train_tokenizer

    rows = generate_corpus(300, seed=0)
    tokenizer = train_tokenizer([r["prompt"] + "\n" + r["response"] for r in rows], vocab_size=1024)
    records = {
        "math": {"id": "m", "prompt": "How much change?", "response": MATH, "domain": "math"},
        "code": {"id": "c", "prompt": "Write area.", "response": CODE, "domain": "code"},
        "instruction": {"id": "i", "prompt": "Repot a plant.", "response": INSTRUCTION, "domain": "instruction"},
    }
    records["unicode"] = {"id": "u", "prompt": "Price?", "domain": "math",
                          "response": "Le café coûte 3 € — très cher 🙂.\nDonc 3 × 2 = 6 €.\n#### 6"}
    out = {}
    for name, record in records.items():
        row = tokenize_record(tokenizer, record, 4096)
        offsets = pairs_from_flat(row["response_offsets"])[:-1]  # eligible positions: drop the EOS
        out[name] = (record["response"], offsets)
    return out


def test_span_array_offsets_project_exactly_like_pairs(tokenized):
    """The stage passes (r, 2) arrays (``spans_from_flat``); the projection must not depend on the container."""
    for name, (text, offsets) in tokenized.items():
        domain = "math" if name == "unicode" else name
        spans = np.asarray(offsets, dtype=np.int64)
        scores = np.cos(np.arange(len(offsets)) * 1.7)  # signed, no ties
        budget = len(offsets) * 2 // 3
        from_pairs = project_response(text, domain, offsets, scores, budget)
        from_array = project_response(text, domain, spans, scores, budget)
        assert from_array.units == from_pairs.units and not from_array.fallback
        np.testing.assert_array_equal(from_array.mask, from_pairs.mask)
        assert (from_array.chosen_units, from_array.solver) == (from_pairs.chosen_units, from_pairs.solver)


def test_core_mask_from_the_unit_builder_projects_like_the_units_core_fields(tokenized):
    for name, (text, offsets) in tokenized.items():
        domain = "math" if name == "unicode" else name
        units, core, check = units_and_core(text, domain, offsets)
        assert check.ok and core.tolist() == [any(j in (u.core or ()) for u in units) for j in range(len(offsets))]
        scores = np.sin(np.arange(len(offsets)) * 2.3)
        budget = len(offsets) // 2
        with_mask = closure_projection(scores, units, budget, core_mask=core)
        from_units = closure_projection(scores, units, budget)
        np.testing.assert_array_equal(with_mask.mask, from_units.mask)
        assert with_mask.chosen_units == from_units.chosen_units
    with pytest.raises(ValueError, match="core_mask"):
        closure_projection(scores, units, budget, core_mask=core[:-1])


def test_spans_from_flat_pairs_up_and_rejects_odd_lengths():
    np.testing.assert_array_equal(spans_from_flat([0, 2, 3, 5, -1, -1]), [[0, 2], [3, 5], [-1, -1]])
    assert spans_from_flat([0, 2, 3, 5]).tolist() == [list(p) for p in pairs_from_flat([0, 2, 3, 5])]
    with pytest.raises(ValueError, match="even length"):
        spans_from_flat([0, 2, 3])


def test_real_tokenizer_math_units(tokenized):
    text, offsets = tokenized["math"]
    assert offsets[-1] == (-1, -1)  # the <|end|> marker is eligible and unaligned
    units = structural_units(text, "math", offsets)
    assert unit_texts(text, offsets, units) == text.split("\n")
    assert [u.mandatory for u in units] == [False, False, True]
    assert "".join(text[slice(*offsets[k])] for k in units[-1].key).strip() == "32"


def test_real_tokenizer_code_units(tokenized):
    text, offsets = tokenized["code"]
    units = structural_units(text, "code", offsets)
    assert unit_texts(text, offsets, units) == [
        "def area(width, height):",
        "result = scale(width,\n                   height)",
        "return result + 1",
    ]


def test_real_tokenizer_instruction_units(tokenized):
    text, offsets = tokenized["instruction"]
    units = structural_units(text, "instruction", offsets)
    assert unit_texts(text, offsets, units)[2:] == [line for line in text.split("\n")[1:]]
    assert [u.kind for u in units][2:] == ["list_item"] * 3


def test_real_tokenizer_projection_keeps_answer(tokenized):
    text, offsets = tokenized["math"]
    r = len(offsets)
    scores = np.linspace(1.0, -1.0, r)  # decreasing: score-only keeps the start, drops the answer
    b_r = round(0.75 * r)
    token_mask = top_b_mask(scores, b_r)
    result = project_response(text, "math", offsets, scores, b_r, token_mask=token_mask)
    assert not result.fallback and result.final_answer_kept and result.used_budget == b_r
    assert final_answer_covered(token_mask, result.units) is False


def test_projection_is_optimal_over_optional_units():
    """Mandatory first, then max sum q over the rest within the residual (covers the 'all', DP and prune paths)."""
    rng = np.random.default_rng(5)
    solvers = set()
    for _ in range(200):
        scores, units, b_r = random_instance(rng, with_answer=bool(rng.integers(0, 2)))
        scores = scores + rng.choice([-0.5, 0.0, 0.5])
        result = closure_projection(scores, units, b_r, complete_budget=False)
        solvers.add(result.solver)
        q = unit_quality(scores, units)
        mandatory_size = sum(u.size for u in units if u.mandatory)
        residual = b_r - mandatory_size if mandatory_size <= b_r else 0
        optional = [i for i, u in enumerate(units) if not u.mandatory]
        best = brute_force([units[i].size for i in optional], [q[i] for i in optional], residual)
        got = sum(q[i] for i in result.chosen_units if not units[i].mandatory)
        assert got == pytest.approx(best, abs=1e-7)
    assert {"all", "dp", "none"} <= solvers


def test_real_tokenizer_non_ascii_text(tokenized):
    text, offsets = tokenized["unicode"]
    assert verify_alignment(text, offsets).ok  # byte-level pieces of one character share its span
    units = structural_units(text, "math", offsets)
    assert [u.kind for u in units] == ["step", "equation", "answer"]
    assert unit_texts(text, offsets, units) == text.split("\n")


def test_math_without_final_answer_has_no_mandatory_unit():
    text = "He buys 3 bags of 8 apples, so 3 * 8 = 24 apples.\nHe gives 12 of the"  # truncated
    result = project_response(text, "math", toy_offsets(text), np.ones(len(toy_offsets(text))), 10)
    assert not result.has_final_answer and not result.final_answer_kept and result.used_budget == 10
