"""Which pipeline rank holds which global stage: the one place that maps (rank, chunk) <-> stage.

With ``p`` ranks and ``v`` model chunks per rank there are ``S = v * p`` global stages in model order
(stage 0 holds the embedding, stage ``S - 1`` the head). Two placements exist:

``loop`` (Megatron's interleaved layout; every schedule but the V-shaped ones): chunk ``c`` on rank
``r`` is stage ``c * p + r``, so activations hop ``0 -> 1 -> ... -> p-1 -> 0 -> ...``::

    p=2, v=2:   rank 0 holds stages 0, 2      rank 1 holds stages 1, 3

``v`` (ZB-V, DualPipe-V; always two chunks): rank ``r`` holds stage ``r`` (chunk 0) and stage
``2p - 1 - r`` (chunk 1). Activations go down the ranks on chunk 0 and back up on chunk 1, so the
first and the last stage are both on rank 0 and the turn ``p-1 -> p`` stays on rank ``p - 1``::

    p=3:   rank 0 holds stages 0, 5      rank 1 holds 1, 4      rank 2 holds 2, 3
           0 -> 1 -> 2 -> (same rank) 3 -> 4 -> 5

Schedules, the verifier, the simulator, the runtime and the trainer all ask this module; nothing
else does stage arithmetic. A placement is named by a string so it travels with a schedule
(``Schedule.placement``).
"""
from __future__ import annotations

PLACEMENTS = ("loop", "v")
V_SCHEDULES = frozenset({"zb-v", "dualpipe-v"})  # two chunks per rank, placed in a V


def schedule_key(name: str) -> str:
    """Canonical schedule name (``ZB_V`` -> ``zb-v``)."""
    return name.lower().replace("_", "-")


def placement_of(schedule: str) -> str:
    """Stage placement a schedule runs on: ``v`` for ZB-V and DualPipe-V, else ``loop``."""
    return "v" if schedule_key(schedule) in V_SCHEDULES else "loop"


def chunks_per_rank(schedule: str, virtual_stages: int = 1) -> int:
    """Model chunks each pipeline rank holds: ``virtual_stages`` for interleaved 1F1B, 2 for the
    V-shaped schedules (fixed by their shape), 1 otherwise."""
    key = schedule_key(schedule)
    if key == "interleaved":
        return virtual_stages
    return 2 if key in V_SCHEDULES else 1


def _check(placement: str, v: int | None = None) -> None:
    if placement not in PLACEMENTS:
        raise ValueError(f"unknown stage placement {placement!r}; choose one of {PLACEMENTS}")
    if placement == "v" and v is not None and v != 2:
        raise ValueError(f"the V placement holds exactly two chunks per rank, got v={v}")


def stage_of(rank: int, chunk: int, p: int, placement: str = "loop") -> int:
    """Global stage of local ``chunk`` on ``rank``."""
    if placement == "loop":
        return chunk * p + rank
    _check(placement)
    return rank if chunk == 0 else 2 * p - 1 - rank


def locate(stage: int, p: int, placement: str = "loop") -> tuple[int, int]:
    """``(rank, chunk)`` holding global ``stage`` (the inverse of :func:`stage_of`)."""
    if placement == "loop":
        return stage % p, stage // p
    _check(placement)
    return (stage, 0) if stage < p else (2 * p - 1 - stage, 1)


def stage_ids(rank: int, p: int, v: int, placement: str = "loop") -> list[int]:
    """Global stages of ``rank``'s chunks, in local chunk order."""
    _check(placement, v)
    return [stage_of(rank, c, p, placement) for c in range(v)]


def holders_of_ends(p: int, v: int, placement: str = "loop") -> list[int]:
    """Pipeline ranks holding the first and the last stage (tied embeddings), without repeats:
    ``[0, p - 1]`` for the loop placement, ``[0]`` for the V (both ends on rank 0)."""
    _check(placement, v)
    return sorted({locate(0, p, placement)[0], locate(v * p - 1, p, placement)[0]})


class Schedule(list):
    """A schedule (one action list per rank) that knows its stage placement. It is a plain list for
    every other purpose, so code written for ``list[list[Action]]`` keeps working; ``verify``,
    ``simulate`` and the runtime read ``placement`` from it."""

    def __init__(self, lists=(), placement: str = "loop") -> None:
        _check(placement)
        super().__init__(lists)
        self.placement = placement


def placement_for(schedules, placement: str | None = None) -> str:
    """The placement given explicitly, else the one a :class:`Schedule` carries, else ``loop``."""
    placement = placement or getattr(schedules, "placement", "loop")
    _check(placement)
    return placement


def check_schedule_config(schedule: str, pp: int, virtual_stages: int, microbatches: int) -> int:
    """The requirements of ``parallel.schedule`` on the pipeline size, ``parallel.virtual_stages`` and
    the microbatches per step; raises ValueError naming the broken one, else returns chunks per rank.

    interleaved   pp >= 2, virtual_stages >= 2 chunks per rank, microbatches % pp == 0
    zb-v,         pp >= 2, two chunks per rank placed in a V (virtual_stages left at 1, or 2),
    dualpipe-v    microbatches >= 2 * pp (each rank warms up on both chunks)
    the others    one chunk per rank (virtual_stages == 1); any pp, any microbatch count
    """
    key = schedule_key(schedule)
    if key == "interleaved":
        if virtual_stages < 2:
            raise ValueError(f"schedule=interleaved needs parallel.virtual_stages >= 2, got {virtual_stages}")
        if pp < 2:
            raise ValueError(f"schedule=interleaved needs parallel.pp >= 2, got pp={pp}")
        if microbatches % pp:
            raise ValueError(f"schedule=interleaved needs the number of microbatches ({microbatches}) "
                             f"divisible by parallel.pp={pp}")
    elif key in V_SCHEDULES:
        if pp < 2:
            raise ValueError(f"schedule={key} needs parallel.pp >= 2 (it places two stages on each "
                             f"pipeline rank in a V), got pp={pp}")
        if virtual_stages not in (1, 2):
            raise ValueError(f"schedule={key} places exactly two model chunks on each pipeline rank: leave "
                             f"parallel.virtual_stages at 1 (or 2), got {virtual_stages}")
        if microbatches < 2 * pp:
            raise ValueError(f"schedule={key} needs at least 2*pp = {2 * pp} microbatches per step "
                             f"(train.global_batch_size / (micro_batch_size*dp)), got {microbatches}")
    elif virtual_stages != 1:
        raise ValueError(f"parallel.virtual_stages={virtual_stages} needs schedule=interleaved "
                         f"(got schedule={schedule})")
    return chunks_per_rank(key, virtual_stages)
