"""Generation actors for BMO online self-refining: G responses per masked question from the current policy.

:class:`HFGenerationActor` (CPU or GPU; PEFT adapter injected per call, sampling by
:func:`raycurate.models.sampling.sample_responses`) and :class:`VLLMGenerationActor` (GPU; one ``LoRARequest`` id
per adapter version, ``raw_logprobs``) share ``generate(requests, *, adapter_dir, n, temperature, max_new_tokens,
step, seed)`` -> rows ``{question_id, sample, response_ids, token_logprobs, logprob, finished, step, policy}``.
:class:`GenerationPool` picks the backend (:func:`resolve_backend`), splits requests over its actors and sorts
the rows; :func:`write_generations` stores them.  Log-probs at temperature 1, per-question seeds, restarts and
stateless calls: docs/bilevel.md, "Generation", "Generation actors" and "Log-probs".
"""

from __future__ import annotations

import dataclasses
import importlib.util
import logging
import os
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from raycurate.rundir import atomic_file
from raycurate.stages.runtime import actor_cpus, cluster_cpus, cluster_gpus

if TYPE_CHECKING:
    from raycurate.models.sampling import Sample

log = logging.getLogger("raycurate")

BACKENDS = ("auto", "hf", "vllm")
ADAPTER_CONFIG = "adapter_config.json"
VLLM_INSTALL_HINT = "pip install 'raycurate[gpu]'"


@dataclasses.dataclass(frozen=True)
class GenerationRequest:
    """One question to answer.

    Attributes:
        question_id: Unique id of the question (the example id); also seeds its sampler.
        prompt_ids: Prompt token ids, BOS and chat-template tokens included, ending where the response starts.
    """

    question_id: str
    prompt_ids: list[int]


def policy_kind(path: str) -> str:
    """``"adapter"`` for a PEFT adapter directory, ``"checkpoint"`` for a full HF checkpoint directory.

    Raises:
        FileNotFoundError: ``path`` is neither.
    """
    if os.path.isfile(os.path.join(path, ADAPTER_CONFIG)):
        return "adapter"
    if os.path.isfile(os.path.join(path, "config.json")):
        return "checkpoint"
    raise FileNotFoundError(
        f"policy directory {path!r} has neither {ADAPTER_CONFIG} (a PEFT LoRA adapter, written by "
        "peft's save_pretrained) nor config.json (a full HF checkpoint); pass one of those, or None for the base model"
    )


def directory_stamp(path: str) -> tuple:
    """(absolute path, (name, mtime_ns, size) of every file): changes whenever a trainer rewrites the directory."""
    root = Path(path).resolve()
    files = sorted(p for p in root.iterdir() if p.is_file())
    return str(root), tuple((p.name, p.stat().st_mtime_ns, p.stat().st_size) for p in files)


def check_requests(requests: Sequence[GenerationRequest]) -> None:
    """Reject empty prompts and duplicate question ids (a duplicate would get the same seed, hence the same samples)."""
    counts = Counter(r.question_id for r in requests)
    duplicates = sorted(qid for qid, count in counts.items() if count > 1)
    if duplicates:
        raise ValueError(f"duplicate question ids {duplicates[:5]}; each question must be requested once "
                         "(ask for more samples with n=G instead)")
    empty = [r.question_id for r in requests if not r.prompt_ids]
    if empty:
        raise ValueError(f"questions {empty[:5]} have empty prompts; every prompt needs at least one token")


def result_rows(request: GenerationRequest, samples: Sequence[Sample], *, step: int, policy: str) -> list[dict]:
    """One row per sample of a request."""
    return [
        {
            "question_id": request.question_id,
            "sample": g,
            "response_ids": list(sample.response_ids),
            "token_logprobs": list(sample.token_logprobs),
            "logprob": float(sum(sample.token_logprobs)),
            "finished": bool(sample.finished),
            "step": int(step),
            "policy": policy,
        }
        for g, sample in enumerate(samples)
    ]


def stop_and_pad_ids(model_dir: str, config: Any = None) -> tuple[list[int], int]:
    """Stop tokens (generation config EOS list, else the model config's EOS) and the pad id of a checkpoint."""
    from transformers import AutoConfig, GenerationConfig

    from raycurate.models.loading import config_dir

    model_dir = config_dir(model_dir)  # an adapter-only folder: its base's configs
    if config is None:
        config = AutoConfig.from_pretrained(model_dir, local_files_only=True, trust_remote_code=False)
    try:
        generation = GenerationConfig.from_pretrained(model_dir, local_files_only=True)
    except OSError:  # no generation_config.json
        generation = None
    eos: list[int] = []
    for source in (generation, config):
        value = getattr(source, "eos_token_id", None) if source is not None else None
        for token in [value] if isinstance(value, int) else (value or []):
            if token not in eos:
                eos.append(int(token))
    if not eos:
        raise ValueError(f"{model_dir}: neither generation_config.json nor config.json defines eos_token_id; "
                         "set it so responses can end")
    pad = getattr(generation, "pad_token_id", None) if generation is not None else None
    pad = pad if pad is not None else getattr(config, "pad_token_id", None)
    return eos, int(pad if pad is not None else eos[0])


class HFGenerationActor:
    """Hugging Face sampling actor (see the module docstring).  Plain class: wrap with ``ray.remote`` to deploy.

    Args:
        model_dir: Base model checkpoint directory (``config.json`` + weights); adapters are applied on top.
        threads: torch intra-op threads.
        seed: Default base seed of :meth:`generate`.
        dtype: ``"float32"``, ``"bfloat16"`` or ``"auto"``.
        batch_size: Prompts per forward batch.
    """

    def __init__(self, model_dir: str, *, threads: int = 1, seed: int = 0, dtype: str = "float32",
                 batch_size: int = 32):
        import torch
        from transformers.utils import logging as hf_logging

        from raycurate.models.loading import best_device, load_model

        hf_logging.disable_progress_bar()  # one "Loading weights" bar per actor (and per restart) clutters the driver
        torch.set_num_threads(max(1, int(threads)))
        self.model_dir = model_dir
        self.seed = seed
        self.dtype = dtype
        self.batch_size = batch_size
        self.device = best_device()
        self._base = load_model(model_dir, dtype=dtype, device=self.device)
        self.eos_ids, self.pad_id = stop_and_pad_ids(model_dir, self._base.config)
        self._peft: Any = None
        self._policy: Any = self._base
        self._policy_key: tuple | None = None

    def _release_policy(self) -> None:
        """Back to the bare base model: LoRA layers are removed (not merged), a loaded checkpoint is dropped."""
        if self._peft is not None:
            self._base = self._peft.unload()
            self._peft = None
        self._policy, self._policy_key = self._base, None

    def _activate(self, adapter_dir: str | None) -> Any:
        """The model to sample from for ``adapter_dir`` (reused while the directory is unchanged)."""
        kind = None if adapter_dir is None else policy_kind(adapter_dir)
        key = None if adapter_dir is None else directory_stamp(adapter_dir)
        if key == self._policy_key:
            return self._policy
        self._release_policy()
        if adapter_dir is not None:
            if kind == "adapter":
                from peft import PeftModel

                self._peft = PeftModel.from_pretrained(self._base, adapter_dir, is_trainable=False,
                                                       local_files_only=True)
                self._policy = self._peft.to(self.device).eval()
            else:
                from raycurate.models.loading import load_model

                self._policy = load_model(adapter_dir, dtype=self.dtype, device=self.device)
            self._policy_key = key
        return self._policy

    def generate(self, requests: Sequence[GenerationRequest], *, adapter_dir: str | None = None, n: int,
                 temperature: float, max_new_tokens: int, step: int, seed: int | None = None,
                 top_p: float = 1.0) -> list[dict]:
        """Sample ``n`` responses per request from the base model, ``adapter_dir`` on it, or a full checkpoint.

        Args:
            requests: Questions to answer.
            adapter_dir: ``None`` (base model), a PEFT adapter directory, or a full HF checkpoint directory.
            n: Responses per question (G).
            temperature: Sampling temperature (0 = greedy).
            max_new_tokens: Generation budget per response.
            step: Training step, recorded in the rows and part of each request's seed.
            seed: Base seed (the actor's ``seed`` when None).
            top_p: Nucleus mass.

        Returns:
            Rows in request order, ``n`` per request (see the module docstring).
        """
        import torch

        from raycurate.models.sampling import derive_seed, sample_responses

        check_requests(requests)
        if not requests:
            return []
        model = self._activate(adapter_dir)
        base_seed = self.seed if seed is None else seed
        generators = [torch.Generator().manual_seed(derive_seed(base_seed, step, r.question_id)) for r in requests]
        samples = sample_responses(
            model, [r.prompt_ids for r in requests], n=n, temperature=temperature, max_new_tokens=max_new_tokens,
            eos_ids=self.eos_ids, pad_id=self.pad_id, generator=generators, top_p=top_p, batch_size=self.batch_size,
        )
        policy = adapter_dir or self.model_dir
        return [row for r, s in zip(requests, samples) for row in result_rows(r, s, step=step, policy=policy)]


def import_vllm() -> Any:
    """The ``vllm`` module, or an ImportError that says how to install it."""
    try:
        import vllm
    except ImportError as err:
        raise ImportError(
            f"the vLLM generation backend needs vllm, which is not installed ({err}); run `{VLLM_INSTALL_HINT}` on "
            "the GPU nodes, or use generation backend 'hf'"
        ) from err
    return vllm


def vllm_completion_samples(output: Any) -> list[tuple[list[int], list[float], bool]]:
    """``(response_ids, token_logprobs, finished)`` per completion of one vLLM ``RequestOutput``, by sample index.

    Each step of ``completion.logprobs`` maps token id -> ``Logprob``; with ``logprobs=0`` it holds just the
    sampled token.  vLLM keeps the stop token in ``token_ids`` (finish reason ``"stop"``).
    """
    samples = []
    for completion in sorted(output.outputs, key=lambda c: c.index):
        ids = [int(t) for t in completion.token_ids]
        if completion.logprobs is None or len(completion.logprobs) != len(ids):
            raise RuntimeError("vLLM returned no per-token logprobs; SamplingParams(logprobs=0) must be set")
        logprobs = [float(step[tok].logprob) for step, tok in zip(completion.logprobs, ids)]
        samples.append((ids, logprobs, completion.finish_reason == "stop"))
    return samples


class VLLMGenerationActor:
    """vLLM sampling actor with LoRA adapters (GPU).  Plain class: wrap with ``ray.remote(num_gpus=1)`` to deploy.

    Args:
        model_dir: Base model checkpoint directory.
        seed: Engine seed and default base seed of :meth:`generate`.
        gpu_memory_utilization: Fraction of the GPU vLLM may take (weights + KV cache).
        max_lora_rank: Largest LoRA rank the engine accepts (>= the trainer's ``r``).
        max_loras: Adapters resident on the GPU at once (older versions are evicted, least recently used first).
        max_model_len: Context limit (None: the model's).
        dtype: vLLM dtype (``"auto"``, ``"bfloat16"``, ...).
        **engine_kwargs: Passed to ``vllm.LLM`` unchanged (e.g. ``enforce_eager=True``).
    """

    def __init__(self, model_dir: str, *, seed: int = 0, gpu_memory_utilization: float = 0.85,
                 max_lora_rank: int = 64, max_loras: int = 1, max_model_len: int | None = None, dtype: str = "auto",
                 **engine_kwargs: Any):
        vllm = import_vllm()
        self.model_dir = model_dir
        self.seed = seed
        self.eos_ids, self.pad_id = stop_and_pad_ids(model_dir)
        self._vllm = vllm
        self._lora_ids: dict[tuple, int] = {}
        try:
            self._llm = vllm.LLM(
                model=model_dir, seed=seed, dtype=dtype, enable_lora=True, max_lora_rank=max_lora_rank,
                max_loras=max_loras, gpu_memory_utilization=gpu_memory_utilization, max_model_len=max_model_len,
                logprobs_mode="raw_logprobs", **engine_kwargs,
            )
        except TypeError as err:
            if "logprobs_mode" not in str(err):
                raise
            raise ImportError(
                f"vllm {getattr(vllm, '__version__', '?')} has no logprobs_mode; BMO needs the raw (temperature-1) "
                "policy log-probs it selects, so upgrade to vllm>=0.10.2"
            ) from err

    def _lora_request(self, adapter_dir: str | None) -> Any:
        from vllm.lora.request import LoRARequest

        if adapter_dir is None:
            return None
        if policy_kind(adapter_dir) != "adapter":
            raise ValueError(
                f"{adapter_dir!r} is a full checkpoint; vLLM actors serve LoRA adapters over their base model. For "
                "full fine-tuning use generation backend 'hf', or start a new pool with model_dir set to it"
            )
        key = directory_stamp(adapter_dir)
        if key not in self._lora_ids:  # a new id per adapter version: vLLM caches adapters by id
            self._lora_ids[key] = len(self._lora_ids) + 1
        lora_id = self._lora_ids[key]
        return LoRARequest(lora_name=f"policy-{lora_id}", lora_int_id=lora_id,
                           lora_path=str(Path(adapter_dir).resolve()))

    def generate(self, requests: Sequence[GenerationRequest], *, adapter_dir: str | None = None, n: int,
                 temperature: float, max_new_tokens: int, step: int, seed: int | None = None,
                 top_p: float = 1.0) -> list[dict]:
        """Same contract as :meth:`HFGenerationActor.generate` (samples differ: another sampler and kernels)."""
        from vllm import SamplingParams

        from raycurate.models.sampling import Sample, derive_seed

        check_requests(requests)
        if not requests:
            return []
        base_seed = self.seed if seed is None else seed
        params = [
            SamplingParams(
                n=n, temperature=temperature, top_p=top_p, max_tokens=max_new_tokens, logprobs=0,
                stop_token_ids=self.eos_ids, seed=derive_seed(base_seed, step, r.question_id) & 0x7FFFFFFF,
            )
            for r in requests
        ]
        prompts = [{"prompt_token_ids": list(r.prompt_ids)} for r in requests]  # a vllm.inputs.TokensPrompt
        outputs = self._llm.generate(prompts, params, use_tqdm=False, lora_request=self._lora_request(adapter_dir))
        policy = adapter_dir or self.model_dir
        rows = []
        for request, output in zip(requests, outputs):
            samples = [Sample(*s) for s in vllm_completion_samples(output)]
            rows.extend(result_rows(request, samples, step=step, policy=policy))
        return rows


def resolve_backend(backend: str, total_gpus: float, vllm_available: bool) -> str:
    """``"hf"`` or ``"vllm"``; ``auto`` picks vLLM iff the cluster has a GPU and vllm is importable."""
    if backend not in BACKENDS:
        raise ValueError(f"generation backend {backend!r} is unknown; valid backends: {list(BACKENDS)}")
    if backend == "auto":
        return "vllm" if total_gpus >= 1 and vllm_available else "hf"
    if backend == "vllm" and total_gpus < 1:
        raise ValueError("generation backend 'vllm' needs a GPU and the Ray cluster reports none; use 'hf' or 'auto'")
    if backend == "vllm" and not vllm_available:
        raise ImportError(f"generation backend 'vllm' needs vllm; run `{VLLM_INSTALL_HINT}` or use 'hf'")
    return backend


def split_contiguous(items: Sequence[Any], parts: int) -> list[list[Any]]:
    """``items`` cut into at most ``parts`` contiguous, near-equal, non-empty chunks (in order)."""
    parts = max(1, min(parts, len(items)))
    size, extra = divmod(len(items), parts)
    chunks, start = [], 0
    for k in range(parts):
        end = start + size + (1 if k < extra else 0)
        chunks.append(list(items[start:end]))
        start = end
    return [c for c in chunks if c]


class GenerationPool:
    """A pool of generation actors (HF or vLLM) behind one ``generate`` call.  Needs an initialised Ray.

    Args:
        model_dir: Base model checkpoint directory.
        backend: ``"auto"``, ``"hf"`` or ``"vllm"`` (see :func:`resolve_backend`).
        num_actors: Actors (model copies); capped by the GPUs for vLLM.
        num_cpus_per_actor: CPUs per actor (None: sized from the cluster so one CPU stays free).
        num_gpus_per_actor: GPUs per actor (None: 1 for vLLM, 0 for HF).
        seed: Base seed of every request's sampler.
        max_restarts: Times Ray restarts a crashed actor.
        max_task_retries: Times a call on a crashed actor is retried.
        **actor_kwargs: Extra constructor arguments of the actor class (e.g. ``dtype``, ``gpu_memory_utilization``).
    """

    def __init__(self, model_dir: str, *, backend: str = "auto", num_actors: int = 1,
                 num_cpus_per_actor: float | None = None, num_gpus_per_actor: float | None = None, seed: int = 0,
                 max_restarts: int = 2, max_task_retries: int = 2, **actor_kwargs: Any):
        import ray

        if num_actors < 1:
            raise ValueError(f"num_actors={num_actors}: a generation pool needs at least one actor")
        from raycurate.models.loading import config_dir

        if not os.path.isfile(os.path.join(config_dir(model_dir), "config.json")):
            raise FileNotFoundError(f"generation model_dir {model_dir!r} has no config.json; pass a local HF "
                                    "checkpoint directory (the base model the adapters were trained on)")
        total_gpus = cluster_gpus()
        self.backend = resolve_backend(backend, total_gpus, importlib.util.find_spec("vllm") is not None)
        self.model_dir = model_dir
        self.seed = seed
        gpus = num_gpus_per_actor if num_gpus_per_actor is not None else (1.0 if self.backend == "vllm" else 0.0)
        if gpus > 0:
            num_actors = min(num_actors, max(1, int(total_gpus // gpus)))
        cpus = actor_cpus(num_cpus_per_actor, num_actors, cluster_cpus())
        actor_class: type
        if self.backend == "hf":
            actor_class, kwargs = HFGenerationActor, {"threads": max(1, round(cpus)), **actor_kwargs}
        else:
            actor_class, kwargs = VLLMGenerationActor, dict(actor_kwargs)
        remote = ray.remote(actor_class).options(num_cpus=cpus, num_gpus=gpus, max_restarts=max_restarts,
                                                 max_task_retries=max_task_retries)
        log.info("generation pool: %d %s actors x (%.2f CPU, %.2f GPU)", num_actors, self.backend, cpus, gpus)
        self.actors = [remote.remote(model_dir, seed=seed, **kwargs) for _ in range(num_actors)]

    def generate(self, requests: Sequence[GenerationRequest], **kwargs: Any) -> list[dict]:
        """Split ``requests`` over the actors, gather, and return rows sorted by ``(question_id, sample)``.

        Args:
            requests: Questions to answer (unique ids).
            **kwargs: The actors' ``generate`` keywords (``adapter_dir``, ``n``, ``temperature``,
                ``max_new_tokens``, ``step``, optional ``seed`` (default: the pool's) and ``top_p``).
        """
        import ray

        check_requests(requests)
        kwargs.setdefault("seed", self.seed)
        chunks = split_contiguous(list(requests), len(self.actors))
        futures = [actor.generate.remote(chunk, **kwargs) for actor, chunk in zip(self.actors, chunks)]
        rows = [row for part in ray.get(futures) for row in part]
        return sorted(rows, key=lambda row: (row["question_id"], row["sample"]))

    def shutdown(self) -> None:
        """Kill the actors (no restart)."""
        import ray

        for actor in self.actors:
            ray.kill(actor, no_restart=True)
        self.actors = []


GENERATION_COLUMNS = ("question_id", "step", "sample", "response", "response_ids", "token_logprobs", "logprob",
                      "finished", "policy")


def generations_table(rows: Sequence[dict]) -> Any:
    """A pyarrow table of generation rows with fixed types for the known columns; other keys pass through.

    ``response`` (decoded text) is a column only when every row has it.
    """
    import pyarrow as pa

    types = {"question_id": pa.string(), "step": pa.int64(), "sample": pa.int32(), "response": pa.string(),
             "response_ids": pa.list_(pa.int32()), "token_logprobs": pa.list_(pa.float32()),
             "logprob": pa.float64(), "finished": pa.bool_(), "policy": pa.string()}
    required = [c for c in GENERATION_COLUMNS if c != "response"]
    missing = sorted({c for row in rows for c in required if c not in row})
    if missing:
        raise ValueError(f"generation rows lack columns {missing}; pass rows returned by a generation actor")
    names = [c for c in GENERATION_COLUMNS if all(c in row for row in rows)] if rows else required
    extras = sorted({k for row in rows for k in row} - set(GENERATION_COLUMNS))
    arrays = {c: pa.array([row[c] for row in rows], type=types[c]) for c in names}
    arrays.update({k: pa.array([row.get(k) for row in rows]) for k in extras})
    return pa.table(arrays)


def write_generations(rows: Sequence[dict], path: str | Path) -> Path:
    """Write ``generations.parquet`` atomically (:func:`raycurate.rundir.atomic_file`).

    Args:
        rows: Generation rows (see :func:`generations_table`).
        path: Output file.

    Returns:
        The path written.
    """
    import pyarrow.parquet as pq

    path = Path(path)
    table = generations_table(rows)
    with atomic_file(path) as tmp:
        pq.write_table(table, tmp)
    return path
