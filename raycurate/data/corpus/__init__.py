"""The embedded benchmark corpus: generated SFT rows (math, code, instruction) with ground truth on every row.

:mod:`.benchmark` (:func:`generate_corpus`, :func:`corpus_summary`), :mod:`.heldout` (:func:`generate_heldout`,
:func:`generate_validation_questions`), :mod:`.trusted` (:func:`generate_trusted`), :mod:`.pretraining`
(:func:`generate_pretraining_texts`), :mod:`.jsonl` (:func:`write_jsonl`, :func:`bad_input_lines`); underneath,
:mod:`.domains` (mix and dispatch), :mod:`.math_tasks`, :mod:`.code_tasks`, :mod:`.instruction_tasks`,
:mod:`.corruptions` (the seven kinds) and :mod:`.rows` (the shared task and row).  One seeded generator split by
concern: the modules move code, never draws (``scripts/corpus_digest.py`` checks).  Domains, corruption kinds, the
row schema and determinism: docs/data.md, "The embedded corpus"; why: docs/design.md, "The proving ground".
"""

from raycurate.data.corpus.benchmark import corpus_summary, generate_corpus
from raycurate.data.corpus.corruptions import CORRUPTION_KINDS, CORRUPTIONS_BY_DOMAIN
from raycurate.data.corpus.domains import DEFAULT_DOMAIN_WEIGHTS, DOMAINS
from raycurate.data.corpus.heldout import generate_heldout, generate_validation_questions
from raycurate.data.corpus.jsonl import BAD_LINE_KINDS, bad_input_lines, write_jsonl
from raycurate.data.corpus.math_tasks import MAX_RESULT
from raycurate.data.corpus.pretraining import generate_pretraining_texts
from raycurate.data.corpus.trusted import generate_trusted

__all__ = [
    "BAD_LINE_KINDS",
    "CORRUPTIONS_BY_DOMAIN",
    "CORRUPTION_KINDS",
    "DEFAULT_DOMAIN_WEIGHTS",
    "DOMAINS",
    "MAX_RESULT",
    "bad_input_lines",
    "corpus_summary",
    "generate_corpus",
    "generate_heldout",
    "generate_pretraining_texts",
    "generate_trusted",
    "generate_validation_questions",
    "write_jsonl",
]
