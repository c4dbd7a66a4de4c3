"""The planner: the real training step of one rank per role, dry-run on the `meta` stand-in, turned into
memory per rank, step time, MFU and bytes per group for a GPU cluster (`launch/plan.py`).

    tracker.py   what a step allocates and computes, op by op (memory by category, FLOPs, bytes)
    dryrun.py    one rank's step through the real Trainer on the stand-in, its ops and collectives recorded
    step_costs.py  that step priced: each op and collective attributed to its pipeline action
    cost.py      roofline per op and alpha-beta per collective (plain functions)
    hardware.py  GPU and link table with stated efficiencies (peaks: parallel3d/hardware.py, shared with the MFU)
    profile.py   this machine as a device (`--gpu cpu`): microbenchmarks, cached per host and core count
    op_replay.py every op of a plan replayed on this CPU, alone and in its action's order (cached beside it)
    replay_speed.py  a probe of the machine's speed at each replay, so replays of different moments compare
    compare.py   a plan beside a real run's log (`launch/plan.py --compare`), per component
    kernels.py   our Triton kernels' occupancy from benchmarks/kernel_report.py (roofline derating)
    offload.py   optimizer / parameter offload on top of the device step
    estimate.py  one layout's plan: roles, pipeline simulation, memory at the peak in flight
    search.py    every valid layout, ordered by textbook formulas, dry-run until enough fit (a budget)
"""
from parallel3d.planner.estimate import Plan, plan
from parallel3d.planner.hardware import GPUS, gpu
from parallel3d.planner.search import candidates, search

__all__ = ["GPUS", "Plan", "candidates", "gpu", "plan", "search"]
