"""Near-duplicates (raycurate.algorithms.dedup, raycurate.stages.dedup): shingles, MinHash, LSH pairs, clusters,
the stage."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from raycurate.algorithms.dedup import cluster_duplicates, duplicate_pairs, minhash_signatures, word_shingles
from raycurate.rundir import RunDir
from raycurate.stages.base import StageOutput, output_path, run_stage
from raycurate.stages.dedup import dedup_stage, flagged_ids

TEXTS = [
    "Tom buys 3 bags of 4 apples. How many apples? He has 3 * 4 = 12 apples. #### 12",
    "Write a Python function that returns the square of x. def square(x): return x * x",
    "Quick question: Tom buys 3 bags of 4 apples. How many apples? He has 3 * 4 = 12 apples. #### 12",
    "List three colours of the rainbow. - red - orange - yellow",
]


def test_word_shingles_are_lowercased_word_trigrams():
    assert word_shingles("The cat, the CAT sat") == frozenset({"the cat the", "cat the cat", "the cat sat"})
    assert word_shingles("two words") == frozenset({"two words"})


def test_minhash_agreement_estimates_the_jaccard_similarity():
    a, c = word_shingles(TEXTS[0]), word_shingles(TEXTS[2])
    true = len(a & c) / len(a | c)
    sig = minhash_signatures([TEXTS[0], TEXTS[2]], num_perm=512, seed=1)
    assert (sig[0] == sig[1]).mean() == pytest.approx(true, abs=0.07)
    assert np.array_equal(sig, minhash_signatures([TEXTS[0], TEXTS[2]], num_perm=512, seed=1))  # seeded


def test_pairs_find_the_perturbed_copy_and_the_earlier_row_is_kept():
    sig = minhash_signatures(TEXTS, num_perm=64, seed=0)
    shingles = [word_shingles(t) for t in TEXTS]
    pairs = duplicate_pairs(sig, shingles, threshold=0.7, bands=16)
    assert [(i, j) for i, j, _ in pairs] == [(0, 2)]
    source, similarity = cluster_duplicates(pairs, [len(t) for t in TEXTS], keep="first")
    assert source.tolist() == [-1, -1, 0, -1] and 0.7 <= similarity[2] < 1.0
    with pytest.raises(ValueError, match="divisible"):
        duplicate_pairs(sig, shingles, threshold=0.7, bands=5)


def _tokens(out: Path, rows: list[tuple[str, str, str, str]]) -> StageOutput:
    (out / "tokens").mkdir()
    pq.write_table(pa.table({
        "id": [r[0] for r in rows], "split": [r[1] for r in rows], "prompt": [r[2] for r in rows],
        "response": [""] * len(rows),
        "label": pa.array([{"clean": r[3] == "none", "corruption": r[3]} for r in rows],
                          type=pa.struct([("clean", pa.bool_()), ("corruption", pa.string())])),
    }), out / "tokens" / "part-00000.parquet")
    return StageOutput(outputs={"tokens": "tokens"})


@pytest.mark.ray
def test_dedup_stage_flags_later_copies_of_validation_rows_and_of_earlier_candidates(ray_local, tmp_path):
    run = RunDir(tmp_path / "run")
    rows = [("v0", "validation", TEXTS[1], "none"),
            ("c0", "selection", TEXTS[0], "none"),
            ("c1", "selection", TEXTS[2], "near_duplicate"),  # copies c0
            ("c2", "selection", TEXTS[1] + " ok", "near_duplicate"),  # copies the validation row
            ("c3", "selection", TEXTS[3], "none")]
    run_stage(run, "tok", lambda out: _tokens(out, rows), config={})
    record = dedup_stage(run, "dedup", tokens_stage="tok", split_column="split", reference_split="validation",
                         candidate_split="selection", threshold=0.7)
    table = pq.read_table(output_path(run, "dedup", "duplicates")).to_pylist()
    assert [(r["id"], r["duplicate"], r["duplicate_of"]) for r in table] == [
        ("c0", False, ""), ("c1", True, "c0"), ("c2", True, "v0"), ("c3", False, "")]
    assert flagged_ids(run, "dedup") == ["c1", "c2"]
    metrics = record["metrics"]
    assert (metrics["candidates"], metrics["flagged"], metrics["reference_rows"]) == (4, 2, 1)
    assert metrics["near_duplicate_recall"] == 1.0 and metrics["precision"] == 1.0


@pytest.mark.ray
def test_the_trusted_table_is_the_reference_instead_of_the_validation_split(ray_local, tmp_path):
    run = RunDir(tmp_path / "run")
    pool = [("v0", "validation", TEXTS[3], "none"), ("c0", "selection", TEXTS[2], "near_duplicate"),
            ("c1", "selection", TEXTS[3] + " ok", "none")]  # copies v0, which is no reference here
    run_stage(run, "tok", lambda out: _tokens(out, pool), config={})
    run_stage(run, "trusted", lambda out: _tokens(out, [("t0", "trusted", TEXTS[0], "none")]), config={})
    record = dedup_stage(run, "dedup", tokens_stage="tok", split_column="split", reference_split="validation",
                         candidate_split="selection", threshold=0.7, reference_stage="trusted")
    table = pq.read_table(output_path(run, "dedup", "duplicates")).to_pylist()
    assert [(r["id"], r["duplicate"], r["duplicate_of"]) for r in table] == [("c0", True, "t0"), ("c1", False, "")]
    assert record["metrics"]["reference_rows"] == 1


@pytest.mark.ray
def test_pipeline_drops_the_flagged_candidates_only_when_asked(ray_local, tmp_path):
    from raycurate.config.bilevel import BilevelConfig
    from raycurate.config.data import DataConfig
    from raycurate.config.schema import JobConfig
    from raycurate.pipelines.bilevel import near_duplicates, split_rows
    from raycurate.stages.bridge import read_token_rows

    run = RunDir(tmp_path / "run")
    rows = [("v0", "validation", TEXTS[1], "none"), ("c0", "selection", TEXTS[0], "none"),
            ("c1", "selection", TEXTS[2], "near_duplicate"), ("c3", "selection", TEXTS[3], "none")]
    run_stage(run, "tokenize", lambda out: _tokens(out, rows), config={})
    off = JobConfig()
    assert near_duplicates(run, off) == []
    on = JobConfig(bilevel=BilevelConfig(dedup_threshold=0.7), data=DataConfig(trusted_rows=0))  # validation first
    split_rows(run, on)
    kept = [r["id"] for r in read_token_rows(output_path(run, "bilevel_candidate_rows", "tokens"), ["id"])]
    assert kept == ["c0", "c3"]
    assert run.stage_record("bilevel_dedup")["metrics"]["flagged"] == 1
    with pytest.raises(ValueError, match="dedup_threshold"):
        near_duplicates(run, JobConfig(bilevel=BilevelConfig(dedup_threshold=1.5)))


def test_the_config_choices_are_the_algorithms():
    from raycurate.algorithms.dedup import KEEP_RULES, SIMILARITIES
    from raycurate.config.curate import DEDUP_KEEP_RULES, DEDUP_SIMILARITIES

    assert (DEDUP_SIMILARITIES, DEDUP_KEEP_RULES) == (SIMILARITIES, KEEP_RULES)


def test_example_similarity_is_the_lower_of_prompt_containment_and_response_jaccard():
    prompts = ["What is two plus three?", "Please help: What is two plus three?", "What is two plus four?"]
    responses = ["2 + 3 = 5. #### 5", "2 + 3 = 5. #### 5", "2 + 4 = 6. #### 6"]
    sig = minhash_signatures(responses, num_perm=64, seed=0)
    pairs = duplicate_pairs(sig, [word_shingles(p) for p in prompts], 0.95, 16, "example",
                            [word_shingles(r) for r in responses])
    # the padded prompt holds every word 3-gram of the plain one, and the responses are identical
    assert pairs == [(0, 1, 1.0)]
    jaccard = duplicate_pairs(minhash_signatures([f"{p}\n{r}" for p, r in zip(prompts, responses)], 64, 0),
                              [word_shingles(f"{p}\n{r}") for p, r in zip(prompts, responses)], 0.95, 16)
    assert jaccard == []  # the two words of padding cost the short pair its Jaccard similarity
    with pytest.raises(ValueError, match="response_shingles"):
        duplicate_pairs(sig, [word_shingles(p) for p in prompts], 0.95, 16, "example")


def test_clusters_keep_one_copy_by_rule_and_never_flag_protected_rows():
    from raycurate.algorithms.dedup import cluster_duplicates

    # rows 0-1 protected (trusted); 2~3~4 a chain; 5~6 a pair; 1~7
    pairs = [(2, 3, 0.97), (3, 4, 0.96), (5, 6, 0.99), (1, 7, 1.0)]
    lengths = [10, 10, 30, 20, 25, 9, 8, 5]
    source, value = cluster_duplicates(pairs, lengths, keep="first", protected=2)
    assert source.tolist() == [-1, -1, -1, 2, 2, -1, 5, 1]
    assert value.tolist() == [0, 0, 0, 0.97, 0.96, 0, 0.99, 1.0]  # 4 meets 2 only through 3: its best pair
    source, _ = cluster_duplicates(pairs, lengths, keep="shortest", protected=2)
    assert source.tolist() == [-1, -1, 3, -1, 3, 6, -1, 1]  # the shortest copy stays; the trusted row 1 beats 7
    with pytest.raises(ValueError, match="keep"):
        cluster_duplicates(pairs, lengths, keep="longest")


@pytest.mark.ray
def test_the_curate_rule_drops_the_padded_copy_even_when_it_comes_first(ray_local, tmp_path):
    run = RunDir(tmp_path / "run")
    rows = [("c0", "selection", "Please help: How many legs does a spider have?", "near_duplicate"),
            ("c1", "selection", "How many legs does a spider have?", "none"),
            ("c2", "selection", "How many legs does an ant have?", "none")]
    responses = {"c0": "A spider has 8 legs.", "c1": "A spider has 8 legs.", "c2": "An ant has 6 legs."}

    def tokens(out: Path) -> StageOutput:
        _tokens(out, rows)
        part = out / "tokens" / "part-00000.parquet"
        table = pq.read_table(part)
        pq.write_table(table.set_column(table.schema.get_field_index("response"), "response",
                                        pa.array([responses[i] for i in table["id"].to_pylist()])), part)
        return StageOutput(outputs={"tokens": "tokens"})

    run_stage(run, "tok", tokens, config={})
    record = dedup_stage(run, "dedup", tokens_stage="tok", split_column="split", reference_split="validation",
                         candidate_split="selection", threshold=0.95, measure="example", keep="shortest")
    assert flagged_ids(run, "dedup") == ["c0"]
    table = {r["id"]: r for r in pq.read_table(output_path(run, "dedup", "duplicates")).to_pylist()}
    assert (table["c0"]["duplicate_of"], table["c0"]["jaccard"]) == ("c1", 1.0)
    assert record["metrics"]["near_duplicate_recall"] == 1.0 and record["metrics"]["keep"] == "shortest"
