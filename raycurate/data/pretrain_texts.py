"""Seeded pre-training episodes that teach a tiny model to learn in context and to read the prompt's facts.

An episode is one string of several chat examples rendered as rows and P2D's probe render them
(:func:`render_example`, :func:`render_episode`), sharing a latent element only the earlier examples reveal, so
attending back is the cheapest way to lower the loss: :func:`lookup_episode` (facts with distractors),
:func:`rule_episode` (a hidden arithmetic rule), :func:`mapping_episode` (induction ``A B ... A -> B``),
:func:`copy_episode`, :func:`worked_episode` (worked fact + distractor problems) and :func:`domain_episodes` (the
benchmark's clean texts).  :func:`pretraining_mixture` draws them with seeded weights for the embedded model's
recipe (:mod:`raycurate.models.pretrain`); why: docs/design.md, "Embedded base model".
"""

from __future__ import annotations

import random
from collections.abc import Callable

from raycurate.data.corpus import generate_pretraining_texts

USER, ASSISTANT, END, EOS = "<|user|>", "<|assistant|>", "<|end|>", "<|eos|>"

DEFAULT_MIX: dict[str, float] = {
    "lookup": 0.2, "rule": 0.15, "mapping": 0.15, "copy": 0.05, "worked": 0.15, "domain": 0.3,
}
INSTRUCTIONS = (
    "Solve the following problems. Show your work and end with '#### answer'.",
    "Answer each question using the facts given.",
    "Follow the pattern of the examples.",
    "Complete the task.",
)
_NAMES = ("Ana", "Ben", "Chen", "Dara", "Eli", "Fay", "Gus", "Hana", "Ivo", "Jin", "Kai", "Lena", "Milo", "Nia",
          "Omar", "Pia", "Raj", "Sara", "Timo", "Uma", "Vera", "Wes", "Xia", "Yuri", "Zane", "Ada", "Bo", "Cleo")
_ATTRIBUTES = ("age", "favorite color", "house number", "pet", "city", "lucky number", "bike color", "team",
               "score", "locker number", "book count", "street")
_WORDS = ("apple", "river", "stone", "cloud", "lamp", "tiger", "piano", "garden", "rocket", "window", "candle",
          "forest", "mirror", "pencil", "button", "island", "ladder", "basket", "violin", "meadow", "shadow",
          "bridge", "castle", "feather", "marble", "comet", "harbor", "lemon", "orbit", "velvet", "spoon", "tunnel",
          "red", "blue", "green", "gold", "silver", "purple", "orange", "black", "white", "pink")
_OBJECTS = ("apples", "coins", "books", "stickers", "marbles", "pens", "cards", "shells", "stamps", "cookies")
_ANSWER_FORMATS = ("#### {v}", "The answer is {v}.\n#### {v}", "So the answer is {v}.\n#### {v}",
                   "Answer: {v}\n#### {v}")


def render_example(prompt: str, response: str) -> str:
    """One chat example exactly as a tokenized row renders it (user turn, assistant turn, EOS)."""
    return f"{USER}{prompt}{END}{ASSISTANT}{response}{END}{EOS}"


def render_episode(examples: list[tuple[str, str]], instruction: str | None) -> str:
    """Instruction line (optional, followed by a blank line) and the rendered examples, back to back."""
    head = "" if instruction is None else instruction + "\n\n"
    return head + "".join(render_example(p, r) for p, r in examples)


def _value(rng: random.Random, attribute: str) -> str:
    if attribute.endswith("color"):
        return rng.choice(("red", "blue", "green", "gold", "silver", "purple", "orange", "black", "white", "pink"))
    if attribute in ("pet", "city", "team", "street"):
        return rng.choice(_WORDS[:32]).capitalize()
    return str(rng.randrange(1, 100))


def lookup_episode(rng: random.Random, n_examples: int) -> list[tuple[str, str]]:
    """Fact-lookup examples with distractor facts; one answer phrasing per episode."""
    phrasing = rng.choice(_ANSWER_FORMATS)
    examples = []
    for _ in range(n_examples):
        people = rng.sample(_NAMES, rng.randint(2, 4))
        attributes = rng.sample(_ATTRIBUTES, rng.randint(2, 3))
        facts = [(p, a, _value(rng, a)) for p in people for a in attributes]
        shown = rng.sample(facts, min(len(facts), rng.randint(3, 6)))
        person, attribute, value = rng.choice(shown)
        text = " ".join(f"{p}'s {a} is {v}." for p, a, v in shown)
        prompt = f"{text} What is {person}'s {attribute}?"
        examples.append((prompt, f"{person}'s {attribute} is {value}.\n" + phrasing.format(v=value)))
    return examples


_RULES: dict[str, Callable[[int, int], int]] = {
    "plus": lambda x, c: x + c, "times": lambda x, c: x * c, "minus": lambda x, c: c - x,
    "double_plus": lambda x, c: 2 * x + c,
}
_RULE_SYMBOL = {"plus": "{x} + {c}", "times": "{x} * {c}", "minus": "{c} - {x}", "double_plus": "2 * {x} + {c}"}


def rule_episode(rng: random.Random, n_examples: int) -> list[tuple[str, str]]:
    """Input/output pairs of one hidden rule ``y = f(x, c)``; ``c`` and the rule are fixed per episode."""
    rule = rng.choice(sorted(_RULES))
    c = rng.randint(2, 9) if rule == "times" else rng.randint(1, 60)
    verb = rng.choice(("Apply the rule to", "What does the machine return for", "Transform"))
    examples = []
    for _ in range(n_examples):
        x = rng.randint(1, 40) if rule != "minus" else rng.randint(1, c + 20)
        y = _RULES[rule](x, c)
        work = _RULE_SYMBOL[rule].format(x=x, c=c)
        examples.append((f"{verb} {x}.", f"{work} = {y}\n#### {y}"))
    return examples


def mapping_episode(rng: random.Random, n_examples: int) -> list[tuple[str, str]]:
    """A random word -> word table per episode; later examples repeat keys (induction: ``A B ... A -> B``)."""
    keys = rng.sample(_WORDS, 6)
    table = {k: rng.choice(_WORDS) for k in keys}
    examples = []
    for _ in range(n_examples):
        key = rng.choice(keys)
        examples.append((f"Code word for {key}?", f"{key} -> {table[key]}\n#### {table[key]}"))
    return examples


def copy_episode(rng: random.Random, n_examples: int) -> list[tuple[str, str]]:
    """Repeat a random word list; one list length range per episode."""
    low = rng.randint(3, 6)
    examples = []
    for _ in range(n_examples):
        words = [rng.choice(_WORDS) for _ in range(rng.randint(low, low + 4))]
        examples.append((f"Repeat: {' '.join(words)}", " ".join(words)))
    return examples


def worked_episode(rng: random.Random, n_examples: int) -> list[tuple[str, str]]:
    """Word problems with relevant and distractor facts and one or two worked steps; one operation per episode."""
    op = rng.choice(("+", "-", "*"))
    examples = []
    for _ in range(n_examples):
        name, other = rng.sample(_NAMES, 2)
        thing, other_thing = rng.sample(_OBJECTS, 2)
        a = rng.randint(2, 12) if op == "*" else rng.randint(5, 60)
        b = rng.randint(2, 9) if op == "*" else rng.randint(1, a if op == "-" else 40)
        verb = {"+": "gets", "-": "gives away", "*": "gets this many times over: boxes of"}[op]
        relevant = [f"{name} has {a} {thing}.", f"{name} {verb} {b} {thing}." if op != "*"
                    else f"{name} has {b} boxes with {a} {thing} each."]
        distractors = [f"{other} has {rng.randint(1, 60)} {other_thing}.",
                       f"{name} also owns {rng.randint(1, 9)} {other_thing}."]
        sentences = relevant + distractors[: rng.randint(1, 2)]
        rng.shuffle(sentences)
        result = {"+": a + b, "-": a - b, "*": a * b}[op]
        step = f"{a} {op} {b} = {result}" if op != "*" else f"{b} * {a} = {result}"
        question = f"How many {thing} does {name} have now?" if op != "*" else f"How many {thing} are in the boxes?"
        examples.append((" ".join(sentences) + " " + question, f"{step} {thing}.\n#### {result}"))
    return examples


def split_prompt_response(text: str) -> tuple[str, str] | None:
    """(prompt, response) of a ``prompt + "\\n" + response`` text, or None when it has no newline."""
    prompt, sep, response = text.partition("\n")
    return (prompt, response) if sep and prompt and response else None


def domain_episodes(texts: list[str], rng: random.Random, max_examples: int) -> list[str]:
    """Group ``prompt\\nresponse`` texts into chat episodes of 1..``max_examples`` examples (probe layout)."""
    pairs = [pair for pair in map(split_prompt_response, texts) if pair is not None]
    episodes, i = [], 0
    while i < len(pairs):
        k = rng.randint(1, max_examples)
        instruction = rng.choice(INSTRUCTIONS[:1] + (None,))
        episodes.append(render_episode(pairs[i: i + k], instruction))
        i += k
    return episodes


GENERATORS: dict[str, Callable[[random.Random, int], list[tuple[str, str]]]] = {
    "lookup": lookup_episode, "rule": rule_episode, "mapping": mapping_episode, "copy": copy_episode,
    "worked": worked_episode,
}


def pretraining_mixture(n_episodes: int, seed: int, mix: dict[str, float] | None = None,
                        max_examples: int = 8, domain_texts: int | None = None) -> list[str]:
    """Seeded episodes of every kind in ``mix`` (weights normalised), shuffled.

    Args:
        n_episodes: Number of generic (non-``domain``) episodes is ``round(n_episodes * (1 - w_domain))``; the
            ``domain`` share is filled with grouped benchmark texts.
        seed: Seed; same seed, same texts.
        mix: Kind -> weight; default :data:`DEFAULT_MIX`.
        max_examples: Most examples per episode.
        domain_texts: Benchmark texts to group (default: about 4.5 per domain episode).

    Returns:
        Episode strings (special tokens written out, to be tokenized with the chat tokenizer).
    """
    weights = dict(DEFAULT_MIX if mix is None else mix)
    unknown = set(weights) - set(GENERATORS) - {"domain"}
    if unknown:
        raise ValueError(f"unknown episode kinds {sorted(unknown)}; valid: {sorted(GENERATORS) + ['domain']}")
    total = sum(weights.values())
    rng = random.Random(f"raycurate.pretrain_texts:{seed}")
    episodes: list[str] = []
    for kind, weight in sorted(weights.items()):
        count = round(n_episodes * weight / total)
        if kind == "domain":
            n_texts = domain_texts if domain_texts is not None else int(count * (max_examples + 1) / 2)
            episodes += domain_episodes(generate_pretraining_texts(n_texts, seed), rng, max_examples)
            continue
        for _ in range(count):
            instruction = rng.choice(INSTRUCTIONS + (None,))
            episodes.append(render_episode(GENERATORS[kind](rng, rng.randint(2, max_examples)), instruction))
    rng.shuffle(episodes)
    return episodes
