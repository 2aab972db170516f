"""The embedded benchmark corpus: determinism, exact labels, correct arithmetic, spans, held-out disjointness."""

from __future__ import annotations

import json
import random
import re
import time
from collections import Counter

import pytest

from raycurate.data.answers import answers_match, extract_final_answer, normalize_answer
from raycurate.data.corpus import (
    CORRUPTIONS_BY_DOMAIN,
    MAX_RESULT,
    code_tasks,
    corpus_summary,
    generate_corpus,
    generate_heldout,
    generate_pretraining_texts,
    generate_validation_questions,
    math_tasks,
    write_jsonl,
)

EQUATION = re.compile(r"(\d+) ([-+*/]) (\d+) = (\d+)")
OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b, "/": lambda a, b: a / b}


@pytest.fixture(scope="module")
def rows() -> list[dict]:
    return generate_corpus(1200, seed=3)


def _equations(response: str) -> list[tuple[int, str, int, int]]:
    return [(int(a), op, int(b), int(c)) for a, op, b, c in EQUATION.findall(response)]


def _false_equations(response: str) -> int:
    return sum(OPS[op](a, b) != c for a, op, b, c in _equations(response))


def _of(rows: list[dict], domain: str | None = None, corruption: str | None = None) -> list[dict]:
    return [
        r for r in rows
        if (domain is None or r["domain"] == domain) and (corruption is None or r["label"]["corruption"] == corruption)
    ]


def test_same_seed_same_rows_different_seed_different_rows():
    assert generate_corpus(200, seed=7) == generate_corpus(200, seed=7)
    other = generate_corpus(200, seed=8)
    assert [r["prompt"] for r in generate_corpus(200, seed=7)] != [r["prompt"] for r in other]


@pytest.mark.parametrize(
    ("n_rows", "fraction", "expected"),
    [(100, 0.3, 30), (5, 0.3, 2), (7, 0.5, 4), (10, 0.0, 0), (10, 1.0, 10), (0, 0.3, 0), (1200, 0.25, 300)],
)
def test_exact_corrupted_count_round_half_up(n_rows, fraction, expected):
    rows = generate_corpus(n_rows, seed=1, corrupt_fraction=fraction)
    assert len(rows) == n_rows
    assert sum(not r["label"]["clean"] for r in rows) == expected
    assert all(r["label"]["clean"] == (r["label"]["corruption"] == "none") for r in rows)


def test_prompts_unique_except_near_duplicates(rows):
    prompts = [r["prompt"] for r in rows if r["label"]["corruption"] != "near_duplicate"]
    assert len(set(prompts)) == len(prompts)


def test_domains_apportioned_exactly(rows):
    assert Counter(r["domain"] for r in rows) == {"math": 720, "code": 240, "instruction": 240}
    only_code = generate_corpus(50, seed=0, domain_weights={"code": 2.0})
    assert {r["domain"] for r in only_code} == {"code"}
    with pytest.raises(ValueError, match="Unknown domains"):
        generate_corpus(10, seed=0, domain_weights={"poetry": 1.0})
    with pytest.raises(ValueError, match="corrupt_fraction"):
        generate_corpus(10, seed=0, corrupt_fraction=1.5)


def test_corruption_kinds_apply_to_their_domain_and_are_balanced(rows):
    for domain, kinds in CORRUPTIONS_BY_DOMAIN.items():
        counts = Counter(r["label"]["corruption"] for r in _of(rows, domain) if not r["label"]["clean"])
        assert set(counts) == set(kinds)
        assert max(counts.values()) - min(counts.values()) <= 1


def test_ids_unique_and_formatted(rows):
    assert [r["id"] for r in rows[:2]] == ["bench-s3-000001", "bench-s3-000002"]
    assert len({r["id"] for r in rows}) == len(rows)


def test_clean_math_arithmetic_is_correct_and_answer_matches(rows):
    clean_math = _of(rows, "math", "none")
    assert len(clean_math) > 400
    lookups = 0
    for row in clean_math:
        lines = row["response"].split("\n")
        equations = _equations(row["response"])
        assert _false_equations(row["response"]) == 0
        assert all(c < MAX_RESULT for *_, c in equations)
        assert lines[-1] == f"#### {row['label']['answer']}"
        if not equations:  # a look-up: one line stating the asked count, which the prompt states too
            lookups += 1
            assert len(lines) == 2 and lines[0] in row["prompt"]
            assert lines[0].split(" has ")[1].split(" ")[0] == row["label"]["answer"]
            continue
        assert 1 <= len(equations) == len(lines) - 1 <= 2
        assert extract_final_answer(row["response"]) == row["label"]["answer"] == str(equations[-1][3])
    assert 0.1 < lookups / len(clean_math) < 0.25  # one template in six


def test_math_templates_are_varied(rows):
    first_facts = {re.sub(r"\d+", "N", r["response"].split("\n")[0].split(",")[0].split(" ", 1)[1])
                   for r in _of(rows, "math", "none")}
    assert len(first_facts) >= 5


def test_every_math_prompt_has_a_same_form_distractor_about_another_person(rows):
    for row in _of(rows, "math"):
        distractors = [row["prompt"][a:b] for a, b in row["label"]["distractor_spans"]]
        relevant_first = row["prompt"][slice(*row["label"]["relevant_spans"][0])]
        shape = re.sub(r"^\w+ has \d+ ", "", relevant_first.removeprefix("Question: "))
        assert any(re.sub(r"^\w+ has \d+ ", "", d) == shape and d != relevant_first for d in distractors)


def test_swapped_entity_works_the_distractor_persons_count(rows):
    swapped = _of(rows, "math", "swapped_entity")
    assert swapped
    for row in swapped:
        assert _false_equations(row["response"]) == 0
        answer = extract_final_answer(row["response"])
        assert answer is not None and answer != row["label"]["answer"]
        first_line_numbers = re.findall(r"\d+", row["response"].split("\n")[0])
        distractors = [row["prompt"][a:b] for a, b in row["label"]["distractor_spans"]]
        assert any(re.match(rf"^\w+ has {n} ", d) for d in distractors for n in first_line_numbers)


def test_wrong_final_answer_math_keeps_steps_and_changes_answer(rows):
    for row in _of(rows, "math", "wrong_final_answer"):
        assert _false_equations(row["response"]) == 0
        predicted = extract_final_answer(row["response"])
        assert predicted is not None and predicted != row["label"]["answer"]


def test_wrong_intermediate_step_has_one_false_equation_propagated(rows):
    for row in _of(rows, "math", "wrong_intermediate_step"):
        equations = _equations(row["response"])
        if not equations:  # a look-up that states a wrong count
            assert row["response"].split("\n")[0] not in row["prompt"]
            assert extract_final_answer(row["response"]) != row["label"]["answer"]
            continue
        assert _false_equations(row["response"]) == 1
        assert extract_final_answer(row["response"]) == str(equations[-1][3]) != row["label"]["answer"]


def test_truncated_has_no_final_answer(rows):
    truncated = _of(rows, corruption="truncated")
    assert {r["domain"] for r in truncated} == {"math", "code", "instruction"}
    for row in truncated:
        assert row["response"] and "####" not in row["response"]
        assert row["response"] == row["response"].rstrip()


def test_unsafe_passage_only_in_unsafe_rows(rows):
    for row in rows:
        expected = 1 if row["label"]["corruption"] == "unsafe" else 0
        assert row["response"].count("[UNSAFE]") == expected, row["id"]


def test_near_duplicate_copies_a_clean_row_with_tiny_prompt_change(rows):
    by_id = {r["id"]: r for r in rows}
    duplicates = _of(rows, corruption="near_duplicate")
    assert duplicates
    for row in duplicates:
        source = by_id[row["label"]["source_id"]]
        assert source["label"]["clean"] and source["domain"] == row["domain"]
        assert row["response"] == source["response"] and row["label"]["answer"] == source["label"]["answer"]
        assert row["prompt"] != source["prompt"] and source["prompt"] in row["prompt"]
        assert len(row["prompt"]) - len(source["prompt"]) <= 16
    assert all(r["label"]["source_id"] == "" for r in rows if r["label"]["corruption"] != "near_duplicate")


def test_off_topic_code_response_does_not_define_the_requested_function(rows):
    off_topic = _of(rows, "code", "off_topic")
    assert off_topic
    for row in off_topic:
        name = re.search(r"`(\w+)\(", row["prompt"]).group(1)
        assert f"def {name}(" not in row["response"]


def test_spans_are_whole_sentences_tiling_the_prompt(rows):
    for row in rows:
        label, prompt = row["label"], row["prompt"]
        relevant, distractor = label["relevant_spans"], label["distractor_spans"]
        for start, end in relevant + distractor:
            sentence = prompt[start:end]
            assert sentence[-1] in ".?" and sentence[0].isupper() and sentence == sentence.strip()
        spans = sorted(relevant + distractor)
        gaps = [prompt[e:s] for (_, e), (s, _) in zip(spans, spans[1:])]
        assert all(gap == " " for gap in gaps), row["id"]
        if label["corruption"] != "near_duplicate":
            assert spans[0][0] == 0 and spans[-1][1] == len(prompt)
        if row["domain"] == "math":
            assert 1 <= len(distractor) <= 3 and prompt[slice(*relevant[-1])].endswith("?")
            assert max(relevant)[1] == spans[-1][1]  # the question comes last
        else:
            assert distractor == []


def test_heldout_is_clean_math_disjoint_from_corpus():
    heldout = generate_heldout(300, seed=3)
    assert heldout == generate_heldout(300, seed=3)
    assert heldout[0]["id"] == "heldout-000001"
    assert all(r["domain"] == "math" and r["label"]["clean"] for r in heldout)
    assert all(_false_equations(r["response"]) == 0 for r in heldout)
    assert all(extract_final_answer(r["response"]) == r["label"]["answer"] for r in heldout)
    corpus_prompts = {r["prompt"] for r in generate_corpus(2000, seed=3)}
    assert not corpus_prompts & {r["prompt"] for r in heldout}


def test_validation_questions_are_clean_math_disjoint_from_heldout_and_corpus():
    heldout = generate_heldout(300, seed=3)
    heldout_prompts = {r["prompt"] for r in heldout}
    validation = generate_validation_questions(200, seed=3, exclude_prompts=heldout_prompts)
    assert validation == generate_validation_questions(200, seed=3, exclude_prompts=heldout_prompts)
    assert [r["id"] for r in validation[:2]] == ["validation-000001", "validation-000002"]
    assert all(r["domain"] == "math" and r["label"]["clean"] for r in validation)
    assert all(extract_final_answer(r["response"]) == r["label"]["answer"] for r in validation)
    prompts = [r["prompt"] for r in validation]
    assert len(set(prompts)) == 200 and not set(prompts) & heldout_prompts
    assert not set(prompts) & {r["prompt"] for r in generate_corpus(2000, seed=3)}
    # an excluded prompt is drawn again: excluding the first question shifts the rest by one
    shifted = generate_validation_questions(3, seed=3, exclude_prompts={prompts[0]})
    assert [r["prompt"] for r in shifted] == prompts[1:4]


def test_pretraining_texts_are_clean_and_never_use_heldout_names():
    texts = generate_pretraining_texts(400, seed=3)
    assert texts == generate_pretraining_texts(400, seed=3) and len(texts) == 400
    assert not any("[UNSAFE]" in t for t in texts)
    assert sum("####" in t for t in texts) == 240  # default mix: 60% math
    heldout_names = {name for name, _ in math_tasks.HELDOUT_NAMES}
    assert not any(re.search(rf"\b{name}\b", t) for t in texts for name in heldout_names)


def test_corpus_summary_counts(rows):
    summary = corpus_summary(rows)
    assert summary["n_rows"] == 1200 and summary["n_corrupted"] == 360 and summary["n_clean"] == 840
    assert summary["domains"] == {"code": 240, "instruction": 240, "math": 720}
    assert sum(summary["corruptions"].values()) == 1200
    assert sum(summary["by_domain"]["math"].values()) == 720


def test_write_jsonl_round_trips_atomically(tmp_path, rows):
    path = write_jsonl(rows[:20], tmp_path / "sub" / "corpus.jsonl")
    write_jsonl(rows[:5], path)  # overwrite in place
    lines = path.read_text(encoding="utf-8").splitlines()
    assert [json.loads(line) for line in lines] == rows[:5]
    assert sorted(p.name for p in path.parent.iterdir()) == ["corpus.jsonl"]


def test_rows_form_one_arrow_schema(rows):
    pa = pytest.importorskip("pyarrow")
    table = pa.Table.from_pylist(rows)
    label = table.schema.field("label").type
    assert label.field("relevant_spans").type == pa.list_(pa.list_(pa.int64()))
    assert table.column("label").null_count == 0


@pytest.mark.parametrize("family", code_tasks.CODE_FAMILIES, ids=lambda f: f.names[0])
def test_code_family_clean_is_correct_and_wrong_return_is_wrong(family):
    rng = random.Random(0)
    for _ in range(5):
        task = code_tasks.sample_code_task(rng, family)
        clean_ns, wrong_ns = {}, {}
        exec("\n".join(task.lines), clean_ns)  # noqa: S102 - code generated by this module
        exec(code_tasks.wrong_code_return(task), wrong_ns)  # noqa: S102
        reference = family.reference(task.params)
        examples = family.examples(task.params)
        clean_fn, wrong_fn = clean_ns[task.params["f"]], wrong_ns[task.params["f"]]
        assert all(clean_fn(*args) == reference(*args) for args in examples)
        assert any(wrong_fn(*args) != reference(*args) for args in examples)


def test_code_function_names_are_unique_across_families():
    names = [name for family in code_tasks.CODE_FAMILIES for name in family.names]
    assert len(names) == len(set(names))


def test_generating_5000_rows_is_fast():
    start = time.process_time()
    generate_corpus(5000, seed=11)
    assert time.process_time() - start < 2.0  # about 0.5 s CPU here; slack for shared CI machines


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("so 3 * 4 = 12.\n#### 12", "12"),
        ("#### 1,234.", "1234"),
        ("#### 7.0", "7"),
        ("#### 2.50 ", "2.5"),
        ("#### $15", "15"),
        ("#### 3\n#### 4\nbye", "4"),
        ("#### -0", "0"),
        ("#### seven", "seven"),
        ("no marker 12", None),
        ("#### \n", None),
    ],
)
def test_extract_final_answer(text, expected):
    assert extract_final_answer(text) == expected


def test_answers_match():
    assert answers_match("7.0", "7") and answers_match(" 1,234. ", "1234") and answers_match("seven", "seven")
    assert not answers_match("8", "7") and not answers_match(None, "7") and not answers_match("", "")
    assert normalize_answer(" 12. ") == "12"


def test_corruption_mix_apportions_each_domain_exactly_and_keeps_the_clean_rows():
    mix = {"swapped_entity": 6, "wrong_intermediate_step": 3, "wrong_final_answer": 1, "off_topic": 1,
           "truncated": 1, "unsafe": 1, "near_duplicate": 1}
    rows = generate_corpus(1000, seed=0, corrupt_fraction=0.5, corruption_mix=mix)
    by_domain = corpus_summary(rows)["by_domain"]
    # math: 600 rows, 298 corrupted, weights sum 14 -> quotas 127.7 / 63.9 / 21.3 x5 -> largest remainder
    math = {k: n for k, n in by_domain["math"].items() if k != "none"}
    assert sum(math.values()) == 600 - by_domain["math"]["none"]
    corrupted = sum(math.values())
    quotas = {k: corrupted * w / 14 for k, w in mix.items()}
    assert all(abs(math[k] - quotas[k]) < 1 for k in mix)
    # instruction rows take only the kinds that apply to them, in equal shares here
    assert set(by_domain["instruction"]) == {"none", "off_topic", "truncated", "unsafe", "near_duplicate"}
    # the mix changes which corruption a row gets, never which rows are clean
    balanced = generate_corpus(1000, seed=0, corrupt_fraction=0.5)
    assert [r for r in rows if r["label"]["corruption"] == "none"] == \
        [r for r in balanced if r["label"]["corruption"] == "none"]
    assert generate_corpus(1000, seed=0, corrupt_fraction=0.5, corruption_mix=mix) == rows


@pytest.mark.parametrize("mix, message", [
    ({"swapped": 1.0}, "Unknown corruption kinds ['swapped']"),
    ({"swapped_entity": -1.0, "off_topic": 1.0}, "finite numbers >= 0"),
    ({"swapped_entity": 1.0}, "no weight to any corruption of the code domain"),
])
def test_corruption_mix_errors_name_the_problem(mix, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        generate_corpus(200, seed=0, corrupt_fraction=0.5, corruption_mix=mix)


def test_corpus_stage_keys_and_summarises_the_corruption_mix(tmp_path):
    from raycurate.rundir import RunDir
    from raycurate.stages.data_stages import corpus_stage

    balanced = corpus_stage(RunDir(tmp_path / "a"), rows=60, seed=0, corrupt_fraction=0.5, heldout_rows=2)
    same = corpus_stage(RunDir(tmp_path / "b"), rows=60, seed=0, corrupt_fraction=0.5, heldout_rows=2,
                        corruption_mix={})
    mixed = corpus_stage(RunDir(tmp_path / "c"), rows=60, seed=0, corrupt_fraction=0.5, heldout_rows=2,
                         corruption_mix={"swapped_entity": 1, "off_topic": 1})
    assert same["config_hash"] == balanced["config_hash"] != mixed["config_hash"]
    by_domain = mixed["metrics"]["summary"]["by_domain"]
    # equal weights: math's corrupted rows split in halves; code and instruction have only off_topic of the two
    assert by_domain["math"]["swapped_entity"] == by_domain["math"]["off_topic"] > 0
    assert set(by_domain["code"]) == set(by_domain["instruction"]) == {"none", "off_topic"}


def test_corpus_seed_is_part_of_the_ids_so_seeds_get_their_own_splits():
    from raycurate.data.corpus.benchmark import corpus_ids
    from raycurate.data.splits import assign_splits

    ratios = {"warmup": 0.05, "validation": 0.05, "selection": 0.90}
    assert corpus_ids(2, 11) == ["bench-s11-000001", "bench-s11-000002"]
    splits = {seed: assign_splits(corpus_ids(1000, seed), 0, ratios) for seed in (0, 1)}
    assert splits[0] != splits[1]  # before: every corpus seed had the same 54 / 41 / 905 split


def test_trusted_rows_are_clean_seeded_and_disjoint_from_the_excluded_prompts():
    from raycurate.data.corpus import generate_heldout, generate_trusted

    corpus = generate_corpus(300, seed=5)
    heldout = generate_heldout(50, seed=5)
    exclude = {r["prompt"] for r in corpus + heldout}
    trusted = generate_trusted(40, seed=5, exclude_prompts=exclude)
    assert len(trusted) == 40 and all(r["label"]["clean"] for r in trusted)
    assert not exclude & {r["prompt"] for r in trusted}
    assert len({r["prompt"] for r in trusted}) == 40
    assert trusted[0]["id"] == "trusted-s5-000001"
    assert Counter(r["domain"] for r in trusted) == {"math": 24, "code": 8, "instruction": 8}
    assert generate_trusted(40, seed=5, exclude_prompts=exclude) == trusted
    assert generate_trusted(40, seed=6, exclude_prompts=exclude) != trusted


def test_corrupted_spans_mark_where_a_response_departs_from_the_clean_one():
    from raycurate.data.corpus.rows import changed_spans

    assert changed_spans("so 4 + 3 = 7.\n#### 7", "so 10 + 3 = 13.\n#### 13") == [[3, 5], [12, 14], [21, 23]]
    assert changed_spans("a\nb\nc", "a\nb") == []  # truncation only deletes
    rows = generate_corpus(200, seed=2, corrupt_fraction=0.5)
    for row in rows:
        spans, kind = row["label"]["corrupted_spans"], row["label"]["corruption"]
        if kind in ("none", "near_duplicate", "truncated"):
            assert spans == []
        elif kind == "off_topic":
            assert spans == [[0, len(row["response"])]]
        else:
            assert spans and all(0 <= a < b <= len(row["response"]) for a, b in spans)
    unsafe = next(r for r in rows if r["label"]["corruption"] == "unsafe")
    assert any("[UNSAFE]" in unsafe["response"][a:b] for a, b in unsafe["label"]["corrupted_spans"])
