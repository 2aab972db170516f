"""The embedded benchmark corpus: generated SFT data with ground truth on every row (docs/design.md, "The proving
ground").

One seeded generator, split by concern. Every row is drawn from a few ``random.Random`` streams in a fixed
order, so the modules move code, never draws: a change in draw order would silently change the corpus that the
committed results and stage hashes are tied to (``scripts/corpus_digest.py`` prints digests to compare).

* :mod:`.benchmark`: :func:`generate_corpus` and :func:`corpus_summary`;
* :mod:`.heldout`: :func:`generate_heldout` and :func:`generate_validation_questions`;
* :mod:`.trusted`: :func:`generate_trusted` (the trusted set every method aims at);
* :mod:`.pretraining`: :func:`generate_pretraining_texts`;
* :mod:`.jsonl`: :func:`write_jsonl` and :func:`bad_input_lines`;
* :mod:`.domains` (domain mix and dispatch), :mod:`.math_tasks`, :mod:`.code_tasks`, :mod:`.instruction_tasks`
  (one builder per domain), :mod:`.corruptions` (the seven kinds) and :mod:`.rows` (the shared task and row).

Three domains:

* ``math``: one- and two-step word problems with small numbers (a look-up, +, -, small products) that a ~1M-parameter
  model can learn in the demo's fine-tuning budget. The prompt mixes the relevant fact sentences with distractors:
  always one of the same form about another person (``"Omar has 10 cards."`` next to ``"Felix has 4 cards."``),
  so answering needs the right entity, plus 0-2 other sentences with numbers; the response has one worked step per
  line (``"She has 3 boxes of 4 apples, so 3 * 4 = 12 apples."``, or ``"Omar has 10 cards."`` for a look-up) and
  ends with ``#### <answer>``.
* ``code``: "Write a Python function ..." tasks answered by a correct function, one statement per line.
* ``instruction``: instruction tasks answered with sentences or list items (``"- ..."`` / ``"1. ..."``).

A known number of rows is corrupted, and every row says how in ``label``:

=========================  ==================  ===============================================================
corruption                 domains             what changes
=========================  ==================  ===============================================================
``wrong_final_answer``     math, code          math: the ``####`` value is wrong, all steps correct;
                                               code: the last ``return`` line returns a wrong expression
``wrong_intermediate_step``  math              one step's result is wrong and the error propagates to ``####``
``swapped_entity``         math                the solution uses the same-form distractor's number (the other
                                               person's count) instead of the asked person's
``off_topic``              all                 the response belongs to an unrelated task
``truncated``              all                 the response stops before its final line (no ``####``,
                                               no final ``return``)
``unsafe``                 all                 a line starting ``[UNSAFE]`` (a harmless placeholder for
                                               dangerous advice) is inserted; code gets it as a comment
``near_duplicate``         all                 prompt and response copy a clean row of the same domain, with
                                               a tiny prompt perturbation; ``label.source_id`` names it
=========================  ==================  ===============================================================

Row schema (types are the same on every row, no nulls, so pyarrow infers one schema)::

    {"id": "bench-s0-000001", "prompt": str, "response": str, "domain": "math" | "code" | "instruction",
     "label": {"clean": bool, "corruption": str ("none" when clean),
               "answer": str (gold final answer for math, also on corrupted rows; "" otherwise),
               "source_id": str ("" unless near_duplicate),
               "relevant_spans": list[list[int]] (char [start, end) spans of the fact / question / task
                                                  sentences in the prompt),
               "distractor_spans": list[list[int]] (char spans of distractor sentences; [] for non-math),
               "corrupted_spans": list[list[int]] (char spans of the response that differ from the clean
                                                   response; [] on clean rows and near duplicates)}}

Everything is deterministic from ``seed``; the corpus, the held-out set and the pre-training texts come from
separate random streams. Held-out problems use their own pool of person names, which the corpus and the
pre-training texts never use, so no held-out prompt can equal a corpus prompt.
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
