"""Instruction tasks: lists, tips, sorting, definitions, opposites and step-by-step processes, answered with
sentences or list items (``"- ..."`` / ``"1. ..."``)."""

from __future__ import annotations

import random
from typing import Callable

from raycurate.data.corpus.rows import Task

_NUMBER_WORDS = {2: "two", 3: "three", 4: "four", 5: "five"}
_WORD_NUMBERS = {word: number for number, word in _NUMBER_WORDS.items()}
_CATEGORIES: dict[str, tuple[str, ...]] = {
    "fruits": ("apple", "banana", "cherry", "mango", "pear", "plum", "kiwi", "grape"),
    "vegetables": ("carrot", "broccoli", "spinach", "potato", "onion", "pepper", "cabbage"),
    "colors": ("red", "blue", "green", "yellow", "purple", "orange", "brown"),
    "planets": ("Mercury", "Venus", "Earth", "Mars", "Jupiter", "Saturn", "Uranus", "Neptune"),
    "musical instruments": ("piano", "guitar", "violin", "flute", "drum", "trumpet", "cello"),
    "mammals": ("dog", "whale", "elephant", "bat", "horse", "rabbit", "tiger"),
    "birds": ("robin", "eagle", "parrot", "penguin", "owl", "sparrow", "swan"),
    "programming languages": ("Python", "Java", "Rust", "Go", "Haskell", "Ruby", "C"),
    "sports": ("soccer", "tennis", "swimming", "basketball", "cycling", "rowing", "hockey"),
}
_TIPS: dict[str, tuple[str, ...]] = {
    "better sleep": ("Go to bed at the same time every night.", "Keep the bedroom dark and quiet.",
                     "Avoid screens for an hour before bed.", "Skip coffee in the afternoon.",
                     "Get some daylight in the morning."),
    "studying for an exam": ("Start reviewing a week early.", "Study in short sessions with breaks.",
                             "Test yourself instead of rereading.", "Explain the topics out loud.",
                             "Sleep well the night before."),
    "saving money": ("Write down what you spend each week.", "Set a fixed amount aside on payday.",
                     "Cook at home more often.", "Wait a day before buying anything big.",
                     "Cancel subscriptions you do not use."),
    "staying hydrated": ("Carry a water bottle with you.", "Drink a glass of water with every meal.",
                         "Eat fruit with a lot of water.", "Drink more when it is hot.",
                         "Set reminders if you forget to drink."),
    "writing clear emails": ("Put the main point in the first sentence.", "Use a specific subject line.",
                             "Keep paragraphs short.", "Say exactly what you need and by when.",
                             "Read the email once before sending it."),
    "keeping a houseplant healthy": ("Water it only when the soil is dry.", "Give it enough indirect light.",
                                     "Use a pot with drainage holes.", "Remove dead leaves.",
                                     "Feed it a little fertilizer in spring."),
}
_WORDS = ("river", "candle", "orbit", "maple", "anchor", "velvet", "harbor", "pebble", "lantern", "meadow",
          "quartz", "falcon", "bridge", "jungle", "ember", "tulip", "copper", "island", "violet", "walnut",
          "glacier", "saddle", "kettle", "nectar", "dune", "ribbon", "summit", "zephyr", "yarn", "basket")
_DEFINITIONS: dict[str, tuple[str, str]] = {
    "a volcano": ("A volcano is an opening in the Earth's crust where molten rock escapes.",
                  "When it erupts it can release lava, ash and gas."),
    "a noun": ("A noun is a word that names a person, place, thing or idea.",
               "Examples are teacher, city, book and freedom."),
    "photosynthesis": ("Photosynthesis is the process plants use to turn light into chemical energy.",
                       "It uses water and carbon dioxide and releases oxygen."),
    "a prime number": ("A prime number is a whole number greater than one with exactly two divisors.",
                       "Examples are two, three, five and seven."),
    "a budget": ("A budget is a plan for how to spend and save money.",
                 "It compares expected income with expected costs."),
    "gravity": ("Gravity is the force that pulls objects with mass toward each other.",
                "It keeps the Moon in orbit around the Earth."),
    "a glacier": ("A glacier is a large, slow river of ice that forms from packed snow.",
                  "Glaciers shape valleys as they move."),
    "a verb": ("A verb is a word that describes an action or a state.", "Examples are run, think and be."),
    "an adjective": ("An adjective is a word that describes a noun.", "Examples are red, quick and tall."),
    "a thermometer": ("A thermometer is a tool that measures temperature.",
                      "Many show the reading on a scale or a screen."),
    "an ecosystem": ("An ecosystem is a community of living things and their surroundings.",
                     "Plants, animals and soil all depend on each other in it."),
    "a fraction": ("A fraction is a number that describes part of a whole.",
                   "It has a numerator above a line and a denominator below it."),
    "evaporation": ("Evaporation is the change of a liquid into a gas.", "Warm air speeds it up."),
    "a map legend": ("A map legend explains the symbols used on a map.", "It usually sits in a corner of the map."),
}
_OPPOSITES = (("hot", "cold"), ("tall", "short"), ("fast", "slow"), ("happy", "sad"), ("early", "late"),
              ("light", "dark"), ("full", "empty"), ("open", "closed"), ("strong", "weak"), ("loud", "quiet"),
              ("wet", "dry"), ("rich", "poor"))
_PROCESSES: dict[str, tuple[str, ...]] = {
    "making a cup of tea": ("Boil fresh water.", "Put a tea bag in a cup.", "Pour the hot water over the tea bag.",
                            "Let it steep for three minutes.", "Remove the tea bag and serve."),
    "planting a seed": ("Fill a small pot with soil.", "Press the seed into the soil.", "Cover it lightly.",
                        "Water it gently.", "Place the pot in a sunny spot."),
    "washing your hands": ("Wet your hands with clean water.", "Apply soap.", "Scrub for twenty seconds.",
                           "Rinse your hands well.", "Dry them with a clean towel."),
    "packing for a day hike": ("Check the weather forecast.", "Pack water and snacks.", "Bring a map of the trail.",
                               "Add a rain jacket.", "Tell someone where you are going."),
    "making a paper airplane": ("Fold a sheet of paper in half lengthwise.", "Fold the top corners to the center.",
                                "Fold the new edges to the center again.", "Fold the plane in half.",
                                "Fold down both wings."),
    "cleaning a bicycle chain": ("Shift to the smallest gear.", "Wipe the chain with a dry cloth.",
                                 "Scrub it with a brush and soapy water.", "Dry the chain completely.",
                                 "Add a little chain oil."),
    "setting up a new notebook for class": ("Write your name on the cover.", "Number the pages.",
                                            "Leave the first page for a table of contents.",
                                            "Add the date to each new entry.", "Keep a pen clipped to it."),
    "repotting a plant": ("Choose a slightly larger pot.", "Add fresh soil to the bottom.",
                          "Gently lift the plant out of the old pot.", "Place it in the new pot and fill the gaps.",
                          "Water it well."),
}
_INSTRUCTION_NOTES = ("Keep the answer short.", "Answer clearly.", "Be concise.", "Use simple words.",
                      "Do not add extra commentary.", "Stick to the point.")


# Each family returns (prompt sentences, response lines).


def _instruction_list(rng: random.Random) -> tuple[list[str], list[str]]:
    category = rng.choice(sorted(_CATEGORIES))
    k = _NUMBER_WORDS[rng.randint(3, 5)]
    items = rng.sample(_CATEGORIES[category], _WORD_NUMBERS[k])
    prompt = rng.choice((f"List {k} {category}.", f"Name {k} {category}.", f"Can you list {k} {category}?"))
    return [prompt], [f"Here are {k} {category}:"] + [f"- {x}" for x in items]


def _instruction_tips(rng: random.Random) -> tuple[list[str], list[str]]:
    topic = rng.choice(sorted(_TIPS))
    k = _NUMBER_WORDS[rng.randint(2, 4)]
    tips = rng.sample(_TIPS[topic], _WORD_NUMBERS[k])
    prompt = rng.choice((f"Give {k} tips for {topic}.", f"Share {k} tips for {topic}.",
                         f"What are {k} good tips for {topic}?"))
    return [prompt], [f"{i}. {tip}" for i, tip in enumerate(tips, 1)]


def _instruction_sort(rng: random.Random) -> tuple[list[str], list[str]]:
    words = rng.sample(_WORDS, rng.randint(3, 6))
    return ([f"Sort these words alphabetically: {', '.join(words)}."],
            ["Sorted alphabetically:"] + [f"{i}. {w}" for i, w in enumerate(sorted(words), 1)])


def _instruction_define(rng: random.Random) -> tuple[list[str], list[str]]:
    term = rng.choice(sorted(_DEFINITIONS))
    prompt = rng.choice((
        [f"Explain what {term} is in two sentences."],
        [f"What is {term}?", "Answer in two sentences."],
        [f"In two sentences, explain what {term} is."],
    ))
    return prompt, list(_DEFINITIONS[term])


def _instruction_opposites(rng: random.Random) -> tuple[list[str], list[str]]:
    pairs = rng.sample(_OPPOSITES, rng.randint(3, 5))
    return ([f"Give the opposite of each word: {', '.join(a for a, _ in pairs)}."],
            [f"- {a}: {b}" for a, b in pairs])


def _instruction_steps(rng: random.Random) -> tuple[list[str], list[str]]:
    process = rng.choice(sorted(_PROCESSES))
    prompt = rng.choice((f"Describe the steps for {process}.", f"List the steps for {process}.",
                         f"What are the steps for {process}?"))
    return [prompt], [f"{i}. {s}" for i, s in enumerate(_PROCESSES[process], 1)]


_INSTRUCTION_FAMILIES: tuple[Callable[[random.Random], tuple[list[str], list[str]]], ...] = (
    _instruction_list, _instruction_tips, _instruction_sort, _instruction_define, _instruction_opposites,
    _instruction_steps,
)


def instruction_task(rng: random.Random) -> Task:
    """A clean instruction task of a random family, sometimes with a style note appended to the prompt."""
    family = rng.choice(_INSTRUCTION_FAMILIES)
    sentences, lines = family(rng)
    if rng.random() < 0.4:
        sentences = sentences + [rng.choice(_INSTRUCTION_NOTES)]
    return Task("instruction", family.__name__, [(s, False) for s in sentences], lines)
