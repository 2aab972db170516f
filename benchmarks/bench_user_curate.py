"""`raycurate curate` on a user's file vs one LoRA SFT epoch over the same rows (issue #38's time target: <= 2.5x).

The rows are written here from hand-written templates (not the corpus generator): 1,000 rows of short arithmetic,
unit conversion, definition and rewriting requests, a quarter of them spoiled by hand-written faults (a wrong final
number, a cut-off answer, an answer to another question), and 100 clean trusted rows whose prompts the data does
not use. Both runs use the real model's LoRA training settings (jobs/real_curate_proving_ground.yaml's `train`):

1. ``raycurate curate --data rows.jsonl --trusted trusted.jsonl --model smollm2-135m --out OUT`` (the default
   recipe), wall time from the command's start to its end (ingest, tokenize, the reference, scoring, outputs);
2. ``raycurate train --data rows.jsonl --model smollm2-135m --out RUN train.epochs=1`` (ingest, tokenize, one
   epoch over every row), timed the same way.

Prints ``uptime`` first and last (say the load when you record it), each wall time, the outputs' row accounting and
``curate_over_sft_epoch=<ratio>`` last.

Usage::

    .venv/bin/python benchmarks/bench_user_curate.py [--rows 1000] [--trusted 100] [--out runs/bench_user_curate] \\
        [--threads N] [--model smollm2-135m]
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NAMES = ["Ada", "Bo", "Cleo", "Dev", "Eli", "Fay", "Gus", "Hana", "Ivo", "Jun", "Kai", "Lena", "Milo", "Nia"]
THINGS = ["apples", "stamps", "marbles", "books", "shells", "coins", "pencils", "cards"]
WORDS = {"gravity": "the force that pulls masses toward each other",
         "photosynthesis": "the way plants turn light, water and carbon dioxide into sugar and oxygen",
         "erosion": "the wearing away of rock and soil by water, wind or ice",
         "inflation": "a general rise in prices that lowers what money can buy",
         "metaphor": "a figure of speech that calls one thing another to suggest a likeness",
         "habitat": "the place where an animal or plant naturally lives",
         "friction": "the force that resists two surfaces sliding over each other",
         "democracy": "government by the people, usually through elected representatives"}
SENTENCES = ["the meeting was moved to friday because of the storm", "our team finished the project early",
             "she forgot her umbrella at the station", "the museum opens at nine every morning",
             "he planted tomatoes and basil in the garden", "the train was late by twenty minutes"]
TRUSTED_SEED = 10_000  # trusted rows come from their own stream of the same templates


def arithmetic(rng: random.Random) -> tuple[str, str, int]:
    name, thing = rng.choice(NAMES), rng.choice(THINGS)
    a, b, c = rng.randint(3, 60), rng.randint(2, 40), rng.randint(1, 9)
    prompt = f"{name} has {a} {thing}, buys {b} more and gives away {c}. How many {thing} does {name} have now?"
    total = a + b - c
    return prompt, f"{name} starts with {a}, then has {a} + {b} = {a + b}, and after giving {c} away has " \
                   f"{a + b} - {c} = {total} {thing}.\n#### {total}", total


def conversion(rng: random.Random) -> tuple[str, str, int]:
    km = rng.randint(2, 90)
    return (f"How many metres are there in {km} kilometres?",
            f"One kilometre is 1000 metres, so {km} kilometres are {km} x 1000 = {km * 1000} metres.\n#### {km * 1000}",
            km * 1000)


def definition(rng: random.Random) -> tuple[str, str, None]:
    word = rng.choice(list(WORDS))
    style = rng.choice(["Define", "Explain in one sentence what is meant by", "What does this word mean:"])
    return f"{style} {word}{rng.choice(['.', '?', ''])} (#{rng.randint(1, 10**6)})", \
        f"{word.capitalize()} is {WORDS[word]}.", None


def rewrite(rng: random.Random) -> tuple[str, str, None]:
    sentence = rng.choice(SENTENCES)
    return f"Rewrite with a capital letter and a full stop: {sentence} (#{rng.randint(1, 10**6)})", \
        f"{sentence[0].upper()}{sentence[1:]}.", None


TEMPLATES = [arithmetic, arithmetic, conversion, definition, rewrite]


def spoil(rng: random.Random, prompt: str, response: str, answer: int | None) -> tuple[str, str]:
    """One hand-written fault: a wrong final number, a cut-off answer, or another question's answer."""
    fault = rng.choice(["wrong", "cut", "other"] if answer is not None else ["cut", "other"])
    if fault == "wrong":
        wrong = answer + rng.choice([-3, -2, -1, 1, 2, 3, 10])
        return prompt, response.replace(f"= {answer}", f"= {wrong}").replace(f"#### {answer}", f"#### {wrong}")
    if fault == "cut":
        return prompt, response[: max(8, len(response) // 3)]
    return prompt, rewrite(rng)[1] if answer is not None else arithmetic(rng)[1]


def write_rows(path: Path, n: int, seed: int, spoiled: float, exclude: set[str]) -> set[str]:
    rng, prompts = random.Random(seed), set()
    with path.open("w", encoding="utf-8") as f:
        i = 0
        while i < n:
            prompt, response, answer = rng.choice(TEMPLATES)(rng)
            if prompt in prompts or prompt in exclude:
                continue
            prompts.add(prompt)
            if rng.random() < spoiled:
                prompt, response = spoil(rng, prompt, response, answer)
            f.write(json.dumps({"id": f"u{seed}-{i:05d}", "prompt": prompt, "response": response}) + "\n")
            i += 1
    return prompts


def uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def timed(cmd: list[str]) -> float:
    started = time.time()
    subprocess.run(cmd, check=True, cwd=ROOT)
    return time.time() - started


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=1000)
    p.add_argument("--trusted", type=int, default=100)
    p.add_argument("--out", default="runs/bench_user_curate")
    p.add_argument("--threads", type=int, default=0, help="train.threads_per_worker (0: the idle cores)")
    p.add_argument("--model", default="smollm2-135m", help="embedded for a quick smoke run of the script")
    args = p.parse_args()
    out = (ROOT / args.out).resolve()
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    data, trusted = out / "rows.jsonl", out / "trusted.jsonl"
    used = write_rows(data, args.rows, seed=0, spoiled=0.25, exclude=set())
    write_rows(trusted, args.trusted, seed=TRUSTED_SEED, spoiled=0.0, exclude=used)
    train = ["train.adapter=lora", "train.frozen_dtype=bfloat16", "train.lora_r=16", "train.lora_alpha=16",
             "train.lr=0.001", "train.epochs=1", "train.micro_batch_size=8", "train.effective_batch_size=8",
             "train.engine=deepspeed", "train.num_workers=1", "train.launcher=task",
             f"train.threads_per_worker={args.threads}", "train.loss_normalization=token", "data.max_length=384",
             "run.progress=false"]  # pools as a user gets them (2 actors)
    cli = [str(Path(sys.executable).parent / "raycurate")]
    print(uptime(), flush=True)
    curate_s = timed([*cli, "curate", "--data", str(data), "--trusted", str(trusted), "--model", args.model,
                      "--out", str(out / "curated"), *train])
    print(f"curate: {curate_s:.0f} s", flush=True)
    sft_s = timed([*cli, "train", "--data", str(data), "--model", args.model, "--out", str(out / "sft"), *train])
    print(f"one LoRA SFT epoch (ingest + tokenize + train): {sft_s:.0f} s", flush=True)
    summary = json.loads((out / "curated/summary.json").read_text())
    print("rows:", json.dumps(summary["rows"]))
    print(uptime())
    print(f"curate_over_sft_epoch={curate_s / sft_s:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
