"""matplotlib, used only to draw pictures: a figure without pyplot, saved without a display.

matplotlib is no dependency of graphprune: it is imported when a picture is drawn, and
a ``.dot`` file needs none. A ``Figure`` made directly (not by ``pyplot``) has no GUI
backend and touches no global state; ``savefig`` picks the Agg/SVG/PDF canvas by the
file's suffix.
"""

from __future__ import annotations

import os

__all__ = ["figure", "save", "FORMATS"]

FORMATS = (".svg", ".png", ".pdf")


def figure(width: float, height: float):
    try:
        from matplotlib.figure import Figure
    except ImportError as err:  # pragma: no cover - matplotlib is in the test extras
        raise ImportError(
            "graphprune draws pictures with matplotlib: pip install matplotlib "
            "(or write a .dot file, which needs nothing)"
        ) from err
    return Figure(figsize=(width, height))


def save(fig, path: str) -> None:
    """Save ``fig``: SVG keeps its text as ``<text>`` (searchable, testable) and carries
    no date or random ids, so the same picture gives the same file."""
    import matplotlib

    suffix = os.path.splitext(path)[1].lower()
    if suffix not in FORMATS:
        raise ValueError(f"graphprune: cannot draw {path!r}: the suffix must be one of {', '.join(FORMATS)}")
    metadata = {"Date": None} if suffix in (".svg", ".pdf") else None
    with matplotlib.rc_context({"svg.fonttype": "none", "svg.hashsalt": "graphprune"}):
        fig.savefig(path, metadata=metadata, dpi=100, bbox_inches="tight", pad_inches=0.15)


# -- the graph picture -----------------------------------------------------------------
def layers(boxes) -> list[list]:
    """The boxes by topological generation (``y`` first), each row ordered by the mean
    position of its parents (a few barycentre sweeps, so that edges cross less)."""
    import networkx as nx

    rows = [list(r) for r in nx.topological_generations(boxes)]
    for _ in range(4):
        pos = {n: i for row in rows for i, n in enumerate(row)}
        for row in rows[1:]:
            row.sort(key=lambda n: _mean([pos[p] for p in boxes.predecessors(n)], pos[n]))
            pos.update((n, i) for i, n in enumerate(row))
    return rows


def _mean(values: list, default: float) -> float:
    return sum(values) / len(values) if values else default


def draw_graph(boxes, legend: list[tuple[str, str]], title: str, path: str) -> None:
    """Draw ``boxes`` (``_render._boxes``) row by row, with a legend, to ``path``."""
    from matplotlib.collections import LineCollection
    from matplotlib.patches import Patch

    rows = layers(boxes)
    wide = max(len(r) for r in rows)
    width = min(120.0, max(7.0, 1.9 * wide))
    height = min(200.0, max(3.0, 0.95 * len(rows) + 0.35 * len(legend) + 1.0))
    fig = figure(width, height)
    ax = fig.add_subplot()
    pos = {n: (i - (len(row) - 1) / 2, -depth) for depth, row in enumerate(rows) for i, n in enumerate(row)}
    ax.add_collection(LineCollection([(pos[u], pos[v]) for u, v in boxes.edges], colors="#8c8c8c",
                                     linewidths=0.8, zorder=1))
    plain = dict(lw=0.6, ls="-")
    borders = {"root": dict(lw=2.5, ls="-"), "keep": dict(lw=2.0, ls="--")}
    for i, (n, d) in enumerate(boxes.nodes(data=True)):
        box = dict(boxstyle="round,pad=0.35", fc=d["fill"], ec="black", **borders.get(d["border"], plain))
        ax.text(*pos[n], d["label"], ha="center", va="center", fontsize=7, zorder=2, bbox=box,
                gid=f"box{i}-{d['state']}")
    ax.set_xlim(-wide / 2 - 0.1, wide / 2 + 0.1)
    ax.set_ylim(-len(rows) + 0.4, 0.6)
    ax.axis("off")
    handles = [Patch(facecolor=fill, edgecolor="black", label=text) for fill, text in legend]
    borders = {d["border"] for _, d in boxes.nodes(data=True)}
    if "root" in borders:
        handles.append(Patch(facecolor="white", edgecolor="black", lw=2.5, label="[y]: the output pruned"))
    if "keep" in borders:
        handles.append(Patch(facecolor="white", edgecolor="black", lw=2.0, ls="--",
                             label="[keep]: a keep= root"))
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, 0.0), fontsize=7, frameon=False,
              title="legend", title_fontsize=8)
    ax.set_title(title, fontsize=9)
    save(fig, path)
