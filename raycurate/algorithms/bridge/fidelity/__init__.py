"""BRIDGE selection-level fidelity diagnostics (paper §3 Fig. 2(b), §5.4 Table 3, App. F); import names from here.

Per example and pure (numpy metrics, torch only where the model runs): :mod:`.eligible` (the eligible- and
fixed-position conventions every part shares), :mod:`.reference` (exact leave-one-out reference scores, App. F.1,
F.2), :mod:`.proxies` (Table 3's "Attention", "Attention x a" and the knock-out derivative), :mod:`.diagnose` (one
example's state, reference and proxies; :func:`fidelity_table` for Table 3, App. F.2's Table 18) and :mod:`.shift`
(Fig. 2(b)'s ranking shift).  The rank metrics are :mod:`raycurate.algorithms.ranking`'s.  The stage is
``stages/bridge_diagnostics.py``; regret, degenerate cases, fixed positions and the conditioning state:
docs/bridge.md, "Diagnostics".
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
