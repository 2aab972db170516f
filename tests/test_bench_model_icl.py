"""benchmarks/bench_model_icl.py bounds its work before computing it and reports progress as it goes."""

from __future__ import annotations

from benchmark_scripts import load_benchmark


def _bench():
    return load_benchmark("bench_model_icl")


def test_knockout_computes_only_the_rows_it_reports(monkeypatch, capsys):
    bench = _bench()
    calls = []
    real = bench.knockout_increases

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(bench, "knockout_increases", counted)
    result = bench.main(["--queries", "2", "--knockout-rows", "3", "--corpus-rows", "60", "--bootstrap", "10",
                         "--induction-episodes", "0", "--progress-every", "1"])
    assert len(calls) == 3 and result["knockout_rows"] <= 3 and result["queries"] == 2
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(" (")[0] for line in lines if line.startswith(("queries", "knock-out rows"))] == [
        "queries 1/2", "queries 2/2", "knock-out rows 1/3", "knock-out rows 2/3", "knock-out rows 3/3"]
    assert lines[-1].startswith("icl_gain=")
