"""Shared by the training-loop tests: a tiny Llama checkpoint writer and a single-process stand-in for Ray Train's
session."""

from __future__ import annotations

import contextlib
import os
import shutil

import torch


class Crash(RuntimeError):
    """The simulated worker failure raised by :class:`LocalSession`."""


class LocalSession:
    """Keeps reported checkpoints in ``store`` (one folder per step); can crash after the n-th one."""

    rank, local_rank, world_size, device = 0, 0, 1, torch.device("cpu")

    def __init__(self, store: str, crash_after_checkpoints: int | None = None) -> None:
        self.store, self.crash_after = store, crash_after_checkpoints
        self.reports: list[dict] = []
        os.makedirs(store, exist_ok=True)

    @contextlib.contextmanager
    def restore_dir(self):
        saved = sorted(os.listdir(self.store))
        yield os.path.join(self.store, saved[-1]) if saved else None

    latest_checkpoint_dir = restore_dir  # one process: every reported checkpoint is already in the store

    def report(self, metrics, checkpoint_dir):
        self.reports.append(metrics)
        if checkpoint_dir is not None:
            shutil.copytree(checkpoint_dir, os.path.join(self.store, f"step_{metrics['step']:05d}"))
            if self.crash_after is not None and len(os.listdir(self.store)) == self.crash_after:
                raise Crash("simulated worker failure")


VOCAB = 64


def write_tiny_llama(path: str, tie_word_embeddings: bool = False) -> str:
    """A 2-layer GQA Llama (vocab 64: <pad>=0, <s>=1, </s>=2, w3..w63) + word-level tokenizer, saved at ``path``;
    ``tie_word_embeddings`` shares the LM head with the embedding (as SmolLM2 does)."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=tie_word_embeddings)
    LlamaForCausalLM(config).save_pretrained(path)
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, VOCAB)}}
    tokenizer = Tokenizer(WordLevel(vocab, unk_token="<pad>"))
    tokenizer.pre_tokenizer = Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>",
                            pad_token="<pad>").save_pretrained(path)
    return path
