"""DSIR (raycurate.algorithms.dsir): stable hashed n-grams, smoothed distributions and weights by hand, seeded
Gumbel top-k resampling."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from raycurate.algorithms import dsir


def test_words_and_ngrams():
    assert dsir.words("Hello, World!  x_1") == ["hello", ",", "world", "!", "x_1"]
    assert dsir.ngrams(["a", "b", "c"]) == ["a", "b", "c", "a b", "b c"]
    assert dsir.ngrams([]) == []


def test_bucket_is_crc32_and_stable_across_processes():
    # crc32(b"a") = 3904355907 -> bucket 3 of 4; crc32(b"b a") = 455324464 -> bucket 0.
    assert dsir.stable_bucket("a", 4) == 3904355907 % 4 == 3
    assert dsir.stable_bucket("b a", 4) == 0
    code = "from raycurate.algorithms.dsir import stable_bucket; print(stable_bucket('hello world', 10000))"
    outs = {
        subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                       env={"PYTHONHASHSEED": seed}, cwd=Path(__file__).resolve().parents[1]).stdout.strip()
        for seed in ("1", "2")
    }
    assert outs == {str(dsir.stable_bucket("hello world", 10000))}


def test_weights_by_hand_on_three_tiny_texts():
    # 4 buckets.  n-gram buckets: a->3, b->1, c->3, "a b"->3, "b a"->0, "b c"->0, "c c"->3.
    target = ["a b", "b a"]  # buckets [3, 1, 3] + [1, 3, 0] -> counts [1, 2, 0, 3], total 6
    raw = ["a b", "b c", "c c"]  # [3, 1, 3] + [1, 3, 0] + [3, 3, 3] -> counts [1, 2, 0, 6], total 9
    assert dsir.hashed_ngram_ids("c c", 4).tolist() == [3, 3, 3]
    t_counts, r_counts = dsir.bucket_counts(target, 4), dsir.bucket_counts(raw, 4)
    assert t_counts.tolist() == [1, 2, 0, 3] and r_counts.tolist() == [1, 2, 0, 6]
    log_pt, log_pr = dsir.smoothed_log_probs(t_counts), dsir.smoothed_log_probs(r_counts)
    assert np.exp(log_pt) == pytest.approx([0.2, 0.3, 0.1, 0.4])  # (c + 1) / (6 + 4)
    assert np.exp(log_pr) == pytest.approx([2 / 13, 3 / 13, 1 / 13, 7 / 13])  # (c + 1) / (9 + 4)
    # log ratio per bucket: log 1.3 for buckets 0, 1, 2 and log(5.2 / 7) for bucket 3.
    up, down = math.log(1.3), math.log(5.2 / 7)
    weights = dsir.log_importance_weights(raw, log_pt, log_pr)
    assert weights == pytest.approx([up + 2 * down, 2 * up + down, 3 * down])
    assert np.argmax(weights) == 1


def test_resample_is_seeded_distinct_and_prefers_heavy_examples():
    log_w = np.log(np.array([1.0, 1.0, 1.0, 1000.0, 1000.0, 1.0]))
    a = dsir.resample(log_w, 2, seed=3)
    assert np.array_equal(a, dsir.resample(log_w, 2, seed=3))
    assert len(set(dsir.resample(log_w, 6, seed=0).tolist())) == 6
    draws = [set(dsir.resample(log_w, 2, seed=s).tolist()) for s in range(20)]
    assert sum(d == {3, 4} for d in draws) >= 18  # the two heavy rows win almost always
    assert len({tuple(dsir.resample(np.zeros(6), 3, seed=s)) for s in range(10)}) > 1
    with pytest.raises(ValueError, match=r"k=7 must lie in \[0, 6\]"):
        dsir.resample(log_w, 7, seed=0)
