"""The examples in examples/ run and say what the README says they say."""

import pathlib
import subprocess
import sys

EXAMPLES = pathlib.Path(__file__).resolve().parent.parent / "examples"


def _run(name: str, timeout: float = 300) -> str:
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / name)], capture_output=True, text=True, timeout=timeout,
        env={"MALLOC_MMAP_THRESHOLD_": "65536", "PATH": "/usr/bin:/bin"},
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_seed_example():
    out = _run("seed_example.py")
    assert "released 4 saved tensor(s) of 2 node(s)" in out  # x -> x1 -> y1; x kept
    assert "w.grad = [5324.0751953125, 6912.072265625, 8788.0693359375]" in out
    assert "as expected: ReleasedTensorError" in out


def test_multitask_example_prints_what_the_readme_shows():
    out = _run("multitask.py")
    assert "gradients equal plain retain_graph=True" in out
    assert "bytes freed: 40.3 MiB (seg head 16.2 MiB)" in out
    readme = (EXAMPLES.parent / "README.md").read_text()
    block = readme.split("```\ngraphprune.backward released", 1)[1].split("```", 1)[0]
    assert "graphprune.backward released" + block in out


def _table(text: str) -> dict[str, list[float]]:
    rows = {}
    for line in text.splitlines():
        if line.startswith(("forward, 3 heads built", "after head")):
            *label, a, b, c = line.split()
            rows[" ".join(label)] = [float(a), float(b), float(c)]
    return rows


def test_demo_gives_memory_back_as_the_readme_says():
    out = _table(_run("demo.py"))
    plain, pruned = out["after head 1's backward"][:2]
    assert plain - pruned >= 48, out  # two heads' 32 MiB of activations, minus noise
    readme = _table((EXAMPLES.parent / "README.md").read_text())
    assert readme.keys() == out.keys()
    for label, numbers in readme.items():  # RSS in MiB: allow an allocator's page or two
        assert all(abs(a - b) <= 3 for a, b in zip(numbers, out[label])), (label, numbers, out[label])
