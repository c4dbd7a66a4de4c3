"""Timelines of real runs (`log.timeline=PATH`): measured events beside the schedule simulated with the
same measured costs, written as a Gantt chart (.png), JSON or CSV.

The runtime records `(pp rank, action, start, end)` per action (time.perf_counter(), which is one clock
for all processes of a node; across nodes the per-rank offsets are unknown, so ranks are drawn as
measured). Records travel between ranks as plain JSON rows: [rank, kind, microbatch, chunk, peer,
start, end]. The simulation gives every compute action the mean measured duration of its (rank, kind)
and communication zero cost with lazy sends (how the runtime works), so the gap between the two
bubbles is what the runtime loses to Python, waiting on peers and allocation.
"""
from __future__ import annotations

import csv
import json
import statistics
from collections import defaultdict
from pathlib import Path
from typing import Optional, Sequence

from .schedules import Action, ActionKind
from .simulate import Timeline, simulate

FORMATS = (".png", ".json", ".csv")


def to_rows(records: Sequence[tuple[int, Action, float, float]]) -> list[list]:
    return [[r, a.kind.name, a.microbatch, a.chunk, a.peer, s, e] for r, a, s, e in records]


def from_rows(rows: Sequence[Sequence]) -> list[tuple[int, Action, float, float]]:
    return [(int(r), Action(ActionKind[k], int(mb), int(c), None if peer is None else int(peer)), float(s), float(e))
            for r, k, mb, c, peer, s, e in rows]


def mean_costs(records: Sequence[tuple[int, Action, float, float]]) -> dict[tuple[int, ActionKind], float]:
    """Mean measured duration of each compute kind on each rank. An action of an ep_overlap pair is recorded
    as one row per turn (runtime.py): its turns add up to its duration."""
    each: dict[tuple[int, Action], float] = defaultdict(float)
    for rank, action, start, end in records:
        if action.kind.is_compute:
            each[(rank, action)] += end - start
    spent: dict[tuple[int, ActionKind], list[float]] = defaultdict(list)
    for (rank, action), seconds in each.items():
        spent[(rank, action.kind)].append(seconds)
    return {key: statistics.mean(v) for key, v in spent.items()}


def measured_and_simulated(records: Sequence[tuple[int, Action, float, float]],
                           schedule: Sequence[Sequence[Action]]) -> tuple[Timeline, Timeline]:
    """The measured timeline and the schedule simulated with the measured mean costs."""
    p = len(schedule)
    measured = Timeline.from_events(records, num_ranks=p)
    costs = mean_costs(records)
    simulated = simulate(schedule, lazy_sends=True, costs=lambda rank, a: costs.get((rank, a.kind), 0.0))
    return measured, simulated


def write_timeline(path: str | Path, measured: Timeline, simulated: Timeline, title: str = "",
                   step: Optional[int] = None, steps: Optional[list[dict]] = None) -> Path:
    """Write both timelines to `path`: .png (Gantt charts, simulated above measured), .json or .csv. The
    JSON carries `step`, the run's step (its JSONL row) the timeline was recorded in, where given, and
    `steps`, where given: each recorded step's {"step", "measured_bubble", "measured"} (log.timeline_steps)."""
    path = Path(path)
    if path.suffix not in FORMATS:
        raise ValueError(f"log.timeline={path}: the file must end in one of {FORMATS}")
    path.parent.mkdir(parents=True, exist_ok=True)
    bubbles = {"measured_bubble": float(measured.bubble_fraction), "simulated_bubble": float(simulated.bubble_fraction)}
    if path.suffix == ".png":
        from .plot import plot_side_by_side
        names = (f"simulated with the measured costs{title}", f"measured{title}")
        return plot_side_by_side(simulated, measured, path, titles=names)
    if path.suffix == ".json":
        recorded = {**({} if step is None else {"step": step}), **({} if steps is None else {"steps": steps})}
        path.write_text(json.dumps({**recorded, **bubbles, "columns": ["rank", "kind", "microbatch", "chunk", "peer",
                                                           "start_s", "end_s"],
                                    "measured": to_rows(measured.records()),
                                    "simulated": to_rows(simulated.records())}))
        return path
    with open(path, "w", newline="") as f:
        out = csv.writer(f)
        out.writerow(["source", "rank", "kind", "microbatch", "chunk", "peer", "start_s", "end_s"])
        for source, timeline in (("measured", measured), ("simulated", simulated)):
            for row in to_rows(timeline.records()):
                out.writerow([source, *row])
    return path


def breakdown(records: Sequence[tuple[int, Action, float, float]], num_ranks: int) -> list[dict[str, float]]:
    """Where each rank's step went, in seconds over the whole step (first start to last end, all ranks):
    ``compute`` (F/B/I/W), ``recv`` (blocked waiting for a receive), ``send`` (posting / waiting sends),
    ``between`` (Python between consecutive actions on the rank) and ``outside`` (before its first and
    after its last action). A communication group is one span, booked to ``recv`` when it receives."""
    if not records:
        return [dict(compute=0.0, recv=0.0, send=0.0, between=0.0, outside=0.0) for _ in range(num_ranks)]
    t0, t1 = min(s for _, _, s, _ in records), max(e for _, _, _, e in records)
    spans: list[dict[tuple[float, float], str]] = [{} for _ in range(num_ranks)]
    for rank, a, s, e in records:
        kind = "compute" if a.kind.is_compute else "recv" if a.kind.is_recv else "send"
        if spans[rank].get((s, e)) != "recv":  # a group that receives is booked as a wait
            spans[rank][(s, e)] = kind
    out = []
    for rank in range(num_ranks):
        row = dict(compute=0.0, recv=0.0, send=0.0, between=0.0, outside=0.0)
        events = sorted(spans[rank].items())
        for (s, e), kind in events:
            row[kind] += e - s
        if events:
            first, last = events[0][0][0], max(e for (_, e), _ in events)
            row["outside"] = (first - t0) + (t1 - last)
            row["between"] = (t1 - t0) - row["outside"] - row["compute"] - row["recv"] - row["send"]
        else:
            row["outside"] = t1 - t0
        out.append(row)
    return out
