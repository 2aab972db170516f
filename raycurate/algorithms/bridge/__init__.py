"""BRIDGE (papers/bridge-token-selection): coupled prompt/response token selection, one module per part of the paper.

§4.2 / App. A.1 validation-directed token utilities: :mod:`.token_utility` (its hand-written forward-mode layer
rules in :mod:`.dual_layers`); §4.3 / App. B.3 attention routing and interaction terms: :mod:`.routing`; §4.4 /
App. A.4, C.2 budgets and alternating coupled selection: :mod:`.selection` (compiled loops in :mod:`.kernels`);
§4.4 / App. G.1, D.2, D.3 structural projection: :mod:`.closure` over the units of :mod:`.units` (token-to-character
checks in :mod:`.alignment`, the solvers in :mod:`.knapsack`); §4.5 / App. B.2 compacted training rows:
:mod:`.compaction`; §5.1 / App. D.1 token-selection baselines: :mod:`.token_baselines`; §3 Fig. 2(b), §5.4 Table 3,
App. F fidelity diagnostics: :mod:`.fidelity`.  :mod:`.rows` chains them per token row for the Ray stages
(``stages/bridge.py``); decisions the paper leaves open are in docs/bridge.md.
"""
