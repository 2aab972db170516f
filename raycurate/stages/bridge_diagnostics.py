"""BRIDGE fidelity diagnostics stage (paper §5.4, App. F): exact leave-one-out reference vs the surrogates."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from raycurate.config.bridge import BridgeConfig
from raycurate.rundir import RunDir
from raycurate.stages.base import StageOutput, output_path, run_stage
from raycurate.stages.runtime import run_as_task


def _jsonable(value: Any) -> Any:
    if hasattr(value, "tolist"):
        return value.tolist()
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    return value


def run_diagnostics(model_dir: str, direction_path: str, selection_dir: str, *, rows: int, seed: int,
                    rho_p: float, rho_r: float, rounds: int, routing_layer: int | None,
                    count_fixed_response: bool) -> dict:
    """Fidelity table (paper Table 3, routing proxies and the knock-out derivative) and ranking-shift curves
    (Fig. 2b: random nested subsets, and Top-b for comparison) on a seeded sample of selected rows.

    Runs inside a Ray task; returns JSON-able results.
    """
    import numpy as np
    import torch
    from safetensors.torch import load_file

    from raycurate.algorithms.bridge.fidelity import example_fidelity, fidelity_table, mean_ranking_shift, ranking_shift
    from raycurate.algorithms.bridge.rows import fixed_masks
    from raycurate.algorithms.bridge.selection import eligible_positions
    from raycurate.models.loading import best_device, load_model
    from raycurate.stages.bridge import read_token_rows

    torch.set_num_threads(max(1, torch.get_num_threads()))
    device = best_device()
    model = load_model(model_dir, dtype="float32", device=device).eval()
    direction = {k: v.to(device) for k, v in load_file(direction_path).items()}
    table = read_token_rows(Path(selection_dir), ["id", "input_ids", "prompt_len", "prompt_offsets",
                                                  "response_offsets"])
    order = np.random.default_rng(seed).permutation(len(table))[:rows]
    examples, curves, top_curves = [], [], []
    for index in sorted(order.tolist()):
        row = table[index]
        n, p = len(row["input_ids"]), int(row["prompt_len"])
        fixed_p, fixed_r = fixed_masks(p, n, row["prompt_offsets"], row["response_offsets"])
        prompt_idx, response_idx = eligible_positions(n, p, bool(fixed_p[0]), fixed_p, fixed_r)
        if len(prompt_idx) == 0 or len(response_idx) == 0:
            continue
        input_ids = torch.as_tensor(row["input_ids"], device=device)
        example = example_fidelity(model, input_ids, p, prompt_idx, response_idx, direction, layer=routing_layer,
                                   rho_p=rho_p, rho_r=rho_r, rounds=rounds, count_fixed_response=count_fixed_response)
        examples.append(example)
        # Fig. 2b: progressively smaller random nested opposite-side subsets, seeded per (seed, row index)
        curves.append(ranking_shift(example.beta, example.gamma, example.prompt_bias, subset="random",
                                    seed=np.random.SeedSequence([seed, index])))
        top_curves.append(ranking_shift(example.beta, example.gamma, example.prompt_bias, subset="top"))
    if not examples:
        raise ValueError("no example in the diagnostics sample has eligible prompt and response tokens")
    table = fidelity_table(examples)
    return {"examples": len(examples), "table": _jsonable(table),
            "response_side_note": response_side_note(table),
            "ranking_shift": _jsonable(mean_ranking_shift(curves)),
            "ranking_shift_top": _jsonable(mean_ranking_shift(top_curves))}


def response_side_note(table: list[dict]) -> dict:
    """The response-side fidelity of the surrogate next to routing alone ("Attention", a_j set to 1) and the
    prompt side of both prompt proxies: the response side is carried by the utility a_j, not by the routing."""
    def spearman(side: str, proxy: str) -> float | None:
        rows = [r for r in table if r["side"] == side and r["proxy"] == proxy]
        return rows[0]["spearman"] if rows else None

    with_a, alone = spearman("response", "attention_x_a"), spearman("response", "attention")
    text = None
    if with_a is not None and alone is not None:
        text = (f"response-side Spearman {with_a:.2f} (Attention x a) is driven by the utility a_j itself: "
                f"Attention alone gives {alone:.2f}")
    return {"response_attention_x_a": with_a, "response_attention_alone": alone,
            "prompt_routing": spearman("prompt", "attention_x_a"),
            "prompt_knockout_grad": spearman("prompt", "knockout_grad"), "text": text}


def diagnostics_stage(run: RunDir, *, selection_stage: str, warmup_stage: str, direction_stage_name: str,
                      bridge_cfg: BridgeConfig, force: bool = False) -> dict:
    """Writes ``bridge_diagnostics/fidelity.json`` (Table 3 rows, the response-side note, the Fig. 2b curves)."""
    model_dir = output_path(run, warmup_stage, "model")
    direction = output_path(run, direction_stage_name, "direction")
    selection = output_path(run, selection_stage, "selection")

    def body(out: Path) -> StageOutput:
        result = run_as_task(
            run_diagnostics, str(model_dir), str(direction), str(selection), rows=bridge_cfg.diagnostics_rows,
            seed=bridge_cfg.seed,
            rho_p=bridge_cfg.rho_p, rho_r=bridge_cfg.rho_r, rounds=bridge_cfg.rounds,
            routing_layer=bridge_cfg.routing_layer, count_fixed_response=bridge_cfg.fold_fixed_response,
        )
        (out / "fidelity.json").write_text(json.dumps(result, indent=2))
        summary = {f"{r['side']}_{r['proxy']}_{k}": r[k] for r in result["table"]
                   for k in ("spearman", "top_b_overlap", "jaccard", "normalized_regret")}
        for name in ("ranking_shift", "ranking_shift_top"):
            curve = result[name]
            summary.update({f"{name}_prompt_{rho:g}": v for rho, v in zip(curve["retention"], curve["prompt_shift"])})
        return StageOutput(outputs={"fidelity": "fidelity.json"}, metrics={"examples": result["examples"], **summary})

    config = {k: getattr(bridge_cfg, k) for k in ("diagnostics_rows", "seed", "rho_p", "rho_r", "rounds",
                                                    "routing_layer", "fold_fixed_response")}
    config["diagnostics_version"] = 2  # knock-out proxy, nested random ranking shift, response-side note
    return run_stage(run, "bridge_diagnostics", body, config=config,
                     upstream=[selection_stage, warmup_stage, direction_stage_name], force=force)
