"""Pipeline parallelism. Pure parts: schedules as data, verifier, simulator, partitioning, plots.

A schedule is one list of :class:`Action` per pipeline rank (see ``schedules.py`` for the data model
and the communication rules a runtime must follow). ``verify`` proves it well formed, ``simulate``
turns it into a :class:`Timeline` (the same type a runtime builds from measured events), and
``plot_timeline`` draws either. Nothing imported here needs torch or torch.distributed.
"""
from .partition import balanced_counts, partition_layers
from .placement import (PLACEMENTS, V_SCHEDULES, Schedule, chunks_per_rank, holders_of_ends, locate,
                        placement_of, stage_ids)
from .plot import format_timeline, plot_side_by_side, plot_timeline
from .schedules import (SCHEDULE_NAMES, Action, ActionKind, ScheduleError, build_schedule,
                        format_schedule, gpipe, interleaved_1f1b, one_f_one_b, stage_of, zb_h1)
from .simulate import (DEFAULT_COSTS, Event, Timeline, message_key, partner, peak_in_flight,
                       simulate, split_steps)
from .verify import verify
from .vshape import dualpipe_v, zb_v

__all__ = [
    "Action", "ActionKind", "DEFAULT_COSTS", "Event", "SCHEDULE_NAMES", "ScheduleError",
    "Timeline", "balanced_counts", "build_schedule", "format_schedule", "format_timeline",
    "gpipe", "interleaved_1f1b", "message_key", "one_f_one_b", "partition_layers", "partner",
    "peak_in_flight", "plot_side_by_side", "plot_timeline", "simulate", "split_steps",
    "stage_of", "verify", "zb_h1",
    "PLACEMENTS", "V_SCHEDULES", "Schedule", "chunks_per_rank", "holders_of_ends", "locate",
    "placement_of", "stage_ids", "dualpipe_v", "zb_v",
]

# The runtime needs torch and torch.distributed, so it is imported only when first asked for.
_RUNTIME = ("PipelineStats", "ScheduleCache", "forward_only_schedule", "run_pipeline_forward",
            "run_pipeline_step")
__all__ += list(_RUNTIME)


def __getattr__(name: str):
    if name in _RUNTIME:
        from . import runtime
        return getattr(runtime, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
