"""Reference set for BRIDGE's per-example selection and closure: write per-case digests, or check against them.

Every case runs a public entry point on generated inputs and hashes every output field bit for bit (masks, float64
scores, ``u_sur``, rounds, units, solver, diagnostics):

* ``select``: :func:`~raycurate.algorithms.bridge.selection.select` (all three schedules, T = 1..6) and
  :func:`~raycurate.algorithms.bridge.selection.knockout_update` on attention-shaped, Gaussian, tie-heavy (quantized,
  all-zero, duplicated columns) and tiny (p or r in 0..3) inputs, budgets from rho in {0, 0.3, 0.75, 1} or drawn;
* ``closure``: :func:`~raycurate.algorithms.bridge.closure.project_response` on bench math responses and corpus
  responses of every domain (``raycurate.data.corpus``), with tokenizer, word-level and character-level offsets,
  template tokens ``(-1, -1)``, a few misaligned offsets (fallback), tie-heavy scores, token masks from Top-b or
  drawn, and projection options (tau, alpha, greedy above a small DP limit, no completion, unit limits);
* ``bridge``: :func:`~raycurate.algorithms.bridge.rows.select_example` on tokenized corpus rows with drawn routing and
  utilities (closure on/off, ``first_tokens``, ``fold_fixed_response``, schedules, knock-out prompt scores) and
  :func:`~raycurate.algorithms.bridge.rows.corpus_response_masks` (``bridge.budget = corpus``) over groups of them.

Usage::

    python benchmarks/selection_reference.py --write REF.json     # digests of the current code
    python benchmarks/selection_reference.py --check REF.json     # same digests? (exit 1 and the first diffs if not)
    python benchmarks/selection_reference.py --paths              # compiled kernels vs the numpy path, in-process

``--paths`` needs :mod:`raycurate.algorithms.bridge.kernels` (numba); the last
line is ``reference_cases=N mismatches=M``.
"""

from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import hashlib  # noqa: E402
import json  # noqa: E402
import re  # noqa: E402
import struct  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable, Iterator  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_selection import make_instance  # noqa: E402

from raycurate.algorithms.bridge.closure import project_response  # noqa: E402
from raycurate.algorithms.bridge.rows import SelectionSettings, corpus_response_masks, select_example  # noqa: E402
from raycurate.algorithms.bridge.selection import budgets, knockout_update, select, top_b  # noqa: E402

Case = Callable[[], dict[str, Any]]
_WORDS = re.compile(r"[ \t]*(?:\w+|[^\w\s])|\n")


def digest(value: Any) -> str:
    """Bit-exact digest of an output value (arrays by dtype, shape and bytes; floats by their IEEE bits)."""
    h = hashlib.blake2b(digest_size=8)
    _feed(h, value)
    return h.hexdigest()


def _feed(h: Any, value: Any) -> None:
    if isinstance(value, np.ndarray):
        h.update(f"A{value.dtype.str}{value.shape}".encode())
        h.update(np.ascontiguousarray(value).tobytes())
    elif isinstance(value, (bool, np.bool_)):
        h.update(b"T" if value else b"F")
    elif isinstance(value, (int, np.integer)):
        h.update(f"I{int(value)}".encode())
    elif isinstance(value, (float, np.floating)):
        h.update(b"D" + struct.pack("<d", float(value)))
    elif isinstance(value, str):
        h.update(b"S" + value.encode() + b"\0")
    elif value is None:
        h.update(b"N")
    elif isinstance(value, dict):
        h.update(b"{")
        for k in sorted(value):
            _feed(h, k)
            _feed(h, value[k])
        h.update(b"}")
    elif isinstance(value, (list, tuple)):
        h.update(b"[")
        for v in value:
            _feed(h, v)
        h.update(b"]")
    else:
        raise TypeError(f"cannot digest {type(value)}")


def _fields(obj: Any) -> dict[str, Any]:
    out = {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}
    if "units" in out:
        out["units"] = [tuple(u) for u in out["units"]]
    return out


# ------------------------------------------------------------------------------------------------------------ inputs


def _matrix(rng: np.random.Generator, p: int, r: int, kind: str) -> tuple[np.ndarray, np.ndarray]:
    if kind == "attention":
        attn = rng.dirichlet(np.full(p + r + 1, 0.3), size=r)  # (r, 1 + p + r)
        a = rng.normal(size=r) * rng.exponential(size=r)
        beta = np.ascontiguousarray((attn[:, 1 : p + 1] * a[:, None]).T)
        gamma = a * attn[:, p + 1 :].sum(axis=1)
    elif kind == "normal":
        beta, gamma = rng.normal(size=(p, r)), rng.normal(size=r)
    elif kind == "quantized":  # many exact ties
        beta, gamma = np.round(rng.normal(size=(p, r)) * 2) / 4, np.round(rng.normal(size=r) * 2) / 4
    elif kind == "zeros":
        beta, gamma = np.zeros((p, r)), np.where(rng.random(r) < 0.5, 0.0, 1.0)
    elif kind == "dupcols":
        base = rng.normal(size=(p, max(1, r // 3)))
        beta = base[:, rng.integers(0, base.shape[1], size=r)] if r else np.zeros((p, 0))
        gamma = np.round(rng.normal(size=r))
    else:  # "scaled": float16-like magnitudes and signs
        beta = (rng.normal(size=(p, r)) * 1e-3).astype(np.float16).astype(np.float64)
        gamma = (rng.normal(size=r) * 1e-2).astype(np.float16).astype(np.float64)
    return np.ascontiguousarray(beta, dtype=np.float64), np.asarray(gamma, dtype=np.float64)


def _size(rng: np.random.Generator) -> int:
    band = rng.random()
    if band < 0.15:
        return int(rng.integers(0, 4))
    if band < 0.6:
        return int(rng.integers(4, 60))
    return int(rng.integers(150, 331))


def _budget_pair(rng: np.random.Generator, p: int, r: int) -> tuple[int, int]:
    if rng.random() < 0.6:
        rho_p, rho_r = (float(rng.choice([0.0, 0.3, 0.75, 1.0])) for _ in range(2))
        return budgets(p, r, rho_p, rho_r)
    return int(rng.integers(0, p + 1)), int(rng.integers(0, r + 1))


def select_cases(seed: int, n: int) -> Iterator[Case]:
    kinds = ("attention", "normal", "quantized", "zeros", "dupcols", "scaled")
    for k in range(n):
        rng = np.random.default_rng([seed, 1, k])
        p, r = _size(rng), _size(rng)
        beta, gamma = _matrix(rng, p, r, kinds[k % len(kinds)])
        bias = None if rng.random() < 0.5 else np.round(rng.normal(size=p) * 4) / 8
        b_p, b_r = _budget_pair(rng, p, r)
        schedule = ("alternating", "alternating", "one_pass", "independent")[k % 4]
        rounds = int(rng.integers(1, 7))
        knock = rng.normal(size=p) if rng.random() < 0.2 else None

        def case(beta=beta, gamma=gamma, bias=bias, b_p=b_p, b_r=b_r, schedule=schedule, rounds=rounds,
                 knock=knock) -> dict[str, Any]:
            res = select(beta, gamma, b_p, b_r, schedule, rounds, prompt_bias=bias)
            out = _fields(res)
            if knock is not None:
                out["knockout"] = _fields(knockout_update(res, knock, beta, gamma, b_p, b_r, prompt_bias=bias))
            return out

        yield case


def _corpus(seed: int, n_rows: int) -> tuple[list[dict], Any]:
    from raycurate.data.corpus import generate_corpus
    from raycurate.models.tokenizer import train_tokenizer

    rows = generate_corpus(n_rows, seed=seed)
    tokenizer = train_tokenizer([r["prompt"] + "\n" + r["response"] for r in rows], vocab_size=1024)
    return rows, tokenizer


def _token_rows(records: list[dict], tokenizer: Any) -> list[dict]:
    from raycurate.data.tokenize import is_rejection, tokenize_record

    out = []
    for rec in records:
        row = tokenize_record(tokenizer, rec, 4096)
        if not is_rejection(row):
            out.append({**row, "response": rec["response"], "domain": rec.get("domain")})
    return out


def _offsets_variants(rng: np.random.Generator, text: str, tokenizer_offsets: np.ndarray) -> list[np.ndarray]:
    words = np.array([m.span() for m in _WORDS.finditer(text)], dtype=np.int64).reshape(-1, 2)
    chars = np.array([(i, i + 1) for i in range(len(text))], dtype=np.int64).reshape(-1, 2)[: 400]
    templ = words.copy()
    if len(templ):
        at = np.sort(rng.choice(len(templ) + 1, size=min(3, len(templ)), replace=False))
        templ = np.insert(templ, at, -1, axis=0)
    bad = words.copy()
    if len(bad) > 2:
        bad[len(bad) // 2] = bad[len(bad) // 2 - 1][::-1]  # a span going backwards
    return [tokenizer_offsets, words, chars, templ, bad]


def _scores(rng: np.random.Generator, r: int, style: int) -> np.ndarray:
    if style == 0:
        return rng.normal(size=r) * rng.exponential(size=r)
    if style == 1:
        return np.round(rng.normal(size=r) * 2) / 2
    if style == 2:
        return np.zeros(r)
    return -np.abs(rng.normal(size=r))


def closure_cases(seed: int, texts: list[tuple[str, str, np.ndarray]], per_text: int) -> Iterator[Case]:
    options = ({}, {"tau": 0.0}, {"alpha": 1.0, "eps": 0.5}, {"dp_capacity_limit": 8}, {"complete_budget": False},
               {"max_unit_tokens": 12, "min_unit_tokens": 2}, {"tau": 5.0, "alpha": 0.0})
    for t, (text, domain, tok_offsets) in enumerate(texts):
        rng = np.random.default_rng([seed, 2, t])
        variants = _offsets_variants(rng, text, tok_offsets)
        for k in range(per_text):
            offsets = variants[k % len(variants)] if k < len(variants) else variants[int(rng.integers(0, 4))]
            r = len(offsets)
            scores = _scores(rng, r, int(rng.integers(0, 4)) if k % 3 else 0)
            b_r = budgets(0, r, 0.0, float(rng.choice([0.3, 0.75, 1.0])))[1] if k % 2 else int(rng.integers(0, r + 1))
            mode = int(rng.integers(0, 3))
            if mode == 0:
                token_mask = None
            elif mode == 1:
                token_mask = top_b(scores, b_r)
            else:
                token_mask = np.zeros(r, dtype=bool)
                token_mask[rng.choice(r, size=int(rng.integers(0, b_r + 1)), replace=False)] = True
            dom = domain if k % 5 else ("sentence", None, "math", "code", "instruction")[int(rng.integers(0, 5))]
            opts = options[k % len(options)] if k >= 2 else {}

            def case(text=text, dom=dom, offsets=offsets, scores=scores, b_r=b_r, token_mask=token_mask,
                     opts=opts) -> dict[str, Any]:
                return _fields(project_response(text, dom, offsets, scores, b_r, token_mask=token_mask, **opts))

            yield case


def _routing(rng: np.random.Generator, row: dict) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    n, p = len(row["input_ids"]), int(row["prompt_len"])
    r_all = n - p
    attn = rng.dirichlet(np.full(n, 0.3), size=r_all)  # (r_all, n)
    a_p = attn[:, :p].astype(np.float32)
    c = np.array([attn[j, p : p + j].sum() for j in range(r_all)], dtype=np.float32)
    utilities = np.zeros(n, dtype=np.float32)
    utilities[p:] = (rng.normal(size=r_all) * rng.exponential(size=r_all)).astype(np.float32)
    return utilities, a_p, c, rng.normal(size=n)


def bridge_cases(seed: int, rows: list[dict], per_row: int, group: int) -> Iterator[Case]:
    variants = (SelectionSettings(), SelectionSettings(first_tokens=8), SelectionSettings(closure=False),
                SelectionSettings(rho_p=0.3, rho_r=0.3, rounds=2), SelectionSettings(fold_fixed_response=True),
                SelectionSettings(schedule="independent", first_tokens=3), SelectionSettings(closure_tau=0.0,
                                                                                             closure_alpha=1.0),
                SelectionSettings(rho_r=1.0, max_unit_tokens=16, min_unit_tokens=2))
    for i, row in enumerate(rows):
        rng = np.random.default_rng([seed, 3, i])
        routing = _routing(rng, row)
        for k in range(per_row):
            settings = variants[(i + k) % len(variants)]
            knock = routing[3] if k == 1 else None

            def case(row=row, routing=routing, settings=settings, knock=knock) -> dict[str, Any]:
                return select_example(*routing[:3], row, settings, prompt_scores=knock)

            yield case
    for g in range(0, len(rows) - group + 1, group):
        chunk = rows[g : g + group]
        rng = np.random.default_rng([seed, 4, g])
        scores = [np.round(rng.normal(size=_eligible_r(row)) * 4) / 4 for row in chunk]
        for settings in (SelectionSettings(budget="corpus"), SelectionSettings(budget="corpus", row_floor=0.25,
                                                                                first_tokens=5),
                         SelectionSettings(budget="corpus", rho_r=0.3, closure=False)):

            def case(chunk=chunk, scores=scores, settings=settings) -> dict[str, Any]:
                return {"rows": corpus_response_masks(chunk, scores, settings)}

            yield case


def _eligible_r(row: dict) -> int:
    from raycurate.algorithms.bridge.rows import fixed_masks
    from raycurate.algorithms.bridge.selection import eligible_positions

    n, p = len(row["input_ids"]), int(row["prompt_len"])
    fp, fr = fixed_masks(p, n, row["prompt_offsets"], row["response_offsets"])
    return len(eligible_positions(n, p, bool(fp[0]), fp, fr)[1])


def all_cases(seed: int = 0) -> list[tuple[str, Case]]:
    """The reference set: (name, case) pairs; each case returns a dict of output fields."""
    from raycurate.algorithms.bridge.alignment import spans_from_flat

    cases: list[tuple[str, Case]] = [(f"select/{k}", c) for k, c in enumerate(select_cases(seed, 5000))]
    rows, tokenizer = _corpus(seed, 400)
    token_rows = _token_rows(rows, tokenizer)
    rng = np.random.default_rng([seed, 5])
    texts = []
    for row in token_rows:
        offsets = spans_from_flat(row["response_offsets"])[:-1]
        texts.append((row["response"], row["domain"], offsets))
    for _ in range(60):  # bench-sized math responses (bench_selection.py), tokenizer offsets
        inst = make_instance(rng)
        row = _token_rows([{"id": "b", "prompt": "Solve.", "response": inst.response, "domain": "math"}],
                          tokenizer)[0]
        texts.append((inst.response, "math", spans_from_flat(row["response_offsets"])[:-1]))
        texts.append((inst.response, "math", inst.offsets))
    cases += [(f"closure/{k}", c) for k, c in enumerate(closure_cases(seed, texts, 12))]
    cases += [(f"bridge/{k}", c) for k, c in enumerate(bridge_cases(seed, token_rows[:300], 4, 20))]
    return cases


def run_cases(cases: list[tuple[str, Case]]) -> dict[str, dict[str, str]]:
    out = {}
    for name, case in cases:
        try:
            fields = case()
            out[name] = {k: digest(v) for k, v in fields.items()}
        except Exception as err:  # noqa: BLE001 (the error itself is part of the reference)
            out[name] = {"error": f"{type(err).__name__}: {err}"}
    return out


def compare(ref: dict[str, dict[str, str]], got: dict[str, dict[str, str]], limit: int = 10) -> list[str]:
    diffs = []
    for name in ref.keys() | got.keys():
        a, b = ref.get(name), got.get(name)
        if a != b:
            fields = sorted(k for k in (a or {}).keys() | (b or {}).keys() if (a or {}).get(k) != (b or {}).get(k))
            diffs.append(f"{name}: {', '.join(fields)}")
    return sorted(diffs)[:limit] + ([f"... {len(diffs) - limit} more"] if len(diffs) > limit else [])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--write", type=Path)
    group.add_argument("--check", type=Path)
    group.add_argument("--paths", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    t0 = time.perf_counter()
    cases = all_cases(args.seed)
    if args.paths:
        from raycurate.algorithms.bridge import kernels

        with kernels.enabled(False):
            ref = run_cases(cases)
        with kernels.enabled(True):
            got = run_cases(cases)
    elif args.write:
        got = run_cases(cases)
        args.write.write_text(json.dumps(got, sort_keys=True))
        ref = got
    else:
        ref = json.loads(args.check.read_text())
        got = run_cases(cases)
    diffs = compare(ref, got)
    for line in diffs:
        print(line)
    errors = sum("error" in v for v in got.values())
    print(f"seconds={time.perf_counter() - t0:.1f} errors_in_reference={errors}")
    print(f"reference_cases={len(got)} mismatches={len(compare(ref, got, limit=10**9))}")
    if diffs:
        sys.exit(1)


if __name__ == "__main__":
    main()
