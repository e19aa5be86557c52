"""The graph picture as Graphviz source, written by hand (no pydot, no ``dot`` binary needed)."""

from __future__ import annotations

__all__ = ["write_dot"]

_BORDERS = {"root": ", penwidth=3", "keep": ', penwidth=2, style="rounded,filled,dashed"'}


def _quote(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def write_dot(boxes, legend: list[tuple[str, str]], title: str, path: str) -> None:
    """Write ``boxes`` (``_render._boxes``) to ``path``: one node per box (``class`` is its
    state: ``release``, ``keep0``, ...), edges from ``y`` down, a ``cluster_legend``."""
    ids = {n: f"n{i}" for i, n in enumerate(boxes)}
    lines = [
        "digraph graphprune {",
        f"  graph [rankdir=TB, labelloc=t, fontname=Helvetica, label={_quote(title)}];",
        '  node [shape=box, style="rounded,filled", fontname=Helvetica, fontsize=10];',
    ]
    for n, d in boxes.nodes(data=True):
        extra = _BORDERS.get(d["border"], "")
        lines.append(f"  {ids[n]} [label={_quote(d['label'])}, fillcolor={_quote(d['fill'])}, "
                     f"class={_quote(d['state'])}{extra}];")
    lines += [f"  {ids[u]} -> {ids[v]};" for u, v in boxes.edges]
    lines.append('  subgraph cluster_legend {\n    label="legend";')
    for i, (fill, text) in enumerate(legend):
        lines.append(f"    legend{i} [label={_quote(text)}, fillcolor={_quote(fill)}, class=\"legend\"];")
    borders = {d["border"] for _, d in boxes.nodes(data=True)}
    if "root" in borders:
        lines.append(f'    legend_y [label="[y]: the output pruned", fillcolor="white"{_BORDERS["root"]}, '
                     'class="legend"];')
    if "keep" in borders:
        lines.append(f'    legend_keep [label="[keep]: a keep= root", fillcolor="white"{_BORDERS["keep"]}, '
                     'class="legend"];')
    lines += ["  }", "}"]
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
