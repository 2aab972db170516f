"""What raycurate's stages cost: per-stage token counts x per-token FLOPs / device throughput (issue #39, item 5).

One model, two uses:

1. **The check on the CPU runs we have.**  The CPU's throughput is calibrated on ONE measured stage (the real
   proving ground's ``train_mixed``: LoRA SFT of SmolLM2-135M on the idle 2-core VM, benchmarks/RESULTS.md), its
   dtype and pass ratios come from in-process microbenchmarks (``bench_cpu_precision.py``,
   ``bench_token_utility.py``), and every other measured stage (evaluations, BRIDGE scoring, the P2D probe, the
   other SFTs) is predicted from its own token counts and printed next to its measured wall time with the error.
2. **1M rows on H100s.**  The same stage formulas with 1M rows, a 1B and a 7B shape and 8 / 64 H100 GPUs whose
   throughput is public peak x an assumed utilisation (nothing here was measured on a GPU: no device was lent).

Every number of docs/cluster.md section 11 is printed by this script::

    python benchmarks/cost_model.py            # the check, the 1M-row tables, Ray's limits (markdown)
    python benchmarks/cost_model.py --recount  # recount the SmolLM2 corpus tokens (needs the model's tokenizer)

FLOPs are matmul FLOPs (2 per multiply-add).  Per token of a padded batch position: a forward is 2 x the body's
weights + 2 x the lm_head's weights at the positions whose logits are formed + the attention scores (4 x layers x
hidden x attended keys); full fine-tuning is 3 forwards (weight and input gradients); LoRA is the forward plus the
input-gradient backward of the frozen weights (2 forwards, + 6 x the adapter's weights); the BRIDGE JVP pass is a
measured ratio x a full-logit forward.
"""

from __future__ import annotations

import argparse
import collections
import heapq
import math
from dataclasses import dataclass, field, replace

# --------------------------------------------------------------------------------------------------------------------
# Model shapes


@dataclass(frozen=True)
class Shape:
    """A decoder-only transformer, as far as its FLOPs and bytes go."""

    name: str
    params: int
    layers: int
    hidden: int  # = query heads x head_dim for every shape here
    vocab: int
    tied: bool  # lm_head shares the embedding matrix
    kv_heads: int
    head_dim: int

    @property
    def head(self) -> int:
        """Weights of the lm_head matmul (vocab x hidden)."""
        return self.vocab * self.hidden

    @property
    def body(self) -> int:
        """Matmul weights of the decoder layers (the embedding is a lookup, the lm_head is counted apart)."""
        return self.params - self.head * (1 if self.tied else 2)

    def kv_bytes_per_token(self, bytes_per_value: int = 2) -> int:
        """KV-cache bytes one token adds (keys and values of every layer)."""
        return 2 * self.layers * self.kv_heads * self.head_dim * bytes_per_value


SMOLLM2_135M = Shape("SmolLM2-135M", 134_515_008, 30, 576, 49_152, True, 3, 64)
LLAMA_1B = Shape("Llama-3.2-1B", 1_235_814_400, 16, 2048, 128_256, True, 8, 64)
QWEN_7B = Shape("Qwen2.5-7B", 7_615_616_512, 28, 3584, 152_064, False, 4, 128)

#: LoRA r = 16 on every linear layer of SmolLM2-135M (the proving grounds' adapter; the manifests'
#: ``trainable_parameters``).
SMOLLM2_LORA_PARAMS = 4_884_480

# --------------------------------------------------------------------------------------------------------------------
# FLOPs per token (one padded batch position)


def attention_flops(shape: Shape, ctx: float) -> float:
    """QK^T and AV of one query position attending to ``ctx`` keys, all layers."""
    return 4.0 * shape.layers * shape.hidden * ctx


def forward_flops(shape: Shape, ctx: float, logit_frac: float = 1.0) -> float:
    """A forward pass per position; ``logit_frac`` = share of positions whose logits are formed (the engines'
    supervised window, ``logits_to_keep``)."""
    return 2.0 * shape.body + 2.0 * shape.head * logit_frac + attention_flops(shape, ctx)


def train_full_flops(shape: Shape, ctx: float, logit_frac: float = 1.0) -> float:
    """Full fine-tuning: forward + input gradients + weight gradients = 3 forwards."""
    return 3.0 * forward_flops(shape, ctx, logit_frac)


def train_lora_flops(shape: Shape, ctx: float, logit_frac: float = 1.0, adapter_params: int = 0) -> float:
    """LoRA (or head deltas) on a frozen base: the frozen matrices need input gradients only (2 forwards), the
    attention scores a full backward (3x), the adapter forward + both gradients (6 x its weights)."""
    return 2.0 * forward_flops(shape, ctx, logit_frac) + attention_flops(shape, ctx) + 6.0 * adapter_params


def direction_flops(shape: Shape, ctx: float, logit_frac: float, last_layers: int) -> float:
    """BRIDGE's g_target: a forward, then gradients into the last ``last_layers`` layers only."""
    return (forward_flops(shape, ctx, logit_frac) + 4.0 * shape.body * last_layers / shape.layers
            + 2.0 * shape.head * logit_frac)


# --------------------------------------------------------------------------------------------------------------------
# Stages as work


@dataclass(frozen=True)
class Part:
    """``flops`` of one pass kind in one dtype; ``bytes`` = weight + KV bytes that decode steps read (roofline)."""

    kind: str  # train | forward | decode
    dtype: str  # bfloat16 | float32
    flops: float
    bytes: float = 0.0


@dataclass
class Stage:
    """One stage's compute and how it spreads.

    ``layout``: ``train`` (Ray Train workers / the single-worker task), ``pool`` (an actor pool or warm tasks over
    ``units``: shards, batches or question groups, relative sizes), ``task`` (ONE Ray task: one device), ``cpu``
    (``cpu_seconds`` of CPU work spread over the CPUs).  ``workers`` caps the pool (its ``num_actors``)."""

    name: str
    parts: list[Part] = field(default_factory=list)
    layout: str = "pool"
    units: list[float] | None = None
    workers: int | None = None
    cpu_seconds: float = 0.0
    threads: str = "machine"  # CPU only: "machine" (2 threads or 2 one-thread workers) | "one" (a lone 1-thread worker)
    sync_rows: float = 0.0  # GPU training only: rows through optimizer steps (steps = sync_rows / effective batch)
    sync_params: float = 0.0  # weights synchronised per step (full fine-tuning: all of them; adapters: ~0)

    @property
    def flops(self) -> float:
        return sum(p.flops for p in self.parts)


def shard_makespan(units: list[float], actors: int, in_flight: int = 2) -> float:
    """Share of the total work done by the busiest actor: ``raycurate.stages.sharded._run_pool``'s schedule
    (round-robin, ``in_flight`` queued per actor, the next unit to the first actor that finishes one)."""
    actors = max(1, min(actors, len(units)))
    total = float(sum(units))
    if total <= 0:
        return 0.0
    queue = collections.deque(units)
    pending: list[collections.deque] = [collections.deque() for _ in range(actors)]
    for _ in range(in_flight):
        for a in range(actors):
            if queue:
                pending[a].append(queue.popleft())
    finish = [0.0] * actors  # when each actor's current unit ends (unit work = time at rate 1)
    events: list[tuple[float, int]] = []
    for a in range(actors):
        if pending[a]:
            finish[a] = pending[a].popleft()
            heapq.heappush(events, (finish[a], a))
    while events:  # an actor finishes a unit: it pulls the next queued unit, then starts its next pending one
        t, a = heapq.heappop(events)
        if queue:
            pending[a].append(queue.popleft())
        if pending[a]:
            finish[a] = t + pending[a].popleft()
            heapq.heappush(events, (finish[a], a))
    return max(finish) / total


# --------------------------------------------------------------------------------------------------------------------
# Devices


@dataclass
class Cpu:
    """The 2-core Intel Xeon VM of benchmarks/RESULTS.md, idle.

    ``train_rate``: effective FLOP/s of the whole machine on LoRA steps with a bf16 frozen base (calibrated);
    ``fp32_over_train``: fp32 forward FLOP/s over that; ``bf16_over_fp32``: bf16 forward over fp32 forward;
    ``one_thread``: a lone 1-thread worker's share of the machine (2 threads were ~1.8x one thread, idle).
    Decode steps run at the forward rate of their dtype (an assumption the check tests)."""

    train_rate: float
    fp32_over_train: float
    bf16_over_fp32: float
    cores: int = 2
    one_thread: float = 1 / 1.8
    startup_train_s: float = 20.0
    startup_pool_s: float = 10.0
    name: str = "2-core Xeon VM"

    def rate(self, part: Part) -> float:
        if part.kind == "train":
            return self.train_rate
        fp32 = self.train_rate * self.fp32_over_train
        return fp32 * (self.bf16_over_fp32 if part.dtype == "bfloat16" else 1.0)

    def seconds(self, stage: Stage) -> float:
        if stage.layout == "cpu":
            return stage.cpu_seconds / min(stage.workers or self.cores, self.cores)
        # share: of the machine's throughput that the busiest worker gets; work_share: of the work it does
        work_share = 1.0
        if stage.threads == "one":
            share = self.one_thread
        elif stage.layout == "train":
            share = 1.0  # one worker with a thread per core
        else:
            workers = min(stage.workers or self.cores, self.cores)
            share = 1.0 / workers
            work_share = shard_makespan(stage.units, workers) if stage.units else 1.0 / workers
        compute = sum(work_share * p.flops / (self.rate(p) * share) for p in stage.parts)
        startup = self.startup_train_s if stage.layout == "train" else self.startup_pool_s
        return startup + compute


@dataclass
class GpuCluster:
    """``gpus`` H100 SXM (80 GB) GPUs, 8 per node.  Public peaks; every utilisation is an ASSUMPTION."""

    gpus: int
    peak_bf16: float = 989e12  # dense bf16 tensor-core peak
    peak_fp32: float = 67e12  # fp32 without TF32 (PyTorch's default: torch.backends.cuda.matmul.allow_tf32 False)
    hbm_bytes_per_s: float = 3.35e12
    mfu_train: float = 0.40  # full fine-tuning, ZeRO-2, bf16, one node
    mfu_forward: float = 0.45  # batched no-grad / JVP passes in bf16
    mfu_fp32: float = 0.60  # of the fp32 peak
    hbm_efficiency: float = 0.70  # decode steps: bytes read / (peak bandwidth x this)
    nvlink_bytes_per_s: float = 450e9  # per GPU, one direction, inside a node
    efa_bytes_per_s: float = 50e9  # per GPU across nodes: p5's 3,200 Gbit/s EFA shared by 8 GPUs
    comm_overlap: float = 0.5  # share of ZeRO-2's reduce-scatter / all-gather hidden behind compute
    startup_train_s: float = 180.0  # worker group, DeepSpeed init, model load from the shared filesystem
    startup_pool_s: float = 120.0  # actors start, load the model
    cpus_per_node: int = 192  # p5.48xlarge vCPUs
    gpu_memory: float = 80e9

    @property
    def nodes(self) -> int:
        return max(1, math.ceil(self.gpus / 8))

    @property
    def name(self) -> str:
        return f"{self.gpus} x H100"

    @property
    def cpus(self) -> int:
        return self.cpus_per_node * self.nodes

    @property
    def effective_batch(self) -> int:
        """Rows per optimizer step the job would use: jobs/bridge_metamath_llama3b.yaml's 64 on one node; 512 on 64
        GPUs (``effective_batch_size`` must be a multiple of micro_batch_size 4 x 64 workers = 256, and a step's
        compute has to cover the gradient exchange across nodes)."""
        return 64 if self.gpus <= 8 else 512

    def sync_seconds(self, stage: Stage) -> float:
        """Exposed ZeRO-2 communication: per optimizer step each GPU moves ~4 bytes per synchronised weight
        (reduce-scatter of bf16 gradients + all-gather of bf16 weights) over NVLink or, across nodes, EFA."""
        if not stage.sync_params or self.gpus == 1:
            return 0.0
        steps = math.ceil(stage.sync_rows / self.effective_batch)
        bandwidth = self.nvlink_bytes_per_s if self.gpus <= 8 else self.efa_bytes_per_s
        return steps * 4.0 * stage.sync_params / bandwidth * (1.0 - self.comm_overlap)

    def rate(self, part: Part) -> float:
        if part.dtype == "float32":
            return self.peak_fp32 * self.mfu_fp32
        return self.peak_bf16 * (self.mfu_train if part.kind == "train" else self.mfu_forward)

    def part_seconds(self, part: Part) -> float:
        compute = part.flops / self.rate(part)
        if part.kind == "decode" and part.bytes:
            return max(compute, part.bytes / (self.hbm_bytes_per_s * self.hbm_efficiency))
        return compute

    def seconds(self, stage: Stage) -> float:
        if stage.layout == "cpu":
            return stage.cpu_seconds / min(stage.workers or self.cpus, self.cpus)
        if stage.layout == "task":
            workers = 1
        else:
            workers = min(stage.workers or self.gpus, self.gpus)
        if stage.layout == "train":
            return (self.startup_train_s + sum(self.part_seconds(p) for p in stage.parts) / workers
                    + self.sync_seconds(stage))
        work_share = shard_makespan(stage.units, workers) if stage.units else 1.0 / workers
        return self.startup_pool_s + work_share * sum(self.part_seconds(p) for p in stage.parts)


# --------------------------------------------------------------------------------------------------------------------
# The check: SmolLM2-135M on the 2-core VM (benchmarks/RESULTS.md, 2026-12-06, idle unless said)


@dataclass(frozen=True)
class Batches:
    """Token counts of a set of rows cut into padded batches (``--recount`` recomputes them)."""

    rows: int
    real: float  # tokens
    padded: float  # batch positions (rows x longest row of their batch)
    window: float  # positions inside each batch's supervised logit window (first target - 1 .. last target)
    mean_len: float  # sum over positions of their batch's length / padded: attention keys = mean_len / 2

    def scaled(self, rows: int) -> Batches:
        k = rows / self.rows
        return Batches(rows, self.real * k, self.padded * k, self.window * k, self.mean_len)


# Corpus seed 11 at 40% corruption (jobs/real_proving_ground.yaml's mix), SmolLM2's chat template with the one-line
# system prompt.  Training batches: 8 rows in a shuffled order (mean of 200 orders); scoring: 8 (BRIDGE) or 16
# (reference) rows in table order.
ALL_B8 = Batches(1000, 88_711, 126_716, 0.744 * 126_716, 128.4)
CLEAN_B8 = Batches(600, 52_883, 75_663, 0.750 * 75_663, 127.6)
SELECTION_B8 = Batches(897, 79_654, 113_546, 0.746 * 113_546, 128.4)
ALL_B16 = Batches(1000, 88_711, 134_376, 0.790 * 134_376, 135.2)
# 300 held-out questions in groups of 50: prompts (left-padded) and gold sequences (right-padded)
HELDOUT_PROMPTS = Batches(300, 20_134, 26_850, 0.0, 89.5)
HELDOUT_GOLD = Batches(300, 30_987, 43_850, 30_650, 146.3)


def cpu_train_stage(name: str, batches: Batches, threads: str = "machine") -> Stage:
    ctx = batches.mean_len / 2
    per_token = train_lora_flops(SMOLLM2_135M, ctx, batches.window / batches.padded, SMOLLM2_LORA_PARAMS)
    return Stage(name, [Part("train", "bfloat16", batches.padded * per_token)], layout="train", threads=threads)


def eval_parts(shape: Shape, dtype: str, prompts: Batches, gold: Batches, samples: int, new_tokens: int,
               batch: int) -> list[Part]:
    """One held-out evaluation (``model_stages.evaluate_rows``): greedy generation (prefill with the last
    position's logits, then ``new_tokens`` decode steps for every row of a batch: a batch runs until its longest
    answer, which the sampled rows nearly always take to the cap), the gold-response loss over the logit window,
    and ``samples`` sampled answers per question sharing one prefill."""
    q = prompts.rows
    value_bytes = 2 if dtype == "bfloat16" else 4
    weight_bytes = shape.params * value_bytes
    prefill = prompts.padded * forward_flops(shape, prompts.mean_len / 2, 0.0) + q * 2.0 * shape.head
    gold_pass = gold.padded * forward_flops(shape, gold.mean_len / 2, gold.window / gold.padded)
    ctx = prompts.real / q + new_tokens / 2
    parts = [Part("forward", dtype, prefill), Part("forward", dtype, gold_pass)]
    for rows_per_question in ([1] + ([samples] if samples else [])):
        steps = math.ceil(q / batch) * new_tokens
        decode = q * rows_per_question * new_tokens * forward_flops(shape, ctx, 1.0)
        kv = q * rows_per_question * new_tokens * ctx * shape.kv_bytes_per_token(value_bytes)
        parts.append(Part("decode", dtype, decode, steps * weight_bytes + kv))
    if samples:
        parts.append(Part("forward", dtype, prefill))
    return parts


def cpu_eval_stage(name: str, dtype: str) -> Stage:
    parts = eval_parts(SMOLLM2_135M, dtype, HELDOUT_PROMPTS, HELDOUT_GOLD, samples=2, new_tokens=64, batch=50)
    return Stage(name, parts, layout="pool", units=[1.0] * 6, workers=2)  # 6 groups of 50 on 2 warm tasks


#: BRIDGE utilities / no-grad full-logit forward at SmolLM2's shape, L = 4 of 30 (bench_token_utility.py, idle,
#: one thread, fourth session 2026-12-06): fp32 1.25, bf16 1.58.
JVP_OVER_FORWARD = {"float32": 1.25, "bfloat16": 1.58}


def bridge_score_parts(shape: Shape, batches: Batches, dtype: str, jvp_ratio: float) -> list[Part]:
    """``bridge_score``: one JVP pass (``jvp_ratio`` x a full-logit forward) and the routing layer's forward (all
    layers, last position's logits) per micro-batch."""
    ctx = batches.mean_len / 2
    return [Part("forward", dtype, batches.padded * jvp_ratio * forward_flops(shape, ctx, 1.0)),
            Part("forward", dtype, batches.padded * forward_flops(shape, ctx, 0.0))]


def cpu_bridge_score_stage(rows: int = 905, shard_rows: int = 256) -> Stage:
    batches = SELECTION_B8.scaled(rows)
    units = [min(shard_rows, rows - s) for s in range(0, rows, shard_rows)]
    return Stage("bridge_score", bridge_score_parts(SMOLLM2_135M, batches, "float32", JVP_OVER_FORWARD["float32"]),
                 units=units, workers=2)


def p2d_probe_parts(shape: Shape, prompts: float, prompt_tokens: float, dtype: str) -> list[Part]:
    """``p2d_probe``: one forward per ICL prompt (batch 1, no padding), logits at every position."""
    return [Part("forward", dtype, prompts * prompt_tokens * forward_flops(shape, prompt_tokens / 2, 1.0))]


def cpu_p2d_probe_stage() -> Stage:
    return Stage("p2d_probe", p2d_probe_parts(SMOLLM2_135M, 600, 736, "float32"), units=[1.0] * 75, workers=2)


def reference_scores_parts(shape: Shape, batches: Batches, dtype: str) -> list[Part]:
    """``curate_reference_scores``: the pool rows' losses under the reference and the base (two forwards)."""
    per_token = forward_flops(shape, batches.mean_len / 2, batches.window / batches.padded)
    return [Part("forward", dtype, 2 * batches.padded * per_token)]


@dataclass(frozen=True)
class Measured:
    stage: Stage
    seconds: float
    source: str


#: bench_cpu_precision.py, SmolLM2-135M, batch 8 x 96 tokens, full logits, one thread, one process (load 9-12, so
#: only the ratios are used): forward fp32 352 tok/s, forward bf16 weights 1,149, LoRA r=16 step with a bf16 frozen
#: base 174.
MICRO = {"forward_fp32": 352.0, "forward_bf16": 1149.0, "lora_step_bf16_frozen": 174.0, "tokens": 96}


def cpu_ratios() -> tuple[float, float]:
    """(fp32 forward FLOP/s over bf16-frozen LoRA step FLOP/s, bf16 forward over fp32 forward) from MICRO."""
    ctx = MICRO["tokens"] / 2
    fwd = forward_flops(SMOLLM2_135M, ctx, 1.0)
    step = train_lora_flops(SMOLLM2_135M, ctx, 1.0, SMOLLM2_LORA_PARAMS)
    fp32_over_train = MICRO["forward_fp32"] * fwd / (MICRO["lora_step_bf16_frozen"] * step)
    return fp32_over_train, MICRO["forward_bf16"] / MICRO["forward_fp32"]


CALIBRATION = ("train_mixed", 360.0, "third session, idle: 125 LoRA steps, 2 threads, 6.0 min")


def calibrated_cpu() -> Cpu:
    """The CPU whose ``train_rate`` makes ``train_mixed`` take its measured 360 s."""
    fp32_over_train, bf16_over_fp32 = cpu_ratios()
    probe = Cpu(train_rate=1.0, fp32_over_train=fp32_over_train, bf16_over_fp32=bf16_over_fp32)
    stage = cpu_train_stage("train_mixed", ALL_B8)
    compute_at_unit_rate = probe.seconds(stage) - probe.startup_train_s
    probe.train_rate = compute_at_unit_rate / (CALIBRATION[1] - probe.startup_train_s)
    return probe


def cpu_checks() -> list[Measured]:
    """Measured stages of benchmarks/RESULTS.md with their workloads."""
    third = "third session 2026-12-06, idle"
    fourth = "fourth session 2026-12-06, idle"
    return [
        Measured(cpu_train_stage("train_mixed (calibration)", ALL_B8), 360.0, third + ", 2 threads"),
        Measured(cpu_train_stage("train_bridge", SELECTION_B8.scaled(905)), 330.0, third + ", 905 rows"),
        Measured(cpu_train_stage("train_random", SELECTION_B8.scaled(905)), 336.0, third + ", 905 rows"),
        Measured(cpu_train_stage("train_clean (1 thread)", CLEAN_B8, threads="one"), 330.0, third + ", 600 rows"),
        Measured(cpu_eval_stage("eval_mixed (fp32)", "float32"), 246.0, third),
        Measured(cpu_eval_stage("eval_clean (fp32)", "float32"), 234.0, third),
        Measured(cpu_eval_stage("eval_bridge (fp32)", "float32"), 264.0, third),
        Measured(cpu_eval_stage("eval_random (fp32)", "float32"), 252.0, third),
        Measured(cpu_eval_stage("eval_p2d (fp32)", "float32"), 276.0, fourth),
        Measured(cpu_eval_stage("eval_base (bf16)", "bfloat16"), 120.0, third),
        Measured(cpu_bridge_score_stage(), 288.0, third + ", 4 shards of 256 on 2 actors"),
        Measured(cpu_p2d_probe_stage(), 672.0, fourth),
    ]


def loaded_checks(cpu: Cpu) -> list[tuple[str, float, float, str]]:
    """runs/det_s0 (load 10-30; ``p2d_pool`` and ``eval.pool`` of 1 actor, every worker 1 thread): the same run's
    LoRA reference training (200 trusted rows x 3 epochs, 1,019 s) calibrates the loaded one-thread rate, the
    other stages are predicted from it.  Shown, never held to 25%: the load moved between the stages (this run's
    two LoRA trainings differ by 1.4x in seconds per token)."""
    trusted = ALL_B8.scaled(600)  # manifest: 600 examples, 75 steps, 54,021 tokens (90 per row, as the corpus)
    train_measured = 1019.1
    unit = Cpu(1.0, cpu.fp32_over_train, cpu.bf16_over_fp32)
    loaded = replace(cpu)
    loaded.train_rate = (unit.seconds(cpu_train_stage("ref", trusted, threads="one")) - cpu.startup_train_s) / (
        train_measured - cpu.startup_train_s)
    pool = ALL_B16.scaled(883)  # 883 pool rows in micro-batches of 16, table order
    stages = [
        (Stage("curate_reference_scores", reference_scores_parts(SMOLLM2_135M, pool, "float32"), workers=1,
               threads="one"), 1601.2),
        (cpu_train_stage("train_curate (416 rows)", ALL_B8.scaled(416), threads="one"), 1073.1),
        (Stage("eval_curate (200 validation questions, fp32)", eval_parts(
            SMOLLM2_135M, "float32", HELDOUT_PROMPTS.scaled(200), HELDOUT_GOLD.scaled(200), 2, 64, 50), workers=1,
            threads="one"), 965.1),
    ]
    return [(stage.name, loaded.seconds(stage), measured, "runs/det_s0, load 10-30") for stage, measured in stages]


# --------------------------------------------------------------------------------------------------------------------
# 1M rows on H100s


@dataclass(frozen=True)
class Job:
    """The 1M-row curation job (every value an assumption stated in docs/cluster.md section 11)."""

    rows: int = 1_000_000
    prompt: int = 256
    response: int = 256
    pad: float = 1.4  # padded / real positions at micro-batch 4-8 (1.43 measured on the corpus at batch 8)
    window: float = 0.75  # logit-window share of padded positions (0.74-0.79 measured)
    epochs: int = 1  # full fine-tuning epochs of every SFT
    trusted: int = 10_000  # trusted rows (curate reference: LoRA, 3 epochs)
    reference_epochs: int = 3
    warmup_share: float = 0.05  # BRIDGE split_ratios
    validation_share: float = 0.05
    last_layers: int = 4
    rho_p: float = 0.75  # BRIDGE keeps this share of prompt tokens (compaction shortens the rows)
    keep_fraction: float = 0.4  # BDS / reference: rows kept
    p2d_rounds: int = 3
    p2d_demos: int = 5
    p2d_queries: int = 3
    p2d_data_ratio: float = 0.10
    p2d_epochs: int = 3
    questions: int = 1_319  # held-out questions per evaluation (GSM8K test size)
    eval_prompt: int = 128
    eval_gold: int = 256
    samples: int = 2
    new_tokens: int = 256
    eval_batch: int = 50
    shard_rows: int = 1024
    validation_rows: int | None = None  # bridge.validation_rows (null: the whole validation split)
    diagnostics_rows: int = 200  # bridge.diagnostics_rows (the default)
    scoring_dtype: str = "float32"  # what the scoring stages load today (bridge, reference, P2D probe, direction)

    @property
    def length(self) -> int:
        return self.prompt + self.response


def jvp_ratio(shape: Shape, last_layers: int) -> float:
    """JVP / forward at L of n layers, extrapolated from SmolLM2 bf16 (1.58 at 4 of 30): 1 + 4.35 x L / n."""
    k = (JVP_OVER_FORWARD["bfloat16"] - 1.0) / (4 / 30)
    return 1.0 + k * last_layers / shape.layers


def batches(job: Job, rows: float, length: float | None = None, pad: float | None = None) -> Batches:
    length = job.length if length is None else length
    pad = job.pad if pad is None else pad
    real = rows * length
    return Batches(int(rows), real, real * pad, real * pad * job.window, length * pad)


def full_sft(name: str, shape: Shape, b: Batches, epochs: int = 1) -> Stage:
    per_token = train_full_flops(shape, b.mean_len / 2, b.window / b.padded)
    return Stage(name, [Part("train", "bfloat16", epochs * b.padded * per_token)], layout="train",
                 sync_rows=epochs * b.rows, sync_params=shape.params)


def lora_sft(name: str, shape: Shape, b: Batches, epochs: int, adapter: int) -> Stage:
    per_token = train_lora_flops(shape, b.mean_len / 2, b.window / b.padded, adapter)
    return Stage(name, [Part("train", "bfloat16", epochs * b.padded * per_token)], layout="train")


def shards(rows: float, shard_rows: int) -> list[float]:
    n = int(rows)
    return [float(min(shard_rows, n - s)) for s in range(0, n, shard_rows)]


def million_row_stages(shape: Shape, job: Job) -> list[tuple[str, Stage]]:
    """(method, stage) of the 1M-row job; the same stage formulas as the CPU check."""
    d = job.scoring_dtype
    pool = batches(job, job.rows)
    tokens_total = job.rows * job.length
    out: list[tuple[str, Stage]] = []
    # data (CPU): ingest is the driver alone at 24k rows/s (bench_scale.py, 1M rows in 41.7 s); tokenize 340k
    # tokens and MinHash 700k words (~1.4 tokens each) per CPU-second (measured here, loaded: CPU time), on
    # tokenize.num_actors = 8 one-CPU actors
    out.append(("data", Stage("ingest (driver)", layout="cpu", cpu_seconds=job.rows / 24e3, workers=1)))
    out.append(("data", Stage("tokenize + dedup", layout="cpu", workers=8,
                              cpu_seconds=tokens_total / 340e3 + tokens_total / 1.4 / 700e3)))
    # baseline
    out.append(("SFT on all rows", full_sft("train_mixed", shape, pool, job.epochs)))
    # reference filter
    trusted = batches(job, job.trusted)
    # (the adapter's own 6 x its weights is left out: under 5% of a LoRA step at SmolLM2's shape, less above)
    out.append(("reference", lora_sft("curate_reference", shape, trusted, job.reference_epochs, 0)))
    ref = Stage("curate_reference_scores", reference_scores_parts(shape, pool, d),
                units=[1.0] * math.ceil(job.rows / 64))  # Ray Data batches of p2d_pool.batch_size 64
    out.append(("reference", ref))
    out.append(("reference", full_sft("train_curate", shape, batches(job, job.rows * job.keep_fraction), job.epochs)))
    # BRIDGE
    warm = batches(job, job.rows * job.warmup_share)
    val = batches(job, min(job.rows * job.validation_share, job.validation_rows or job.rows))
    sel_rows = job.rows * (1 - job.warmup_share - job.validation_share)
    sel = batches(job, sel_rows)
    out.append(("BRIDGE", full_sft("bridge_warmup", shape, warm)))
    direction = direction_flops(shape, val.mean_len / 2, val.window / val.padded, job.last_layers) * val.padded
    out.append(("BRIDGE", Stage("bridge_direction", [Part("forward", d, direction)], layout="task")))
    out.append(("BRIDGE", Stage("bridge_score", bridge_score_parts(shape, sel, d, jvp_ratio(shape, job.last_layers)),
                                units=shards(sel_rows, job.shard_rows))))
    # fidelity diagnostics (one Ray task): the exact leave-one-out reference is one JVP pass of the row per
    # eligible prompt token (batches of 16 leave-one-out rows), plus the row itself
    diag = job.diagnostics_rows * (job.prompt + 1) * job.length * jvp_ratio(shape, job.last_layers) * forward_flops(
        shape, job.length / 2, 1.0)
    out.append(("BRIDGE", Stage("bridge_diagnostics", [Part("forward", d, diag)], layout="task")))
    # selection + closure: 1.44M tokens/s per core at ~500-token rows (bench_selection.py, idle)
    out.append(("BRIDGE", Stage("bridge_select", layout="cpu", cpu_seconds=sel_rows * job.length / 1.44e6)))
    compact = batches(job, sel_rows, length=job.rho_p * job.prompt + job.response)
    out.append(("BRIDGE", full_sft("train_bridge", shape, compact, job.epochs)))
    # BDS: per step 4 validation + 4 candidate rows trained, then the 4 candidates forwarded at theta^{k+1}
    cand = batches(job, job.rows)
    bds_train = 2 * cand.padded * train_full_flops(shape, cand.mean_len / 2, cand.window / cand.padded)
    bds_fwd = cand.padded * forward_flops(shape, cand.mean_len / 2, cand.window / cand.padded)
    out.append(("BDS", Stage("train_bilevel (BDS epoch)", [Part("train", "bfloat16", bds_train),
                                                          Part("train", "bfloat16", bds_fwd)], layout="train",
                             sync_rows=2 * job.rows, sync_params=shape.params)))
    out.append(("BDS", full_sft("train_curate", shape, batches(job, job.rows * job.keep_fraction), job.epochs)))
    # P2D: proxy and heads are fixed-size (100 rows x 20 steps; one pass over the q/k/v weights)
    proxy = batches(job, 100 * 20)
    out.append(("P2D", full_sft("p2d_proxy", shape, proxy)))
    prompts = job.rows * job.p2d_rounds / job.p2d_demos
    prompt_tokens = (job.p2d_demos + job.p2d_queries) * job.length
    out.append(("P2D", Stage("p2d_probe", p2d_probe_parts(shape, prompts, prompt_tokens, d),
                             units=[1.0] * math.ceil(prompts / 8))))
    chosen = batches(job, job.rows * job.p2d_data_ratio)
    out.append(("P2D", lora_sft("train_p2d (head deltas)", shape, chosen, job.p2d_epochs, 0)))
    # one evaluation (every arm has one): bf16 (a full fine-tune exports bf16 on GPUs)
    eval_prompts = Batches(job.questions, job.questions * job.eval_prompt, job.questions * job.eval_prompt * 1.2, 0.0,
                           job.eval_prompt * 1.2)
    gold_len = job.eval_prompt + job.eval_gold
    eval_gold = Batches(job.questions, job.questions * gold_len, job.questions * gold_len * job.pad,
                        job.questions * gold_len * job.pad * job.window, gold_len * job.pad)
    groups = math.ceil(job.questions / job.eval_batch)
    out.append(("evaluation (each arm)", Stage("eval_<arm>", eval_parts(
        shape, "bfloat16", eval_prompts, eval_gold, job.samples, job.new_tokens, job.eval_batch),
        units=[1.0] * groups)))
    return out


# --------------------------------------------------------------------------------------------------------------------
# Ray's and DeepSpeed's limits at 1M rows


def zero2_bytes_per_gpu(shape: Shape, workers: int, micro_batch: int, tokens: float) -> dict[str, float]:
    """Full fine-tuning under DeepSpeed ZeRO-2 in bf16 (no activation checkpointing in the engines)."""
    weights = 2.0 * shape.params
    grads = 2.0 * shape.params / workers
    optimizer = 12.0 * shape.params / workers  # fp32 master + two Adam moments, partitioned
    activations = 34.0 * micro_batch * tokens * shape.hidden * shape.layers  # bf16, flash attention (no s^2 term)
    logits = micro_batch * tokens * 0.75 * shape.vocab * 6.0  # bf16 logits + their fp32 upcast in the loss
    return {"weights": weights, "grads": grads, "optimizer": optimizer, "activations": activations,
            "logits": logits, "total": weights + grads + optimizer + activations + logits}


def limits(shape: Shape, job: Job, gpus: int) -> dict[str, float]:
    """Numbers docs/cluster.md section 11 compares with Ray's and DeepSpeed's limits."""
    nodes = max(1, math.ceil(gpus / 8))
    sel_rows = job.rows * (1 - job.warmup_share - job.validation_share)
    per_row_scores = (job.response * (job.prompt + 2)) * 2  # fp16 utilities, routing (r x p), history mass
    token_table = job.rows * job.length * 5 + job.rows * 40  # int32 ids + int8 mask + id strings
    fp32 = 4.0 * shape.params
    padded = job.length * job.pad
    probe_tokens = (job.p2d_demos + job.p2d_queries) * job.length
    return {
        "object_store_per_node": min(0.3 * 2048 * 2**30, 200e9),
        "score_bytes_per_row": per_row_scores,
        "score_bytes_total": per_row_scores * sel_rows,
        "score_bytes_per_shard": per_row_scores * job.shard_rows,
        "shards": math.ceil(sel_rows / job.shard_rows),
        "shard_tail": shard_makespan(shards(sel_rows, job.shard_rows), gpus) * gpus,
        "token_table_per_worker": token_table,
        "token_table_per_node": token_table * min(8, gpus),
        "tokenize_blocks": math.ceil(job.rows / 512),
        "zero2_total": zero2_bytes_per_gpu(shape, gpus, 4, padded)["total"],
        "zero2_activations": zero2_bytes_per_gpu(shape, gpus, 4, padded)["activations"],
        "reference_fp32_two_models": 2 * fp32 + 16 * padded * job.window * shape.vocab * 4,
        "bridge_fp32_model": fp32,
        # the model, fp32 logits at every position (+ their float() copy), the fp32 attention maps of the layers
        # holding selected heads (assumed 10: rho_P 0.1 of the heads, spread over layers)
        "probe_fp32": fp32 + probe_tokens * shape.vocab * 8 + 10 * (shape.hidden // shape.head_dim)
        * probe_tokens ** 2 * 4,
        "min_effective_batch": 4 * gpus,
        "nodes": nodes,
    }


# --------------------------------------------------------------------------------------------------------------------
# Output


def pct(predicted: float, measured: float) -> float:
    return 100.0 * (predicted - measured) / measured


#: bench_token_utility.py at SmolLM2's shape, fp32, one thread, load ~2.5 (third session 2026-12-06): a no-grad
#: full-logit forward of 2 x 192 tokens in 0.792 s and 0.843 s.  The alternative fp32 rate of the check: a
#: cross-process figure (not a ratio measured in one process), two such workers on the two cores.
FORWARD_BENCH = {"tokens": 384, "seconds": (0.792 + 0.843) / 2}


def alternative_cpu(cpu: Cpu) -> Cpu:
    """``cpu`` with its fp32 forward rate from FORWARD_BENCH instead of the in-process ratio of MICRO."""
    per_thread = FORWARD_BENCH["tokens"] * forward_flops(SMOLLM2_135M, FORWARD_BENCH["tokens"] / 4, 1.0) / (
        FORWARD_BENCH["seconds"])
    return replace(cpu, fp32_over_train=cpu.cores * per_thread / cpu.train_rate)


def print_check() -> None:
    cpu = calibrated_cpu()
    alt = alternative_cpu(cpu)
    print(f"CPU calibration: {CALIBRATION[0]} {CALIBRATION[1]:.0f} s ({CALIBRATION[2]}) -> LoRA-step rate "
          f"{cpu.train_rate / 1e9:.0f} GFLOP/s (machine); fp32 forward {cpu.fp32_over_train:.3f}x that "
          f"(alternative: {alt.fp32_over_train:.3f}x); bf16 forward {cpu.bf16_over_fp32:.2f}x fp32; JVP "
          f"{JVP_OVER_FORWARD['float32']} fp32 forwards\n")
    print("| stage | measured (min) | predicted (min) | error | within 25% | alternative fp32 rate: predicted, error "
          "| source |")
    print("|---|---|---|---|---|---|---|")
    held = []
    for m in cpu_checks():
        p, q = cpu.seconds(m.stage), alt.seconds(m.stage)
        err = pct(p, m.seconds)
        calibration = "calibration" in m.stage.name
        if not calibration:
            held.append(abs(err) <= 25)
        ok = "—" if calibration else ("yes" if abs(err) <= 25 else "**no**")
        print(f"| {m.stage.name} | {m.seconds / 60:.1f} | {p / 60:.1f} | {err:+.1f}% | {ok} | {q / 60:.1f}, "
              f"{pct(q, m.seconds):+.0f}% | {m.source} |")
    print(f"\nwithin 25%: {sum(held)} of {len(held)} predicted stages")
    eval_stage = cpu_eval_stage("eval", "float32")
    decode = sum(p_.flops for p_ in eval_stage.parts if p_.kind == "decode") / eval_stage.flops
    print(f"(an evaluation's FLOPs: {100 * decode:.0f}% decode steps, the rest prefill and the gold-loss forward)")
    print("\nLoaded run (not held to 25%):\n")
    print("| stage | measured (min) | predicted (min) | error | source |")
    print("|---|---|---|---|---|")
    for name, p, measured, source in loaded_checks(cpu):
        print(f"| {name} | {measured / 60:.1f} | {p / 60:.1f} | {pct(p, measured):+.0f}% | {source} |")


def hours(seconds: float) -> str:
    h = seconds / 3600
    return f"{h:.2f}" if h < 10 else f"{h:.1f}"


CONFIGS = [(shape, gpus) for shape in (LLAMA_1B, QWEN_7B) for gpus in (8, 64)]


def million_table(job: Job) -> tuple[list[tuple[str, str, list[float]]], dict[str, list[tuple[float, str]]]]:
    """Seconds per (method, stage) for each of CONFIGS, and per method its total and dominant stage."""
    tables = {shape.name: million_row_stages(shape, job) for shape in (LLAMA_1B, QWEN_7B)}
    rows: list[tuple[str, str, list[float]]] = []
    totals: dict[str, list[tuple[float, str]]] = {}
    for i, (method, stage) in enumerate(tables[LLAMA_1B.name]):
        cells = [GpuCluster(gpus).seconds(tables[shape.name][i][1]) for shape, gpus in CONFIGS]
        rows.append((method, stage.name, cells))
        acc = totals.setdefault(method, [(0.0, "", 0.0)] * len(CONFIGS))
        totals[method] = [(t + c, name if c > top else name_top, max(top, c))
                          for (t, name_top, top), c, name in zip(acc, cells, [stage.name] * len(cells))]
    return rows, {m: [(t, name) for t, name, _ in v] for m, v in totals.items()}


def print_million(job: Job, title: str, stages: bool = True) -> None:
    header = " | ".join(f"{shape.name} / {gpus} GPUs" for shape, gpus in CONFIGS)
    rows, totals = million_table(job)
    print(f"\n{title}\n")
    if stages:
        print(f"| method | stage | {header} |")
        print("|---|---|" + "---|" * len(CONFIGS))
        for method, name, cells in rows:
            print(f"| {method} | {name} | " + " | ".join(hours(c) for c in cells) + " |")
        print()
    print("| method: hours in all (dominant stage) | " + header + " |")
    print("|---|" + "---|" * len(CONFIGS))
    for method, cells in totals.items():
        print(f"| {method} | " + " | ".join(f"{hours(t)} ({name})" for t, name in cells) + " |")


def print_limits(job: Job) -> None:
    print("\nRay / DeepSpeed sizes at 1M rows (GB)\n")
    print("| model / GPUs | ZeRO-2 per GPU (activations) | reference scoring, 2 fp32 models | BRIDGE fp32 model | "
          "P2D probe fp32 | min effective batch | shard tail |")
    print("|---|---|---|---|---|---|---|")
    gb = 1e9
    for shape, gpus in CONFIGS:
        lim = limits(shape, job, gpus)
        print(f"| {shape.name} / {gpus} | {lim['zero2_total'] / gb:.0f} ({lim['zero2_activations'] / gb:.0f}) | "
              f"{lim['reference_fp32_two_models'] / gb:.0f} | {lim['bridge_fp32_model'] / gb:.0f} | "
              f"{lim['probe_fp32'] / gb:.0f} | {lim['min_effective_batch']} | x{lim['shard_tail']:.2f} |")
    lim = limits(QWEN_7B, job, 8)
    print(f"\nobject store per p5 node {lim['object_store_per_node'] / gb:.0f} GB; BRIDGE scores "
          f"{lim['score_bytes_per_row'] / 1e3:.0f} kB/row, {lim['score_bytes_total'] / gb:.0f} GB in all, "
          f"{lim['score_bytes_per_shard'] / 1e6:.0f} MB per {job.shard_rows}-row shard, {lim['shards']} shards; "
          f"token table {lim['token_table_per_worker'] / gb:.1f} GB per training worker, "
          f"{lim['token_table_per_node'] / gb:.0f} GB per 8-worker node; tokenize blocks {lim['tokenize_blocks']}")


def recount() -> None:
    """Recompute the SmolLM2 corpus Batches above (corpus seed 11, 40%, the real proving ground's mix)."""
    import random

    import yaml

    from raycurate.data.corpus.benchmark import generate_corpus
    from raycurate.data.corpus.heldout import generate_heldout
    from raycurate.data.splits import assign_split
    from raycurate.data.tokenize import tokenize_record
    from raycurate.models.loading import load_tokenizer

    job = yaml.safe_load(open("jobs/real_proving_ground.yaml"))
    tok = load_tokenizer(job["model"]["name_or_path"])
    system = job["tokenize"]["system_prompt"]
    rows = generate_corpus(1000, 11, 0.4, corruption_mix=job["data"]["corruption_mix"])
    toks = [tokenize_record(tok, r, 384, system_prompt=system) for r in rows]

    def window(x: dict) -> tuple[int, int]:
        idx = [i for i, v in enumerate(x["loss_mask"]) if v]
        return idx[0] - 1, idx[-1] + 1

    def count(sub: list[dict], size: int, orders: int) -> str:
        padded = real = win = sq = 0.0
        for seed in range(orders):
            order = list(sub)
            if orders > 1:
                random.Random(seed).shuffle(order)
            for i in range(0, len(order), size):
                chunk = order[i:i + size]
                t = max(len(x["input_ids"]) for x in chunk)
                lo, hi = min(window(x)[0] for x in chunk), max(window(x)[1] for x in chunk)
                padded += t * len(chunk)
                real += sum(len(x["input_ids"]) for x in chunk)
                win += (hi - lo) * len(chunk)
                sq += t * t * len(chunk)
        return (f"Batches({len(sub)}, {real / orders:,.0f}, {padded / orders:,.0f}, {win / padded:.3f} x padded, "
                f"{sq / padded:.1f})")

    ratios = {"warmup": 0.05, "validation": 0.05, "selection": 0.90}
    print("ALL_B8", count(toks, 8, 200))
    print("CLEAN_B8", count([x for x, r in zip(toks, rows) if r["label"]["clean"]], 8, 200))
    print("SELECTION_B8", count([x for x in toks if assign_split(x["id"], 0, ratios) == "selection"], 8, 1))
    print("ALL_B16", count(toks, 16, 1))
    held = [tokenize_record(tok, r, 384, system_prompt=system) for r in generate_heldout(300, 11)]
    prompts = [x["prompt_len"] for x in held]
    print("HELDOUT prompts real", sum(prompts), "padded",
          sum(max(prompts[i:i + 50]) * len(prompts[i:i + 50]) for i in range(0, 300, 50)))
    print("HELDOUT_GOLD", count(held, 50, 1))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--recount", action="store_true", help="recount the corpus tokens (needs the tokenizer)")
    args = parser.parse_args(argv)
    if args.recount:
        recount()
        return 0
    print_check()
    job = Job()
    print_million(job, f"1M rows of {job.prompt} + {job.response} tokens, hours; scoring stages in float32 (as the "
                       "code loads them)")
    print_million(Job(scoring_dtype="bfloat16", validation_rows=2000),
                  "The same with the scoring stages in bf16 and bridge.validation_rows = 2,000", stages=False)
    print_limits(job)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
