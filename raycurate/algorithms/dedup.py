"""Near-duplicate detection: word 3-gram shingles, MinHash signatures, LSH candidate pairs verified exactly, and
the choice of which copy of each duplicate cluster to keep (docs/design.md, "The default curate recipe")."""

from __future__ import annotations

import hashlib
import re

import numpy as np

_MERSENNE_31 = (1 << 31) - 1
_WORD = re.compile(r"\w+")

#: How a candidate pair is verified (``curate.dedup_similarity``): ``jaccard`` |A & B| / |A | B| of the texts'
#: shingles; ``containment`` |A & B| / min(|A|, |B|), which stays near 1 when one text is the other plus a few
#: words (a greeting, "Question:", "Thanks."); ``example``: the lower of the prompts' containment and the responses'
#: Jaccard similarity (the same answer to the same question, one of them padded).
SIMILARITIES = ("jaccard", "containment", "example")
#: Which copy of a duplicate cluster is kept (``curate.dedup_keep``): ``first`` (lowest index, i.e. by id) or
#: ``shortest`` (fewest characters, then lowest index: the copy without added boilerplate).
KEEP_RULES = ("first", "shortest")


def word_shingles(text: str, n: int = 3) -> frozenset[str]:
    """The set of lowercased word n-grams of ``text`` (the whole text as one shingle when it has < n words)."""
    words = _WORD.findall(text.lower())
    if len(words) < n:
        return frozenset([" ".join(words)])
    return frozenset(" ".join(words[i:i + n]) for i in range(len(words) - n + 1))


def _shingle_hashes(shingles: frozenset[str]) -> np.ndarray:
    """(S,) uint64 32-bit hashes of the shingles (blake2b: the same in every process, unlike ``hash``)."""
    return np.array([int.from_bytes(hashlib.blake2b(s.encode("utf-8"), digest_size=4).digest(), "little")
                     for s in shingles], dtype=np.uint64)


def minhash_signatures(texts: list[str], num_perm: int = 64, seed: int = 0, n: int = 3) -> np.ndarray:
    """MinHash signatures: for each of ``num_perm`` seeded hash functions ``(a x + b) mod (2^31 - 1)``, the minimum
    over the text's word n-gram hashes; two texts agree on one row with probability = their Jaccard similarity.

    Args:
        texts: R texts.
        num_perm: Signature length P.
        seed: Seed of the hash functions (same seed, same signatures).
        n: Words per shingle.

    Returns:
        (R, P) uint64 signatures.
    """
    rng = np.random.default_rng([seed, 61])
    prime = np.uint64(_MERSENNE_31)
    a = rng.integers(1, _MERSENNE_31, size=num_perm, dtype=np.uint64)  # a x + b < 2^62 for x < 2^31: no overflow
    b = rng.integers(0, _MERSENNE_31, size=num_perm, dtype=np.uint64)
    out = np.empty((len(texts), num_perm), dtype=np.uint64)
    for r, text in enumerate(texts):
        x = _shingle_hashes(word_shingles(text, n)) % prime  # (S,)
        out[r] = ((np.outer(x, a) + b) % prime).min(axis=0)
    return out


def similarity(a: frozenset[str], b: frozenset[str], measure: str = "jaccard") -> float:
    """Jaccard or containment similarity of two shingle sets (1.0 for two empty sets)."""
    if measure not in ("jaccard", "containment"):
        raise ValueError(f"similarity measure must be jaccard or containment, got {measure!r}")
    inter = len(a & b)
    denominator = len(a | b) if measure == "jaccard" else min(len(a), len(b))
    return inter / denominator if denominator else 1.0


def duplicate_pairs(signatures: np.ndarray, shingles: list[frozenset[str]], threshold: float,
                    bands: int = 16, measure: str = "jaccard",
                    response_shingles: list[frozenset[str]] | None = None) -> list[tuple[int, int, float]]:
    """Pairs (i < j) whose exact ``measure`` similarity is >= ``threshold``, among the LSH candidates (rows that
    agree on all rows of at least one of ``bands`` signature bands).

    Args:
        signatures: (R, P) MinHash signatures, P divisible by ``bands`` (of the responses for ``example``).
        shingles: R shingle sets (for the exact check; the prompts' for ``example``).
        threshold: Similarity in (0, 1].
        bands: LSH bands.
        measure: One of :data:`SIMILARITIES`.
        response_shingles: R response shingle sets (``example`` only).

    Returns:
        Sorted (i, j, similarity) triples.
    """
    rows, perms = signatures.shape
    if perms % bands:
        raise ValueError(f"signature length {perms} must be divisible by bands={bands}")
    if measure not in SIMILARITIES:
        raise ValueError(f"similarity measure must be one of {SIMILARITIES}, got {measure!r}")
    if measure == "example" and response_shingles is None:
        raise ValueError("measure='example' needs response_shingles")
    width = perms // bands
    candidates: set[tuple[int, int]] = set()
    for band in range(bands):
        buckets: dict[bytes, list[int]] = {}
        for r in range(rows):
            buckets.setdefault(signatures[r, band * width:(band + 1) * width].tobytes(), []).append(r)
        for members in buckets.values():
            candidates.update((members[x], members[y]) for x in range(len(members))
                              for y in range(x + 1, len(members)))
    pairs = []
    for i, j in sorted(candidates):
        if measure == "example":
            assert response_shingles is not None
            value = min(similarity(shingles[i], shingles[j], "containment"),
                        similarity(response_shingles[i], response_shingles[j], "jaccard"))
        else:
            value = similarity(shingles[i], shingles[j], measure)
        if value >= threshold:
            pairs.append((i, j, value))
    return pairs


def _clusters(pairs: list[tuple[int, int, float]], rows: int) -> list[list[int]]:
    """Connected components (size >= 2) of the duplicate graph, each sorted."""
    parent = list(range(rows))

    def find(x: int) -> int:
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for i, j, _ in pairs:
        parent[find(j)] = find(i)
    groups: dict[int, list[int]] = {}
    for r in range(rows):
        groups.setdefault(find(r), []).append(r)
    return [sorted(g) for g in groups.values() if len(g) > 1]


def cluster_duplicates(pairs: list[tuple[int, int, float]], lengths: list[int], *, keep: str = "first",
                       protected: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Keep one copy of each duplicate cluster and point every other member at it.

    Rows ``0 .. protected - 1`` (a trusted set) are never flagged: a cluster holding one keeps all of its protected
    rows and flags the rest against the first protected row. Otherwise ``keep`` picks the copy (:data:`KEEP_RULES`).

    Args:
        pairs: (i, j, similarity) from :func:`duplicate_pairs`.
        lengths: R text lengths (characters), for ``keep="shortest"``.
        keep: One of :data:`KEEP_RULES`.
        protected: Leading rows that are never flagged.

    Returns:
        (R,) int64 index of the kept copy each flagged row duplicates (-1 for kept rows), (R,) float64 the flagged
        row's similarity to that copy (its highest pair similarity when the two are linked only through others).
    """
    if keep not in KEEP_RULES:
        raise ValueError(f"keep must be one of {KEEP_RULES}, got {keep!r}")
    rows = len(lengths)
    direct: dict[tuple[int, int], float] = {(i, j): s for i, j, s in pairs}
    best = np.zeros(rows)
    for i, j, s in pairs:
        best[i], best[j] = max(best[i], s), max(best[j], s)
    source, value = np.full(rows, -1, dtype=np.int64), np.zeros(rows)
    for members in _clusters(pairs, rows):
        guarded = [m for m in members if m < protected]
        if guarded:
            kept, flagged = guarded[0], [m for m in members if m >= protected]
        else:
            kept = members[0] if keep == "first" else min(members, key=lambda m: (lengths[m], m))
            flagged = [m for m in members if m != kept]
        for m in flagged:
            source[m] = kept
            value[m] = direct.get((min(m, kept), max(m, kept)), best[m])
    return source, value
