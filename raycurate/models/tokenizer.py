"""A download-free byte-level BPE tokenizer with chat special tokens: :func:`train_tokenizer`.

Deterministic for the same texts and settings; special tokens ``<|bos|>``, ``<|eos|>``, ``<|pad|>``, ``<|user|>``,
``<|assistant|>``, ``<|system|>``, ``<|end|>`` (ids 0-6); ``tokenizer(text)`` never adds BOS or EOS, and the chat
template renders ``<|role|>`` + content + ``<|end|>`` per turn, so a prompt's rendering is an exact token prefix of
the whole conversation's.  Why, and how rows use it: docs/design.md, "Tiny base model"; :mod:`raycurate.data.tokenize`.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

BOS_TOKEN = "<|bos|>"
EOS_TOKEN = "<|eos|>"
PAD_TOKEN = "<|pad|>"
USER_TOKEN = "<|user|>"
ASSISTANT_TOKEN = "<|assistant|>"
SYSTEM_TOKEN = "<|system|>"
END_TOKEN = "<|end|>"
SPECIAL_TOKENS = [BOS_TOKEN, EOS_TOKEN, PAD_TOKEN, USER_TOKEN, ASSISTANT_TOKEN, SYSTEM_TOKEN, END_TOKEN]

CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] not in ['system', 'user', 'assistant'] -%}"
    "{{ raise_exception('unknown chat role ' ~ message['role'] ~ '; use system, user or assistant') }}"
    "{%- endif -%}"
    "{{ '<|' ~ message['role'] ~ '|>' ~ message['content'] ~ '<|end|>' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|assistant|>' }}{%- endif -%}"
)


def _min_vocab_size() -> int:
    # 256 byte symbols of the byte-level alphabet plus the special tokens.
    return 256 + len(SPECIAL_TOKENS)


def train_tokenizer(
    texts: Iterable[str], vocab_size: int = 2048, chat_template: bool = True, min_frequency: int = 2
) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE tokenizer on ``texts``.

    Args:
        texts: Training texts (any iterable; consumed once).
        vocab_size: Target vocabulary size including the special tokens and the 256 byte symbols. The result may
            be smaller when the texts do not support that many merges.
        chat_template: Attach the system/user/assistant chat template described in the module docstring.
        min_frequency: Minimum pair count for a merge.

    Returns:
        A ``PreTrainedTokenizerFast`` with bos/eos/pad set that adds no special tokens on its own.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    if vocab_size < _min_vocab_size():
        raise ValueError(
            f"vocab_size={vocab_size} is too small: a byte-level BPE needs at least {_min_vocab_size()} "
            "(256 bytes + special tokens); use 512 or more."
        )
    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    core.train_from_iterator(texts, trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        additional_special_tokens=[USER_TOKEN, ASSISTANT_TOKEN, SYSTEM_TOKEN, END_TOKEN],
        add_bos_token=False,
        add_eos_token=False,
        padding_side="right",
        clean_up_tokenization_spaces=False,
    )
    if chat_template:
        tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer
