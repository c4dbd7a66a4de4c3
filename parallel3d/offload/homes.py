"""The optimizer's offload homes: where training state lives off the device, and the copies that move it.

`OffloadHomes` owns, for parallel.offload_optimizer / offload_params (none of them without offload):

    copies      the copy engine beside compute (streams.py)                    any offload
    published   the updated parameters' device copies, per bucket (publish.py)  any offload
    host_grads  the reduced gradients, per bucket, in host memory (host_grads.py)  optimizer offload
    nvme        the fp32 master and Adam state in files (nvme.py)             offload_optimizer=nvme
    param_home  ZeRO-3's persistent parameter shard off the device (params.py)  offload_params
    state_device  where the master and Adam state live in memory: the host under optimizer offload

The DistributedOptimizer builds them in its construction order (the constructor: copies, published,
host_grads; `place_state` before the buckets are initialised, as the files are filled from the
parameters, which ZeRO-3 frees then; `place_params` after), hands each to the owner that uses it
(gradient sync, optimizer step, publishing, ZeRO-3's gathers) and `close`s them. The offload modules are
imported only when a mode is on.
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

import torch

from parallel3d.data_parallel.buffer import Bucket
from parallel3d.mesh import ParallelContext


class OffloadHomes:
    def __init__(self, optimizer: str, params: str, offload_dir: Optional[str], buffer_mb: float,
                 ctx: ParallelContext) -> None:
        self.optimizer, self.params, self.dir, self.buffer_mb, self.ctx = optimizer, params, offload_dir, buffer_mb, ctx
        self.state_device = torch.device("cpu") if optimizer != "none" else None
        self.copies: Any = None
        self.published: Any = None
        self.host_grads: Any = None
        self.nvme: Any = None
        self.param_home: Any = None
        if (optimizer, params) != ("none", "none"):
            from parallel3d.offload.publish import DevicePublish
            from parallel3d.offload.streams import CopyEngine
            self.copies = CopyEngine(ctx.device)
            self.published = DevicePublish(self.copies)
        if optimizer != "none":       # reduced gradients leave the device per bucket
            from parallel3d.offload.host_grads import HostGrads
            self.host_grads = HostGrads(self.copies)

    def place_state(self, buckets: Sequence[Bucket]) -> None:
        """offload_optimizer=nvme: the master and Adam state files, filled from the parameters."""
        if self.optimizer == "nvme":
            from parallel3d.offload.nvme import NvmeAdam
            self.nvme = NvmeAdam.create(buckets, self.ctx, self.dir, self.buffer_mb, self.copies)

    def place_params(self, buckets: Sequence[Bucket], dtype: torch.dtype) -> None:
        """offload_params: takes each bucket's param_flat (ZeRO-3's persistent shard) off the device."""
        if self.params != "none":
            from parallel3d.offload.params import ParamOffload
            self.param_home = ParamOffload.create(buckets, self.params, dtype, self.ctx, self.dir, self.copies)

    def drain(self, buckets: Sequence[Bucket]) -> None:
        """The host gradients' copies of a step that ends without an update are done."""
        if self.host_grads is not None:
            self.host_grads.drain(buckets)

    def wait_published(self) -> None:
        """Every parameter copy to the device has landed."""
        if self.published is not None:
            self.published.wait_all()

    def close(self, buckets: Sequence[Bucket]) -> None:
        """Wait for the copies in flight, then remove the files and stop the threads."""
        self.wait_published()
        self.drain(buckets)
        for home in (self.nvme, self.param_home, self.copies, self.host_grads):
            if home is not None:
                home.close()
