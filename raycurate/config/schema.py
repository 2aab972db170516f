"""The job config: one typed section per concern, loaded from ``jobs/*.yaml`` with ``key=value`` overrides.

``raycurate run --help-config`` prints every key with its type, default and description.
"""

from __future__ import annotations

import dataclasses

from raycurate.config.base import option
from raycurate.config.bilevel import BilevelConfig
from raycurate.config.bridge import BridgeConfig
from raycurate.config.curate import POOL_SPLIT, CurateConfig
from raycurate.config.data import DataConfig, TokenizeConfig
from raycurate.config.model import ModelConfig
from raycurate.config.p2d import P2DConfig
from raycurate.config.pool import ActorPoolConfig
from raycurate.config.train import TrainConfig

PIPELINES = ("demo", "sft", "bridge", "p2d", "bilevel", "curate", "proving_ground")
#: lm-eval tasks (name prefixes) that execute model-written code.
CODE_TASKS = ("humaneval", "mbpp")
#: The lm-eval tasks raycurate writes over the embedded corpus's held-out questions.
LOCAL_LM_EVAL_TASKS = ("raycurate_heldout_em", "raycurate_heldout_gold_ll")
#: base is the base model's evaluation, which always runs.
DEMO_METHODS = ("base", "sft", "curate", "bridge", "p2d", "bilevel")
BRIDGE_SPLITS = ("warmup", "validation", "selection")


@dataclasses.dataclass
class RunConfig:
    """Where the run lives and how it reports."""

    name: str = option("demo", "Run name; outputs go to <runs_dir>/<name>/.")
    runs_dir: str = option("runs", "Folder holding run directories: a local path, or a storage URI pyarrow opens "
                                   "(s3://bucket/prefix, gs://..., hdfs://..., file:///...; S3 query parameters such "
                                   "as ?endpoint_override=host:port&scheme=http allowed). With a URI the run works "
                                   "in a local mirror (run.local_dir) and uploads each finished stage.")
    local_dir: str | None = option(None, "Local mirror of a remote run.runs_dir: the run works in "
                                         "<local_dir>/<name>/ (null: .cache/raycurate/run-mirrors/<sha of runs_dir>). "
                                         "_scratch/ (training checkpoints) lives only here. On a multi-node cluster "
                                         "put it on storage every node mounts (NFS/EFS). Unused for a local runs_dir.")
    seed: int = option(0, "Global seed for samplers that have no seed of their own.")
    progress: bool = option(True, "Show progress bars.")
    force: list[str] = option([], "Stages to re-run even when their outputs are current (or ['all']).")


@dataclasses.dataclass
class RayConfig:
    """How to reach Ray."""

    address: str | None = option(None, "null starts a local Ray; 'auto' joins the cluster of a submitted job.")
    num_cpus: int | None = option(None, "CPUs of a local Ray instance (null: all cores).", ge=1)
    temp_dir: str | None = option(None, "Ray session folder for a local instance (null: Ray's default /tmp/ray).")
    object_store_memory: int | None = option(None, "Object store bytes for a local instance (null: Ray's default).",
                                             ge=1)
    spill_dir: str | None = option(None, "Object spilling folder of a local instance (null: Ray's default).")


@dataclasses.dataclass
class EvalConfig:
    """Held-out evaluation of trained checkpoints (exact match of the final answer and gold-response loss)."""

    max_new_tokens: int = option(96, "Generation budget per held-out question (greedy and sampled).", ge=1)
    batch_size: int = option(32, "Questions per generation batch.", ge=1)
    samples: int = option(4, "Sampled answers per held-out question at eval.temperature (0: greedy only). Their "
                          "accuracy, sampled_exact_match, shows how often a model reproduces what it was taught, "
                          "bad rows included; greedy decoding hides a minority of bad rows.", ge=0)
    temperature: float = option(1.0, "Sampling temperature of the sampled answers.", gt=0)
    seed: int = option(0, "Seed of the sampled answers (each question's samples depend on it and the question id).")
    split: str = option("heldout", "Question set the eval stages score: heldout (what results report) or validation "
                        "(data.validation_questions; what sweeps choose settings on). Results go to "
                        "results.<split> in the manifest.", choices=("heldout", "validation"))
    pool: ActorPoolConfig = option(ActorPoolConfig(num_actors=2, batch_size=50),
                                 "Evaluation workers: num_actors Ray tasks, batch_size questions per call.")
    dtype: str = option(
        "auto", "Precision of the evaluated model. auto: each checkpoint as stored, a LoRA adapter folder merged onto "
        "its base in float32. float32: every weight in float32. bfloat16: the weights in bf16 and a LoRA adapter "
        "folder unmerged, its adapter in float32 beside its bf16 base (nothing of the update rounded away; activations "
        "are bf16); a full checkpoint is cast to bf16, which rounds most of a small fp32 update away (merged LoRA "
        "exports, P2D head deltas). On a SmolLM2-135M LoRA arm bf16 was 1.2-1.3x faster on CPU and changed 6.7% of "
        "the greedy answers, exact match within noise (benchmarks/RESULTS.md). In the stage hash only where a "
        "model loads differently than with auto, so finished runs keep their evaluations.",
        choices=("auto", "float32", "bfloat16"))
    lm_eval_tasks: list[str] = option(
        [], "lm-eval tasks run on each main trained model: raycurate_heldout_em / raycurate_heldout_gold_ll (the "
        "embedded held-out set) and named harness tasks (arc_challenge, hellaswag, mmlu, humaneval, gsm8k, "
        "minerva_math, ifeval; their datasets must be in the local HF cache). Empty: skip lm-eval.")
    lm_eval_limit: int | None = option(None, "Documents per lm-eval task (null: all).", ge=1)
    lm_eval_num_fewshot: int | None = option(None, "Few-shot examples for the named tasks (null: each task's default; "
                                             "the BRIDGE paper uses 5 for MMLU).", ge=0)
    lm_eval_allow_code_execution: bool = option(
        False, "Let lm-eval run model-written code (needed by humaneval / mbpp; run on an isolated machine).")
    lm_eval_domain: str = option("math", "Target domain for the BRIDGE paper's General / Overall averages.",
                                 choices=("math", "code", "instruction"))


def _repeated(key: str, values: list) -> list[str]:
    """A problem naming every value listed more than once in ``values`` (config key ``key``)."""
    twice = sorted({repr(v) for v in values if values.count(v) > 1})
    return [f"{key}: {', '.join(twice)} listed more than once; list each once"] if twice else []


@dataclasses.dataclass
class DemoConfig:
    """What ``raycurate demo`` runs after the shared data preparation."""

    methods: list[str] = option(["sft", "curate", "bridge", "p2d", "bilevel"], "Pipelines the demo runs and "
                                "compares: sft (mixed vs clean SFT), curate (curate.steps toward the trusted set, vs "
                                "random rows at its token budget), bridge (BRIDGE + token baselines), p2d "
                                "(head-guided selection + sparse heads), bilevel (BDS weights, BMO regeneration, "
                                "example-level baselines); [base] alone evaluates only the base model.",
                                items=DEMO_METHODS)

    def config_problems(self) -> list[str]:
        """An empty or repeated method list (checked before anything runs)."""
        if not self.methods:
            return [f"demo.methods: empty; name at least one of {', '.join(DEMO_METHODS[1:])}, or [base] to "
                    "evaluate only the base model"]
        return _repeated("demo.methods", self.methods)


@dataclasses.dataclass
class ProvingGroundConfig:
    """The demo repeated over corpus seeds (``jobs/proving_ground.yaml``): every comparison on several corpora."""

    seeds: list[int] = option([0, 1, 2], "Corpus seeds (data.corpus_seed); each runs proving_ground.pipeline in "
                              "<runs_dir>/<name>/seed-<seed>/ and the summary pools them.")
    pipeline: str = option("demo", "Pipeline each seed runs: demo (every method vs its baseline), curate (the "
                           "composition vs each single step at a matched token budget), or a single method.",
                           choices=tuple(p for p in PIPELINES if p != "proving_ground"))
    train_seeds: list[int] | None = option(
        None, "Training seeds (train.seed: batch order, adapter init) per corpus seed; null: train.seed alone. "
        "Each (corpus seed, train seed) is one run, in seed-<seed>/ at train.seed and seed-<seed>-train-<t>/ "
        "otherwise; the summary adds a t-interval over runs, which includes training noise (the question "
        "bootstrap holds each training fixed).")
    pool_only: bool = option(
        False, "Pool the seeds' runs already in <runs_dir>/<name>/seed-<seed>/ as they are (their manifests and "
        "held-out evaluations) without running anything: for runs made by an older raycurate or with other "
        "overrides, whose stage hashes would not match and would re-run. A seed without a run is an error.")

    def config_problems(self) -> list[str]:
        """An empty or repeated seed list (checked before anything runs)."""
        if not self.seeds:
            return ["proving_ground.seeds: empty; give at least one corpus seed, e.g. [0, 1, 2]"]
        if self.train_seeds is not None and not self.train_seeds:
            return ["proving_ground.train_seeds: empty; give at least one training seed, e.g. [0, 1], or null"]
        return _repeated("proving_ground.seeds", self.seeds) + _repeated("proving_ground.train_seeds",
                                                                         self.train_seeds or [])


@dataclasses.dataclass
class JobConfig:
    """A complete raycurate job."""

    pipeline: str = option("demo", "Pipeline to run.", choices=PIPELINES)
    run: RunConfig = option(RunConfig(), "Run directory and reporting.")
    ray: RayConfig = option(RayConfig(), "Ray connection.")
    data: DataConfig = option(DataConfig(), "Input data, validation and splits.")
    model: ModelConfig = option(ModelConfig(), "Base model and tokenizer.")
    tokenize: TokenizeConfig = option(TokenizeConfig(batch_size=256, gpus_per_actor=0),
                                      "Chat rendering (system prompt) and the actor pool for tokenization (CPU work: "
                                      "no GPUs by default).")
    train: TrainConfig = option(TrainConfig(), "Fine-tuning (Ray Train).")
    eval: EvalConfig = option(EvalConfig(), "Held-out evaluation.")
    demo: DemoConfig = option(DemoConfig(), "Demo contents.")
    proving_ground: ProvingGroundConfig = option(ProvingGroundConfig(), "Seed loop of pipeline proving_ground.")
    bridge: BridgeConfig = option(BridgeConfig(), "BRIDGE token selection (pipeline bridge, and the demo).")
    bridge_pool: ActorPoolConfig = option(ActorPoolConfig(batch_size=32), "Actor pool for BRIDGE scoring.")
    p2d: P2DConfig = option(P2DConfig(), "P2D head scoring, ICL probing and sparse head adaptation.")
    bilevel: BilevelConfig = option(BilevelConfig(),
                                    "Bilevel data weights (BDS), online regeneration (BMO), baselines.")
    p2d_pool: ActorPoolConfig = option(ActorPoolConfig(batch_size=8), "Actor pool for P2D ICL probing and IFD.")
    curate: CurateConfig = option(CurateConfig(), "Composable curation (pipeline curate): example-level steps, then "
                                  "BRIDGE, then one SFT; compared with each step alone at a matched token budget.")

    def runs(self, method: str) -> bool:
        """Whether this job runs ``method``: its own pipeline, the demo with it in ``demo.methods``, or curate with
        a step that uses it (:meth:`CurateConfig.methods`); proving_ground asks of ``proving_ground.pipeline``."""
        pipeline = self.proving_ground.pipeline if self.pipeline == "proving_ground" else self.pipeline
        if pipeline == "demo":
            return method in self.demo.methods
        if pipeline == "curate":
            return method in self.curate.methods()
        return pipeline == method

    def config_problems(self) -> list[str]:
        """Cross-section checks of what the chosen pipeline needs (split names, batch arithmetic)."""
        problems = []
        splits = set(self.data.split_ratios)
        needed: list[tuple[str, str]] = []
        if self.runs("bridge"):
            needed += [("data.split_ratios", name) for name in BRIDGE_SPLITS]
        if self.runs("bilevel"):
            needed += [("bilevel.validation_split", self.bilevel.validation_split),
                       ("bilevel.candidate_split", self.bilevel.candidate_split)]
        if self.runs("p2d") and self.p2d.pool_split is not None:
            needed.append(("p2d.pool_split", self.p2d.pool_split))
        curating = "curate" in (self.pipeline, self.proving_ground.pipeline)
        if curating:
            needed.append(("curate (its pool)", POOL_SPLIT))
            problems.extend(self.curate_problems())
        needs = self.methods_needing_trusted()
        if needs and not self.data.has_trusted() and not self.data.validation_input:
            problems.append(f"data.trusted_input: {' and '.join(needs)} need a trusted set (their papers' target is a "
                            "small hand-checked set, never rows of the pool being curated); give a trusted jsonl / "
                            "parquet file, or data.trusted_rows > 0 on the embedded corpus")
        for key, split in needed:
            if split not in splits:
                problems.append(f"{key}: pipeline {self.pipeline!r} needs a split named {split!r}, but "
                                f"data.split_ratios has only {sorted(splits)}; add it (a 0.0 share is allowed)")
        return problems + self.bds_batch_problems() + self.p2d_problems() + self.eval_problems()

    def curate_steps_run(self) -> list[str]:
        """The curate steps this job runs: pipeline curate's, or the demo's with curate in ``demo.methods``."""
        pipeline = self.proving_ground.pipeline if self.pipeline == "proving_ground" else self.pipeline
        if pipeline == "curate" or (pipeline == "demo" and "curate" in self.demo.methods):
            return list(self.curate.steps)
        return []

    def trains_bds(self) -> bool:
        """Whether this job trains BDS weights: bilevel's bds / online methods, or curate's bds step."""
        pipeline = self.proving_ground.pipeline if self.pipeline == "proving_ground" else self.pipeline
        bilevel = pipeline != "curate" and self.runs("bilevel") and bool({"bds", "online"} & set(self.bilevel.methods))
        return bilevel or "bds" in self.curate_steps_run()

    def bds_batch_problems(self) -> list[str]:
        """BDS splits every effective batch into bilevel.val_batch validation rows and the rest candidates, each
        split evenly over the workers (what the Ray Train workers check when they start)."""
        if not self.trains_bds():
            return []
        batch, workers = self.train.effective_batch_size, self.train.num_workers
        val = self.bilevel.val_batch if self.bilevel.val_batch is not None else batch // 2
        cand = batch - val
        default = " (bilevel.val_batch is null: half the batch)" if self.bilevel.val_batch is None else ""
        if cand < 1:
            return [f"bilevel.val_batch: {val} leaves no candidate rows in train.effective_batch_size={batch}; set it "
                    f"below {batch}, e.g. {batch // 2}"]
        if cand < 2 and self.bilevel.omega_optimizer.startswith("sparse_"):
            return [f"bilevel.val_batch: {val} leaves 1 candidate row per step of train.effective_batch_size={batch}, "
                    f"and omega_optimizer={self.bilevel.omega_optimizer} compares each candidate with the others of "
                    "its batch; lower bilevel.val_batch or raise train.effective_batch_size"]
        if val % workers or cand % workers:
            return [f"bilevel.val_batch: {val} validation + {cand} candidate rows per step{default} must each be a "
                    f"multiple of train.num_workers={workers} (every worker takes an equal share); set "
                    f"bilevel.val_batch to a multiple of {workers}, or train.effective_batch_size to a multiple of "
                    f"{2 * workers}"]
        return []

    def p2d_problems(self) -> list[str]:
        """The proxy's full-batch fine-tuning splits p2d.proxy_examples evenly over the workers."""
        rows, workers = self.p2d.proxy_examples, self.train.num_workers
        if not self.runs("p2d") or self.p2d.task_model or rows % workers == 0:
            return []
        return [f"p2d.proxy_examples: {rows} is not a multiple of train.num_workers={workers} (each full-batch proxy "
                f"step splits them evenly over the workers); use {rows - rows % workers or workers}"]

    def eval_problems(self) -> list[str]:
        """Questions the evaluations need: the embedded corpus evaluates every trained model on eval.split, and the
        local lm-eval tasks read its held-out set."""
        problems = []
        own_data = bool(self.data.input_paths())
        if self.eval.split == "validation" and (own_data or not self.data.validation_questions):
            problems.append("eval.split: validation questions exist only on the embedded corpus, with "
                            "data.validation_questions > 0; set data.validation_questions=200 (embedded corpus) or "
                            "eval.split=heldout")
        elif self.eval.split == "heldout" and not own_data and not self.data.heldout_rows:
            problems.append("data.heldout_rows: 0 leaves no held-out questions to evaluate the trained models on; "
                            "set it above 0 (default 200)")
        local = [t for t in self.eval.lm_eval_tasks if t in LOCAL_LM_EVAL_TASKS]
        if local and (own_data or not self.data.heldout_rows):
            problems.append(f"eval.lm_eval_tasks: {local} run over the embedded corpus's held-out questions, which "
                            "this job does not have (data.input set, or data.heldout_rows=0); use named harness "
                            "tasks such as arc_challenge,hellaswag,mmlu")
        code = [t for t in self.eval.lm_eval_tasks if t.startswith(CODE_TASKS)]
        if code and not self.eval.lm_eval_allow_code_execution:
            problems.append(f"eval.lm_eval_tasks: {code} run model-written code; set "
                            "eval.lm_eval_allow_code_execution=true (on an isolated machine) or drop them")
        return problems

    def methods_needing_trusted(self) -> list[str]:
        """The methods of this job that aim at a trusted set and have no fallback in their paper (BDS, BMO, LESS
        and DSIR: the bilevel pipeline, or curate's bds step) or by construction (curate's reference and mask steps);
        BRIDGE and P2D fall back to pool rows as theirs do."""
        pipeline = self.proving_ground.pipeline if self.pipeline == "proving_ground" else self.pipeline
        needs = []
        if pipeline == "curate" or (pipeline == "demo" and "curate" in self.demo.methods):
            needs = [f"the {s} step" for s in self.curate.steps if s in ("reference", "bds", "mask")]
        if pipeline != "curate" and self.runs("bilevel"):
            needs.append("bilevel (BDS, BMO, LESS, DSIR)")
        return needs

    def curate_problems(self) -> list[str]:
        """What pipeline curate needs of the other sections: every step curates the same pool (the selection
        split), and comparing needs the embedded corpus's held-out set."""
        problems = []
        steps = self.curate.steps
        if "bds" in steps and self.bilevel.candidate_split != POOL_SPLIT:
            problems.append(f"bilevel.candidate_split: curate's bds step ranks the {POOL_SPLIT!r} split (the pool "
                            f"every step curates), got {self.bilevel.candidate_split!r}; set it to {POOL_SPLIT!r}")
        if "p2d" in steps and self.p2d.pool_split not in (None, POOL_SPLIT):
            problems.append(f"p2d.pool_split: curate's p2d step scores the {POOL_SPLIT!r} split, got "
                            f"{self.p2d.pool_split!r}; set it to null or {POOL_SPLIT!r}")
        if self.curate.compare and self.data.input_paths():
            problems.append("curate.compare: comparing arms needs the embedded corpus's held-out set; with your own "
                            "data.input set curate.compare=false (the composition is still trained)")
        return problems
