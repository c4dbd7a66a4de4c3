"""The data a schedule is made of: :class:`Action` (kind, microbatch, local chunk, peer) and its
:class:`ActionKind`; :class:`ScheduleError` for a malformed schedule. The contract between schedules,
verifier, simulator and runtime is the docstring of ``schedules.py``.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass


class ScheduleError(ValueError):
    """A schedule is malformed: a message names the rank, the action and what is missing."""


class ActionKind(enum.Enum):
    """What an action does. The value is the short code used by :func:`format_schedule`."""

    FORWARD = "F"
    BACKWARD = "B"
    BACKWARD_INPUT = "I"
    BACKWARD_WEIGHT = "W"
    SEND_ACT = "sa"
    RECV_ACT = "ra"
    SEND_GRAD = "sg"
    RECV_GRAD = "rg"

    @property
    def is_compute(self) -> bool:
        return self in _COMPUTE

    @property
    def is_comm(self) -> bool:
        return not self.is_compute

    @property
    def is_send(self) -> bool:
        return self in (ActionKind.SEND_ACT, ActionKind.SEND_GRAD)

    @property
    def is_recv(self) -> bool:
        return self in (ActionKind.RECV_ACT, ActionKind.RECV_GRAD)


_COMPUTE = frozenset({ActionKind.FORWARD, ActionKind.BACKWARD,
                      ActionKind.BACKWARD_INPUT, ActionKind.BACKWARD_WEIGHT})


@dataclass(frozen=True)
class Action:
    """One step of one rank: ``kind`` on ``microbatch`` for local ``chunk``; ``peer`` for comm."""

    kind: ActionKind
    microbatch: int
    chunk: int = 0
    peer: int | None = None

    def __post_init__(self) -> None:
        if self.microbatch < 0 or self.chunk < 0:
            raise ValueError(f"negative microbatch/chunk in {self.kind.name}")
        if self.kind.is_comm and self.peer is None:
            raise ValueError(f"{self.kind.name} needs a peer rank")
        if self.kind.is_compute and self.peer is not None:
            raise ValueError(f"{self.kind.name} is a compute action and takes no peer")

    def __str__(self) -> str:
        peer = "" if self.peer is None else f", peer={self.peer}"
        return f"{self.kind.name}(mb={self.microbatch}, chunk={self.chunk}{peer})"

    def short(self, with_chunk: bool = False) -> str:
        """Compact form: ``F3``, ``I3``, ``W3`` (``F3c1`` with chunks), ``sa3>1``, ``rg3<2``."""
        text = f"{self.kind.value}{self.microbatch}" + (f"c{self.chunk}" if with_chunk else "")
        if self.peer is not None:
            text += (">" if self.kind.is_send else "<") + str(self.peer)
        return text
