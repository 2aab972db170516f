"""DSIR: data selection by importance resampling over hashed n-gram features (Xie et al. 2023; bilevel paper B5).

Flow (four calls, like the reference package): :func:`bucket_counts` over the target (validation) texts and over
the raw (candidate) texts -> :func:`smoothed_log_probs` of each -> :func:`log_importance_weights` of every raw text
-> :func:`resample` k of them.  Counts are plain (num_buckets,) arrays, so a distributed caller sums per-shard
counts before smoothing.  The decisions (features, CRC-32 hashing, add-one smoothing, unnormalised weights, Gumbel
top-k) are docs/bilevel.md, "Decisions the papers leave open".
"""

from __future__ import annotations

import re
import zlib
from typing import Iterable

import numpy as np

_WORD = re.compile(r"\w+|[^\w\s]")


def words(text: str) -> list[str]:
    """Lowercased word tokens: runs of word characters, or single punctuation marks."""
    return _WORD.findall(text.lower())


def ngrams(tokens: list[str]) -> list[str]:
    """Unigrams followed by adjacent bigrams (joined by one space)."""
    return tokens + [f"{a} {b}" for a, b in zip(tokens, tokens[1:])]


def stable_bucket(ngram: str, num_buckets: int) -> int:
    """Bucket of one n-gram: ``crc32(utf-8 bytes) mod num_buckets`` (the same in every process)."""
    return zlib.crc32(ngram.encode("utf-8")) % num_buckets


def hashed_ngram_ids(text: str, num_buckets: int) -> np.ndarray:
    """Bucket id of every unigram and bigram occurrence of ``text``.

    Returns:
        (n_unigrams + n_bigrams,) int64 bucket ids (repeats kept).
    """
    if num_buckets < 1:
        raise ValueError(f"num_buckets must be >= 1, got {num_buckets}")
    return np.fromiter((stable_bucket(g, num_buckets) for g in ngrams(words(text))), dtype=np.int64)


def bucket_counts(texts: Iterable[str], num_buckets: int) -> np.ndarray:
    """Summed hashed n-gram counts of a collection of texts.

    Returns:
        (num_buckets,) int64 counts.
    """
    counts = np.zeros(num_buckets, dtype=np.int64)
    for text in texts:
        counts += np.bincount(hashed_ngram_ids(text, num_buckets), minlength=num_buckets)
    return counts


def smoothed_log_probs(counts: np.ndarray) -> np.ndarray:
    """Add-one smoothed log-probabilities of a bag-of-n-grams distribution.

    Args:
        counts: (num_buckets,) non-negative counts.

    Returns:
        (num_buckets,) float64 ``log((count + 1) / (total + num_buckets))``.
    """
    counts = np.asarray(counts, dtype=np.float64)
    if counts.ndim != 1 or (counts < 0).any():
        raise ValueError("counts must be a 1-D array of non-negative bucket counts (from bucket_counts)")
    return np.log(counts + 1.0) - np.log(counts.sum() + counts.size)


def log_importance_weights(
    texts: Iterable[str], log_p_target: np.ndarray, log_p_raw: np.ndarray
) -> np.ndarray:
    """DSIR log importance weight of each text: ``sum over its n-grams of log p_target - log p_raw``.

    Args:
        texts: N raw (candidate) texts.
        log_p_target: (num_buckets,) from :func:`smoothed_log_probs` of the target counts.
        log_p_raw: (num_buckets,) from :func:`smoothed_log_probs` of the raw counts.

    Returns:
        (N,) float64 log weights.
    """
    if log_p_target.shape != log_p_raw.shape:
        raise ValueError(
            f"log_p_target {log_p_target.shape} and log_p_raw {log_p_raw.shape} differ; fit both with the same "
            "num_buckets"
        )
    ratio = np.asarray(log_p_target, dtype=np.float64) - np.asarray(log_p_raw, dtype=np.float64)
    return np.array([ratio[hashed_ngram_ids(t, ratio.size)].sum() for t in texts], dtype=np.float64)


def resample(log_weights: np.ndarray, k: int, seed: int) -> np.ndarray:
    """Draw k distinct indices with probability proportional to ``exp(log_weights)`` (Gumbel top-k).

    Args:
        log_weights: (N,) log importance weights.
        k: Number of examples to keep, 0 <= k <= N.
        seed: Seed of the Gumbel noise (same seed, same sample).

    Returns:
        (k,) int64 indices in draw order (highest perturbed key first).
    """
    log_weights = np.asarray(log_weights, dtype=np.float64)
    if not 0 <= k <= log_weights.size:
        raise ValueError(f"k={k} must lie in [0, {log_weights.size}] (the number of candidate texts)")
    keys = log_weights + np.random.default_rng(seed).gumbel(size=log_weights.size)
    order = np.argsort(-keys, kind="stable")
    return order[:k].astype(np.int64)


def target_log_weights(target_texts: list[str], raw_texts: list[str], buckets: int) -> np.ndarray:
    """DSIR log importance weight of every raw text against the target texts.

    Returns:
        (len(raw_texts),) float64 ``log p_target(x) - log p_raw(x)`` under the hashed n-gram models.
    """
    log_p_target = smoothed_log_probs(bucket_counts(target_texts, buckets))
    log_p_raw = smoothed_log_probs(bucket_counts(raw_texts, buckets))
    return log_importance_weights(raw_texts, log_p_target, log_p_raw)
