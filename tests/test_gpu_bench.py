"""benchmarks/gpu_bench.py: the CPU smoke run (all four parts, tiny shapes) and, on a CUDA machine, the real run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PARTS = {
    "token_utility": ("forward_s", "utility_s", "utility_over_forward", "utility_tokens_per_s"),
    "head_scoring": ("seconds", "heads_per_s", "heads"),
    "bds_step": ("lora_step_s", "bds_step_s", "bds_over_lora"),
    "generation": ("seconds", "tokens_per_s", "generated_tokens"),
}


def run_bench(out: Path, *args: str, timeout: int) -> dict:
    """Run the benchmark in a subprocess from the repository root; return its JSON."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run([sys.executable, "benchmarks/gpu_bench.py", "--out", str(out), *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1].startswith("gpu_bench mode="), proc.stdout[-2000:]
    return json.loads((out / "gpu_bench.json").read_text())


def check(result: dict) -> None:
    assert result["errors"] == []
    assert result["ray_imported"] is False
    assert result["imported"] == {"ray": False, "deepspeed": False, "vllm": False}
    for part, keys in PARTS.items():
        entry = result[part]
        assert "error" not in entry, entry.get("traceback")
        for key in keys:
            assert isinstance(entry[key], (int, float)) and entry[key] > 0, (part, key, entry[key])
    assert result["token_utility"]["utilities_finite"] and result["head_scoring"]["scores_finite"]
    assert result["bds_step"]["omega_finite"]


def test_smoke_runs_all_parts_without_ray(tmp_path):
    result = run_bench(tmp_path, "--smoke", timeout=600)
    assert result["mode"] == "smoke" and result["env"]["device"] == "cpu"
    check(result)


@pytest.mark.gpu
def test_full_benchmark_on_gpu(tmp_path):
    result = run_bench(tmp_path, "--device", "cuda", timeout=600)
    assert result["mode"] == "full" and result["dtype"] == "bfloat16"
    check(result)
    assert result["wall_s"] < 480
