"""Gantt charts of pipeline timelines, simulated or measured (one row per rank).

Uses matplotlib's object API with the Agg canvas directly (no ``pyplot``), so plotting touches no
global figure state and works on headless machines; the file type follows the path's suffix
(``.png``, ``.svg``, ``.pdf``). :func:`format_timeline` is the text twin for logs and docstrings.
"""
from __future__ import annotations

from pathlib import Path

from .schedules import ActionKind
from .simulate import Timeline

K = ActionKind
COLORS = {K.FORWARD: "#4c78a8", K.BACKWARD: "#f58518", K.BACKWARD_INPUT: "#e45756",
          K.BACKWARD_WEIGHT: "#54a24b"}
COMM_COLOR = "#bbbbbb"
LABELS = {K.FORWARD: "forward", K.BACKWARD: "backward", K.BACKWARD_INPUT: "backward (input)",
          K.BACKWARD_WEIGHT: "backward (weight)"}


def _summary(timeline: Timeline) -> str:
    return f"makespan {float(timeline.makespan):.4g}, bubble {float(timeline.bubble_fraction):.1%}"


def _draw(ax, timeline: Timeline, title: str | None) -> None:
    with_chunk = any(e.action.chunk > 0 for evs in timeline.events for e in evs)
    span = float(timeline.makespan) or 1.0
    origin = min((float(e.start) for evs in timeline.events for e in evs), default=0.0)
    seen = set()
    for rank, evs in enumerate(timeline.events):
        for e in evs:
            start, width = float(e.start) - origin, float(e.end - e.start)
            kind = e.action.kind
            if kind.is_comm:
                if width > 0:  # waiting for / moving a message: a thin grey strip
                    ax.broken_barh([(start, width)], (rank - 0.1, 0.2), color=COMM_COLOR)
                continue
            label = None if kind in seen else LABELS[kind]
            seen.add(kind)
            ax.broken_barh([(start, width)], (rank - 0.4, 0.8), facecolor=COLORS[kind],
                           edgecolor="white", linewidth=0.5, label=label)
            text = str(e.action.microbatch) + (f".{e.action.chunk}" if with_chunk else "")
            if width >= span * len(text) / 100:  # label only where it fits
                ax.text(start + width / 2, rank, text, ha="center", va="center",
                        fontsize=7, color="white")
    ax.set_yticks(range(timeline.num_ranks))
    ax.set_yticklabels([f"rank {r}" for r in range(timeline.num_ranks)])
    ax.set_ylim(timeline.num_ranks - 0.5, -0.5)  # rank 0 on top
    ax.set_xlim(0, span)
    ax.set_xlabel("time")
    ax.set_title(f"{title}  ({_summary(timeline)})" if title else _summary(timeline), fontsize=9)
    if seen:
        ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.25), ncol=len(seen), fontsize=7,
                  frameon=False)


def _save(fig, path: str | Path) -> Path:
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    FigureCanvasAgg(fig)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    return path


def plot_timeline(timeline: Timeline, path: str | Path, title: str | None = None) -> Path:
    """Draw ``timeline`` as a Gantt chart (colour per action kind, microbatch labels) to ``path``.

    Microbatch labels read ``mb`` or ``mb.chunk`` for interleaved schedules. Grey strips are time
    spent inside communication groups (zero-cost messages that did not wait are not drawn).
    """
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10, 0.5 * timeline.num_ranks + 1.4))
    _draw(fig.add_subplot(1, 1, 1), timeline, title)
    return _save(fig, path)


def plot_side_by_side(simulated: Timeline, measured: Timeline, path: str | Path,
                      titles: tuple[str, str] = ("simulated", "measured")) -> Path:
    """Simulated above measured, each on its own time axis, to compare shapes and bubbles."""
    from matplotlib.figure import Figure

    rows = simulated.num_ranks + measured.num_ranks
    fig = Figure(figsize=(10, 0.5 * rows + 3.0))
    _draw(fig.add_subplot(2, 1, 1), simulated, titles[0])
    _draw(fig.add_subplot(2, 1, 2), measured, titles[1])
    fig.subplots_adjust(hspace=0.9)
    return _save(fig, path)


def format_timeline(timeline: Timeline, unit: float | None = None) -> str:
    """Text Gantt chart: one row per rank, one 3-character cell per ``unit`` of time.

    ``unit`` defaults to the shortest compute event. A cell shows the compute action covering its
    midpoint (``F3``, ``B3``, ``I3``, ``W3``) or ``.`` when the rank is idle.
    """
    compute = [e for evs in timeline.events for e in evs if e.action.kind.is_compute]
    if not compute:
        return "\n".join(f"rank {r}:" for r in range(timeline.num_ranks))
    unit = unit or min(e.end - e.start for e in compute if e.end > e.start)
    origin = min(e.start for evs in timeline.events for e in evs)
    cells = int(round(float(timeline.makespan / unit)))
    lines = []
    for rank, evs in enumerate(timeline.events):
        row = []
        for i in range(cells):
            mid = origin + (i + 0.5) * unit
            hit = next((e for e in evs if e.action.kind.is_compute and e.start <= mid < e.end),
                       None)
            row.append((hit.action.short() if hit else ".").ljust(3))
        lines.append(f"rank {rank}: " + "".join(row).rstrip())
    return "\n".join(lines)
