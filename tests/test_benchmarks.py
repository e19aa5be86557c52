"""The benchmark suite runs end to end at tiny sizes and writes its report.

Its numbers are not asserted (tiny sizes measure nothing); its structure is: a table
per workload, a row per strategy, the floor, the targets, the tracking-overhead and
scaling tables, plots.
"""

import json
import os
import re
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks import workloads as W  # noqa: E402

pytest.importorskip("matplotlib")


@pytest.fixture(scope="module")
def suite(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    env = dict(os.environ)
    env.pop("MALLOC_MMAP_THRESHOLD_", None)  # the runner must set it itself
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks", "--tiny", "--out", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return out, proc


def test_writes_results_and_plots(suite):
    out, _ = suite
    names = set(os.listdir(out))
    assert "RESULTS.md" in names and "results.json" in names
    assert "prune_scaling.png" in names
    for fam in ("seed", "lazy", "eager", "pcgrad", "depth"):
        assert f"memory_{fam}.png" in names
        assert os.path.getsize(out / f"memory_{fam}.png") > 10_000


def test_every_strategy_has_a_row_in_every_table(suite):
    out, _ = suite
    text = (out / "RESULTS.md").read_text()
    assert "**Machine:**" in text
    assert "MALLOC_MMAP_THRESHOLD_" in text and "clear_refs" in text
    sections = re.split(r"^## ", text, flags=re.M)
    by_title = {s.splitlines()[0].strip(): s for s in sections[1:]}
    for cfg in W.configs("tiny"):
        name = W.config_name(cfg)
        assert name in by_title, f"no table for {name}"
        body = by_title[name]
        assert "| strategy | peak MiB" in body
        assert "Floor = measured" in body
        for s in cfg["strategies"]:
            row = re.search(rf"^\| \**{re.escape(s)}\** \|(.*)$", body, flags=re.M)
            assert row, f"{name}: no row for {s}"
            cells = [c.strip() for c in row.group(1).split("|")]
            assert not cells[0].startswith("failed"), f"{name}/{s}: {cells[0]}"
            if not cells[0].startswith("n/a"):
                float(cells[0].split()[0])  # a measured peak
                float(cells[3])  # a measured time
    assert "## Targets" in by_title or any(t.startswith("Targets") for t in by_title)
    scaling = next(s for t, s in by_title.items() if t.startswith("Scaling"))
    assert "| graph | nodes | runs |" in scaling
    chain = re.search(r"^\| chain \| \d+ \| (\d+) \|(?:[^|]*\|){3}([^|]*)\|", scaling, flags=re.M)
    assert chain, "no chain row in the scaling table"
    lo, hi = (float(v) for v in chain.group(2).split(",")[0].split("–"))  # the runs' range of prune_after
    assert 0 < lo <= hi
    overhead = by_title.get("Tracking overhead", "")
    assert "| measurement | plain | graphprune |" in overhead
    floors = [line for line in overhead.splitlines() if "the floor on this machine" in line]
    assert any("pack hook that detaches, one forward" in f for f in floors), "no chain floor row"
    assert any("that walk / the `l1` backward" in f for f in floors), "no transformer floor row"
    assert any("where the prune's time goes" in line for line in overhead.splitlines()), "no first-touch row"
    assert any("the prune's fixed cost" in line for line in overhead.splitlines()), "no fixed-cost row"
    steps = [line for line in overhead.splitlines() if "where the step's time goes" in line]
    assert steps and len(steps[0].split(" / ")) >= 10, "no step-parts row"  # four parts each, three steps
    assert "per head, 4 heads built one by one" in overhead


def test_json_has_a_measurement_per_job(suite):
    out, _ = suite
    data = json.loads((out / "results.json").read_text())
    assert data["meta"]["machine"]["malloc_mmap_threshold"] == "65536"
    steps = [r for r in data["results"] if r["job"]["kind"] == "step"]
    expected = sum(len(c["strategies"]) + 1 for c in W.configs("tiny"))
    assert len(steps) == expected
    for r in steps:
        assert r["ok"] or r.get("not_applicable"), r.get("error")
        if r["ok"]:
            assert r["series"] and r["series"][-1][0] == "end"
            assert r["peak_resettable"]
    shapes = {r["job"]["shape"] for r in data["results"] if r["job"]["kind"] == "scaling"}
    assert shapes == {"chain", "fanout", "transformer"}
    parts = {r["job"]["part"]: r for r in data["results"] if r["job"]["kind"] == "overhead"}
    assert set(parts) == {"chain", "transformer", "memory", "heads"}
    assert all(r["ok"] for r in parts.values()), [r.get("error") for r in parts.values()]
    timed = [r for r in data["results"] if r["job"]["kind"] in ("timing", "scaling", "overhead")]
    assert timed and all(r["malloc_mmap_threshold"] is None for r in timed)  # the C library's own


def test_compare_prune_reports_each_checkout(capsys):
    from benchmarks import compare_prune

    assert compare_prune.main([ROOT, "--nodes", "40", "--rounds", "1", "--repeats", "1"]) == 0
    line = capsys.readouterr().out.strip()
    numbers = re.fullmatch(rf"{re.escape(ROOT)}: explain_us_per_node (\S+), prune_us_per_node (\S+)", line)
    assert numbers is not None, line
    assert all(float(v) > 0 for v in numbers.groups())



def test_recorder_parts_reports_every_variant(capsys):
    from benchmarks import recorder_parts

    assert recorder_parts.main(["--rounds", "1", "--tiny"]) == 0
    out = capsys.readouterr().out
    rows = {line.split()[0]: line.split()[1:] for line in out.splitlines()[2:]}
    assert set(rows) == set(recorder_parts.VARIANTS)
    assert all(float(cells[0]) > 0 for cells in rows.values())
    assert all(len(cells) == (1 if name in ("plain", "floor") else 2) for name, cells in rows.items())

def test_cuda_adds_the_transformer_steps_on_the_gpu_marked_as_synchronised():
    from benchmarks import overhead

    assert [j["part"] for j in overhead.jobs("tiny")] == list(overhead.PARTS)
    cuda = [j for j in overhead.jobs("tiny", "cuda") if j.get("device") == "cuda"]
    assert [j["part"] for j in cuda] == ["transformer_cuda"]
    result = overhead.run_overhead(dict(kind="overhead", part="transformer", level="tiny", threads=1))
    rows = overhead.rows({"transformer_cuda": result}, [])
    targets = [r for r in rows if r["ok"] is not None]
    assert len(targets) == 3 and all("torch.cuda.synchronize()" in r["measure"] for r in rows)
    assert all(r["workload"].startswith("overhead/transformer_cuda") for r in rows)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_transformer_cuda_job_times_synchronised_steps():
    from benchmarks import overhead

    r = overhead.run_overhead(dict(kind="overhead", part="transformer_cuda", level="tiny", threads=1,
                                   device="cuda"))
    assert r["ok"] and r["steps"] >= 3
    assert 0 < r["prune_share"] and r["step_ratio"] > 0


def test_transformer_cuda_job_says_when_there_is_no_gpu(monkeypatch):
    from benchmarks import overhead

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match="no CUDA device"):
        overhead.run_transformer(overhead.SIZES["tiny"], device="cuda")
