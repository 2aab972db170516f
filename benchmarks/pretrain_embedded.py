"""Pre-train the embedded base model with the ICL recipe and write a checkpoint plus its loss curve.

Usage::

    OMP_NUM_THREADS=2 python benchmarks/pretrain_embedded.py --out DIR [--preset tiny-llama-2l] [--steps 3000]

Writes ``DIR/`` (config, safetensors, tokenizer, ``recipe.json`` with the exact command, seed, data hash and the
loss curve) and ``DIR/loss_curve.csv`` (step, block_len, loss).
"""

from __future__ import annotations

import argparse
import sys

from raycurate.models.pretrain import build_recipe_checkpoint


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--preset", default="tiny-llama-2l")
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--episodes", type=int, default=20000)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--vocab-size", type=int, default=2048)
    parser.add_argument("--curriculum", default="0.6:128:8,0.25:512:2,0.15:1024:1",
                        help="share:block_len:batch per phase, comma separated")
    parser.add_argument("--mix", default="", help="kind:weight,... (default: pretrain_texts.DEFAULT_MIX)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--save-every", type=int, default=0, help="snapshot to OUT/partial every N steps")
    args = parser.parse_args(argv)
    phases = tuple((float(s), int(t), int(b)) for s, t, b in (p.split(":") for p in args.curriculum.split(",")))
    mix = {k: float(w) for k, w in (p.split(":") for p in args.mix.split(","))} if args.mix else None
    command = "python benchmarks/pretrain_embedded.py " + " ".join(sys.argv[1:] if argv is None else argv)
    build_recipe_checkpoint(args.out, preset=args.preset, steps=args.steps, n_episodes=args.episodes, lr=args.lr,
                            seed=args.seed, vocab_size=args.vocab_size, phases=phases, mix=mix,
                            num_threads=args.threads, command=command,
                            save_every=args.save_every)


if __name__ == "__main__":
    main()
