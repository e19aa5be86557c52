"""``python -m graphprune explain``, run in a subprocess on small scripts."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import xml.etree.ElementTree as ET

import torch
from test_render import parse_dot

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

OWN_TAPE = """\
import sys
import torch
import graphprune as gp

print("args", sys.argv[1:])
w = torch.ones(64, requires_grad=True)
with gp.track():
    x = w.exp()
    y1 = x.sin().exp().sum()
    y2 = x.cos().sum()
gp.backward(y1)
gp.backward(tensors=y2)
"""

NO_TAPE = """\
import torch
import graphprune as gp

w = torch.ones(64, requires_grad=True)
x = w.exp()
y1 = x.sin().sum()
y1.backward(retain_graph=True)
gp.prune_after(y1, keep=x)
"""


def explain(tmp_path, source: str, *args: str) -> subprocess.CompletedProcess:
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(source))
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-m", "graphprune", "explain", *args, str(script), "--lr", "1"],
                          capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)


def test_reports_each_call_with_pictures(tmp_path):
    out_dir = tmp_path / "pictures"
    proc = explain(tmp_path, OWN_TAPE, "--svg", str(out_dir), "--format", "dot")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "with its own gp.track() blocks" in out
    assert "args ['--lr', '1']" in out  # the script got its own arguments
    assert "[1] graphprune.backward at train.py:11\n    graphprune.backward released 2 saved tensor(s)" in out
    assert "[2] graphprune.backward at train.py:12\n" in out
    assert "      kept 2 node(s), 256 B: y2 (tensor of shape (), torch.float32, created at train.py:10)" \
        in out
    assert "graphprune explain: 2 call(s), 256 B freed in all; memory timeline: " in out  # x is held
    first = out_dir / "01-backward-train.py-11.dot"
    assert f"    picture: {first}" in out
    nodes, _, legend = parse_dot(first)
    assert {a["class"] for a in nodes.values()} == {"release", "keep0"}
    assert "released by this call" in [a["label"] for a in legend.values()]
    texts = ["".join(t.itertext()) for t in ET.parse(out_dir / "timeline.svg").iter("{http://www.w3.org/2000/svg}text")]
    assert "backward at train.py:11" in texts and "backward at train.py:12" in texts


def test_a_script_without_a_tape_runs_inside_one(tmp_path):
    proc = explain(tmp_path, NO_TAPE)
    assert proc.returncode == 0, proc.stderr
    assert "inside one tape" in proc.stdout
    assert "[1] graphprune.prune_after at train.py:8\n" in proc.stdout
    assert "released 1 saved tensor(s) of 1 node(s)" in proc.stdout  # tracked: no "outside track()" warning
    assert "GraphPruneWarning" not in proc.stderr


def test_exit_code_and_help(tmp_path):
    proc = explain(tmp_path, "import sys\nsys.exit(3)\n")
    assert proc.returncode == 3 and "0 call(s)" in proc.stdout and "made no prune_after" in proc.stdout
    helped = subprocess.run([sys.executable, "-m", "graphprune", "--help"], capture_output=True, text=True,
                            timeout=120, cwd=ROOT)
    assert helped.returncode == 0 and "explain" in helped.stdout and "python -m graphprune" in helped.stdout


PER_LOSS = """\
import torch
import graphprune as gp

w = torch.ones(64, requires_grad=True)
with gp.track():
    x = w.exp()
    losses = [x.sin().sum(), x.cos().sum()]
reports = gp.backward_each(l for l in losses)  # a generator, as torch takes
with gp.track():
    x = w.exp()
rows = gp.grads_each([lambda: x.sin().sum(), lambda: x.cos().sum()], w)
with gp.track():
    x = w.exp()
    stacked = torch.stack([x.sin().sum(), x.cos().sum()])
with gp.pruning() as p:
    stacked[0].backward(retain_graph=True)
    stacked[1].backward()
print("routed", len(p.reports), "plain", len(p.passed))
"""


def test_the_per_loss_helpers_passes_and_routed_calls_are_reported(tmp_path):
    out_dir = tmp_path / "pictures"
    proc = explain(tmp_path, PER_LOSS, "--svg", str(out_dir), "--format", "dot")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    # backward_each's cut: a pass per head, then the trunk's, which its strategy labels
    assert "[1] graphprune.backward_each at train.py:8, pass 1\n" in out
    assert "[2] graphprune.backward_each at train.py:8, pass 2\n" in out
    assert "[3] graphprune.backward_each at train.py:8, pass 3\n" in out
    assert out.count("    strategy: cut: 2 head pass(es), then the trunk once from 1 edge(s)\n") == 1
    assert "[4] graphprune.grads_each at train.py:11, pass 1\n" in out
    assert "[5] graphprune.grads_each at train.py:11, pass 2\n" in out
    assert "    picture: none (the losses are callables" in out
    assert "[6] graphprune.pruning at train.py:16, routed Tensor.backward\n" in out
    assert "[7]" not in out  # the plain pass (no retain_graph) is PyTorch's, unreported as elsewhere
    assert "routed 1 plain 1" in out  # the script's own view of its block is unchanged
    assert "graphprune explain: 3 call(s) (6 report(s)), " in out
    assert (out_dir / "01-backward_each-train.py-8.dot").exists()
    assert (out_dir / "06-pruning-train.py-16.dot").exists()
    assert not list(out_dir.glob("04-*"))  # callables: no picture
    texts = ["".join(t.itertext()) for t in ET.parse(out_dir / "timeline.svg").iter("{http://www.w3.org/2000/svg}text")]
    assert "backward_each at train.py:8, pass 2" in texts  # marked when the pass ended


NESTED = """\
import torch
import graphprune as gp

w = torch.ones(8, requires_grad=True)
v = torch.ones(8, requires_grad=True)
with gp.track():
    x = w.exp()

def first():
    with gp.track():
        z = v.exp()
    gp.grads_each([z.sin().sum(), z.cos().sum()], v)
    return x.sin().sum()

rows = gp.grads_each([first, lambda: x.cos().sum()], w)
print("rows", len(rows))
u = torch.ones(8, requires_grad=True)
with gp.track():
    x = w.exp()
    failing = [x.sin().sum(), u.cos().sum()]
try:
    gp.grads_each(failing, w)
except RuntimeError as e:
    print("caught", type(e).__name__)
"""


def test_a_helper_inside_a_helpers_callable_and_a_helper_that_raises_are_reported_once(tmp_path):
    proc = explain(tmp_path, NESTED)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "rows 2" in out and "caught RuntimeError" in out  # the script runs as it runs alone
    # the inner call's passes under its own line, the outer's under the outer line: once each
    assert "[1] graphprune.grads_each at train.py:12, pass 1\n" in out
    assert "[2] graphprune.grads_each at train.py:12, pass 2\n" in out
    assert "[3] graphprune.grads_each at train.py:15, pass 1\n" in out
    assert "[4] graphprune.grads_each at train.py:15, pass 2\n" in out
    # the pass that ran before the call raised freed its head: it is reported
    assert "[5] graphprune.grads_each at train.py:22, pass 1\n" in out
    assert "[6]" not in out
    assert "graphprune explain: 3 call(s) (5 report(s))" in out


LEAF_OUTPUT = """\
import torch
import graphprune as gp

w = torch.ones(4, requires_grad=True)
with gp.track():
    y = (w.exp() ** 2).sum()
gp.backward([y, w], [torch.ones(()), torch.ones(4)])  # a leaf among the outputs, as torch takes
print("grad", w.grad[0].item())
"""


def test_a_leaf_among_the_outputs_is_left_out_of_the_picture(tmp_path):
    out_dir = tmp_path / "pictures"
    proc = explain(tmp_path, LEAF_OUTPUT, "--svg", str(out_dir), "--format", "dot")
    assert proc.returncode == 0, proc.stderr
    assert "grad 15.7" in proc.stdout  # 2 e^2 + 1: the script ran on past its call
    assert f"    picture: {out_dir / '01-backward-train.py-7.dot'}" in proc.stdout


def test_sys_exit_with_a_message_prints_it(tmp_path):
    proc = explain(tmp_path, "import sys\nsys.exit('fatal: bad config')\n")
    assert proc.returncode == 1 and "fatal: bad config" in proc.stderr


def test_a_function_imported_by_name_during_a_run_reports_to_the_run_in_progress(tmp_path, monkeypatch,
                                                                                 capsys):
    # a module that ran `from graphprune import backward` during a run keeps the CLI's
    # function: in a later run it reports there, numbered by that run; outside any run
    # it is graphprune's own
    import importlib
    import sys

    import graphprune as gp
    from graphprune import _cli

    (tmp_path / "mylib.py").write_text(
        "from graphprune import backward\n\ndef step(y):\n    return backward(y)\n")
    (tmp_path / "train.py").write_text(textwrap.dedent("""\
        import torch
        import graphprune as gp
        import mylib

        w = torch.ones(4, requires_grad=True)
        with gp.track():
            x = w.exp()
        mylib.step((x * x).sum())
        """))
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "mylib", raising=False)
    original = gp.backward
    for run in range(2):
        assert _cli.main(["explain", "train.py"]) == 0
        out = capsys.readouterr().out
        assert "[1] graphprune.backward at mylib.py:4\n" in out, (run, out)
        assert "graphprune explain: 1 call(s)" in out
    assert gp.backward is original
    mylib = importlib.import_module("mylib")
    w = torch.ones(4, requires_grad=True)
    with gp.track():
        x = w.exp()
    assert isinstance(mylib.step((x * x).sum()), gp.PruneReport)
    assert capsys.readouterr().out == ""  # outside a run: graphprune's own function, silent


def test_heads_a_helpers_callables_build_are_on_the_timeline(tmp_path):
    # a per-loss helper opens its own tape for a head a callable builds: with --svg its
    # saved tensors are counted on the run's timeline (they were not: the timeline's peak
    # was the trunk's alone)
    import sys

    import graphprune as gp
    from graphprune import _cli

    session = _cli.Session(str(tmp_path), "dot", False)
    w = torch.ones(256, requires_grad=True)
    with session.patched():
        with gp.track():  # the run's track(), with its timeline
            x = w.exp()  # the trunk saves its output: 1 KiB
        trunk = session.timeline.peak
        line = sys._getframe().f_lineno + 1  # the helper's call, below
        gp.backward_each([lambda: (x * 2).sin().sum(), lambda: (x * 3).sin().sum()])
    assert trunk == 1024
    assert session.timeline.peak == 2 * trunk  # and a head's: x * 2, which its sin saves
    assert [e.label for e in session.timeline.events if e.kind == "mark"] == [
        f"backward_each at test_cli.py:{line}, pass {i}" for i in (1, 2, 3)]


DEEPER_TAP = """\
import torch
import graphprune as gp

w = torch.ones(4, requires_grad=True)
with gp.track():
    x = w.exp()
    z = x.sin()  # the first head's tap: deeper than the last head's, x
gp.grads_each([lambda: (z * z).sum(), lambda: (x * x).sum()], w)
"""


def test_what_a_helper_releases_after_its_passes_is_not_called_a_pass(tmp_path):
    # the last pass does not reach the first head's tap: the helper releases what is left
    # of the trunk after it, without a pass
    proc = explain(tmp_path, DEEPER_TAP)
    assert proc.returncode == 0, proc.stderr
    assert "[2] graphprune.grads_each at train.py:8, pass 2\n" in proc.stdout
    assert "[3] graphprune.grads_each at train.py:8, after the passes\n" in proc.stdout


def test_misuse_of_the_command_line_is_a_usage_error(tmp_path):
    """No command, a directory as the script and an --svg that names a file were a help
    text with exit 0, "no such script" and a FileExistsError traceback."""
    script = tmp_path / "s.py"
    script.write_text("print('ran')\n")
    taken = tmp_path / "taken.svg"
    taken.write_text("")
    for argv, said in [([], None), (["explain", str(tmp_path)], "a directory, not a script"),
                       (["explain", "--svg", str(taken), str(script)], "--svg takes a directory")]:
        proc = subprocess.run([sys.executable, "-m", "graphprune", *argv], capture_output=True, text=True,
                              timeout=120, cwd=ROOT)
        assert proc.returncode == 2 and "usage: python -m graphprune" in proc.stderr, (argv, proc.stderr)
        assert said is None or said in proc.stderr
        assert "Traceback" not in proc.stderr and "ran" not in proc.stdout


def test_a_script_that_passes_its_own_timeline_has_that_one_pictured(tmp_path, capsys):
    # its block recorded its saved tensors on its own timeline: the run's, with the calls'
    # marks only, was pictured "peak 0.0 MiB" (found in review)
    import graphprune as gp
    from graphprune import _cli

    session = _cli.Session(str(tmp_path), "dot", False)
    w = torch.ones(1 << 18, requires_grad=True)
    mine = gp.Timeline("mine")
    with session.patched():
        with gp.track(timeline=mine):
            x = w.exp()  # saves its output: 1 MiB
        gp.backward(x.sin().sum())
    assert mine.peak == 1 << 20 and session.timeline.peak == 0
    session.summary()
    assert "(the script's own timeline)" in capsys.readouterr().out
    texts = ["".join(t.itertext()) for t in ET.parse(tmp_path / "timeline.svg").iter("{http://www.w3.org/2000/svg}text")]
    assert "mine (peak 1.0 MiB)" in texts
