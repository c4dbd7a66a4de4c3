"""Two pieces of one rank's work run in turns, switching where one of them waits for communication.

The expert-parallel all-to-all of one microbatch can hide behind another microbatch's compute
(Megatron-Core's 1F1B all-to-all overlap, DeepSeek-V3's DualPipe pairs). A pipeline schedule names the
pairs (``pipeline/pairing.py``); this module runs one pair. The forward runs on the calling thread, the
backward on a helper thread (one, kept for every pair); exactly one of them runs at a time, handing the turn over at each *switch
point*: right after it has started a collective and before it waits for it. So

    forward    attn, router | start dispatch  ...........................  wait | experts | start combine ...
    backward                                  | combine' wait, experts' ... start dispatch' |  ...

and the started transfer travels while the partner computes. Everything stays in one deterministic order:
the two pieces alternate at the same points on every rank of a stage, so every process group sees its
collectives issued in the same order on all its ranks, as NCCL requires, and the pair computes the same
operations on the same values as the two pieces run one after the other.

Why threads and not generators: the pieces are ordinary module forwards and ``torch.autograd.backward``
calls, whose switch points lie deep inside autograd; a thread keeps its own autograd state (the backward's
graph task is not the forward's, so ``params.in_backward`` still tells a recomputation from a forward). On
CUDA, autograd runs the backward's nodes on its device thread: every thread other than the forward's is the
backward's side. The helper thread takes the caller's grad mode, thread count (OpenMP's is per thread),
CUDA device and stream, the dispatch modes and the saved-tensor hooks in force (the planner's tracker), so
the backward runs as it would on the calling thread.
"""
from __future__ import annotations

import threading
import time
from typing import Callable, Optional

import torch

FORWARD, BACKWARD = "forward", "backward"


class Interleave:
    """Runs pairs (`run`); `switch` is a no-op outside one. One per ParallelContext (`ctx.interleave`)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._turn: Optional[str] = None
        self._done: set = set()
        self._error: Optional[BaseException] = None
        self._forward_thread: Optional[int] = None
        self.turns: Optional[list] = None   # (perf_counter, side) at each hand-over of the running pair
        self.switches = 0                   # hand-overs at switch points, over the context's life
        self._job: Optional[tuple] = None   # (backward, inherited state) handed to the helper thread
        self._helper: Optional[threading.Thread] = None   # started by the first pair, kept (a daemon)

    @property
    def active(self) -> bool:
        """Whether a pair is running: collectives started now should be waited after a `switch`."""
        return self._forward_thread is not None and len(self._done) < 2

    def run(self, forward: Callable[[], None], backward: Callable[[], None], first: str = FORWARD,
            turns: Optional[list] = None) -> None:
        """Run `forward` here and `backward` on a helper thread, in turns, `first` first. `turns`, when a
        list, gets (perf_counter, side) at the start and at each hand-over (the measured timeline)."""
        if self._forward_thread is not None:
            raise RuntimeError("an interleaved pair is already running on this context")
        self._turn, self._done, self._error, self.turns = first, set(), None, turns
        self._forward_thread = threading.get_ident()
        self._mark(first)
        if self._helper is None or not self._helper.is_alive():   # one thread for every pair (0.2 ms a start)
            self._helper = threading.Thread(target=self._serve, name="interleave-backward", daemon=True)
            self._helper.start()
        with self._cond:
            self._job = (backward, _inherited())
            self._cond.notify_all()
        try:
            self._side(FORWARD, forward, None)
        finally:
            with self._cond:
                while BACKWARD not in self._done:
                    self._cond.wait()
            self._forward_thread, self.turns = None, None
        if self._error is not None:
            raise self._error

    def switch(self) -> None:
        """Hand the turn to the partner (if it has not finished) and wait until it is ours again."""
        if not self.active:
            return
        me = FORWARD if threading.get_ident() == self._forward_thread else BACKWARD
        other = BACKWARD if me == FORWARD else FORWARD
        with self._cond:
            if other in self._done or self._error is not None:
                return
            self._turn = other
            self.switches += 1
            self._mark(other)
            self._cond.notify_all()
            self._wait_for(me)

    # ---- internals --------------------------------------------------------------------------------------
    def _serve(self) -> None:
        """The helper thread: run each pair's backward side as it is handed over."""
        while True:
            with self._cond:
                while self._job is None:
                    self._cond.wait()
                work, inherit = self._job
                self._job = None
            self._side(BACKWARD, work, inherit)

    def _side(self, side: str, work: Callable[[], None], inherit: Optional[Callable[[], object]]) -> None:
        try:
            with self._cond:
                self._wait_for(side)
            if inherit is None:
                work()
            else:
                with inherit():
                    work()
        except _PartnerFailed:
            pass
        except BaseException as e:  # handed to the caller of run; the partner stops at its next switch
            with self._cond:
                self._error = self._error or e
        finally:
            with self._cond:
                self._done.add(side)
                other = BACKWARD if side == FORWARD else FORWARD
                if other not in self._done:
                    self._turn = other
                    self._mark(other)
                self._cond.notify_all()

    def _wait_for(self, side: str) -> None:
        while self._turn != side and self._error is None:
            self._cond.wait()
        if self._error is not None:  # stop here: running on alone would issue collectives out of order
            raise _PartnerFailed()

    def _mark(self, side: str) -> None:
        if self.turns is not None:
            self.turns.append((time.perf_counter(), side))


class _PartnerFailed(Exception):
    """Raised at a switch point once the partner has failed (run re-raises the partner's error)."""


class _Inherit:
    """Re-enters, on the helper thread, the calling thread's state that torch keeps per thread."""

    def __init__(self) -> None:
        from torch.utils._python_dispatch import _get_current_dispatch_mode_stack
        self.grad = torch.is_grad_enabled()
        self.threads = torch.get_num_threads()   # (OpenMP's count is per thread: a new one takes every core)
        self.modes = list(_get_current_dispatch_mode_stack())
        self.saved = torch._C._autograd._top_saved_tensors_default_hooks(False)  # (pack, unpack) or None
        self.stream = torch.cuda.current_stream() if torch.cuda.is_available() and torch.cuda.is_initialized() \
            else None

    def __enter__(self) -> None:
        from torch.utils._python_dispatch import _push_mode
        torch.set_grad_enabled(self.grad)
        if torch.get_num_threads() != self.threads:
            torch.set_num_threads(self.threads)
        if self.stream is not None:
            torch.cuda.set_device(self.stream.device)
            torch.cuda.set_stream(self.stream)
        for mode in self.modes:
            _push_mode(mode)
        if self.saved is not None:
            torch._C._autograd._push_saved_tensors_default_hooks(*self.saved)

    def __exit__(self, *exc) -> None:
        from torch.utils._python_dispatch import _pop_mode
        if self.saved is not None:
            torch._C._autograd._pop_saved_tensors_default_hooks()
        for _ in self.modes:
            _pop_mode()


def _inherited() -> Callable[[], _Inherit]:
    state = _Inherit()
    return lambda: state
