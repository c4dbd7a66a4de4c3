"""The selftest's one table: a row per layout (parity with world size 1) and a row per measured bandwidth.

    check                    mesh / group            result       detail
    tp2                      tp2 dp2                 ok           max rel err loss 4.1e-08 grad_norm 1.1e-07 ...
    pp2-zb-v                 dp2 pp2                 ok           ...
    tp2-sp-pp2-zero1         -                       skipped: needs world >= 8
    bus bandwidth (NCCL-tests' busbw, the slowest rank's time) beside the planner's: <its GPU, or why none>
    busbw tp all_reduce      ranks 0,1 intra-node    <B> GB/s     planner <P> GB/s; 64 MiB in <T> ms, in tp2

A layout's result is "ok", "MISMATCH" (its detail names the first difference; every one is listed under the
table), "skipped: ..." or "error: ...". Only MISMATCH and error rows fail the selftest.
"""
from __future__ import annotations

from typing import Sequence

WIDTHS = (26, 24, 14)


def _line(*cells: str) -> str:
    """The cells in their columns; a cell wider than its column pushes the rest right (one space kept)."""
    out = ""
    for i, cell in enumerate(cells):
        out += cell if i == len(cells) - 1 else (cell + " ").ljust(WIDTHS[i])
    return out.rstrip()


def layout_detail(row: dict) -> str:
    if row["result"] == "ok":
        e = row["errors"]
        return (f"max rel err loss {e['loss']:.1e} grad_norm {e['grad_norm']:.1e} weights {e['weights']:.1e}; "
                f"{row['seconds']:.1f} s")
    if row["result"] == "MISMATCH":
        more = len(row["mismatches"]) - 1
        return row["mismatches"][0] + (f" (+{more} more)" if more else "")
    return ""


def _ranks(ranks: Sequence[int]) -> str:
    if len(ranks) > 2 and list(ranks) == list(range(ranks[0], ranks[-1] + 1)):
        return f"{ranks[0]}-{ranks[-1]}"
    return ",".join(str(r) for r in ranks) if len(ranks) <= 4 else f"{ranks[0]},{ranks[1]},..,{ranks[-1]}"


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:.3g} MiB"


def bandwidth_detail(row: dict) -> str:
    figure = "n/a" if row["planner_busbw"] is None else f"{row['planner_busbw'] / 1e9:.3g} GB/s"
    return f"planner {figure}; {_mib(row['bytes'])} in {row['seconds'] * 1e3:.3g} ms, in {row['layout']}"


def table(layouts: Sequence[dict], bandwidths: Sequence[dict], header: str, planner: str) -> str:
    lines = [header, _line("check", "mesh / group", "result", "detail")]
    for row in layouts:
        lines.append(_line(row["name"], row["mesh"] or "-", row["result"], layout_detail(row)))
    if bandwidths:
        lines.append(f"bus bandwidth (NCCL-tests' busbw, the slowest rank's time) beside the planner's: {planner}")
    for row in bandwidths:
        lines.append(_line(f"busbw {row['group']} {row['op']}", f"ranks {_ranks(row['ranks'])} {row['link']}",
                           f"{row['busbw'] / 1e9:.3g} GB/s", bandwidth_detail(row)))
    failed = [row for row in layouts if row["result"] in ("MISMATCH",) or row["result"].startswith("error")]
    for row in failed:
        lines.append(f"{row['name']}: {row['result']}")
        lines += [f"    {m}" for m in row.get("mismatches", [])]
    ok = sum(row["result"] == "ok" for row in layouts)
    skipped = sum(row["result"].startswith("skipped") for row in layouts)
    lines.append(f"{ok} ok, {len(failed)} failed, {skipped} skipped"
                 + (f": FAILED {', '.join(row['name'] for row in failed)}" if failed else ""))
    return "\n".join(lines)
