"""BRIDGE selection-level fidelity diagnostics (paper §5.4 Table 3, §3 Fig. 2(b), App. F.1, F.2; docs/bridge.md).

The generic rank and selection metrics live in :mod:`raycurate.algorithms.ranking`; this package holds the one
diagnostic built on them, split where its parts meet: :mod:`.eligible` (the eligible- and fixed-position
conventions every part shares), :mod:`.reference` (part 2), :mod:`.proxies` (part 3's proxies), :mod:`.diagnose`
(one example, Table 3, App. F.2's Table 18) and :mod:`.shift` (Fig. 2(b)).  Import the public names from here.

Three parts, all per example and pure (numpy for the metrics, torch only where the model is evaluated):

1. **Metrics** (in :mod:`raycurate.algorithms.ranking`) between a reference score vector and a proxy score vector
   over the same candidates, with the budget-``b`` Top-b sets taken by
   :func:`raycurate.algorithms.bridge.selection.top_b` (ties by position): :func:`spearman` (average ranks for ties),
   :func:`top_b_overlap` ``|Top_b(ref) & Top_b(proxy)| / b``, :func:`jaccard` ``|.&.| / |.|.|``,
   :func:`normalized_regret` and :func:`utility_retention`.  With
   ``U_ref(S) = sum_{x in S} ref_x``, App. F.2 defines the retention ``Ret = U_ref(S_proxy) / U_ref(S_ref)`` and
   Table 18 reports ``Norm. Regret = 1 - Ret`` (0.9925 / 0.0075, 0.9948 / 0.0052), so

       regret = (U_ref(S_ref) - U_ref(S_proxy)) / |U_ref(S_ref)|  >= 0,

   which equals ``1 - Ret`` when ``U_ref(S_ref) > 0`` and stays a non-negative loss when the best reference
   utility is negative (decision: absolute value in the denominator).  Degenerate cases return NaN and are left
   out of the means, as App. F.3 does ("zero-variance ... vectors are excluded ... valid sample counts are
   reported"): Spearman of a constant vector, overlap/Jaccard at ``b = 0``, regret when ``U_ref(S_ref) = 0`` and
   the proxy set is not optimal.

2. **Exact conditional reference scores** (App. F.1, F.2) for one example with direction ``v``:
   ``beta^exact_ij = v . [g_j(P) - g_j(T_i(P))] = a_j(P) - a_j(T_i(P))`` where ``T_i(P)`` physically removes prompt
   token ``i`` (later positions shift left) and ``a_j`` is the JVP token utility
   (:func:`raycurate.algorithms.bridge.token_utility.token_utilities`); the leave-one-out rows all have length ``n - 1``
   and go through the model as batches of ``chunk`` rows, one JVP call per chunk.  Then
   ``Delta_p^exact(i | S_r) = sum_{j in S_r} beta^exact_ij`` and ``Delta_r^exact(j | S_p) = a_j(S_p)``, the
   utility recomputed on the physically compacted prompt (paper §5.4, App. F.2).

3. **Proxies** compared with the reference (Table 3): "Attention" (routing weights only, ``a`` set to 1:
   ``sum_{j in S_r} A_p[j, i]`` and ``c_j + sum_{i in S_p} A_p[j, i]``) and "Attention x a" (the BRIDGE
   surrogate ``Delta_p``, ``Delta_r``); :func:`fidelity_table` aggregates per-example metrics into Table 3 rows.
   :func:`ranking_shift` measures Fig. 2(b): one minus the Spearman correlation between the full-retention
   ranking and the ranking conditioned on a smaller opposite-side subset.

Fixed positions (decision, consistent with :func:`raycurate.algorithms.bridge.selection.fold_fixed_positions`): the
candidates are the *eligible* positions; fixed prompt tokens (BOS, template) stay in every compacted prompt and
fixed response tokens (EOS, end-of-turn) are always supervised, so they enter both the reference
(``Delta_p^exact`` sums over ``S_r`` plus the fixed response positions) and the proxies (folded into ``gamma``
and the prompt bias); ``count_fixed_response=False`` drops the fixed response terms from the compared prompt
scores, the paper's protocol ("EOS excluded from response evaluation", App. F.3).  BOS is never perturbed and EOS
never ranked.
The conditioning state of a diagnosed example is the final BRIDGE selection ``(S_p^(T), S_r^(T))`` of the
surrogate at the configured budgets (decision; §5.4 does not name the state).
"""

from raycurate.algorithms.bridge.fidelity.diagnose import (
    STATE_METRICS,
    FidelityExample,
    example_fidelity,
    fidelity_table,
    state_fidelity_table,
    state_recomputed_fidelity,
)
from raycurate.algorithms.bridge.fidelity.eligible import SIDES
from raycurate.algorithms.bridge.fidelity.proxies import KNOCKOUT, PROXIES, knockout_scores, proxy_scores
from raycurate.algorithms.bridge.fidelity.reference import (
    compacted_utilities,
    exact_interactions,
    exact_reference_scores,
    leave_one_out_rows,
    reference_from_interactions,
)
from raycurate.algorithms.bridge.fidelity.shift import (
    DEFAULT_RETENTIONS,
    mean_ranking_shift,
    nested_random_masks,
    ranking_shift,
)

__all__ = [
    "DEFAULT_RETENTIONS",
    "KNOCKOUT",
    "PROXIES",
    "SIDES",
    "STATE_METRICS",
    "FidelityExample",
    "compacted_utilities",
    "exact_interactions",
    "exact_reference_scores",
    "example_fidelity",
    "fidelity_table",
    "knockout_scores",
    "leave_one_out_rows",
    "mean_ranking_shift",
    "nested_random_masks",
    "proxy_scores",
    "ranking_shift",
    "reference_from_interactions",
    "state_fidelity_table",
    "state_recomputed_fidelity",
]
