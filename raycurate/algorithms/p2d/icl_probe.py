"""Head-guided ICL probing of training examples (P2D §3.2.2, Data Whisperer protocol).

:func:`icl_rounds` cuts the pool into prompts (an instruction, demonstrations, queries) round by round and
:func:`assemble_prompt` renders one; per prompt k the queries give a score s^(k) (:func:`gold_loglik_score`,
:func:`exact_match_score`, :func:`rouge_l_f1`) and each demonstration a weight w^(k), the selected heads' attention
from the query block to its span (:func:`demo_attention_weights`).  :func:`aggregate_example_scores` averages
``s^(k) w^(k)`` over an example's counted appearances (:func:`query_centred_scores` optionally centres s^(k) per
query first) and :func:`select_top` keeps the top rho_D.  Rounds, fillers, query draws, the loglik score and
NaN handling: docs/p2d.md, "Decisions the paper leaves open"; the stages are ``stages/p2d.py``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from raycurate.data.answers import answers_match, extract_final_answer

Span = tuple[int, int]

# Added before flooring in ``n_top`` so that an exact half (ratio * n = k + 0.5) rounds up despite float error.
_HALF_UP_SLACK = 1e-9


@dataclass(frozen=True)
class IclPrompt:
    """One probing prompt, as indices into the selection pool.

    Attributes:
        demos: Demonstration example indices, in prompt order.
        queries: Query example indices, in prompt order; disjoint from ``demos``.
        counted: Per demonstration, whether this appearance counts towards the example's score (False only for
            fillers of a round's last prompt); empty means all count.
        separate_queries: The queries index a separate query set (the trusted rows), not the pool.
    """

    demos: tuple[int, ...]
    queries: tuple[int, ...]
    counted: tuple[bool, ...] = ()
    separate_queries: bool = False

    def __post_init__(self) -> None:
        if not self.counted:
            object.__setattr__(self, "counted", (True,) * len(self.demos))
        if len(self.counted) != len(self.demos):
            raise ValueError(f"counted has {len(self.counted)} entries for {len(self.demos)} demonstrations")
        if not self.separate_queries and set(self.demos) & set(self.queries):
            raise ValueError(f"demonstrations {self.demos} and queries {self.queries} overlap")


def icl_rounds(
    n_examples: int, n_rounds: int, demos_per_prompt: int = 5, queries_per_prompt: int = 3, *, seed: int,
    query_examples: int | None = None,
) -> list[IclPrompt]:
    """Seeded probing prompts in which every example is a counted demonstration exactly ``n_rounds`` times.

    Args:
        n_examples: Pool size N, at least ``demos_per_prompt + queries_per_prompt``.
        n_rounds: Rounds n >= 1; each round covers the whole pool once.
        demos_per_prompt: Demonstrations per prompt (paper: 5).
        queries_per_prompt: Queries per prompt (paper: 3).
        seed: Seed of the permutations, fillers and queries; same seed, same prompts.
        query_examples: Size Q of a separate query set (the trusted rows): each prompt's queries are drawn from
            ``range(Q)`` instead of from the pool; None: from the pool minus the prompt's demonstrations.

    Returns:
        ``n_rounds * ceil(N / demos_per_prompt)`` prompts, round by round.
    """
    counts = {
        "n_examples": n_examples,
        "n_rounds": n_rounds,
        "demos_per_prompt": demos_per_prompt,
        "queries_per_prompt": queries_per_prompt,
    }
    for name, value in counts.items():
        if isinstance(value, bool) or int(value) != value or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    if query_examples is not None and query_examples < queries_per_prompt:
        raise ValueError(f"the query set has {query_examples} examples but each prompt needs {queries_per_prompt} "
                         "queries; add trusted rows or lower p2d.queries")
    if n_examples < demos_per_prompt + (0 if query_examples is not None else queries_per_prompt):
        raise ValueError(
            f"the pool has {n_examples} examples but each prompt needs {demos_per_prompt} demonstrations + "
            f"{queries_per_prompt} disjoint queries; use a larger pool or fewer demonstrations/queries"
        )
    rng = np.random.default_rng(seed)
    prompts = []
    for _ in range(n_rounds):
        order = rng.permutation(n_examples)
        for start in range(0, n_examples, demos_per_prompt):
            prompts.append(
                _prompt(
                    rng,
                    n_examples,
                    order[start : start + demos_per_prompt].tolist(),
                    demos_per_prompt,
                    queries_per_prompt,
                    query_examples,
                )
            )
    return prompts


def _prompt(rng: np.random.Generator, n_examples: int, chunk: list[int], n_demos: int, n_queries: int,
            query_examples: int | None = None) -> IclPrompt:
    fillers = _draw_excluding(rng, n_examples, set(chunk), n_demos - len(chunk))
    demos, counted = chunk + fillers, [True] * len(chunk) + [False] * len(fillers)
    if fillers:  # fillers must not always sit last (position biases attention)
        shuffle = rng.permutation(len(demos))
        demos, counted = [demos[i] for i in shuffle], [counted[i] for i in shuffle]
    if query_examples is not None:
        queries = _draw_excluding(rng, query_examples, set(), n_queries)
    else:
        queries = _draw_excluding(rng, n_examples, set(demos), n_queries)
    return IclPrompt(tuple(demos), tuple(queries), tuple(counted), separate_queries=query_examples is not None)


def _draw_excluding(rng: np.random.Generator, n: int, exclude: set[int], k: int) -> list[int]:
    """``k`` distinct indices of ``range(n)`` outside ``exclude``, uniformly at random."""
    if k == 0:
        return []
    if n < 4 * (len(exclude) + k):  # small pool: sample the complement directly
        allowed = np.setdiff1d(np.arange(n), np.fromiter(exclude, dtype=np.int64))
        return rng.choice(allowed, size=k, replace=False).tolist()
    picked: list[int] = []
    while len(picked) < k:  # large pool: rejection sampling, O(k) instead of O(n)
        for index in rng.integers(0, n, size=2 * k).tolist():
            if index not in exclude and index not in picked:
                picked.append(index)
                if len(picked) == k:
                    break
    return picked


def demo_appearances(prompts: Iterable[IclPrompt], n_examples: int) -> np.ndarray:
    """(N,) int64 number of counted demonstration appearances of each example."""
    counts = np.zeros(n_examples, dtype=np.int64)
    for prompt in prompts:
        for example, counted in zip(prompt.demos, prompt.counted, strict=True):
            counts[example] += int(counted)
    return counts


def assemble_prompt(
    instruction_ids: Sequence[int],
    demo_ids: Sequence[Sequence[int]],
    query_ids: Sequence[Sequence[int]],
    query_answer_ids: Sequence[Sequence[int]] | None = None,
    separator: Sequence[int] = (),
) -> dict[str, list[int] | list[Span] | Span]:
    """Concatenate already-tokenised pieces into one probing prompt and record where each piece sits.

    Layout: ``instruction, demo_1, sep, ..., demo_n, sep, query_1 [answer_1], sep, ..., query_m [answer_m]``.  The
    caller renders each piece (chat template, "Q:/A:" labels) before tokenising; only ``separator`` is added here,
    between consecutive rows (a row = a demonstration, or a query with its answer), in no span.

    Args:
        instruction_ids: Token ids of the task instruction (may be empty).
        demo_ids: Per demonstration, its token ids (prompt and response), each non-empty.
        query_ids: Per query, its token ids (prompt only), each non-empty.
        query_answer_ids: Per query, the gold answer ids appended right after it (teacher forcing), or None.
        separator: Token ids between consecutive rows (ChatML: the newline after ``<|im_end|>``; may be empty).

    Returns:
        ``{"input_ids": [...], "demo_spans": [(start, end), ...], "query_spans": [...], "answer_spans": [...]
        (empty without answers), "query_block": (start, end)}``; spans are half-open token positions and the
        query block runs from the first query token to the end of the sequence (answers included).
    """
    if not demo_ids or not query_ids:
        raise ValueError(f"a probing prompt needs demonstrations and queries, got {len(demo_ids)} and {len(query_ids)}")
    if query_answer_ids is not None and len(query_answer_ids) != len(query_ids):
        raise ValueError(f"got {len(query_answer_ids)} answers for {len(query_ids)} queries; pass one per query")
    input_ids = [int(token) for token in instruction_ids]

    def append(piece: Sequence[int], what: str) -> Span:
        if len(piece) == 0:
            raise ValueError(f"{what} has no tokens; drop empty examples before probing")
        start = len(input_ids)
        input_ids.extend(int(token) for token in piece)
        return start, len(input_ids)

    demo_spans, query_spans, answer_spans = [], [], []
    for i, piece in enumerate(demo_ids):
        demo_spans.append(append(piece, f"demonstration {i}"))
        input_ids.extend(int(token) for token in separator)
    for i, piece in enumerate(query_ids):
        if i:
            input_ids.extend(int(token) for token in separator)
        query_spans.append(append(piece, f"query {i}"))
        if query_answer_ids is not None:
            answer_spans.append(append(query_answer_ids[i], f"answer of query {i}"))
    return {
        "input_ids": input_ids,
        "demo_spans": demo_spans,
        "query_spans": query_spans,
        "answer_spans": answer_spans,
        "query_block": (query_spans[0][0], len(input_ids)),
    }


def demo_attention_weights(
    attn: Mapping[int, torch.Tensor],
    selected: torch.Tensor,
    query_rows: slice | torch.Tensor,
    demo_spans: Sequence[Span],
) -> torch.Tensor:
    """Attention-based weight of each demonstration, restricted to the selected heads.

    ``w_i ∝ (1 / len_i) * sum_{(l, h) in H_T} sum_{r in query rows} sum_{c in span_i} attn[l][h, r, c]``, normalised
    so the weights of the prompt's demonstrations sum to 1.

    Args:
        attn: Layer index -> attention weights of one prompt, (H, T, T) or (H, Tq, T) (rows already cut to the
            query block); must hold every layer with a selected head, other layers are ignored.
        selected: (L, H) bool mask of the selected heads H_T.
        query_rows: Rows of ``attn[l]`` (dim 1) that are query-block tokens, as a slice or index tensor; pass
            ``slice(None)`` when the tensors hold only query rows.
        demo_spans: Half-open (start, end) key positions of each demonstration.

    Returns:
        (n_demos,) float64 weights summing to 1.
    """
    if selected.dim() != 2 or not selected.any():
        raise ValueError(f"selected must be an (L, H) bool mask with at least one head, got {tuple(selected.shape)}")
    if not demo_spans or any(end <= start for start, end in demo_spans):
        raise ValueError(f"demo_spans must be non-empty (start, end) pairs with end > start, got {list(demo_spans)}")
    mass = torch.zeros(len(demo_spans), dtype=torch.float64)
    for layer in torch.nonzero(selected.any(dim=1)).flatten().tolist():
        if layer not in attn:
            raise KeyError(f"attention of layer {layer} is missing; capture every layer that holds a selected head")
        weights = attn[layer]
        if weights.dim() != 3 or weights.shape[0] != selected.shape[1]:
            raise ValueError(
                f"attention of layer {layer} must be (H={selected.shape[1]}, Tq, T), got {tuple(weights.shape)}; "
                "index the batch dimension away first"
            )
        columns = weights[selected[layer]][:, query_rows].to(torch.float64).sum(dim=(0, 1))  # (T,)
        cumulative = torch.cat([columns.new_zeros(1), torch.cumsum(columns, dim=0)])  # (T + 1,)
        mass += torch.stack([cumulative[end] - cumulative[start] for start, end in demo_spans])
    lengths = torch.tensor([end - start for start, end in demo_spans], dtype=torch.float64)
    per_token = mass / lengths
    total = per_token.sum()
    if not total > 0:
        raise ValueError("the query block puts no attention on any demonstration; check query_rows and demo_spans")
    return per_token / total


def answer_token_logprobs(logits: torch.Tensor, input_ids: torch.Tensor, span: Span) -> torch.Tensor:
    """Teacher-forced log-probabilities of the tokens at positions ``span`` of one sequence.

    Args:
        logits: (T, V) logits of one sequence; ``logits[t]`` predicts ``input_ids[t + 1]``.
        input_ids: (T,) token ids.
        span: Half-open (start, end) answer positions, ``start >= 1``.

    Returns:
        (end - start,) float32 ``log p(input_ids[t] | input_ids[:t])`` for t in the span.
    """
    start, end = span
    if not 1 <= start < end <= input_ids.shape[0]:
        raise ValueError(f"answer span {span} must satisfy 1 <= start < end <= {input_ids.shape[0]}")
    log_probs = torch.log_softmax(logits[start - 1 : end - 1].float(), dim=-1)  # (n, V)
    return log_probs.gather(1, input_ids[start:end, None]).squeeze(1)


def gold_loglik_score(token_logprobs: torch.Tensor | Sequence[float]) -> float:
    """Query score from teacher-forced gold log-probs: ``exp(mean log p)``, the geometric-mean token probability.

    Args:
        token_logprobs: (n,) log-probabilities of the gold answer tokens, n >= 1.

    Returns:
        A score in (0, 1]; higher = the model predicts the gold answer better.
    """
    values = torch.as_tensor(token_logprobs, dtype=torch.float64)
    if values.numel() == 0:
        raise ValueError("the gold answer has no tokens to score")
    return float(torch.exp(values.mean()))


def exact_match_score(candidate: str, reference: str) -> float:
    """1.0 when the candidate's final answer equals the reference's, else 0.0 (GSM8K style).

    Each side's answer is the value after its last ``####`` when it has one, else the whole text; numbers compare
    by value after normalisation (:func:`raycurate.data.answers.answers_match`).
    """
    pred = extract_final_answer(candidate) or candidate
    gold = extract_final_answer(reference) or reference
    return float(answers_match(pred, gold))


def rouge_l_f1(candidate: Sequence, reference: Sequence) -> float:
    """ROUGE-L F1 between two token sequences: LCS-based precision and recall, beta = 1.

    Args:
        candidate: Candidate tokens (ids or strings).
        reference: Reference tokens.

    Returns:
        ``2 P R / (P + R)`` with ``P = LCS / len(candidate)``, ``R = LCS / len(reference)``; 0 if either is empty.
    """
    lcs = _lcs_length(list(candidate), list(reference))
    if lcs == 0:
        return 0.0
    precision, recall = lcs / len(candidate), lcs / len(reference)
    return 2 * precision * recall / (precision + recall)


def _lcs_length(a: list, b: list) -> int:
    """Longest common subsequence length, O(len(a) * len(b)) time and O(len(b)) memory."""
    previous = [0] * (len(b) + 1)
    for item in a:
        current = [0]
        for j, other in enumerate(b):
            current.append(previous[j] + 1 if item == other else max(previous[j + 1], current[j]))
        previous = current
    return previous[-1]


def aggregate_example_scores(appearances: Iterable[tuple[int, float, float]], n_examples: int) -> np.ndarray:
    """``s_final(i) = mean over the counted appearances of example i of s^(k) * w_i^(k)``.

    Args:
        appearances: ``(example_index, s_k, w_k)`` for every counted demonstration appearance (skip fillers).
        n_examples: Pool size N.

    Returns:
        (N,) float64 scores; NaN for examples with no appearance.
    """
    totals = np.zeros(n_examples, dtype=np.float64)
    counts = np.zeros(n_examples, dtype=np.int64)
    for example, score, weight in appearances:
        if not 0 <= example < n_examples:
            raise ValueError(f"example index {example} is outside the pool of {n_examples} examples")
        value = float(score) * float(weight)
        if not math.isfinite(value):
            raise ValueError(f"example {example} has a non-finite appearance score s={score!r}, w={weight!r}")
        totals[example] += value
        counts[example] += 1
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(counts > 0, totals / np.maximum(counts, 1), np.nan)


def query_centred_scores(queries: Sequence[Sequence[str]], query_scores: Sequence[Sequence[float]]) -> np.ndarray:
    """Each prompt's score s^(k) with the difficulty of its queries taken out: the mean over its queries of
    (the query's score in this prompt - that query's mean score over every prompt it appears in).

    Which queries a prompt draws moves s^(k) more than which demonstrations it holds (on SmolLM2, 88% of the
    variance of s^(k)), so an example's s_final mostly measured its prompts' luck; centring each query on its own
    mean leaves what the demonstrations changed.

    Args:
        queries: Per prompt, its query ids.
        query_scores: Per prompt, each query's score, aligned with ``queries``.

    Returns:
        (K,) float64 centred prompt scores (0 where every query scored its own mean).
    """
    totals: dict[str, float] = {}
    counts: dict[str, int] = {}
    for ids, scores in zip(queries, query_scores, strict=True):
        if len(ids) != len(scores):
            raise ValueError(f"a prompt has {len(ids)} queries but {len(scores)} query scores")
        for qid, score in zip(ids, scores):
            totals[qid] = totals.get(qid, 0.0) + float(score)
            counts[qid] = counts.get(qid, 0) + 1
    return np.array([np.mean([float(x) - totals[q] / counts[q] for q, x in zip(ids, scores)])
                     for ids, scores in zip(queries, query_scores)], dtype=np.float64)


def n_top(n: int, ratio: float) -> int:
    """Examples kept at ``ratio``: ``round(ratio * n)`` half up, at least 1, at most n."""
    if not 0.0 < float(ratio) <= 1.0:
        raise ValueError(f"data ratio must lie in (0, 1], got {ratio!r}; it is the fraction of examples to keep")
    return min(n, max(1, math.floor(float(ratio) * n + 0.5 + _HALF_UP_SLACK)))


def select_top(scores: np.ndarray | Sequence[float], ratio: float) -> np.ndarray:
    """Indices of the ``n_top(N, ratio)`` highest scores, best first; ties go to the lower index.

    Args:
        scores: (N,) scores without NaN (probe every example, or drop the unprobed ones first).
        ratio: Data ratio rho_D in (0, 1].

    Returns:
        (k,) int64 indices into ``scores``.
    """
    values = np.asarray(scores, dtype=np.float64)
    if values.ndim != 1 or values.size == 0:
        raise ValueError(f"scores must be a non-empty 1-D array, got shape {values.shape}")
    missing = np.flatnonzero(np.isnan(values))
    if missing.size:
        raise ValueError(
            f"{missing.size} examples have no score (NaN), e.g. {missing[:5].tolist()}; they were never a counted "
            "demonstration: run more rounds or drop them before selecting"
        )
    order = np.argsort(-values, kind="stable")
    return order[: n_top(values.size, ratio)].astype(np.int64)
