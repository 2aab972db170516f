"""Causal-LM pre-training of a tiny preset, cached on disk as a local HF checkpoint, and the embedded model's recipe.

:func:`pack_token_blocks` and :func:`pretrain_causal_lm` (packed blocks, AdamW, warm-up + cosine) train a model;
:func:`ensure_base_model` caches one per :func:`base_model_key` under an :func:`exclusive_lock`;
:func:`pretrain_curriculum`, :func:`recipe_texts` and :func:`build_recipe_checkpoint` are the recipe behind the
committed ``raycurate/models/embedded/`` checkpoint (texts: :mod:`raycurate.data.pretrain_texts`).  Decisions:
docs/design.md, "Tiny base model" and "Embedded base model".
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from raycurate.models.optim import cosine_with_warmup, decay_param_groups

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

CACHE_FORMAT_VERSION = 2  # 2: warmup (step + 1) / (warmup + 1) of models.optim.cosine_with_warmup
LR_FLOOR = 0.1  # the cosine decays to 10% of lr
METADATA_FILE = "pretrain_metadata.json"


def pack_token_blocks(tokenizer: PreTrainedTokenizerBase, texts: list[str], max_len: int) -> torch.Tensor:
    """Tokenize ``texts`` as BOS + text + EOS, concatenate, and cut into full blocks.

    Args:
        tokenizer: Tokenizer with bos/eos ids (BOS is skipped when it has none).
        texts: Documents.
        max_len: Block length T.

    Returns:
        Long tensor of shape (N, T); the tail shorter than T is dropped.
    """
    import torch

    prefix = [] if tokenizer.bos_token_id is None else [tokenizer.bos_token_id]
    encoded = tokenizer(list(texts), add_special_tokens=False)["input_ids"]
    stream = [token for ids in encoded for token in (prefix + ids + [tokenizer.eos_token_id])]
    n_blocks = len(stream) // max_len
    if n_blocks == 0:
        raise ValueError(
            f"the texts give {len(stream)} tokens, fewer than one block of max_len={max_len}; "
            "pass more texts or a smaller max_len"
        )
    return torch.tensor(stream[: n_blocks * max_len], dtype=torch.long).view(n_blocks, max_len)


def causal_lm_loss(logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy.

    Args:
        logits: (B, T, V) logits; position t predicts input_ids[:, t + 1].
        input_ids: (B, T) token ids.

    Returns:
        Scalar loss over the B * (T - 1) predictions.
    """
    import torch.nn.functional as F

    vocab = logits.shape[-1]
    return F.cross_entropy(logits[:, :-1].reshape(-1, vocab).float(), input_ids[:, 1:].reshape(-1))


def _adamw(model: PreTrainedModel, lr: float, weight_decay: float) -> Any:
    """AdamW (betas 0.9/0.95) with weight decay on the matrices only (:func:`decay_param_groups`)."""
    import torch

    return torch.optim.AdamW(decay_param_groups(model, weight_decay), lr=lr, betas=(0.9, 0.95), eps=1e-8)


def _training_setup(model: PreTrainedModel, seed: int, lr: float, weight_decay: float,
                    steps: int) -> tuple[torch.Generator, Any, int, torch.device]:
    """(seeded generator, :func:`_adamw`, warm-up steps (5% of ``steps``), the model's device); puts the model in
    training mode."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    optimizer = _adamw(model, lr, weight_decay)
    model.train()
    return generator, optimizer, max(1, steps // 20), next(model.parameters()).device


def _batches(n_blocks: int, batch_size: int, steps: int, generator: torch.Generator) -> Iterator[torch.Tensor]:
    """Block indices per step: epochs of seeded permutations, ``batch_size`` indices at a time."""
    import torch

    order = torch.empty(0, dtype=torch.long)
    for _ in range(steps):
        while order.numel() < batch_size:
            order = torch.cat([order, torch.randperm(n_blocks, generator=generator)])
        yield order[:batch_size]
        order = order[batch_size:]


def _training_step(model: PreTrainedModel, optimizer: Any, input_ids: torch.Tensor, lr: float) -> float:
    """One clipped AdamW step on the next-token loss of ``input_ids`` (B, T) at learning rate ``lr``; its loss."""
    import torch

    for group in optimizer.param_groups:
        group["lr"] = lr
    loss = causal_lm_loss(model(input_ids=input_ids, use_cache=False).logits, input_ids)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    return loss.item()


@contextlib.contextmanager
def _torch_threads(num_threads: int | None) -> Iterator[None]:
    import torch

    previous = torch.get_num_threads()
    if num_threads is not None:
        torch.set_num_threads(num_threads)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def pretrain_causal_lm(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    texts: list[str],
    *,
    steps: int,
    batch_size: int = 16,
    lr: float = 3e-3,
    max_len: int = 128,
    seed: int = 0,
    weight_decay: float = 0.1,
    num_threads: int | None = None,
    progress: bool = True,
) -> list[float]:
    """Train ``model`` in place on packed ``texts`` with AdamW + warm-up/cosine.

    Args:
        model: Causal LM (trained in place, left in eval mode).
        tokenizer: Its tokenizer.
        texts: Training documents.
        steps: Optimizer steps.
        batch_size: Blocks per step.
        lr: Peak learning rate.
        max_len: Block length in tokens.
        seed: Seed of the block order.
        weight_decay: AdamW weight decay on weight matrices and embeddings.
        num_threads: ``torch.set_num_threads`` during training (restored after); ``None`` keeps the current
            setting (which honours ``OMP_NUM_THREADS``, as set by Ray for its workers).
        progress: Show a tqdm progress bar.

    Returns:
        The training loss of every step (length ``steps``).
    """
    from tqdm.auto import tqdm

    blocks = pack_token_blocks(tokenizer, texts, max_len)  # (N, T)
    generator, optimizer, warmup, device = _training_setup(model, seed, lr, weight_decay, steps)
    losses: list[float] = []
    with _torch_threads(num_threads):
        bar = tqdm(_batches(len(blocks), batch_size, steps, generator), total=steps, disable=not progress,
                   desc="pretrain", unit="step")
        for step, index in enumerate(bar):
            multiplier = cosine_with_warmup(step, warmup, steps, floor=LR_FLOOR)
            losses.append(_training_step(model, optimizer, blocks[index].to(device), lr * multiplier))
            bar.set_postfix(loss=f"{losses[-1]:.3f}")
    model.eval()
    return losses


def texts_fingerprint(texts: list[str]) -> str:
    """SHA-256 of the texts (order-sensitive), for use as ``data_key``."""
    digest = hashlib.sha256()
    for text in texts:
        digest.update(text.encode("utf-8"))
        digest.update(b"\x00")
    return digest.hexdigest()


def base_model_key(**settings: Any) -> str:
    """16-hex-digit hash of the settings that determine a cached base model."""
    payload = json.dumps({"format": CACHE_FORMAT_VERSION, **settings}, sort_keys=True)
    return hashlib.sha256(payload.encode("utf-8")).hexdigest()[:16]


@contextlib.contextmanager
def exclusive_lock(lock_path: str) -> Iterator[None]:
    """Hold an exclusive advisory lock on ``lock_path``, so two processes filling one cache folder build it once
    (no-op where ``fcntl`` is unavailable: the final atomic rename alone then keeps the folder whole)."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - non-POSIX: rely on the atomic rename alone
        yield
        return
    with open(lock_path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _is_complete(path: str) -> bool:
    return os.path.isfile(os.path.join(path, METADATA_FILE))


def _build_base_model(
    out_dir: str, preset: str, texts: list[str], settings: dict[str, Any], num_threads: int | None, progress: bool
) -> None:
    """Train tokenizer and model and write the checkpoint (weights, config, tokenizer, metadata) into ``out_dir``."""
    from raycurate.models.tiny import build_tiny_model
    from raycurate.models.tokenizer import train_tokenizer

    start = time.perf_counter()
    tokenizer = train_tokenizer(texts, vocab_size=settings["vocab_size"], chat_template=settings["chat_template"])
    model = build_tiny_model(preset, tokenizer, seed=settings["seed"])
    losses = pretrain_causal_lm(
        model, tokenizer, texts, steps=settings["steps"], batch_size=settings["batch_size"], lr=settings["lr"],
        max_len=settings["max_len"], seed=settings["seed"], num_threads=num_threads, progress=progress,
    )
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    tail = losses[-max(1, len(losses) // 10):]
    metadata = {
        "preset": preset,
        "settings": settings,
        "num_texts": len(texts),
        "vocab_size": len(tokenizer),
        "initial_loss": losses[0] if losses else None,
        "final_loss": sum(tail) / len(tail) if losses else None,
        "losses": losses,
        "seconds": round(time.perf_counter() - start, 3),
        "created_unix": time.time(),
    }
    with open(os.path.join(out_dir, METADATA_FILE), "w") as handle:
        json.dump(metadata, handle, indent=1)


def ensure_base_model(
    preset: str,
    cache_dir: str,
    texts_fn: Callable[[], list[str]],
    *,
    steps: int = 300,
    seed: int = 0,
    vocab_size: int = 2048,
    chat_template: bool = True,
    data_key: str | None = None,
    batch_size: int = 16,
    lr: float = 3e-3,
    max_len: int = 128,
    num_threads: int | None = None,
    progress: bool = True,
) -> str:
    """Return a local HF checkpoint dir of ``preset`` pre-trained on ``texts_fn()``, building it on first use.

    Args:
        preset: A key of ``TINY_PRESETS``.
        cache_dir: Cache root; the checkpoint goes to ``<cache_dir>/base-models/<preset>-<key>``.
        texts_fn: Returns the pre-training texts; called only when the checkpoint must be built (or to fingerprint
            the texts when ``data_key`` is None).
        steps, seed, vocab_size, chat_template, batch_size, lr, max_len: Tokenizer and training settings (all part
            of the cache key).
        data_key: A string that identifies the texts (e.g. corpus name + seed + row count); ``None`` hashes the
            texts themselves.
        num_threads: Torch threads while training (not part of the key); ``None`` keeps torch's setting.
        progress: Show a progress bar while training.

    Returns:
        Path of the checkpoint directory (``model.safetensors``, ``config.json``, tokenizer files and
        ``pretrain_metadata.json`` with initial/final loss and seconds).
    """
    from raycurate.models.tiny import TINY_PRESETS

    if preset not in TINY_PRESETS:
        raise ValueError(f"unknown tiny preset {preset!r}; valid presets: {sorted(TINY_PRESETS)}")
    texts = None
    if data_key is None:
        texts = list(texts_fn())
        data_key = "sha256:" + texts_fingerprint(texts)
    settings = {
        "preset": preset, "steps": steps, "seed": seed, "vocab_size": vocab_size, "chat_template": chat_template,
        "data_key": data_key, "batch_size": batch_size, "lr": lr, "max_len": max_len,
    }
    root = os.path.join(os.path.abspath(cache_dir), "base-models")
    final_dir = os.path.join(root, f"{preset}-{base_model_key(**settings)}")
    if _is_complete(final_dir):
        return final_dir
    os.makedirs(root, exist_ok=True)
    with exclusive_lock(final_dir + ".lock"):
        if _is_complete(final_dir):  # another process built it while we waited
            return final_dir
        texts = list(texts_fn()) if texts is None else texts
        tmp_dir = tempfile.mkdtemp(prefix=f".tmp-{preset}-", dir=root)
        try:
            _build_base_model(tmp_dir, preset, texts, settings, num_threads, progress)
            try:
                os.replace(tmp_dir, final_dir)
            except OSError:
                # Without fcntl a racing process may have published first; its checkpoint is equivalent.
                if not _is_complete(final_dir):
                    raise
        finally:
            shutil.rmtree(tmp_dir, ignore_errors=True)
    return final_dir


# --------------------------------------------------------------------------------------------- block curriculum

# (share of the steps, block length, blocks per step): 1k tokens per step throughout.  Short blocks first (most
# updates, cheap, where lookups and induction form), then blocks as long as the longest probe prompt.
DEFAULT_CURRICULUM: tuple[tuple[float, int, int], ...] = ((0.6, 128, 8), (0.25, 512, 2), (0.15, 1024, 1))


def curriculum_schedule(steps: int, phases: tuple[tuple[float, int, int], ...]) -> list[tuple[int, int, int]]:
    """(steps, block length, batch size) per phase; the shares are rounded so that the steps add up exactly.

    Args:
        steps: Total optimizer steps.
        phases: (share of steps, block length, blocks per step) per phase, shares > 0.

    Returns:
        One (n_steps, max_len, batch_size) per phase, ``sum(n_steps) == steps``.
    """
    if steps < len(phases) or not phases or any(share <= 0 for share, _, _ in phases):
        raise ValueError(f"need steps >= number of phases and positive shares, got steps={steps}, phases={phases}")
    total = sum(share for share, _, _ in phases)
    bounds = [round(steps * sum(s for s, _, _ in phases[: i + 1]) / total) for i in range(len(phases))]
    starts = [0] + bounds[:-1]
    return [(end - start, length, batch) for start, end, (_, length, batch) in zip(starts, bounds, phases)]


def pretrain_curriculum(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    texts: list[str],
    *,
    steps: int,
    phases: tuple[tuple[float, int, int], ...] = DEFAULT_CURRICULUM,
    lr: float = 3e-3,
    seed: int = 0,
    weight_decay: float = 0.1,
    num_threads: int | None = None,
    on_step: Callable[[int, int, float], None] | None = None,
    stop_after: int | None = None,
) -> list[float]:
    """Train ``model`` in place with a block-length curriculum under one warm-up/cosine schedule.

    The texts are packed once (BOS + text + EOS); each phase cuts the same stream into its block length.

    Args:
        model: Causal LM (trained in place, left in eval mode).
        tokenizer: Its tokenizer.
        texts: Training documents.
        steps: Total optimizer steps over all phases.
        phases: (share of steps, block length, blocks per step) per phase, see :func:`curriculum_schedule`.
        lr: Peak learning rate.
        seed: Seed of the block order.
        weight_decay: AdamW weight decay on matrices and embeddings.
        num_threads: Torch threads while training; ``None`` keeps the current setting.
        on_step: Called as ``on_step(step, block_len, loss)`` after every step (logging).
        stop_after: Stop after this many steps (a prefix of the same run: same schedule, same batches).

    Returns:
        The training loss of every step run (length ``steps``, or ``stop_after`` when smaller).
    """

    schedule = curriculum_schedule(steps, phases)
    stream = pack_token_blocks(tokenizer, texts, 1).flatten()  # (N,)
    generator, optimizer, warmup, device = _training_setup(model, seed, lr, weight_decay, steps)
    losses: list[float] = []
    with _torch_threads(num_threads):
        for n_steps, max_len, batch_size in schedule:
            n_blocks = stream.numel() // max_len
            if n_blocks < batch_size:
                raise ValueError(f"the texts give {n_blocks} blocks of {max_len} tokens, fewer than a batch")
            blocks = stream[: n_blocks * max_len].view(n_blocks, max_len)
            for index in _batches(n_blocks, batch_size, n_steps, generator):
                step = len(losses)
                if stop_after is not None and step >= stop_after:
                    break
                losses.append(_training_step(model, optimizer, blocks[index].to(device),
                                             lr * cosine_with_warmup(step, warmup, steps, floor=LR_FLOOR)))
                if on_step is not None:
                    on_step(step, max_len, losses[-1])
    model.eval()
    return losses


RECIPE_FILE = "recipe.json"
LOSS_CURVE_FILE = "loss_curve.csv"


def recipe_texts(n_episodes: int, seed: int, mix: dict[str, float] | None = None) -> list[str]:
    """The ICL recipe's pre-training texts (:func:`raycurate.data.pretrain_texts.pretraining_mixture`)."""
    from raycurate.data.pretrain_texts import pretraining_mixture

    return pretraining_mixture(n_episodes, seed, mix)


def build_recipe_checkpoint(
    out_dir: str,
    *,
    preset: str = "tiny-llama-2l",
    steps: int = 3000,
    n_episodes: int = 20000,
    lr: float = 3e-3,
    seed: int = 0,
    vocab_size: int = 2048,
    phases: tuple[tuple[float, int, int], ...] = DEFAULT_CURRICULUM,
    mix: dict[str, float] | None = None,
    num_threads: int | None = None,
    command: str = "",
    save_every: int = 0,
) -> dict[str, Any]:
    """Run the embedded model's recipe: mixture texts -> tokenizer -> curriculum pre-training -> checkpoint.

    Writes weights, config, tokenizer, ``recipe.json`` (settings, command, data hash, losses) and
    ``loss_curve.csv`` into ``out_dir`` (created), flushing the curve as training goes; with ``save_every`` > 0
    also a snapshot under ``out_dir/partial`` every that many steps.

    Returns:
        The recipe record written to ``recipe.json``.
    """
    from raycurate.models.tiny import build_tiny_model
    from raycurate.models.tokenizer import train_tokenizer

    start = time.perf_counter()
    os.makedirs(out_dir, exist_ok=True)
    texts = recipe_texts(n_episodes, seed, mix)
    tokenizer = train_tokenizer(texts, vocab_size=vocab_size, chat_template=True)
    model = build_tiny_model(preset, tokenizer, seed=seed)
    curve = open(os.path.join(out_dir, LOSS_CURVE_FILE), "w")
    curve.write("step,block_len,loss,seconds\n")

    def log_step(step: int, block_len: int, loss: float) -> None:
        curve.write(f"{step},{block_len},{loss:.5f},{time.perf_counter() - start:.1f}\n")
        if step % 50 == 0:
            curve.flush()
        if save_every and step > 0 and step % save_every == 0:  # a usable snapshot if the run is cut short
            model.save_pretrained(os.path.join(out_dir, "partial"))
            tokenizer.save_pretrained(os.path.join(out_dir, "partial"))

    try:
        losses = pretrain_curriculum(model, tokenizer, texts, steps=steps, phases=phases, lr=lr, seed=seed,
                                     num_threads=num_threads, on_step=log_step)
    finally:
        curve.close()
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    record = {
        "command": command, "preset": preset, "steps": steps, "n_episodes": n_episodes, "lr": lr, "seed": seed,
        "vocab_size": len(tokenizer), "phases": [list(p) for p in phases], "mix": mix,
        "data_sha256": texts_fingerprint(texts), "n_texts": len(texts),
        "n_parameters": sum(p.numel() for p in model.parameters()),
        "context": max(length for _, length, _ in phases), "seconds": round(time.perf_counter() - start, 1),
        "losses": [round(x, 5) for x in losses],
    }
    with open(os.path.join(out_dir, RECIPE_FILE), "w") as handle:
        json.dump(record, handle, indent=1)
    return record
