"""Pipelines: short, readable sequences of stages.  ``PIPELINES`` maps a job's ``pipeline`` key to its runner."""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from raycurate.config.schema import JobConfig


def _demo(cfg: JobConfig) -> dict:
    from raycurate.pipelines.demo import run_demo

    return run_demo(cfg)


def _sft(cfg: JobConfig) -> dict:
    from raycurate.pipelines.sft import run_sft_pipeline

    return run_sft_pipeline(cfg)


def _bridge(cfg: JobConfig) -> dict:
    from raycurate.pipelines.bridge import run_bridge_pipeline

    return run_bridge_pipeline(cfg)


def _p2d(cfg: JobConfig) -> dict:
    from raycurate.pipelines.p2d import run_p2d_pipeline

    return run_p2d_pipeline(cfg)


def _bilevel(cfg: JobConfig) -> dict:
    from raycurate.pipelines.bilevel import run_bilevel_pipeline

    return run_bilevel_pipeline(cfg)


def _curate(cfg: JobConfig) -> dict:
    from raycurate.pipelines.curate import run_curate

    return run_curate(cfg)


def _proving_ground(cfg: JobConfig) -> dict:
    from raycurate.pipelines.proving_ground import run_proving_ground

    return run_proving_ground(cfg, run_pipeline)  # each seed's job goes through this registry


PIPELINES: dict[str, Callable[[JobConfig], dict]] = {
    "demo": _demo, "sft": _sft, "bridge": _bridge, "p2d": _p2d, "bilevel": _bilevel, "curate": _curate,
    "proving_ground": _proving_ground,
}


def run_pipeline(cfg: JobConfig) -> dict:
    """Run the pipeline named by ``cfg.pipeline``."""
    try:
        runner = PIPELINES[cfg.pipeline]
    except KeyError:
        raise ValueError(f"unknown pipeline {cfg.pipeline!r}; registered: {', '.join(sorted(PIPELINES))}") from None
    return runner(cfg)
