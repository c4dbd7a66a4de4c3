"""A plan beside the run it plans (`launch/plan.py --compare run.jsonl [--timeline t.json]`): where the
model is off, per component, from what a real run logs.

From the run's JSONL (`log.jsonl`, one row per step) it takes the median step time over the later half of
the steps (`steady_rows`: a run warms up over its first steps) with their quartiles, the comm bytes per "<group>.<op>" of the last step
and the largest `peak_mem_bytes`; from the timeline JSON (`log.timeline=PATH.json`) the mean measured
duration of each pipeline action kind, the span of the pipeline and its bubble, and what followed the
pipeline in the same step (its JSONL step time less the span), each the median over the steps the timeline
recorded (`log.timeline_steps`; one by default: then one step's figures, not medians); of an MoE run at
EP > 1, its routing load (`moe_tokens_per_expert.*`: the busiest EP rank's share of each layer's routed slots over the
balanced share, the mean over layers, the median over the steady steps), which a plan assumes (1.0, balanced,
unless planned with `--moe-load`) and the step waits on at every exchange. The plan gives the same
quantities (estimate.Plan). Rows: step time; pipeline span and what follows it (gradient-sync tail,
clipping, optimizer); compute per microbatch by action kind; bubble; communication bytes and modeled
seconds per group and op; peak memory (the plan's peak plus the device's reserved bytes: the CUDA context,
or on `--gpu cpu` the process's resident memory before the model, since a CPU run logs its peak RSS).
"""
from __future__ import annotations

import json
import statistics
from collections import defaultdict
from pathlib import Path
from typing import Optional

from parallel3d.expert_parallel.dispatch import rank_load
from parallel3d.planner.estimate import Plan


COMPUTE_KINDS = ("FORWARD", "BACKWARD", "BACKWARD_INPUT", "BACKWARD_WEIGHT")


def steady_rows(rows: list) -> list:
    """The steps a steady state is read from: the later half (at least all but the first). A run warms up
    over more than its first step: a CPU run of llama_100m with 4 experts at EP 2 took 8.4, 6.0, 4.7, 4.6,
    4.5, 4.4, 4.3 s while its heap grew to the routed shapes (peak RSS 4.09 -> 4.55 GiB), and the median of
    all steps but the first had kept two of the warm-up steps in a six-step run."""
    return rows[max(1, len(rows) // 2):] if len(rows) > 1 else list(rows)


def routing_load(row: dict, ep: int) -> Optional[float]:
    """One step's MoE routing load at `ep` (module docstring); None without MoE telemetry or below EP 2."""
    layers = [v for k, v in row.items() if k.startswith("moe_tokens_per_expert.")]
    if ep < 2 or not layers:
        return None
    return statistics.mean(rank_load(tokens, ep) for tokens in layers)


def read_run(jsonl: str, timeline: Optional[str] = None, ep: int = 1) -> dict:
    """The run's figures (module docstring); `ep`: the run's parallel.ep, for its routing load. Raises
    ValueError naming the file when it has no step rows."""
    rows = []
    for line in Path(jsonl).read_text().splitlines():
        line = line.strip()
        if line:
            row = json.loads(line)
            if "step_time_s" in row:
                rows.append(row)
    if not rows:
        raise ValueError(f"--compare {jsonl}: no step rows (log.jsonl rows with step_time_s) in the file")
    steady = steady_rows(rows)
    times = [r["step_time_s"] for r in steady]
    # the middle half of the steps the median is taken over: a VM may run at two speeds for seconds at a
    # time (RESULTS.md, ninth session), and a short step's median lands in either
    quartiles = statistics.quantiles(times, n=4) if len(times) > 1 else times * 3
    run = {"steps": len(rows), "step_time_s": statistics.median(times),
           "step_time_q1_s": quartiles[0], "step_time_q3_s": quartiles[2],
           "tokens_per_s": statistics.median(r.get("tokens_per_s", 0.0) for r in steady),
           "comm_bytes": dict(rows[-1].get("comm_bytes") or {}),
           "peak_mem_bytes": max(int(r.get("peak_mem_bytes", 0)) for r in rows)}
    if rows[-1].get("simulated"):   # launch/pretrain.py --simulate-rank: which rank of which world it ran
        run["simulated"] = dict(rows[-1]["simulated"])
    loads = [x for x in (routing_load(r, ep) for r in steady) if x is not None]
    if loads:
        run["moe_load"] = statistics.median(loads)
    if timeline:
        run.update(read_timeline(json.loads(Path(timeline).read_text()), {r.get("step"): r for r in rows}))
    return run


def read_timeline(data: dict, by_step: dict) -> dict:
    """The run's pipeline figures from its timeline JSON `data` (every step it recorded: log.timeline_steps)
    and its JSONL rows `by_step` (step -> row): the mean of each action kind over the recorded steps, and the
    median over them of the pipeline's span, its bubble and what followed it in the same step (that step's
    logged time less its span; left out for a timeline that does not name its step)."""
    steps = data.get("steps") or [{"step": data.get("step"), "measured": data["measured"],
                                   "measured_bubble": data.get("measured_bubble", 0.0)}]
    spent: dict = defaultdict(list)
    spans, bubbles, after, computed = [], [], [], []
    for recorded in steps:
        starts, ends, busy = [], [], 0.0
        for rank, kind, _mb, _chunk, _peer, start, end in recorded["measured"]:
            starts.append(start)
            ends.append(end)
            if kind in COMPUTE_KINDS:
                spent[kind].append(end - start)
                busy += end - start
        span = max(ends) - min(starts) if starts else 0.0
        spans.append(span)
        computed.append(busy)
        bubbles.append(recorded.get("measured_bubble", 0.0))
        row = by_step.get(recorded["step"]) if recorded["step"] is not None else None
        if row is not None and starts:
            after.append(row["step_time_s"] - span)
    out = {"action_s": {k: statistics.mean(v) for k, v in spent.items()}, "pipeline_s": statistics.median(spans),
           "compute_s": statistics.median(computed),
           "bubble": statistics.median(bubbles), "timeline_steps": len(steps)}
    if after:
        out["after_pipeline_s"] = statistics.median(after)
    return out


def rows(plan: Plan, run: dict, reserved_bytes: float) -> list[tuple[str, str, str, str]]:
    """(component, plan, run, run / plan) rows."""
    out = []

    def add(name: str, planned: Optional[float], measured: Optional[float], fmt: str = "{:.4f} s") -> None:
        p = "-" if planned is None else fmt.format(planned)
        m = "-" if measured is None else fmt.format(measured)
        ratio = f"{measured / planned:.2f}" if planned and measured is not None else "-"
        out.append((name, p, m, ratio))

    b = plan.breakdown
    if run.get("simulated"):
        simulated_rows(plan, run, reserved_bytes, add, out)
        return out
    add("step time", plan.step_time_s, run["step_time_s"])
    q1, q3 = run["step_time_q1_s"], run["step_time_q3_s"]   # how far one run's median can move
    out.append(("step time, middle half of the steps", "", f"{q1:.4f}-{q3:.4f} s",
                f"{q1 / plan.step_time_s:.2f}-{q3 / plan.step_time_s:.2f}"))
    add("tokens/s", plan.tokens_per_s, run["tokens_per_s"], "{:,.0f}")
    measured_pipeline = run.get("pipeline_s")
    add("pipeline (all microbatches)", b["pipeline_s"], measured_pipeline)
    add("after the pipeline (grad sync tail, clip, optimizer)", b["outside_actions_s"], run.get("after_pipeline_s"))
    chunks: dict = defaultdict(list)
    for key, seconds in b.get("action_s", {}).items():   # "KIND.chunk" -> seconds of one action
        chunks[key.split(".")[0]].append(seconds)
    per_kind = {k: statistics.mean(v) for k, v in chunks.items()}
    for kind in COMPUTE_KINDS:
        if kind in per_kind or kind in run.get("action_s", {}):
            add(f"one {kind.lower()} action (a microbatch of a chunk)", per_kind.get(kind), run.get("action_s", {}).get(kind))
    add("pipeline bubble", plan.bubble, run.get("bubble"), "{:.1%}")
    if "moe_load" in run:
        add("MoE routing load (busiest EP rank / balanced)", plan.expert_load, run["moe_load"], "{:.2f}")
    comm_s = b.get("comm_s", {})
    for key in sorted(set(plan.comm_bytes) | set(run["comm_bytes"])):
        add(f"comm {key} bytes", plan.comm_bytes.get(key), run["comm_bytes"].get(key), "{:,.0f}")
        if key in comm_s:
            out.append((f"comm {key} modeled time", f"{comm_s[key]:.4f} s", "(not logged)", "-"))
    add("peak memory (GiB)", (plan.memory["peak"] + reserved_bytes) / 2 ** 30, run["peak_mem_bytes"] / 2 ** 30,
        "{:.3f}")
    return out


def simulated_rows(plan: Plan, run: dict, reserved_bytes: float, add, out: list) -> None:
    """The rows of a simulated rank's run (launch/pretrain.py --simulate-rank K): rank K alone, its collectives
    answered locally, so nothing waits for a peer or the network. Its step is its own stage's compute of every
    microbatch (plan: that stage's priced compute, without communication) and what follows the pipeline; no
    bubble. Memory is set beside the plan of K's own stage, not the fullest. `add(name, plan, run, fmt)`
    appends a row to `out` (rows())."""
    sim = run["simulated"]
    role = next((r for r in plan.roles if r["pp_rank"] == sim["pp_rank"]), None)
    if role is None:
        raise ValueError(f"--compare: the run simulated rank {sim['rank']} of pipeline stage {sim['pp_rank']}, "
                         f"which the plan's layout (pp={plan.layout['pp']}) does not have")
    stage = f"stage {sim['pp_rank']}"
    out.append((f"simulated rank {sim['rank']} of {sim['world_size']} ({stage}, {sim.get('device', '?')}), "
                f"alone: no waits", "", "", ""))
    after = plan.breakdown["outside_actions_s"]
    add(f"step time: {stage}'s compute + after the pipeline", role["compute_s"] + after, run["step_time_s"])
    q1, q3 = run["step_time_q1_s"], run["step_time_q3_s"]
    out.append(("step time, middle half of the steps", "", f"{q1:.4f}-{q3:.4f} s", ""))
    add(f"{stage} compute, all microbatches (timeline)", role["compute_s"], run.get("compute_s"))
    add("after the pipeline (grad sync tail, clip, optimizer)", after, run.get("after_pipeline_s"))
    kinds: dict = defaultdict(list)
    for key, seconds in role["action_compute_s"].items():   # "KIND.chunk" -> compute seconds of one action
        kinds[key.split(".")[0]].append(seconds)
    for kind in COMPUTE_KINDS:
        if kind in kinds or kind in run.get("action_s", {}):
            planned = statistics.mean(kinds[kind]) if kind in kinds else None
            add(f"one {kind.lower()} action of {stage} (compute)", planned, run.get("action_s", {}).get(kind))
    if "moe_load" in run:
        add("MoE routing load (busiest EP rank / balanced)", plan.expert_load, run["moe_load"], "{:.2f}")
    for key in sorted(set(plan.comm_bytes) | set(run["comm_bytes"])):  # the plan's: its fullest rank's
        add(f"comm {key} bytes (plan: fullest rank)", plan.comm_bytes.get(key), run["comm_bytes"].get(key),
            "{:,.0f}")
    add(f"peak memory of {stage} (GiB)", (role["memory"]["peak"] + reserved_bytes) / 2 ** 30,
        run["peak_mem_bytes"] / 2 ** 30, "{:.3f}")
    return out


def table(plan: Plan, run: dict, reserved_bytes: float) -> str:
    body = rows(plan, run, reserved_bytes)
    width = max(len(r[0]) for r in body)
    lines = [f"{'component':<{width}}  {'plan':>16}  {'run':>16}  run/plan"]
    lines += [f"{n:<{width}}  {p:>16}  {m:>16}  {r}" for n, p, m, r in body]
    return "\n".join(lines)
