"""`raycurate curate`: your own data in, a curated dataset out (issue #38 items 1, 2, 8).

* pure pieces: the row ledger agrees with the composition, kept character spans, the command's config (CLI flags
  and API keywords give the same request), what --out may hold;
* bad input on the new surface: each ends in one line ``raycurate: ...`` and exit code 2, with nothing written;
* end to end on a hand-written jsonl (40 lines) and a 10-row trusted file on the committed embedded model: every
  input row is in exactly one of curated.jsonl / dropped.jsonl / rejected.jsonl, original fields survive untouched,
  each drop has its reason, a re-run (through the Python API) resumes and writes the same files, another
  command's outputs are refused, a full disk leaves the outputs as they were;
* slow: the default steps (bds, bridge) with --train and --heldout.
"""

from __future__ import annotations

import errno
import json
import os
import time
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import yaml

from raycurate.algorithms.composition import Step, compose, ledger
from raycurate.cli.main import main
from raycurate.data.tokenize import kept_spans

# Hand-written rows (not the corpus generator): clean sums, five wrong answers, a near-duplicate, rows with fields
# ingest renames or normalises (an int id, `split`, a nested dict, domain "MATH ", messages only, non-ASCII), a
# row repeating a trusted prompt, and four rows ingest rejects (malformed, empty response, repeated id).
DATA_LINES = [
    '{"id": "r01", "prompt": "Tom has 3 apples and buys 4 more. How many apples does he have?", "response": "He has 3 + 4 = 7 apples.\\n#### 7", "note": "hand"}',  # noqa: E501
    '{"id": "r02", "prompt": "Tom has 5 apples and buys 9 more. How many apples does he have?", "response": "He has 5 + 9 = 14 apples.\\n#### 14"}',  # noqa: E501
    '{"id": "r03", "prompt": "Mia has 12 stickers and gets 7 more. How many stickers does she have?", "response": "She has 12 + 7 = 19 stickers.\\n#### 19"}',  # noqa: E501
    '{"id": "r04", "prompt": "Mia has 8 stickers and gets 8 more. How many stickers does she have?", "response": "She has 8 + 8 = 16 stickers.\\n#### 16"}',  # noqa: E501
    '{"id": "r05", "prompt": "A shelf holds 21 books and 13 more arrive. How many books are there?", "response": "There are 21 + 13 = 34 books.\\n#### 34"}',  # noqa: E501
    '{"id": "r06", "prompt": "A shelf holds 6 books and 17 more arrive. How many books are there?", "response": "There are 6 + 17 = 23 books.\\n#### 23"}',  # noqa: E501
    '{"id": "r07", "prompt": "Leo runs 14 km on Monday and 15 km on Tuesday. How far does he run?", "response": "He runs 14 + 15 = 29 km.\\n#### 29"}',  # noqa: E501
    '{"id": "r08", "prompt": "Leo runs 30 km on Monday and 12 km on Tuesday. How far does he run?", "response": "He runs 30 + 12 = 42 km.\\n#### 42"}',  # noqa: E501
    '{"id": "r09", "prompt": "A farm has 9 cows and 27 sheep. How many animals are there?", "response": "There are 9 + 27 = 36 animals.\\n#### 36"}',  # noqa: E501
    '{"id": "r10", "prompt": "A farm has 11 cows and 11 sheep. How many animals are there?", "response": "There are 11 + 11 = 22 animals.\\n#### 22"}',  # noqa: E501
    '{"id": "r11", "prompt": "Zoe saves 40 dollars and then 2 dollars more. How much has she saved?", "response": "She has saved 40 + 2 = 42 dollars.\\n#### 42"}',  # noqa: E501
    '{"id": "r12", "prompt": "Zoe saves 18 dollars and then 5 dollars more. How much has she saved?", "response": "She has saved 18 + 5 = 23 dollars.\\n#### 23"}',  # noqa: E501
    '{"id": "r13", "prompt": "A bus carries 7 adults and 26 children. How many people are on it?", "response": "It carries 7 + 26 = 33 people.\\n#### 33"}',  # noqa: E501
    '{"id": "r14", "prompt": "A bus carries 16 adults and 16 children. How many people are on it?", "response": "It carries 16 + 16 = 32 people.\\n#### 32"}',  # noqa: E501
    '{"id": "r15", "prompt": "Sam bakes 25 rolls and 19 buns. How many pastries does he bake?", "response": "He bakes 25 + 19 = 44 pastries.\\n#### 44"}',  # noqa: E501
    '{"id": "r16", "prompt": "Sam bakes 33 rolls and 4 buns. How many pastries does he bake?", "response": "He bakes 33 + 4 = 37 pastries.\\n#### 37"}',  # noqa: E501
    '{"id": "r17", "prompt": "A garden has 2 roses and 48 tulips. How many flowers does it have?", "response": "It has 2 + 48 = 50 flowers.\\n#### 50"}',  # noqa: E501
    '{"id": "r18", "prompt": "A garden has 19 roses and 19 tulips. How many flowers does it have?", "response": "It has 19 + 19 = 38 flowers.\\n#### 38"}',  # noqa: E501
    '{"id": "r19", "prompt": "Ivy reads 44 pages and then 6 pages. How many pages has she read?", "response": "She has read 44 + 6 = 50 pages.\\n#### 50"}',  # noqa: E501
    '{"id": "r20", "prompt": "Ivy reads 13 pages and then 28 pages. How many pages has she read?", "response": "She has read 13 + 28 = 41 pages.\\n#### 41"}',  # noqa: E501
    '{"id": "r21", "prompt": "A jar has 10 red beads and 35 blue beads. How many beads are in it?", "response": "It has 10 + 35 = 45 beads.\\n#### 45"}',  # noqa: E501
    '{"id": "r22", "prompt": "A jar has 22 red beads and 22 blue beads. How many beads are in it?", "response": "It has 22 + 22 = 44 beads.\\n#### 44"}',  # noqa: E501
    '{"id": "r23", "prompt": "Ned picks 17 plums and 9 pears. How many fruits does he pick?", "response": "He picks 17 + 9 = 26 fruits.\\n#### 26"}',  # noqa: E501
    '{"id": "r24", "prompt": "Ned picks 31 plums and 8 pears. How many fruits does he pick?", "response": "He picks 31 + 8 = 39 fruits.\\n#### 39"}',  # noqa: E501
    '{"id": "w1", "prompt": "A box holds 5 pens and 6 pencils. How many items are in the box?", "response": "There are 5 + 6 = 33 items.\\n#### 33"}',  # noqa: E501
    '{"id": "w2", "prompt": "A box holds 9 pens and 9 pencils. How many items are in the box?", "response": "There are 9 + 9 = 84 items.\\n#### 84"}',  # noqa: E501
    '{"id": "w3", "prompt": "A box holds 14 pens and 3 pencils. How many items are in the box?", "response": "There are 14 + 3 = 45 items.\\n#### 45"}',  # noqa: E501
    '{"id": "w4", "prompt": "A box holds 20 pens and 20 pencils. How many items are in the box?", "response": "There are 20 + 20 = 403 items.\\n#### 403"}',  # noqa: E501
    '{"id": "w5", "prompt": "A box holds 7 pens and 8 pencils. How many items are in the box?", "response": "There are 7 + 8 = 59 items.\\n#### 59"}',  # noqa: E501
    '{"id": "r01-copy", "prompt": "Tom has 3 apples and buys 4 more. How many apples does he have?", "response": "He has 3 + 4 = 7 apples.\\n#### 7"}',  # noqa: E501
    '{"id": 77, "prompt": "Sara reads 12 pages a day for 3 days. How many pages does she read?", "response": "She reads 12 * 3 = 36 pages.\\n#### 36", "split": "train", "meta": {"a": 1, "b": [1, 2]}}',  # noqa: E501
    '{"messages": [{"role": "user", "content": "What is 6 times 7?"}, {"role": "assistant", "content": "6 * 7 = 42\\n#### 42"}], "tags": ["x", 1]}',  # noqa: E501
    '{"id": "r33", "prompt": "Lia has 4 coins and finds 5 more. How many coins does she have?", "response": "She has 4 + 5 = 9 coins.\\n#### 9", "domain": "MATH ", "score": 0.5}',  # noqa: E501
    '{"id": "r34", "prompt": "Ann has 2 coins and finds 3 more. How many coins does she have?", "response": "She has 2 + 3 = 5 coins.\\n#### 5"}',  # noqa: E501
    '{"id": "r35", "prompt": "Chloé a 6 crayons et en trouve 2. Combien en a-t-elle ?", "response": "Elle en a 6 + 2 = 8.\\n#### 8"}',  # noqa: E501
    '{"id": "r36", "prompt": "Say hello to the team.", "response": "Hello, team!"}',
    '{"id": "bad-json", "prompt": "unterminated',
    '{"id": "r38", "prompt": "Empty answer?", "response": ""}',
    '{"id": "r02", "prompt": "Repeated id", "response": "1 + 1 = 2\\n#### 2"}',
    '{"id": "r40", "prompt": "Kim has 15 cards and buys 30 more. How many cards does she have?", "response": "She has 15 + 30 = 45 cards.\\n#### 45"}',  # noqa: E501
]
TRUSTED_LINES = [
    json.dumps({"id": f"t{k}", "prompt": f"Ann has {a} coins and finds {b} more. How many coins does she have?",
                "response": f"She has {a} + {b} = {a + b} coins.\n#### {a + b}"})
    for k, (a, b) in enumerate([(2, 3), (10, 4), (6, 6), (15, 5), (8, 12), (20, 9), (3, 30), (11, 7), (9, 16), (26, 4)])
]
# Tiny settings (tests/test_curate_e2e.py's TINY, one torch thread, one actor per pool).
TINY = ["run.progress=false", "tokenize.num_actors=1", "p2d_pool.num_actors=1", "bridge_pool.num_actors=1",
        "eval.pool.num_actors=1", "eval.max_new_tokens=8", "eval.samples=0", "eval.lm_eval_tasks=[]",
        "train.engine=ddp", "train.num_workers=1", "train.launcher=task", "train.threads_per_worker=1",
        "train.micro_batch_size=4", "train.effective_batch_size=8", "train.max_steps=2", "bridge.micro_batch=16",
        "bridge.last_layers=2"]
ADDED = ("weight", "raycurate_weight", "kept_response_spans", "kept_prompt_spans")


def write_inputs(folder: Path) -> tuple[Path, Path]:
    folder.mkdir(parents=True, exist_ok=True)
    data, trusted = folder / "data.jsonl", folder / "trusted.jsonl"
    data.write_text("\n".join(DATA_LINES) + "\n", encoding="utf-8")
    trusted.write_text("\n".join(TRUSTED_LINES) + "\n", encoding="utf-8")
    return data, trusted


def jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def run_cli(args: list[str], capsys) -> tuple[int, str, str]:
    code = main(args)
    out, err = capsys.readouterr()
    return code, out, err


# --------------------------------------------------------------------------------------------- pure pieces


def test_ledger_agrees_with_compose_and_ranks_what_each_step_received():
    pool = [f"r{i}" for i in range(10)]
    dedup = Step("dedup", dropped=frozenset({"r3", "r7"}))
    scores = Step("reference", scores={i: float(-k) for k, i in enumerate(pool)})  # r0 best, r9 worst
    decided = ledger(pool, [dedup, scores], 0.5, seed=0)
    assert decided.kept == compose(pool, [dedup, scores], 0.5, 0)[-1] == ["r0", "r1", "r2", "r4"]
    assert decided.received == {"dedup": 10, "reference": 8} and decided.passed == {"dedup": 8, "reference": 4}
    assert {i: s for i, s in decided.dropped.items() if s == "dedup"} == {"r3": "dedup", "r7": "dedup"}
    assert decided.ranks["reference"] == {"r0": 1, "r1": 2, "r2": 3, "r4": 4, "r5": 5, "r6": 6, "r8": 7, "r9": 8}
    assert sorted(i for i, s in decided.dropped.items() if s == "reference") == ["r5", "r6", "r8", "r9"]
    assert ledger(pool, [], 0.5, 0).kept == sorted(pool) and not ledger(pool, [], 0.5, 0).dropped


def test_kept_spans_merge_adjacent_kept_tokens_and_skip_markup():
    # "He has 7." as tokens "He" " has" " 7" "." then an end-of-turn marker (-1, -1)
    offsets = [0, 2, 2, 6, 6, 8, 8, 9, -1, -1]
    assert kept_spans(offsets, [1, 1, 1, 1, 1]) == [[0, 9]]
    assert kept_spans(offsets, [1, 0, 1, 1, 1]) == [[0, 2], [6, 9]]
    assert kept_spans(offsets, [0, 0, 0, 0, 1]) == []
    assert kept_spans([0, 2, 3, 5], [1, 1]) == [[0, 2], [3, 5]]  # a gap between tokens splits the span
    with pytest.raises(ValueError, match="two per token"):
        kept_spans([0, 2], [1, 1])


def test_cli_flags_and_api_keywords_make_the_same_request(tmp_path):
    from raycurate.pipelines.user_curate import request_of, user_job_config

    data, trusted = write_inputs(tmp_path)
    keys = {"curate.steps": ["dedup", "reference", "mask"], "curate.keep_fraction": 0.5}
    cli = user_job_config([str(data)], [str(trusted)], str(tmp_path / "out"), "embedded", overrides=TINY, keys=keys,
                          command_line=True)
    config = {k: yaml.safe_load(v) for k, v in (o.split("=", 1) for o in TINY)}
    api = user_job_config(str(data), str(trusted), str(tmp_path / "out"), "embedded", layers=[config, {}], keys=keys)
    assert request_of(cli, train=False, heldout=None) == request_of(api, train=False, heldout=None)
    assert cli.data.split_ratios == {"warmup": 0.0, "validation": 0.0, "selection": 1.0} and not cli.curate.compare
    assert cli.run.runs_dir == str(tmp_path / "out") and cli.run.name == "run"
    # pool sizes and threads are not settings: the same command with more actors resumes
    more = user_job_config([str(data)], [str(trusted)], str(tmp_path / "out"), "embedded",
                           overrides=[*TINY, "tokenize.num_actors=2", "eval.pool.num_actors=3"], keys=keys)
    assert request_of(more, train=False, heldout=None) == request_of(cli, train=False, heldout=None)
    # bridge needs its warmup split; the user command takes the steps and keep fraction from CurateConfig
    from raycurate.config.curate import CurateConfig

    default = user_job_config([str(data)], [str(trusted)], str(tmp_path / "out"), "embedded", overrides=TINY)
    assert default.curate.steps == CurateConfig().steps == ["dedup", "reference"]
    assert default.curate.keep_fraction == CurateConfig().keep_fraction and default.data.split_ratios["warmup"] == 0
    bridge = user_job_config([str(data)], [str(trusted)], str(tmp_path / "out"), "embedded", overrides=TINY,
                             keys={"curate.steps": ["bds", "bridge"]})
    assert bridge.data.split_ratios["warmup"] > 0 and sum(bridge.data.split_ratios.values()) == pytest.approx(1)


def test_out_may_be_new_empty_or_this_commands_outputs(tmp_path):
    from raycurate.errors import OutputError
    from raycurate.pipelines.user_curate import MARKER, check_out

    request = {"config": {"curate": {"keep_fraction": 0.5}}, "train": False, "heldout": None}
    check_out(tmp_path / "new", request, force=False)
    (tmp_path / "empty").mkdir()
    check_out(tmp_path / "empty", request, force=False)
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / MARKER).write_text(json.dumps({"request": request}))
    (mine / "curated.jsonl").write_text("{}\n")
    check_out(mine, request, force=False)  # the same command: resume
    other = {**request, "config": {"curate": {"keep_fraction": 0.7}}}
    with pytest.raises(OutputError, match=r"another `raycurate curate` \(different curate.keep_fraction\)"):
        check_out(mine, other, force=False)
    check_out(mine, other, force=True)
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "notes.txt").write_text("mine")
    with pytest.raises(OutputError, match="not empty and holds no"):
        check_out(tmp_path / "busy", request, force=False)
    (tmp_path / "file").write_text("x")
    with pytest.raises(OutputError, match="is a file"):
        check_out(tmp_path / "file", request, force=False)


def test_original_records_come_back_exactly_as_written(tmp_path):
    """curated.jsonl's records are re-read from their file and line: an int id, a field named split, a nested dict,
    an unnormalised domain, a messages-only row and key order come back as written (ingest's parquet has none of
    them as written); a row that is another one now is an error."""
    from raycurate.data.validate import check_record
    from raycurate.errors import InputError
    from raycurate.stages.curated_outputs import original_records

    data, _ = write_inputs(tmp_path)
    wanted, expected, seen = {}, {}, set()
    for line_no, line in enumerate(DATA_LINES, start=1):
        try:
            record = json.loads(line)
        except ValueError:
            continue
        verdict = check_record(record, seen_ids=seen)
        if verdict.record is not None:
            wanted[(str(data), line_no)] = verdict.record["id"]
            expected[verdict.record["id"]] = record
    got = list(original_records([str(data)], wanted))
    assert [row_id for row_id, _ in got] == list(expected)  # file order
    for row_id, record in got:
        assert record == expected[row_id] and list(record) == list(expected[row_id])
    by_id = dict(got)
    assert by_id["77"]["id"] == 77 and by_id["77"]["split"] == "train" and by_id["77"]["meta"] == {"a": 1, "b": [1, 2]}
    assert by_id["r33"]["domain"] == "MATH " and "id" not in next(r for r in by_id.values() if "messages" in r)
    with pytest.raises(InputError, match="the file changed during the run"):
        list(original_records([str(data)], {(str(data), 2): "r01"}))


def test_an_input_field_named_like_an_added_one_keeps_its_value(tmp_path):
    import pyarrow as pa

    from raycurate.rundir import RunDir
    from raycurate.stages.curated_outputs import added_names

    run = RunDir(tmp_path / "run")
    (run.root / "ingest" / "accepted").mkdir(parents=True)
    pq.write_table(pa.table({"id": ["a"], "prompt": ["p"], "response": ["r"], "weight": [0.5]}),
                   run.root / "ingest" / "accepted" / "accepted-00000.parquet")
    run.record_stage("ingest", {"status": "done", "outputs": {"accepted": "ingest/accepted"}})
    assert added_names(run, None) == {"weight": "raycurate_weight"}
    assert added_names(run, "bridge") == {"weight": "raycurate_weight", "kept_response_spans": "kept_response_spans",
                                          "kept_prompt_spans": "kept_prompt_spans"}


# --------------------------------------------------------------------------------------------- bad input


def _bad_cases(tmp_path: Path) -> dict[str, tuple[list[str], str]]:
    data, trusted = write_inputs(tmp_path / "in")
    empty = tmp_path / "in" / "empty.jsonl"
    empty.write_text("\n")
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "notes.txt").write_text("someone else's")
    heldout = tmp_path / "in" / "heldout.jsonl"
    heldout.write_text('{"prompt": "What is 2 + 2?"}\n')
    base = ["curate", "--model", "embedded"]
    ok = ["--data", str(data), "--trusted", str(trusted)]
    out = ["--out", str(tmp_path / "out")]
    return {
        "no --data": ([*base, "--trusted", str(trusted), *out], "--data is required"),
        "missing --data": ([*base, "--data", str(tmp_path / "nope.jsonl"), "--trusted", str(trusted), *out],
                           "--data: "),
        "empty --data": ([*base, "--data", str(empty), "--trusted", str(trusted), *out],
                         "--data: all inputs are empty"),
        "no --trusted": ([*base, "--data", str(data), *out], "--trusted is required"),
        "missing --trusted": ([*base, "--data", str(data), "--trusted", str(tmp_path / "nope.jsonl"), *out],
                              "--trusted: "),
        "empty --trusted": ([*base, "--data", str(data), "--trusted", str(empty), *out],
                            "--trusted: all inputs are empty"),
        "--keep 0": ([*base, *ok, *out, "--keep", "0"], "--keep 0 must lie in (0, 1]"),
        "--keep 1.5": ([*base, *ok, *out, "--keep", "1.5"], "--keep 1.5 must lie in (0, 1]"),
        "--keep abc": ([*base, *ok, *out, "--keep", "abc"], "is not a number"),
        "unknown step": ([*base, *ok, *out, "--steps", "dedup,shiny"], "unknown step(s) ['shiny']"),
        "bad override": ([*base, *ok, *out, "train.lrr=1"], "train.lrr"),
        "--out holds other files": ([*base, *ok, "--out", str(busy)], "not empty and holds no"),
        "--out is a file": ([*base, *ok, "--out", str(data)], "is a file"),
        "--out is a URI": ([*base, *ok, "--out", "s3://bucket/curated"], "give a local folder"),
        "--heldout without response": ([*base, *ok, *out, "--heldout", str(heldout)],
                                       "needs non-empty 'prompt' and 'response'"),
        "--data is a URI": ([*base, "--data", "s3://bucket/rows.jsonl", "--trusted", str(trusted), *out],
                            "not a storage URI"),
    }


def test_bad_input_ends_in_one_line_and_exit_2_with_nothing_written(tmp_path, capsys):
    for name, (args, says) in _bad_cases(tmp_path).items():
        code, out, err = run_cli(args, capsys)
        assert code == 2, (name, err)
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("raycurate: ") and says in lines[0], (name, err)
        assert not (tmp_path / "out").exists(), name  # nothing written
    assert sorted(p.name for p in (tmp_path / "busy").iterdir()) == ["notes.txt"]


def test_read_only_out_is_one_line(tmp_path, capsys, monkeypatch):
    """A write refused by the filesystem (read-only, forbidden) is exit 2 and one line; for a real read-only
    folder when not root (root writes anyway), else simulated at the first write into --out."""
    data, trusted = write_inputs(tmp_path / "in")
    out = tmp_path / "locked" / "out"
    out.parent.mkdir()
    if os.geteuid() != 0:
        out.parent.chmod(0o555)
    else:
        import raycurate.rundir

        def refuse(path, data):
            raise OSError(errno.EROFS, "Read-only file system", str(path))

        monkeypatch.setattr(raycurate.rundir, "atomic_write_json", refuse)
    try:
        code, _, err = run_cli(["curate", "--data", str(data), "--trusted", str(trusted), "--model", "embedded",
                                "--out", str(out)], capsys)
    finally:
        out.parent.chmod(0o755)
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert err.startswith("raycurate: ") and ("read-only" in err or "not writable" in err or "cannot create" in err)
    assert not list(out.glob("*.jsonl"))


# --------------------------------------------------------------------------------------------- end to end


STEPS = ["--steps", "dedup,reference,mask", "--keep", "0.5"]


@pytest.fixture(scope="module")
def curated(ray_local, tmp_path_factory):
    """`raycurate curate` once on the hand-written rows: (input folder, out folder, seconds, stdout)."""
    import contextlib
    import io

    folder = tmp_path_factory.mktemp("user_curate")
    data, trusted = write_inputs(folder / "in")
    out = folder / "out"
    stdout = io.StringIO()
    started = time.time()
    with contextlib.redirect_stdout(stdout):
        code = main(["curate", "--data", str(data), "--trusted", str(trusted), "--model", "embedded", "--out",
                     str(out), *STEPS, *TINY])
    seconds = time.time() - started
    print(f"[timing] raycurate curate e2e (dedup, reference, mask; 40 rows): {seconds:.1f} s")
    assert code == 0
    return folder / "in", out, seconds, stdout.getvalue()


@pytest.mark.ray
def test_every_input_row_is_curated_dropped_or_rejected(curated):
    inputs, out, _, stdout = curated
    summary = json.loads((out / "summary.json").read_text())
    kept, dropped, rejected = jsonl(out / "curated.jsonl"), jsonl(out / "dropped.jsonl"), jsonl(out / "rejected.jsonl")
    rows = summary["rows"]
    assert rows["input"] == len(DATA_LINES) == len(kept) + len(dropped) + len(rejected)
    assert (rows["kept"], rows["dropped"], rows["rejected"]) == (len(kept), len(dropped), len(rejected))
    # each input line is in exactly one file: curated and dropped by id, rejected by line
    lines = {r["line"] for r in rejected} | {r["line"] for r in dropped}
    assert len(lines) == len(rejected) + len(dropped)
    assert {r["reason"] for r in rejected} == {"malformed_json", "empty_field", "duplicate_id", "overlaps_trusted"}
    assert rows["rejected_by_reason"]["overlaps_trusted"] == 1  # r34 repeats trusted row t0's prompt
    assert {str(r["id"]) for r in kept}.isdisjoint(r["id"] for r in dropped)
    assert rows["dropped_by_step"] == {"dedup": 1, "reference": summary["steps"]["reference"]["dropped"]}
    scores = pq.read_table(out / "scores.parquet").to_pylist()
    received = [r for r in scores if r["reference_rank"] is not None]
    # the reference's default rule (keep_rule calibrated): keep the rows no worse than 95% of held-out trusted rows
    assert summary["settings"]["keep_rule"] == "calibrated" and summary["settings"]["calibration_quantile"] == 0.95
    assert summary["steps"]["reference"]["kept"] == sum(r["reference_score"] >= -0.95 for r in received) > 0
    assert summary["trusted"]["accepted"] == 10 and summary["trusted"]["used_by_stage"]["curate_reference"] == 10
    assert summary["settings"]["split_ratios"]["selection"] == 1.0 and not rows["kept_uncurated"]
    assert f"kept:       {len(kept)}" in stdout


@pytest.mark.ray
def test_original_fields_survive_untouched(curated):
    _, out, _, _ = curated
    originals = {}
    for line in DATA_LINES:
        try:
            record = json.loads(line)
        except ValueError:
            continue
        originals.setdefault(json.dumps(record.get("prompt") or record["messages"][0]["content"]), record)
    kept = jsonl(out / "curated.jsonl")
    summary = json.loads((out / "summary.json").read_text())
    assert summary["added_fields"] == {"weight": "weight", "kept_response_spans": "kept_response_spans"}
    by_id = {}
    for record in kept:
        added = {k: record.pop(k) for k in ADDED if k in record}
        key = json.dumps(record.get("prompt") or record["messages"][0]["content"])
        original = originals[key]
        if "id" not in original:  # the messages-only row: its content-hash id is added
            assert record.pop("id").startswith("h")
        assert record == original and list(record) == list(original)  # every field, type, nesting and key order
        assert added["weight"] == 1.0 and isinstance(added["kept_response_spans"], list)
        by_id[str(original.get("id", "messages"))] = record
    # the rows whose fields ingest renames or normalises
    for row_id, field, value in (("77", "split", "train"), ("77", "meta", {"a": 1, "b": [1, 2]}),
                                 ("r33", "domain", "MATH "), ("messages", "tags", ["x", 1])):
        if row_id in by_id:
            assert by_id[row_id][field] == value
    if "77" in by_id:
        assert by_id["77"]["id"] == 77  # an int id stays an int


@pytest.mark.ray
def test_each_drop_has_its_reason_score_and_rank(curated):
    inputs, out, _, _ = curated
    run = out / "run"
    dropped = jsonl(out / "dropped.jsonl")
    dedup = [r for r in dropped if r["step"] == "dedup"]
    assert len(dedup) == 1 and dedup[0]["rank"] is None and dedup[0]["score"] is None
    assert {dedup[0]["id"], dedup[0]["duplicate_of"]} == {"r01", "r01-copy"}  # the first by id stays
    assert dedup[0]["reason"] == f"near-duplicate of {dedup[0]['duplicate_of']} (Jaccard 1.00)"
    signals = {r["id"]: r for r in pq.read_table(run / "curate_reference_scores/reference_scores.parquet",
                                                 columns=["id", "signal_max", "signal_excess_max"]).to_pylist()}
    summary = json.loads((out / "summary.json").read_text())
    received, kept = summary["steps"]["reference"]["received"], summary["steps"]["reference"]["kept"]
    reference = [r for r in dropped if r["step"] == "reference"]
    assert [r["rank"] for r in reference] == list(range(kept + 1, received + 1))
    for r in reference:
        s = signals[r["id"]]
        assert -1 <= r["score"] < -0.95  # badness: worse than more than 95% of the held-out trusted rows
        assert r["reason"] == (
            f"ranked {r['rank']} of {received} by the trusted reference (worse than {-r['score']:.0%} of the held-out "
            f"trusted rows: worst-token loss {s['signal_max']:.2f} nats, worst-token loss above the base model's "
            f"{s['signal_excess_max']:.2f} nats); kept the rows worse than at most 95% of them ({kept} rows)")
        assert r["source"].endswith("data.jsonl") and r["line"] >= 1
    scores = pq.read_table(out / "scores.parquet").to_pylist()
    accepted = summary["rows"]["input"] - summary["rows"]["rejected"]
    assert len(scores) == accepted and {r["outcome"] for r in scores} == {"curated", "dropped"}
    assert {r["id"] for r in scores if r["outcome"] == "dropped"} == {r["id"] for r in dropped}
    assert all(-1 <= r["reference_score"] <= 0 for r in scores)
    worse = [r for r in scores if r["reference_rank"] and r["reference_rank"] > kept]
    assert all(r["dropped_by"] == "reference" for r in worse)


@pytest.mark.ray
def test_kept_spans_are_the_response_tokens_that_keep_their_loss(curated):
    _, out, _, _ = curated
    table = {r["id"]: r for part in sorted((out / "run/curate_rows/tokens").glob("*.parquet"))
             for r in pq.read_table(part).to_pylist()}
    kept = jsonl(out / "curated.jsonl")
    assert len(kept) == len(table)
    masked = 0
    for record in kept:
        row = table[str(record["id"])]
        p = row["prompt_len"]
        assert record["kept_response_spans"] == kept_spans(row["response_offsets"], row["loss_mask"][p:])
        assert all(0 <= s < e <= len(row["response"]) for s, e in record["kept_response_spans"])
        masked += sum(row["loss_mask"][p:]) < len(row["loss_mask"]) - p
    summary = json.loads((out / "summary.json").read_text())
    level = summary["token_level"]
    assert level["step"] == "mask" and level["kept_response_tokens"] <= level["response_tokens"]
    assert level["kept_response_tokens"] == sum(sum(r["loss_mask"]) for r in table.values())


@pytest.mark.ray
def test_report_and_summary_point_at_the_outputs(curated):
    _, out, seconds, _ = curated
    report = (out / "report.html").read_text()
    assert report.index("<h2 id='your-data'>Your curated data</h2>") < report.index("<h2 id='summary'>")
    assert "href='curated.jsonl'" in report and "href='dropped.jsonl'" in report and "Lowest-scored rows" in report
    assert "href='../curated.jsonl'" in (out / "run/report.html").read_text()
    summary = json.loads((out / "summary.json").read_text())
    assert summary["files"] == {"curated": "curated.jsonl", "dropped": "dropped.jsonl", "rejected": "rejected.jsonl",
                                "scores": "scores.parquet", "summary": "summary.json", "report": "report.html"}
    assert summary["run_dir"] == "run" and summary["stage_seconds"]["curate_reference"] > 0
    assert summary["wall_seconds"] <= seconds + 0.1
    assert not list(out.glob(".curate-outputs.*"))


@pytest.mark.ray
def test_the_api_resumes_the_same_command_and_writes_the_same_files(curated):
    import raycurate

    inputs, out, _, _ = curated
    before = {name: (out / name).read_bytes() for name in ("curated.jsonl", "dropped.jsonl", "rejected.jsonl",
                                                            "scores.parquet")}
    executions = {k: v.get("executions") for k, v in json.loads((out / "run/manifest.json").read_text())
                  ["stages"].items()}
    config = {k: yaml.safe_load(v) for k, v in (o.split("=", 1) for o in TINY)}
    result = raycurate.curate(str(inputs / "data.jsonl"), trusted=str(inputs / "trusted.jsonl"), out=str(out),
                              model="embedded", steps=["dedup", "reference", "mask"], keep_fraction=0.5,
                              config=config)
    assert {name: (out / name).read_bytes() for name in before} == before
    after = json.loads((out / "run/manifest.json").read_text())["stages"]
    assert {k: v.get("executions") for k, v in after.items()} == executions  # nothing re-ran
    assert result.stage == "curate_rows" and result.tokens.num_rows == result.metrics["summary"]["rows"]["kept"]
    assert result.metrics["summary"]["rows"] == json.loads((out / "summary.json").read_text())["rows"]


@pytest.mark.ray
def test_reference_scores_of_a_small_model_on_warm_tasks_equal_the_ray_data_pools(curated, monkeypatch):
    """The demo-sized model is scored on warm in-memory tasks; a real model on a Ray Data actor pool: the same
    table, schema included."""
    import pyarrow.parquet as pq

    import raycurate.models.loading as loading
    from raycurate.config.pool import ActorPoolConfig
    from raycurate.rundir import RunDir
    from raycurate.stages.reference import SCORES_FILE, reference_scores_stage

    _, out, _, _ = curated
    run_root = out / "run"
    warm = pq.read_table(run_root / "curate_reference_scores" / SCORES_FILE)
    monkeypatch.setattr(loading, "is_small_checkpoint", lambda *_args, **_kwargs: False)
    run = RunDir(run_root)
    reference_scores_stage(run, "reference_scores_ray_data", pool_stage="curate_pool_rows", base_stage="base_model",
                           reference_stage="curate_reference", pool_cfg=ActorPoolConfig(num_actors=1))
    pooled = pq.read_table(run_root / "reference_scores_ray_data" / SCORES_FILE)
    assert pooled.schema == warm.schema
    assert pooled.column("id").to_pylist() == warm.column("id").to_pylist()
    for name in warm.column_names[1:]:
        got, want = pooled.column(name).to_pylist(), warm.column(name).to_pylist()
        assert np.allclose(np.hstack(got).astype(float), np.hstack(want).astype(float), atol=1e-5, equal_nan=True), name


@pytest.mark.ray
def test_another_command_is_refused_and_a_full_disk_loses_nothing(curated, capsys, monkeypatch):
    import raycurate.stages.curated_outputs as outputs

    inputs, out, _, _ = curated
    args = ["curate", "--data", str(inputs / "data.jsonl"), "--trusted", str(inputs / "trusted.jsonl"), "--model",
            "embedded", "--out", str(out), *STEPS, *TINY]
    code, _, err = run_cli([*args, "--keep", "0.7"], capsys)
    assert code == 2 and "different curate.keep_fraction" in err and len(err.strip().splitlines()) == 1
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}

    def full(*_args, **_kwargs):
        raise OSError(errno.ENOSPC, "No space left on device", str(out / "rejected.jsonl"))

    monkeypatch.setattr(outputs, "copy_rejected", full)
    code, _, err = run_cli(args, capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert err.startswith("raycurate: cannot write") and "no space left on the device" in err
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} == before  # nothing half-written
    assert not list(out.glob(".curate-outputs.*"))


@pytest.mark.ray
def test_a_trusted_file_that_is_all_held_out_questions_is_an_error(tmp_path, ray_local, capsys):
    data, trusted = write_inputs(tmp_path / "in")
    heldout = tmp_path / "in" / "heldout.jsonl"
    heldout.write_text(trusted.read_text())  # every trusted row is a held-out question
    code, _, err = run_cli(["curate", "--data", str(data), "--trusted", str(trusted), "--model", "embedded",
                            "--out", str(tmp_path / "out"), "--heldout", str(heldout), *TINY], capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "data.trusted_input: none of its 10 rows is usable" in err and "overlaps_evaluation 10" in err
    assert not (tmp_path / "out" / "curated.jsonl").exists()


# --------------------------------------------------------------------------------------------- slow


@pytest.mark.slow
@pytest.mark.ray
@pytest.mark.timeout(1200)
def test_bds_bridge_with_train_and_heldout(tmp_path, ray_local, capsys):
    """bds then bridge: BRIDGE's warmup rows are kept uncurated, the model trains on exactly curated.jsonl's rows
    (as many optimizer steps as all rows, curate.train_steps matched), and base / all rows / curated are compared
    on the held-out questions."""

    data, trusted = write_inputs(tmp_path / "in")
    heldout = tmp_path / "in" / "heldout.jsonl"
    heldout.write_text("".join(json.dumps({"prompt": f"Ben has {a} marbles and gets {b} more. How many marbles "
                                                     "does he have?",
                                           "response": f"He has {a} + {b} = {a + b} marbles.\n#### {a + b}"}) + "\n"
                               for a, b in [(4, 5), (13, 8), (7, 7), (21, 3)]) + '{"prompt": "Say hi.", '
                       '"response": "Hi!"}\n')
    out = tmp_path / "out"
    started = time.time()
    code, _, err = run_cli(["curate", "--data", str(data), "--trusted", str(trusted), "--model", "embedded",
                            "--out", str(out), "--steps", "bds,bridge", "--train", "--heldout", str(heldout), *TINY,
                            "data.split_ratios={warmup: 0.3, validation: 0.0, selection: 0.7}"], capsys)
    print(f"[timing] raycurate curate e2e (bds, bridge, --train, --heldout): {time.time() - started:.1f} s")
    assert code == 0, err
    summary = json.loads((out / "summary.json").read_text())
    assert summary["settings"]["steps"] == ["bds", "bridge"]
    rows = summary["rows"]
    kept = jsonl(out / "curated.jsonl")
    assert rows["input"] == len(kept) + rows["dropped"] + rows["rejected"] and rows["kept_uncurated"]["warmup"] > 0
    assert all("kept_prompt_spans" in r and "kept_response_spans" in r for r in kept)
    manifest = json.loads((out / "run/manifest.json").read_text())
    assert manifest["stages"]["curate_train_rows"]["metrics"]["rows"] == len(kept)
    stages = manifest["stages"]
    assert stages["train_curate"]["metrics"]["steps"] == stages["train_all"]["metrics"]["steps"]  # matched
    assert (out / "model" / "config.json").is_file() and summary["files"]["model"] == "model"
    block = summary["heldout"]
    assert block["questions"] == 5 and block["questions_with_answer"] == 4 and block["training_seeds"] == 1
    assert set(block["models"]) == {"base", "all rows", "curated"} and set(block["curated_minus"]) == {
        "base", "all rows"}
    assert "On your held-out questions" in (out / "report.html").read_text()
    # the rows of the held-out questions never train: none of them is a data row here, so nothing was rejected
    assert "overlaps_evaluation" not in rows["rejected_by_reason"]
