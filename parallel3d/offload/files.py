"""One rank's offload files under parallel.offload_dir, and the fixed host buffers every transfer uses.

    DIR/parallel3d-offload-<host>-<pid>-r<rank>-<what><n>/<kind>.bin   one file per kind (master, exp_avg, ...)

The set is created (and its space reserved with posix_fallocate, so a disk that is too small fails now,
not in the middle of a step) when the optimizer is built, and removed by `close()` (the optimizer's), when
the object is collected, or at interpreter exit (weakref.finalize: a normal end, an exception, sys.exit
from the launcher's error path); launch/common.py turns torchrun's SIGTERM into such an exit.

Reads and writes are os.preadv / os.pwrite straight between the file and a caller's host tensor (no
mmap: mapped pages would count against the process and pile up); after each transfer the range is
dropped from the page cache (POSIX_FADV_DONTNEED), so streaming gigabytes of state does not grow the
machine's cached memory either.
"""
from __future__ import annotations

import errno
import itertools
import os
import shutil
import socket
import tempfile
import weakref
from typing import Any, Callable, Optional

import torch

from parallel3d import comm


class OffloadError(ValueError):
    """The offload directory is missing, unwritable or full, or a transfer failed (one clear message)."""


def check_offload_dir(path: Optional[str]) -> None:
    """parallel.offload_dir must be an existing writable directory (checked before any process group)."""
    if not path:
        raise OffloadError("parallel.offload_dir is not set (nvme offload needs a directory)")
    if not os.path.isdir(path):
        raise OffloadError(f"parallel.offload_dir={path} does not exist or is not a directory")
    try:  # really create a file: os.access says yes to root, also on read-only mounts
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as e:
        raise OffloadError(f"parallel.offload_dir={path} is not writable ({e.strerror})") from None


def create_on_every_rank(ctx, build: Callable[[], Any]) -> Any:
    """build() on every rank of ctx.world; if it fails anywhere (no space, unwritable directory), every
    rank raises the same OffloadError, so no rank is left waiting in a collective, and nothing is left."""
    obj, error = None, None
    try:
        obj = build()
    except OffloadError as e:
        error = str(e)
    errors = comm.all_gather_json(error, ctx.world, ctx.device)
    failed = [(r, e) for r, e in enumerate(errors) if e]
    if failed:
        if obj is not None:
            obj.close()
        rank, message = failed[0]
        raise OffloadError(message if len(errors) == 1 else f"rank {rank}: {message}")
    return obj


def host_buffer(numel: int, dtype: torch.dtype, pin: bool) -> torch.Tensor:
    """A host tensor: pinned when it feeds a CUDA device (asynchronous copies), ordinary otherwise."""
    return torch.empty(numel, dtype=dtype, pin_memory=pin)


def _bytes(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous host tensor, without a copy."""
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


_SERIAL = itertools.count()  # several optimizers in one process (tests) get their own directories


def _remove(fds: dict[str, int], directory: str) -> None:
    """Close the descriptors and delete the directory (a weakref.finalize callback: runs once, on close(),
    when the StateFiles is collected, or at interpreter exit, whichever comes first)."""
    for fd in fds.values():
        os.close(fd)
    fds.clear()
    shutil.rmtree(directory, ignore_errors=True)


class StateFiles:
    """Fixed-size files, one per kind, in this rank's own directory under `root`."""

    def __init__(self, root: str, rank: int, sizes: dict[str, int], tag: str = "optimizer") -> None:
        check_offload_dir(root)
        need = sum(sizes.values())
        st = os.statvfs(root)
        free = st.f_bavail * st.f_frsize
        if need > free:
            raise OffloadError(f"parallel.offload_dir={root} has {free / 2**20:.1f} MiB free but rank {rank}'s "
                               f"offloaded state needs {need / 2**20:.1f} MiB")
        name = f"parallel3d-offload-{socket.gethostname()}-{os.getpid()}-r{rank}-{tag}{next(_SERIAL)}"
        self.dir = os.path.join(root, name)
        self.fds: dict[str, int] = {}
        self._finalizer = weakref.finalize(self, _remove, self.fds, self.dir)
        try:
            os.makedirs(self.dir)
            for kind, nbytes in sizes.items():
                fd = os.open(self._path(kind), os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
                self.fds[kind] = fd
                if nbytes:
                    self._reserve(fd, nbytes, kind)
        except OSError as e:
            self.close()
            raise OffloadError(f"cannot create offload files in {root}: {e}") from None
        except OffloadError:
            self.close()
            raise

    def _path(self, kind: str) -> str:
        return os.path.join(self.dir, f"{kind}.bin")

    def _reserve(self, fd: int, nbytes: int, kind: str) -> None:
        try:
            os.posix_fallocate(fd, 0, nbytes)
        except OSError as e:
            if e.errno == errno.ENOSPC:
                raise OffloadError(f"parallel.offload_dir is full: reserving {nbytes / 2**20:.1f} MiB for "
                                   f"{self._path(kind)} failed (no space left on device)") from None
            if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                raise
            os.ftruncate(fd, nbytes)  # a file system without fallocate: sparse file, ENOSPC shows at write

    def read(self, kind: str, offset: int, out: torch.Tensor) -> torch.Tensor:
        """Fill the host tensor `out` from byte `offset` of the kind's file."""
        fd, buf = self.fds[kind], _bytes(out)
        done = 0
        while done < len(buf):
            n = os.preadv(fd, [buf[done:]], offset + done)
            if n == 0:
                raise OffloadError(f"{self._path(kind)}: read past the end (offset {offset + done})")
            done += n
        os.posix_fadvise(fd, offset, len(buf), os.POSIX_FADV_DONTNEED)
        return out

    def write(self, kind: str, offset: int, src: torch.Tensor) -> None:
        """Write the host tensor `src` at byte `offset` of the kind's file."""
        fd, buf = self.fds[kind], _bytes(src)
        done = 0
        try:
            while done < len(buf):
                done += os.pwrite(fd, buf[done:], offset + done)
        except OSError as e:
            if e.errno == errno.ENOSPC:
                raise OffloadError(f"{self._path(kind)}: no space left on device while writing offloaded "
                                   f"state (parallel.offload_dir is full)") from None
            raise OffloadError(f"{self._path(kind)}: writing offloaded state failed: {e}") from None
        os.posix_fadvise(fd, offset, len(buf), os.POSIX_FADV_DONTNEED)  # starts write-back, drops clean pages

    def close(self) -> None:
        """Close and delete the files and this rank's directory (idempotent)."""
        self._finalizer()
