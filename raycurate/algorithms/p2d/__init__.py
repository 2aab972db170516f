"""P2D (papers/p2d-parameters-to-data): attention heads choose the training data, then are the only part trained.

§3.2.1 Stage I, fast head identification (head sensitivity from base vs proxy weights, top rho_P heads):
:mod:`.head_scoring`; §3.2.2 Stage II, parameter-guided data selection (head-guided ICL probing, structure-aware
filtering, iterative scoring and the top rho_D selection): :mod:`.icl_probe`.  Stage III, sparse head adaptation,
is model code: ``models/heads.py`` (per-head weight slices) and ``models/head_adapter.py`` (the head-delta adapter).
The IFD baseline is :mod:`raycurate.algorithms.ifd`; the stages are ``stages/p2d.py``; decisions in docs/p2d.md.
"""
