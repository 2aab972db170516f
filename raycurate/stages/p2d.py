"""P2D stages (docs/p2d.md): proxy sample, head scoring (Ray task), ICL probing (Ray Data actors), example selection,
data baselines (random, IFD) and the AER table.

The proxy fine-tuning and the sparse head adaptation reuse :func:`raycurate.stages.model_stages.train_stage` (the
latter with a ``head_delta`` adapter spec built from ``heads.json``).
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

from raycurate.config.p2d import P2DConfig
from raycurate.config.pool import ActorPoolConfig
from raycurate.rundir import RunDir
from raycurate.stages.base import StageOutput, output_path, require_columns, run_stage
from raycurate.stages.bridge import read_token_rows
from raycurate.stages.executor import dataset_from_rows, map_model_over_rows, resolve_pool
from raycurate.stages.rows import clean_labels, corruption_kinds, precision, score_separation, seeded_sample, token_ids
from raycurate.stages.runtime import run_as_task

if TYPE_CHECKING:
    from raycurate.algorithms.p2d.head_scoring import Method

log = logging.getLogger("raycurate")

HEADS_FILE = "heads.json"


# --------------------------------------------------------------------------------------------- head scoring


def score_heads_task(base_dir: str, proxy_dir: str, out_path: str, *, ratio: float, tau: float, method: Method,
                     include_o: bool) -> dict:
    """Head sensitivity between the base and proxy weights, layer by layer; writes ``heads.json``.

    Returns:
        Summary: number of heads, selected heads, score range.
    """
    import torch

    from raycurate.algorithms.p2d.head_scoring import heads_table, score_heads, select_heads
    from raycurate.models.heads import layer_head_vectors
    from raycurate.models.loading import head_geometry

    config = _load_config(base_dir)
    scores = []
    with _weights(base_dir) as base, _weights(proxy_dir) as proxy:
        for layer in range(head_geometry(config)["n_layers"]):
            b = layer_head_vectors(base, config, layer, include_o=include_o)  # (H, D)
            p = layer_head_vectors(proxy, config, layer, include_o=include_o)
            scores.append(score_heads(b, p, method=method, tau=tau))  # (H,)
    score = torch.stack(scores)  # (L, H)
    selected = select_heads(score, ratio)
    heads = heads_table(score, selected)
    Path(out_path).write_text(json.dumps({"method": method, "tau": tau, "ratio": ratio, "include_o": include_o,
                                          "n_layers": score.shape[0], "n_heads": score.shape[1],
                                          "heads": heads}, indent=1))
    chosen = [[h["layer"], h["head"]] for h in heads if h["selected"]]
    return {"heads": len(heads), "selected": len(chosen), "selected_heads": chosen,
            "score_max": float(score.max()), "score_min": float(score.min())}


def _load_config(model_dir: str) -> Any:
    from transformers import AutoConfig

    from raycurate.models.loading import config_dir

    return AutoConfig.from_pretrained(config_dir(model_dir), local_files_only=True, trust_remote_code=False)


class _weights:
    """Context manager: the model's safetensors weights as a lazy ``name -> tensor`` mapping (one file or sharded);
    an adapter-only folder (a LoRA proxy) is merged onto its base in memory instead."""

    def __init__(self, model_dir: str) -> None:
        from raycurate.models.loading import adapter_base

        self.model_dir = model_dir
        self.merged = adapter_base(model_dir) is not None
        self.files = sorted(Path(model_dir).glob("*.safetensors"))
        if not self.files and not self.merged:
            raise FileNotFoundError(f"no *.safetensors in {model_dir}; save the model with safetensors")

    def __enter__(self) -> _weights:
        if self.merged:
            from raycurate.models.loading import load_model

            self.index: dict[str, Any] = load_model(self.model_dir, dtype="float32").state_dict()
            return self
        from safetensors import safe_open

        self.handles = [safe_open(str(f), framework="pt") for f in self.files]
        self.index = {name: h for h in self.handles for name in h.keys()}
        return self

    def __exit__(self, *exc: Any) -> None:
        self.handles, self.index = [], {}

    def __getitem__(self, name: str) -> Any:
        if name not in self.index:
            raise KeyError(f"{name} not found in the checkpoint's safetensors files ({len(self.index)} tensors)")
        value = self.index[name]  # a merged tensor, or the safetensors handle holding it
        return value if self.merged else value.get_tensor(name).float()

    def __contains__(self, name: str) -> bool:
        return name in self.index

    def keys(self) -> Any:
        return self.index.keys()


def heads_stage(run: RunDir, stage: str, *, base_stage: str, proxy_stage: str | None, task_model: str | None,
                p2d_cfg: P2DConfig, force: bool = False) -> dict:
    """Score every query head between the base model and the proxy (or a user task model); writes heads.json."""
    base_dir = output_path(run, base_stage, "model")
    if task_model:
        proxy_dir = Path(task_model)
    elif proxy_stage is not None:
        proxy_dir = output_path(run, proxy_stage, "model")
    else:
        raise ValueError("heads_stage needs a proxy_stage (the proxy fine-tune) or a task_model to compare with")
    if task_model and not proxy_dir.is_dir():
        raise FileNotFoundError(f"p2d.task_model={task_model} is not a directory; pass a local HF checkpoint")

    def body(out: Path) -> StageOutput:
        info = run_as_task(score_heads_task, str(base_dir), str(proxy_dir), str(out / HEADS_FILE),
                           ratio=p2d_cfg.head_ratio, tau=p2d_cfg.head_tau, method=p2d_cfg.head_scorer,
                           include_o=p2d_cfg.include_o)
        return StageOutput(outputs={"heads": HEADS_FILE}, metrics=info)

    config = {k: getattr(p2d_cfg, k) for k in ("head_ratio", "head_tau", "head_scorer", "include_o", "task_model")}
    upstream = [base_stage] + ([proxy_stage] if proxy_stage and not task_model else [])
    return run_stage(run, stage, body, config=config, upstream=upstream, force=force)


def selected_heads(run: RunDir, heads_stage_name: str) -> list[list[int]]:
    """``[[layer, head], ...]`` selected by a heads stage."""
    data = json.loads(output_path(run, heads_stage_name, "heads").read_text())
    return [[h["layer"], h["head"]] for h in data["heads"] if h["selected"]]


def random_heads(run: RunDir, heads_stage_name: str, seed: int) -> list[list[int]]:
    """As many heads as the heads stage selected, drawn uniformly with ``default_rng(seed)`` (random-heads baseline)."""
    import numpy as np

    data = json.loads(output_path(run, heads_stage_name, "heads").read_text())
    n_layers, n_heads = data["n_layers"], data["n_heads"]
    k = sum(h["selected"] for h in data["heads"])
    flat = np.random.default_rng(seed).choice(n_layers * n_heads, size=k, replace=False)
    return sorted([int(i) // n_heads, int(i) % n_heads] for i in flat)


# --------------------------------------------------------------------------------------------- ICL probing


def probe_plan(ids: list[str], p2d_cfg: P2DConfig, query_ids: list[str] | None = None) -> list[dict]:
    """The ICL prompts of the iterative randomised probing: ``{prompt_id, demos: [id], queries: [id]}``.

    Args:
        ids: The pool (every id a counted demonstration ``p2d.rounds`` times).
        query_ids: The trusted rows the queries are drawn from; None: from the pool (the paper's protocol).
    """
    from raycurate.algorithms.p2d.icl_probe import icl_rounds

    prompts = icl_rounds(len(ids), p2d_cfg.rounds, demos_per_prompt=p2d_cfg.demos,
                         queries_per_prompt=p2d_cfg.queries, seed=p2d_cfg.seed,
                         query_examples=None if query_ids is None else len(query_ids))
    queries = ids if query_ids is None else query_ids
    return [{"prompt_id": k, "demos": [ids[i] for i in p.demos], "queries": [queries[i] for i in p.queries],
             "counted": [bool(c) for c in _counted(p)]} for k, p in enumerate(prompts)]


def _counted(prompt: Any) -> list[bool]:
    """Which demonstrations of a prompt count as appearances (round fillers do not)."""
    counted = list(prompt.counted)
    return counted if counted else [True] * len(prompt.demos)


def probe_prompt(layout: Any, instruction: list[int], demo_rows: list[dict], query_rows: list[dict]) -> tuple[
        dict, list[tuple[list[int], list[int]]]]:
    """One ICL probe prompt from token rows: the instruction segment, the demonstrations, the queries with their
    teacher-forced gold answers, rows joined by the template's row separator.

    Args:
        layout: The tokenizer's :class:`raycurate.data.chat_layout.ChatLayout`.
        instruction: Opening segment, :func:`raycurate.data.chat_layout.instruction_ids` (lead included).
        demo_rows: Token rows (``input_ids``, ``prompt_len``) shown as demonstrations, prompt and response.
        query_rows: Token rows whose prompt is a query and whose response is its gold answer.

    Returns:
        ``(assembled, queries)``: :func:`raycurate.algorithms.p2d.icl_probe.assemble_prompt`'s dict, and per query its
        ``(prompt ids, answer ids)`` without the sequence lead.
    """
    from raycurate.algorithms.p2d.icl_probe import assemble_prompt
    from raycurate.data.chat_layout import split_row

    demos = [sum(split_row(r, layout), []) for r in demo_rows]
    queries = [split_row(r, layout) for r in query_rows]
    assembled = assemble_prompt(instruction, demos, [q for q, _ in queries], [a for _, a in queries],
                                separator=layout.separator)
    return assembled, queries


class IclProbeUDF:
    """Ray Data actor: for each ICL prompt, the query score s^(k) and the selected heads' attention weights w^(k)."""

    REQUIRED_COLUMNS = ("prompt_id", "demos", "queries")

    def __init__(self, model_dir: str, tokens_dir: str, heads: list[list[int]], instruction: str, query_score: str,
                 max_prompt_tokens: int, max_new_tokens: int, threads: int, stage: str = "p2d_probe",
                 query_tokens_dir: str | None = None):
        import torch

        from raycurate.models.loading import (
            best_device,
            enable_attention_outputs,
            head_geometry,
            load_model,
            load_tokenizer,
        )

        torch.set_num_threads(max(1, threads))
        self.device = best_device()
        if self.device == "cpu":
            torch.set_flush_denormal(True)  # denormal arithmetic slows CPU forwards several-fold
        self.model = load_model(model_dir, dtype="float32", device=self.device).eval()
        self.tokenizer = load_tokenizer(model_dir)
        geometry = head_geometry(self.model.config)
        self.selected = torch.zeros(geometry["n_layers"], geometry["n_heads"], dtype=torch.bool)
        for layer, head in heads:
            self.selected[layer, head] = True
        self.layers = sorted({layer for layer, _ in heads})
        enable_attention_outputs(self.model, self.layers)
        from raycurate.data.chat_layout import chat_layout, instruction_ids

        columns = ["id", "input_ids", "prompt_len", "response"]
        rows = read_token_rows(Path(tokens_dir), columns)
        if query_tokens_dir is not None:  # trusted ids never repeat a pool id (ingest rejects overlaps)
            rows += read_token_rows(Path(query_tokens_dir), columns)
        self.rows = {r["id"]: r for r in rows}
        self.layout = chat_layout(self.tokenizer)
        self.instruction = instruction_ids(self.tokenizer, self.layout, instruction)
        self.query_score, self.max_prompt_tokens, self.max_new_tokens = query_score, max_prompt_tokens, max_new_tokens
        self.stage = stage

    def __call__(self, batch: Any) -> Any:
        import pyarrow as pa

        require_columns(self.stage, batch, self.REQUIRED_COLUMNS)
        results = [self.probe(prompt) for prompt in batch.to_pylist()]
        out = batch
        for name, kind in (("demo_weights", pa.list_(pa.float64())), ("query_scores", pa.list_(pa.float64())),
                           ("score", pa.float64()), ("tokens", pa.int32())):
            out = out.append_column(name, pa.array([r[name] for r in results], type=kind))
        return out

    def probe(self, prompt: dict) -> dict:
        """One ICL prompt: assemble, one forward with attention on the selected layers, score the queries."""
        import torch

        from raycurate.algorithms.p2d.icl_probe import demo_attention_weights

        assembled, queries = probe_prompt(self.layout, self.instruction, [self.rows[i] for i in prompt["demos"]],
                                          [self.rows[i] for i in prompt["queries"]])
        ids = assembled["input_ids"]
        if len(ids) > self.max_prompt_tokens:
            raise ValueError(f"ICL prompt {prompt['prompt_id']} has {len(ids)} tokens > p2d.max_prompt_tokens="
                             f"{self.max_prompt_tokens}; lower p2d.demos / p2d.queries or raise the limit")
        input_ids = torch.tensor([ids], device=self.device)
        with torch.no_grad():
            out = self.model(input_ids=input_ids, output_attentions=True)
        attn = {layer: out.attentions[layer][0].float().cpu() for layer in self.layers}  # (H, T, T)
        start, end = assembled["query_block"]
        weights = demo_attention_weights(attn, self.selected, slice(start, end), assembled["demo_spans"])
        scores = self._query_scores(out.logits[0].float(), assembled, queries)
        return {"demo_weights": [float(w) for w in weights], "query_scores": scores,
                "score": float(sum(scores) / len(scores)), "tokens": len(ids)}

    def _query_scores(self, logits: Any, assembled: dict, queries: list[tuple[list[int], list[int]]]) -> list[float]:
        import torch

        from raycurate.algorithms.p2d.icl_probe import answer_token_logprobs, gold_loglik_score

        if self.query_score == "loglik":
            ids = torch.tensor(assembled["input_ids"])
            # geometric-mean token probability of each gold answer, in (0, 1]
            return [gold_loglik_score(answer_token_logprobs(logits, ids, span)) for span in assembled["answer_spans"]]
        return self._generated_scores(assembled, queries)

    def _generated_scores(self, assembled: dict, queries: list[tuple[list[int], list[int]]]) -> list[float]:
        from raycurate.algorithms.p2d.icl_probe import rouge_l_f1
        from raycurate.data.answers import answers_match, extract_final_answer
        from raycurate.models.generation import generate_greedy
        from raycurate.stages.model_stages import stop_token_ids

        demo_end = assembled["query_block"][0]
        prefix = assembled["input_ids"][:demo_end]
        prompts = [prefix + q for q, _ in queries]
        self.model.set_attn_implementation("sdpa")
        try:
            generated = generate_greedy(self.model, prompts, max_new_tokens=self.max_new_tokens,
                                        pad_id=self.tokenizer.pad_token_id or 0,
                                        eos_ids=stop_token_ids(self.tokenizer))
        finally:
            from raycurate.models.loading import enable_attention_outputs

            enable_attention_outputs(self.model, self.layers)
        scores = []
        for gen, (_, gold) in zip(generated, queries):
            if self.query_score == "rouge_l":
                scores.append(float(rouge_l_f1(gen, gold)))
            else:
                pred = extract_final_answer(self.tokenizer.decode(gen, skip_special_tokens=True))
                ref = extract_final_answer(self.tokenizer.decode(gold, skip_special_tokens=True))
                scores.append(float(pred is not None and ref is not None and answers_match(pred, ref)))
        return scores


def probe_stage(run: RunDir, stage: str, *, pool_stage: str, base_stage: str, heads_stage_name: str,
                p2d_cfg: P2DConfig, pool_cfg: ActorPoolConfig, max_new_tokens: int = 96,
                query_stage: str | None = None, force: bool = False) -> dict:
    """ICL probing over the pool on a Ray Data actor pool; writes ``probes/*.parquet`` (one row per prompt).

    Args:
        query_stage: The trusted set's token table, whose rows are the queries (with their gold answers); None:
            queries from the pool, as the paper.
    """
    import ray.data

    tokens = output_path(run, pool_stage, "tokens")
    model_dir = output_path(run, base_stage, "model")
    query_tokens = output_path(run, query_stage, "tokens") if query_stage else None

    def body(out: Path) -> StageOutput:
        from raycurate.models.loading import is_small_checkpoint

        query_ids = token_ids(run, query_stage) if query_stage else None
        plan = probe_plan(token_ids(run, pool_stage), p2d_cfg, query_ids)
        pool = resolve_pool(pool_cfg)
        kwargs = {
            "model_dir": str(model_dir), "tokens_dir": str(tokens), "heads": selected_heads(run, heads_stage_name),
            "instruction": p2d_cfg.instruction, "query_score": p2d_cfg.query_score,
            "max_prompt_tokens": p2d_cfg.max_prompt_tokens, "max_new_tokens": max_new_tokens,
            "threads": max(1, int(round(pool.num_cpus))), "stage": stage,
            "query_tokens_dir": None if query_tokens is None else str(query_tokens),
        }
        if is_small_checkpoint(str(model_dir)):  # warm in-memory tasks: a Ray Data pool's start-up is most of it
            write_probes(map_model_over_rows(plan, IclProbeUDF, kwargs, pool, warm=True, progress=False),
                         out / "probes")
        else:
            ray.data.DataContext.get_current().execution_options.preserve_order = True
            ds = map_model_over_rows(dataset_from_rows(plan, pool.batch_size), IclProbeUDF, kwargs, pool)
            ds.write_parquet(str(out / "probes"))
        rows = read_token_rows(out / "probes", ["tokens", "score"])
        used = {q for prompt in plan for q in prompt["queries"]}
        return StageOutput(outputs={"probes": "probes"}, metrics={
            "prompts": len(plan), "mean_prompt_tokens": sum(r["tokens"] for r in rows) / max(len(rows), 1),
            "mean_query_score": sum(r["score"] for r in rows) / max(len(rows), 1),
            "query_source": query_stage or pool_stage, "trusted_rows": len(used) if query_stage else 0})

    config = {k: getattr(p2d_cfg, k) for k in ("rounds", "demos", "queries", "query_score", "instruction",
                                                "max_prompt_tokens", "seed")}
    if p2d_cfg.query_score != "loglik":
        config["max_new_tokens"] = max_new_tokens  # generated query scores depend on the budget
    upstream = [pool_stage, base_stage, heads_stage_name] + ([query_stage] if query_stage else [])
    return run_stage(run, stage, body, config=config, upstream=upstream, force=force)


def write_probes(probes: Any, folder: Path) -> None:
    """The probe table of warm tasks as ``folder/probes.parquet``, in prompt order (as the Ray Data path's)."""
    import pyarrow.parquet as pq

    folder.mkdir(parents=True, exist_ok=True)
    pq.write_table(probes.sort_by("prompt_id"), folder / "probes.parquet")


# --------------------------------------------------------------------------------------------- selection


def example_scores(ids: list[str], probes: list[dict], query_baseline: str = "none") -> Any:
    """s_final per pool example (order of ``ids``): mean over its demonstration appearances of s^(k) w^(k), with
    s^(k) centred per query under ``query_baseline: query_mean``."""
    from raycurate.algorithms.p2d.icl_probe import aggregate_example_scores, query_centred_scores

    index = {example_id: i for i, example_id in enumerate(ids)}
    prompt_scores = [p["score"] for p in probes]
    if query_baseline == "query_mean":
        prompt_scores = query_centred_scores([p["queries"] for p in probes],
                                             [p["query_scores"] for p in probes]).tolist()
    appearances = [(index[d], s, w) for p, s in zip(probes, prompt_scores)
                   for d, w, counted in zip(p["demos"], p["demo_weights"], p["counted"]) if counted]
    return aggregate_example_scores(appearances, len(ids))


def selection_rows(ids: list[str], scores: Any, chosen: set[str], labels: dict[str, Any]) -> list[dict]:
    """One row per pool example with its score, rank, decision and the reason for it."""
    import numpy as np

    order = np.argsort(-np.asarray(scores, dtype=np.float64), kind="stable")
    rank = np.empty(len(ids), dtype=np.int64)
    rank[order] = np.arange(1, len(ids) + 1)
    cut = len(chosen)
    rows = []
    for i, example_id in enumerate(ids):
        selected = example_id in chosen
        reason = (f"selected: rank {rank[i]} of {len(ids)} within the top {cut}" if selected else
                  f"not selected: rank {rank[i]} of {len(ids)} is below the top {cut} (s_final={scores[i]:.4g})")
        rows.append({"id": example_id, "s_final": float(scores[i]), "rank": int(rank[i]), "selected": selected,
                     "reason": reason, "clean": labels.get(example_id)})
    return rows


def select_stage(run: RunDir, stage: str, *, pool_stage: str, probe_stage_name: str, p2d_cfg: P2DConfig,
                 force: bool = False) -> dict:
    """Top rho_D of the pool by s_final; writes ``selection.parquet`` (every pool row with its reason).  With
    labels, the metrics hold the precision of the selection, of the random_data sample and of the pool, and the
    AUROC of s_final (clean vs corrupted, per kind, with bootstrap intervals)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from raycurate.algorithms.p2d.icl_probe import select_top

    def body(out: Path) -> StageOutput:
        ids = token_ids(run, pool_stage)
        probes = read_token_rows(output_path(run, probe_stage_name, "probes"))
        scores = example_scores(ids, probes, p2d_cfg.query_baseline)
        chosen = {ids[i] for i in select_top(scores, p2d_cfg.data_ratio)}
        labels = clean_labels(run, pool_stage)
        pq.write_table(pa.Table.from_pylist(selection_rows(ids, scores, chosen, labels)),
                       out / "selection.parquet")
        random = seeded_sample(ids, len(chosen), p2d_cfg.seed + 1)  # the random_data baseline's sample
        return StageOutput(outputs={"selection": "selection.parquet"}, metrics={
            "pool": len(ids), "selected": len(chosen), "precision_selected": precision(sorted(chosen), labels),
            "precision_random": precision(random, labels), "precision_pool": precision(ids, labels),
            **score_separation(ids, scores, labels, corruption_kinds(run, pool_stage), p2d_cfg.seed)})

    config: dict[str, Any] = {"data_ratio": p2d_cfg.data_ratio}
    if p2d_cfg.query_baseline != "none":  # keyed only when set, so finished runs keep their hashes
        config["query_baseline"] = p2d_cfg.query_baseline
    return run_stage(run, stage, body, config=config, upstream=[pool_stage, probe_stage_name], force=force)


def selection_scores(run: RunDir, select_stage_name: str) -> dict[str, float]:
    """``id -> s_final`` of every pool row a selection stage scored (the ranking behind its top rho_D)."""
    import pyarrow.parquet as pq

    table = pq.read_table(output_path(run, select_stage_name, "selection"), columns=["id", "s_final"])
    return {r["id"]: float(r["s_final"]) for r in table.to_pylist()}


def selected_ids(run: RunDir, select_stage_name: str) -> list[str]:
    """Ids chosen by a selection stage."""
    import pyarrow.parquet as pq

    table = pq.read_table(output_path(run, select_stage_name, "selection"), columns=["id", "selected"])
    return sorted(r["id"] for r in table.to_pylist() if r["selected"])


# --------------------------------------------------------------------------------------------- IFD baseline


class IfdUDF:
    """Ray Data actor: IFD = loss(response | instruction) / loss(response alone) under the base model.

    "Response alone" is the sequence lead (a separate BOS), the assistant header of the chat template (none without
    one) and the response: the same response tokens as the conditional row, in an assistant turn with no
    instruction (:func:`raycurate.data.chat_layout.response_alone`).
    """

    REQUIRED_COLUMNS = ("input_ids", "prompt_len")

    def __init__(self, model_dir: str, threads: int, stage: str = "p2d_ifd"):
        import torch

        from raycurate.models.loading import best_device, load_model, load_tokenizer

        torch.set_num_threads(max(1, threads))
        self.model = load_model(model_dir, dtype="float32", device=best_device()).eval()
        from raycurate.data.chat_layout import chat_layout

        tokenizer = load_tokenizer(model_dir)
        self.pad_id = tokenizer.pad_token_id or 0
        self.layout = chat_layout(tokenizer)
        self.stage = stage

    def __call__(self, batch: Any) -> Any:
        import pyarrow as pa
        import torch

        from raycurate.algorithms.ifd import ifd_scores
        from raycurate.algorithms.losses import model_example_losses, pad_rows
        from raycurate.data.chat_layout import response_alone

        require_columns(self.stage, batch, self.REQUIRED_COLUMNS)
        rows = batch.select(["input_ids", "prompt_len"]).to_pylist()
        cond = [{"input_ids": r["input_ids"], "loss_mask": [0] * r["prompt_len"] +
                 [1] * (len(r["input_ids"]) - r["prompt_len"])} for r in rows]
        # the response alone: sequence lead + assistant header + response (the same response tokens are scored)
        alone = [dict(zip(("input_ids", "loss_mask"), response_alone(self.layout, r["input_ids"][r["prompt_len"]:])))
                 for r in rows]
        losses = []
        with torch.no_grad():
            device = next(self.model.parameters()).device
            for table in (cond, alone):
                padded = {k: v.to(device) for k, v in pad_rows(table, self.pad_id).items()}
                losses.append(model_example_losses(self.model, padded["input_ids"], padded["attention_mask"],
                                                   padded["loss_mask"]).cpu())  # no logits for the prompt side
        return batch.append_column("ifd", pa.array(ifd_scores(losses[0], losses[1]).tolist(), type=pa.float64()))


def ifd_select_stage(run: RunDir, stage: str, *, pool_stage: str, base_stage: str, ratio: float,
                     pool_cfg: ActorPoolConfig, force: bool = False) -> dict:
    """IFD baseline: the top ``ratio`` of the pool by instruction-following difficulty; writes ``ifd.parquet``."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq
    import ray.data

    def body(out: Path) -> StageOutput:
        pool = resolve_pool(pool_cfg)
        ds = ray.data.read_parquet(str(output_path(run, pool_stage, "tokens"))).select_columns(
            ["id", "input_ids", "prompt_len"])
        ds = map_model_over_rows(ds, IfdUDF, {"model_dir": str(output_path(run, base_stage, "model")),
                                              "threads": max(1, int(round(pool.num_cpus))), "stage": stage}, pool)
        scores = {r["id"]: r["ifd"] for r in ds.select_columns(["id", "ifd"]).take_all()}
        ids = sorted(scores)
        k = max(1, round(ratio * len(ids)))
        values = np.asarray([scores[i] for i in ids])
        chosen = sorted(ids[i] for i in np.argsort(-values, kind="stable")[:k])
        pq.write_table(pa.table({"id": ids, "ifd": values, "selected": [i in set(chosen) for i in ids]}),
                       out / "ifd.parquet")
        labels = clean_labels(run, pool_stage)
        return StageOutput(outputs={"selection": "ifd.parquet"}, metrics={
            "selected": k, "precision_selected": precision(chosen, labels)})

    return run_stage(run, stage, body, config={"ratio": ratio}, upstream=[pool_stage, base_stage], force=force)


# --------------------------------------------------------------------------------------------- AER


def aer_table(stage_seconds: dict[str, float], *, selection_stages: list[str], adaptation_stage: str,
              full_sft_stage: str) -> dict:
    """AER = (selection time + adaptation time) / full-SFT time (paper Table 2), from stage timings in seconds."""
    missing = [s for s in [*selection_stages, adaptation_stage, full_sft_stage] if s not in stage_seconds]
    if missing:
        raise ValueError(f"AER needs the timings of stages {missing}; they have not run in this run directory")
    selection = sum(stage_seconds[s] for s in selection_stages)
    adaptation = stage_seconds[adaptation_stage]
    full = stage_seconds[full_sft_stage]
    return {"selection_seconds": selection, "adaptation_seconds": adaptation, "full_sft_seconds": full,
            "aer": (selection + adaptation) / full if full > 0 else math.inf,
            "selection_stages": selection_stages, "adaptation_stage": adaptation_stage,
            "full_sft_stage": full_sft_stage}
