"""A process group as this rank sees it (`Group`), the communication ledger (`CommStats`), and the one
place every collective passes to run (`_run`: placement check, the strict backend's blocking rule, an error
that names the op, the group and its ranks)."""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from parallel3d.comm.simulated import SimulatedProcessGroup, SimulatedWork
from parallel3d.comm.strict import StrictLedger
from parallel3d.host_sync import HostSyncs


@dataclass
class CommStats:
    """Calls and bytes per (group, op); `last_op` names the collective in flight (for hang reports)."""
    calls: dict = field(default_factory=lambda: defaultdict(int))
    bytes: dict = field(default_factory=lambda: defaultdict(int))
    last_op: str = ""
    on_op: Optional[Callable[[str], None]] = None   # e.g. the test harness's hang reporter
    listener: Optional[Callable[[str, str, int], None]] = None  # (group, op, bytes) per call: the planner
    on_wait: Optional[Callable[[int], None]] = None  # a dry run's rank waits for call `serial` (SimulatedWork)
    syncs: HostSyncs = field(default_factory=HostSyncs)  # host syncs of this rank (parallel3d.host_sync)
    serial: int = 0                                       # calls recorded so far: the last call's number
    batch: int = 0   # the number of the first call of the last call's batch (start_batch_p2p posts several
                     # sends and receives as one batch, which travel together); a lone call is its own
    strict: Optional[StrictLedger] = None   # the strict test backend's ledger (comm/strict.py), or None

    def make_strict(self) -> StrictLedger:
        """Keep NCCL's rules on this rank's groups (comm/strict.py); host reads report to the ledger."""
        self.strict = StrictLedger()
        self.syncs.on_read = self.strict.host_read
        return self.strict

    def record(self, group: "Group", op: str, nbytes: int, joins_batch: bool = False) -> None:
        key = (group.name, op)
        self.serial += 1
        if not joins_batch:
            self.batch = self.serial
        self.calls[key] += 1
        self.bytes[key] += nbytes
        self.last_op = f"{op} on {group.name} group {group.ranks}"
        if self.on_op is not None:
            self.on_op(self.last_op)
        if self.listener is not None:
            self.listener(group.name, op, nbytes)

    def reset(self) -> None:
        self.calls.clear()
        self.bytes.clear()
        self.syncs.reset()

    def summary(self) -> dict[tuple[str, str], tuple[int, int]]:
        """{(group, op): (calls, bytes)} for every op recorded since the last reset."""
        return {k: (self.calls[k], self.bytes[k]) for k in self.calls}


@dataclass
class Group:
    """One process group as seen from this rank. `pg` is None when size == 1 (no communication).

    `device` is where this group's tensors must live (cuda for NCCL, cpu for gloo); every collective checks
    it, so a tensor on the wrong device fails here, on CPU, as it would fail under NCCL."""
    name: str
    ranks: list[int]
    global_rank: int
    pg: object = None
    stats: Optional[CommStats] = None
    device: Optional[torch.device] = None

    @property
    def simulated(self) -> bool:
        return isinstance(self.pg, SimulatedProcessGroup)

    @property
    def strict(self) -> Optional[StrictLedger]:
        """The strict test backend's ledger of this rank (comm/strict.py), or None."""
        return self.stats.strict if self.stats is not None else None

    @property
    def size(self) -> int:
        return len(self.ranks)

    @property
    def rank(self) -> int:
        return self.ranks.index(self.global_rank)

    def _record(self, op: str, nbytes: int, joins_batch: bool = False) -> None:
        if self.stats is not None:
            self.stats.record(self, op, nbytes, joins_batch)

    def simulated_work(self, then: Optional[object] = None) -> SimulatedWork:
        """The dry-run handle of the call just recorded (SimulatedWork)."""
        return SimulatedWork(self.stats, self.stats.serial if self.stats is not None else 0, then, self.device)


class CollectiveError(RuntimeError):
    """A collective failed or timed out; the message names the op, group and ranks."""


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _same_device(have: torch.device, want: torch.device) -> bool:
    return have.type == want.type and (want.index is None or have.index is None or have.index == want.index)


def check_placement(group: Group, op: str, *tensors: torch.Tensor) -> None:
    """Raise CollectiveError if a tensor handed to `op` is not on the group's device (NCCL would fail)."""
    if group.device is None:
        return
    for t in tensors:
        if not _same_device(t.device, group.device):
            raise CollectiveError(f"{op} on {group.name} group (ranks {group.ranks}): tensor of shape "
                                  f"{tuple(t.shape)} is on {t.device}, the group's device is {group.device}")


def _run(group: Group, op: str, fn: Callable[[], object], *tensors: torch.Tensor, blocking: bool = False
         ) -> object:
    check_placement(group, op, *tensors)
    if group.simulated:
        return None
    if blocking and group.strict is not None:
        group.strict.blocking(group, op)
    if group.pg is None:   # (torch.distributed would take None for the default group)
        raise CollectiveError(f"{op} on {group.name} group (ranks {group.ranks}) on rank {group.global_rank}: "
                              f"it has no process group (not built, or destroyed: ParallelContext.destroy)")
    try:
        return fn()
    except RuntimeError as e:
        raise CollectiveError(f"{op} on {group.name} group (ranks {group.ranks}) failed on rank "
                              f"{group.global_rank}: {e}") from e
