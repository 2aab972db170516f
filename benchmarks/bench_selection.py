"""Throughput of BRIDGE's per-example selection: alternating selection (T = 4) + closure projection.

Realistic sizes (paper setting, MetaMathQA-like): about 200 eligible prompt and 300 eligible response tokens per
example, attention-shaped interactions ``beta_ij = A^p_ji a_j`` with signed utilities, and a math response with
steps and a ``#### answer`` line for the closure.  numpy/BLAS/torch run on one thread, so the throughput is per
core.  Throughput counts ``p + r`` tokens per example and divides by the process CPU time of the timed loop
(wall time is printed too; they agree on an idle machine).  Usage::

    python benchmarks/bench_selection.py [--examples 3000] [--rounds 4] [--seed 0] [--compare 3]

Since issue #29 the selection and closure run compiled kernels (``raycurate.algorithms.bridge.kernels``, numba) where
numba is installed; ``--compare N`` times the numpy code and the kernels interleaved, N runs each, in this one
process, and prints each run, the medians, their ratio and the load average (a shared machine moves the absolute
numbers, the ratio much less).  The timed numbers are the kernels' (the numpy code's with ``RAYCURATE_KERNELS=0``).

Closure comes from ``raycurate.algorithms.bridge.closure.project_response`` (alignment check + structural units + the
projection, i.e. everything the stage runs per example; offsets go in as the (r, 2) array the stage passes since
2026-12-04, earlier rows passed a list of pairs, ~20 us more per example); when that module is not importable only
the selection is timed and the output says ``closure=0``.  The last line is ``tokens_per_s_per_core=<value>``.
"""

from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "NUMEXPR_NUM_THREADS"):
    os.environ[_var] = "1"

import argparse  # noqa: E402
import re  # noqa: E402
import time  # noqa: E402
from dataclasses import dataclass  # noqa: E402

import numpy as np  # noqa: E402

from raycurate.algorithms.bridge.selection import budgets, select  # noqa: E402

_TOKEN = re.compile(r"\w+|[^\w\s]")


@dataclass
class Instance:
    beta: np.ndarray  # (p, r)
    gamma: np.ndarray  # (r,)
    response: str
    offsets: np.ndarray  # (r, 2) int64 character spans, as the stage passes them (``units.spans_from_flat``)


def math_response(rng: np.random.Generator, target_tokens: int) -> tuple[str, np.ndarray]:
    """A worked solution of about ``target_tokens`` word/punctuation tokens ending with ``#### answer``."""
    lines, total, step = [], 0, 1
    while total < target_tokens - 6:
        a, b = (int(x) for x in rng.integers(2, 99, size=2))
        line = f"Step {step}: {a} + {b} = {a + b}, so she now has {a + b} apples in the basket."
        lines.append(line)
        total += len(_TOKEN.findall(line))
        step += 1
    lines.append(f"#### {int(rng.integers(1, 999))}")
    text = "\n".join(lines)
    return text, np.array([m.span() for m in _TOKEN.finditer(text)], dtype=np.int64).reshape(-1, 2)


def make_instance(rng: np.random.Generator) -> Instance:
    response, offsets = math_response(rng, int(rng.integers(270, 330)))
    p, r = int(rng.integers(180, 221)), len(offsets)
    # Attention rows over BOS + p prompt keys + the response prefix; a head-averaged softmax is roughly Dirichlet.
    attn = rng.dirichlet(np.full(p + 1 + r, 0.3), size=r)  # (r, 1 + p + r)
    a = rng.normal(size=r) * rng.exponential(size=r)  # (r,) signed token utilities
    beta = np.ascontiguousarray((attn[:, 1 : p + 1] * a[:, None]).T)  # (p, r)
    history = np.array([attn[j, p + 1 : p + 1 + j].sum() for j in range(r)])  # (r,) c_j, self excluded
    return Instance(beta=beta, gamma=a * history, response=response, offsets=offsets)


def load_closure():
    """``project_response`` from the closure module, or None when it is not importable yet."""
    try:
        from raycurate.algorithms.bridge.closure import project_response
    except ImportError as err:
        print(f"closure not importable ({err}); timing selection only")
        return None
    return project_response


def run_once(inst: Instance, rounds: int, project_response) -> int:
    p, r = inst.beta.shape
    b_p, b_r = budgets(p, r, 0.75, 0.75)
    res = select(inst.beta, inst.gamma, b_p, b_r, "alternating", rounds=rounds)
    if project_response is not None:
        out = project_response(inst.response, "math", inst.offsets, res.response_scores, b_r,
                               token_mask=res.response_mask)
        assert out.mask.sum() <= b_r
    return p + r


def timed(pool: list[Instance], n: int, rounds: int, project_response) -> tuple[int, float, float]:
    tokens = 0
    wall0, cpu0 = time.perf_counter(), time.process_time()
    for k in range(n):
        tokens += run_once(pool[k % len(pool)], rounds, project_response)
    return tokens, time.perf_counter() - wall0, time.process_time() - cpu0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=int, default=3000, help="selections timed (cycling over the pool)")
    parser.add_argument("--pool", type=int, default=128, help="distinct generated examples")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--compare", type=int, default=0, help="interleaved runs of numpy code vs kernels")
    args = parser.parse_args()
    try:
        import torch

        torch.set_num_threads(1)
    except ImportError:
        pass
    rng = np.random.default_rng(args.seed)
    pool = [make_instance(rng) for _ in range(args.pool)]
    mean_p = np.mean([i.beta.shape[0] for i in pool])
    mean_r = np.mean([i.beta.shape[1] for i in pool])
    project_response = load_closure()

    rounds_run = [select(i.beta, i.gamma, *budgets(*i.beta.shape, 0.75, 0.75), rounds=args.rounds).rounds_run
                  for i in pool]
    timed(pool, min(len(pool), args.examples), args.rounds, project_response)  # warm-up (and kernel compile)
    if args.compare:
        compare(pool, args, project_response)
    sel_tokens, sel_wall, sel_cpu = timed(pool, args.examples, args.rounds, None)
    if project_response is not None:
        tokens, wall, cpu = timed(pool, args.examples, args.rounds, project_response)
    else:
        tokens, wall, cpu = sel_tokens, sel_wall, sel_cpu
    print(f"examples={args.examples} mean_p={mean_p:.0f} mean_r={mean_r:.0f} T={args.rounds} "
          f"mean_rounds_run={np.mean(rounds_run):.2f}")
    print(f"selection: {1e6 * sel_cpu / args.examples:.0f} us/example cpu, "
          f"{sel_tokens / sel_cpu:,.0f} tokens/s cpu, {sel_tokens / sel_wall:,.0f} tokens/s wall")
    if project_response is not None:
        print(f"selection+closure: {1e6 * cpu / args.examples:.0f} us/example cpu, "
              f"{tokens / cpu:,.0f} tokens/s cpu, {tokens / wall:,.0f} tokens/s wall")
    print(f"closure={int(project_response is not None)} selection_tokens_per_s_per_core={sel_tokens / sel_cpu:.0f}")
    print(f"tokens_per_s_per_core={tokens / cpu:.0f}")


def compare(pool: list[Instance], args: argparse.Namespace, project_response) -> None:
    """Numpy code and compiled kernels, interleaved in this process: tokens/s per core of selection + closure."""
    from raycurate.algorithms.bridge import kernels

    runs: dict[bool, list[float]] = {False: [], True: []}
    load0 = os.getloadavg()
    for _ in range(args.compare):
        for on in (False, True):
            with kernels.enabled(on):
                tokens, _, cpu = timed(pool, args.examples, args.rounds, project_response)
            runs[on].append(tokens / cpu)
    load1 = os.getloadavg()
    numpy_med, kernel_med = float(np.median(runs[False])), float(np.median(runs[True]))
    print("numpy code: " + " / ".join(f"{x:,.0f}" for x in runs[False]) + " tokens/s per core")
    print("kernels:    " + " / ".join(f"{x:,.0f}" for x in runs[True]) + " tokens/s per core")
    print(f"load average before {load0[0]:.2f} {load0[1]:.2f} {load0[2]:.2f}, after {load1[0]:.2f} {load1[1]:.2f} "
          f"{load1[2]:.2f}")
    print(f"numpy_tokens_per_s_per_core={numpy_med:.0f} kernel_tokens_per_s_per_core={kernel_med:.0f} "
          f"kernel_over_numpy={kernel_med / numpy_med:.3f}")


if __name__ == "__main__":
    main()
