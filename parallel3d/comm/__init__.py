"""Collectives on explicit groups, with exact communication accounting.

Every collective takes a `Group` (never a default/global one). A group of size 1 short-circuits without
touching torch.distributed, which is what lets a world-size-1 model run as plain PyTorch. Every started
collective returns a work handle to `wait_work` before its output is read, whatever the group.

Accounting (`CommStats`): per (group name, op) the number of calls and the bytes of the *logical*
tensor each op moves, so tests can assert Megatron's volume analysis exactly:
  all_reduce: bytes of the tensor            all_gather: bytes of the gathered (full) output
  reduce_scatter: bytes of the full input    all_to_all: bytes this rank sends (its whole input)
  send / recv: bytes of the tensor           broadcast: bytes of the tensor

The package, one file per concern:
  group.py        Group, CommStats, the one runner every collective passes through
  collectives.py  blocking collectives; started ones (start_*) and their handles (wait_work, local_work)
  p2p.py          batched sends and receives (P2P, start_batch_p2p)
  gathers.py      uneven and JSON all-gathers, the differentiable all-to-all
  strict.py       the strict test backend: NCCL's ordering rules kept on gloo
  simulated.py    the dry run's process group (one rank, no network)
  gloo.py         reduce-scatter and all-gather for gloo groups (gloo's own are slow or missing)
Callers use the package (`from parallel3d import comm`; `comm.all_reduce`); a test that replaces a rule
replaces it in the module that owns it.
"""
from parallel3d.comm.collectives import (all_gather, all_reduce, all_to_all, barrier, broadcast,  # noqa: F401
                                         local_work, on_gloo, orders_on_device, reduce_scatter, start_all_gather,
                                         start_all_reduce, start_all_to_all, start_reduce_scatter, wait_work)
from parallel3d.comm.gathers import (all_gather_json, all_gather_varlen, all_to_all_autograd,  # noqa: F401
                                     even_split)
from parallel3d.comm.group import CollectiveError, CommStats, Group, check_placement  # noqa: F401
from parallel3d.comm.p2p import P2P, PendingP2P, batch_p2p, start_batch_p2p  # noqa: F401
from parallel3d.comm.simulated import (SimulatedProcessGroup, SimulatedWork,  # noqa: F401
                                       simulated_expert_load, transfer_stand_ins)
