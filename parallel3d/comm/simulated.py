"""comm's simulated backend: what a process group of a dry run of one rank does in place of the network
(`ParallelContext.simulated`: the off-CPU step tests and the planner). No peer exists, so nothing travels:
outputs are filled as if every rank held this rank's data (`fill_*`, comm.transfer_stand_ins), started
collectives hand back a `SimulatedWork` whose wait tells the rank's stats which call it waited for, and
bytes are recorded by comm exactly as with a real group. (`CommStats` and `Group` in annotations are
comm's, not imported: comm imports this module.)"""
from __future__ import annotations

from typing import Optional

import torch

RECEIVE_SEED = 20_250_048   # fill_received's samples: any fixed seed


class SimulatedProcessGroup:
    """Stands in for a process group in a dry run of one rank (the off-CPU step tests, the planner): no peer exists,
    so collectives move nothing. Output buffers keep their (correct) shapes and are filled as if every rank
    held this rank's data; the bytes are recorded exactly as with a real group. `backend` is the one it
    stands for: "gloo" (a plan of a CPU run) makes the collectives allocate and compute what comm runs on
    gloo (the all-to-all reduce-scatter's receive buffer and its sum). `expert_load`: the routed rows an MoE
    exchange over this group delivers to this rank's experts, as a multiple of the balanced share (its
    absent peers route to it as unevenly as a real run's router did: expert_parallel/dispatch.py)."""

    def __init__(self, backend: str = "nccl", expert_load: float = 1.0) -> None:
        self.backend, self.expert_load = backend, expert_load
        self._generators: dict = {}   # device -> the seeded generator of fill_received's samples

    def generator(self, device: torch.device) -> torch.Generator:
        """This group's generator on `device`, seeded alike on every run (a simulated rank's receives are
        the same from run to run)."""
        key = str(device)
        if key not in self._generators:
            self._generators[key] = torch.Generator(device).manual_seed(RECEIVE_SEED)
        return self._generators[key]

    def __repr__(self) -> str:
        return f"SimulatedProcessGroup({self.backend!r}, expert_load={self.expert_load})"


class SimulatedWork:
    """A dry run's handle of a started collective (SimulatedProcessGroup): nothing travels, but waiting for
    it tells the rank's stats which call (`serial`, CommStats.record's count) the rank blocked on, and when:
    the planner hides a collective only behind the compute between its start and its wait. A handle the
    caller polled complete first (`is_completed`, as the gradient sync follows its reductions up) is not
    waited on: on a real backend the caller reaches its wait only once the transfer is done. `then`: the
    stand-in's own work on wait (gloo's sum of a reduce-scatter). On CUDA (a simulated rank standing for NCCL:
    `launch/pretrain.py --simulate-rank` on a GPU) the handle orders the device as NCCL's does: made once the
    stand-in's fills are queued, it records an event on the current stream, and `wait` makes the waiting
    stream wait for it, so a side stream that reads an output after its wait reads it filled (comm.orders_on_device)."""

    def __init__(self, stats: Optional[CommStats], serial: int, then: Optional[object] = None,
                 device: Optional[torch.device] = None) -> None:
        self.stats, self.serial, self.then, self.polled = stats, serial, then, False
        self.event, self.device = None, device
        if device is not None and device.type == "cuda":
            self.event = torch.cuda.Event()
            self.event.record(torch.cuda.current_stream(device))

    def is_completed(self) -> bool:
        self.polled = True
        return True

    def wait(self) -> bool:
        if self.then is not None:
            self.then.wait()
            self.then = None
        if self.event is not None:
            torch.cuda.current_stream(self.device).wait_event(self.event)
        if not self.polled and self.stats is not None and self.stats.on_wait is not None:
            self.stats.on_wait(self.serial)
        self.polled = True   # (a second wait is no stall)
        return True


def simulated_expert_load(group: "Group") -> float:
    """The routed load a dry run's peers deliver to this rank over `group` (SimulatedProcessGroup); 1.0 for a
    real group, whose counts are real."""
    return group.pg.expert_load if isinstance(group.pg, SimulatedProcessGroup) else 1.0


def fill_reduce_scatter(out: torch.Tensor, inp: torch.Tensor, rank: int) -> None:
    """Every rank holds this rank's inp: the sum's segment is this rank's segment (up to the factor)."""
    out.copy_(inp.narrow(0, rank * out.numel(), out.numel()))


def fill_all_gather(out: torch.Tensor, t: torch.Tensor, size: int) -> None:
    """Every rank holds this rank's t; filled in place (no temporary, so a dry run's memory is the real one).
    An in-place gather (t is this rank's block of out, as ZeRO-1/2's) fills the other blocks only."""
    blocks = out.view((size,) + tuple(t.shape))
    if not torch._C._is_alias_of(t, out):
        blocks.copy_(t.unsqueeze(0).expand((size,) + tuple(t.shape)))
        return
    k = (t.storage_offset() - out.storage_offset()) // max(t.numel(), 1)
    for lo, hi in ((0, k), (k + 1, size)):
        if hi > lo:
            blocks[lo:hi].copy_(t.unsqueeze(0).expand((hi - lo,) + tuple(t.shape)))


def fill_all_to_all(out: torch.Tensor, t: torch.Tensor) -> None:
    """Every peer sends what this rank sends: the received rows are this rank's rows, cycled to fit."""
    n, rows = out.shape[0], t.shape[0]
    for start in range(0, n if rows else 0, max(rows, 1)):  # in place, a block of rows at a time
        take = min(rows, n - start)
        out.narrow(0, start, take).copy_(t.narrow(0, 0, take))


def fill_received(buf: torch.Tensor, generator: torch.Generator) -> None:
    """A point-to-point receive of a simulated rank on a device with values (`launch/pretrain.py
    --simulate-rank`; a meta dry run has none to fill: comm.start_batch_p2p): standard normal samples from the
    group's seeded `generator`, whatever the message (a stage's input hidden states, the gradient of its
    output, a ring's K/V block or its gradient). Unit scale is a plausible residual stream, so RMSNorm and MoE
    routing see tokens spread as a real stage's are (zeros would tie every router logit and send every token to
    the same experts; a copy of a send in the same batch mixes activations with gradients); a gradient of
    unit scale is larger than a real one but finite, and clipping takes the rest. In place, no temporary, so
    the rank's memory is the real one."""
    if buf.is_floating_point():
        buf.normal_(generator=generator)
    else:
        buf.zero_()


def transfer_stand_ins() -> tuple:
    """The functions by which a dry run fills a collective's output in place of the network (the
    simulated backend): their copies are the transfer's own work, which the collective's price covers, so
    the planner's tracker does not price them as compute. Not among them: gloo's sum on wait (real
    arithmetic, run as on gloo)."""
    from parallel3d.comm import gloo
    return (fill_reduce_scatter, fill_all_gather, fill_all_to_all, fill_received, gloo.simulate_reduce_scatter)
