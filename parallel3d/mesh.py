"""Device mesh: `ParallelContext` holds this rank's built process groups and coordinates.

The rank arithmetic (rank order, the experts' folded etp/ep/edp, HSDP and hpZ groups) is pure and lives in `mesh_spec.py`;
its names are re-exported here.
"""
from __future__ import annotations

import datetime
import os
from dataclasses import dataclass, field
from typing import Optional

import torch

from parallel3d.comm import CommStats, Group
from parallel3d.interleave import Interleave
from parallel3d.mesh_spec import ALL_DIMS, DIMS, HSDP_DIMS, NODE_DIMS, Coords, MeshSpec, check_hpz

__all__ = ["DIMS", "MeshSpec", "ParallelContext", "check_hpz", "init_distributed"]  # MeshSpec & co. re-exported


@dataclass(eq=False)
class ParallelContext:
    """Every process group this rank needs plus its coordinates. Passed explicitly; never global.

    Each group field is a `comm.Group` (size, rank, ranks, underlying process group, device); `embedding`
    is None on middle pipeline stages. A world-size-1 context needs no torch.distributed at all. Build one
    with `single`, `build` (real process groups) or `simulated` (one rank of any layout, no processes).
    """
    spec: MeshSpec
    rank: int
    device: torch.device
    backend: Optional[str]
    stats: CommStats
    coords: Coords
    tp: Group
    cp: Group
    dp: Group
    pp: Group
    etp: Group          # expert tensor parallelism: the ranks splitting one expert's ffn (mesh_spec.py)
    ep: Group
    edp: Group
    dp_cp: Group        # dense-gradient reduction (DP x CP)
    embedding: Optional[Group]  # first and last pipeline stage (tied embeddings)
    world: Group
    dp_shard: Group     # HSDP: ZeRO shard group (dense); dp_cp itself without HSDP
    edp_shard: Group    # HSDP: ZeRO shard group of expert weights; edp itself without HSDP
    dp_rep: Group       # HSDP: replicas of one shard (size dp/dp_shard; 1 without HSDP)
    dp_node: Group      # hpZ: the shard group's members on this node (process group made by clone())
    edp_node: Group
    timeout_s: float = 600.0    # collective timeout of the groups (clones get the same)
    _clones: dict[str, Group] = field(default_factory=dict, repr=False)  # see clone()
    # runs two microbatches' computes in turns so one's all-to-all hides behind the other (interleave.py)
    interleave: Interleave = field(default_factory=Interleave, repr=False)

    @classmethod
    def create(cls, spec: MeshSpec, rank: int, device: torch.device | str = "cpu",
               backend: Optional[str] = None) -> "ParallelContext":
        """The context of `rank` with groups that have no process group yet (`build` attaches them)."""
        device, stats = torch.device(device), CommStats()

        def group(dim: str) -> Optional[Group]:
            ranks = spec.group_of(dim, rank)
            return Group(dim, ranks, rank, None, stats, device) if ranks else None

        groups = {d: group(d) for d in DIMS + ("dp_rep",)}
        for dim, alias in cls._aliases(spec).items():
            groups[dim] = groups[alias]  # one Group object: same process group, same accounting name
        for dim in HSDP_DIMS + NODE_DIMS:
            groups.setdefault(dim, group(dim))
        return cls(spec, rank, device, backend, stats, spec.coords(rank), **groups)

    @staticmethod
    def _aliases(spec: MeshSpec) -> dict[str, str]:
        """Without HSDP the shard groups are the DP x CP / expert-DP groups themselves; with etp == tp the
        experts' TP group is the attention's (mesh_spec.py: the layout before folding)."""
        aliases = {} if spec.hsdp else {"dp_shard": "dp_cp", "edp_shard": "edp"}
        return {**aliases, "etp": "tp"} if spec.etp == spec.tp else aliases

    @property
    def is_simulated(self) -> bool:
        """Whether this is one rank alone (`simulated`): its groups answered by the simulated backend."""
        return self.backend == "simulated"

    @property
    def world_size(self) -> int:
        return self.spec.world_size

    def groups(self) -> dict[str, Optional[Group]]:
        """Every group field by name (ALL_DIMS order; aliases (_aliases) repeat their group)."""
        return {d: getattr(self, d) for d in ALL_DIMS}

    def clone(self, dim: str) -> Group:
        """A Group with the same ranks, name and accounting as `dim`'s but its own process group (ZeRO-3
        gathers on it, ordered independently of the gradient reductions on the original). Creating a group is
        collective over the world, so every rank builds the clones of every group of that kind, in spec
        order, the first time any rank asks; later calls return the same clone."""
        import torch.distributed as dist

        dim = self._aliases(self.spec).get(dim, dim)
        group = getattr(self, dim)
        if group.size == 1 or group.simulated or not dist.is_initialized():
            return group
        if dim not in self._clones:
            for ranks in self.spec.groups(dim):
                pg = dist.new_group(ranks, timeout=datetime.timedelta(seconds=self.timeout_s))
                if self.rank in ranks:
                    self._clones[dim] = Group(group.name, list(ranks), self.rank, pg, self.stats, self.device)
        return self._clones[dim]

    def cloned(self, dim: str) -> Group:
        """`dim`'s clone if `clone` made one, else the group itself (never creates one: creating is collective)."""
        return self._clones.get(self._aliases(self.spec).get(dim, dim), getattr(self, dim))

    def destroy(self) -> None:
        """Destroy the process groups `build` and `clone` made, all but the default group. Local to this rank,
        but every rank of a group should destroy it at the same point of its program, as it created it. The
        context's groups are unusable after (their `pg` is None)."""
        import torch.distributed as dist

        groups = [g for g in (*self.groups().values(), *self._clones.values())
                  if g is not None and g.pg is not None and not g.simulated]
        self._clones.clear()
        made = dict.fromkeys(g.pg for g in groups if g.pg is not dist.group.WORLD)  # aliases share one
        for g in groups:
            g.pg = None
        for pg in made:
            dist.destroy_process_group(pg)

    @classmethod
    def single(cls, device: str | torch.device = "cpu") -> "ParallelContext":
        """World size 1: plain single-device PyTorch, torch.distributed untouched."""
        return cls.create(MeshSpec(), 0, device)

    @classmethod
    def simulated(cls, spec: MeshSpec, rank: int, device: str | torch.device = "meta",
                  backend: str = "nccl", expert_load: float = 1.0) -> "ParallelContext":
        """Rank `rank` of `spec` alone, its groups answered by comm's simulated backend (no processes): the
        off-CPU dry run of the real training step (tests/test_fake_device.py) runs through it. The default
        `meta` device is the stand-in for CUDA on CPU-only builds (shapes, devices and placement rules, no
        values); `backend` the one the groups stand for (gloo: a plan of a CPU run); `expert_load` the routed
        rows MoE exchanges deliver to this rank, as a multiple of the balanced share (comm.SimulatedProcessGroup)."""
        from parallel3d.comm import SimulatedProcessGroup

        ctx = cls.create(spec, rank, device, "simulated")
        for group in ctx.groups().values():
            if group is not None and group.size > 1:
                group.pg = SimulatedProcessGroup(backend, expert_load)
        return ctx

    @classmethod
    def build(cls, spec: MeshSpec, device: Optional[torch.device] = None,
              timeout_s: float = 600.0, strict: bool = False) -> "ParallelContext":
        """Create the process groups of `spec` on an initialised default group (every rank must call).
        strict: keep NCCL's ordering rules on these groups (comm/strict.py, the test backend over gloo)."""
        import torch.distributed as dist

        if spec.world_size == 1 and not dist.is_initialized():
            ctx = cls.single(device or "cpu")
            if strict:
                ctx.stats.make_strict()
            return ctx
        if not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialised; call init_distributed() first")
        if dist.get_world_size() != spec.world_size:
            raise ValueError(f"mesh {spec} needs world size {spec.world_size}, torch.distributed has "
                             f"{dist.get_world_size()}")
        backend = dist.get_backend()
        rank = dist.get_rank()
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
        ctx = cls.create(spec, rank, device, backend)
        ctx.timeout_s = timeout_s
        if strict:
            ctx.stats.make_strict()
        timeout = datetime.timedelta(seconds=timeout_s)
        aliases = cls._aliases(spec)
        for dim in ALL_DIMS:
            if dim in aliases or (dim in HSDP_DIMS and not spec.hsdp) or dim in NODE_DIMS:
                continue   # the same Group as dp_cp / edp / tp, or size 1 (dp_rep without HSDP)
            for ranks in spec.groups(dim):  # every rank creates every group, in the same order
                pg = dist.group.WORLD if len(ranks) == spec.world_size else dist.new_group(ranks, timeout=timeout)
                if rank in ranks:
                    getattr(ctx, dim).pg = pg
        return ctx

    # Convenience views used everywhere.
    @property
    def is_first_stage(self) -> bool:
        return self.coords.pp == 0

    @property
    def is_last_stage(self) -> bool:
        return self.coords.pp == self.spec.pp - 1

    def __repr__(self) -> str:
        s = self.spec
        hsdp = f" dp_shard={s.dp_shard}" if s.hsdp else ""
        return (f"ParallelContext(rank={self.rank}/{self.world_size}, tp={s.tp} cp={s.cp} dp={s.dp}{hsdp} "
                f"pp={s.pp} ep={s.ep} etp={s.etp}, coords={self.coords})")


def init_distributed(backend: Optional[str] = None, timeout_s: float = 600.0) -> tuple[int, int]:
    """Initialise the default process group from torchrun's environment. Returns (rank, world_size).

    Without torchrun variables (plain `python`), does nothing and returns (0, 1).
    """
    import torch.distributed as dist

    if "WORLD_SIZE" not in os.environ or int(os.environ["WORLD_SIZE"]) == 1 and "MASTER_ADDR" not in os.environ:
        return 0, 1
    if not dist.is_initialized():
        backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        if backend == "nccl":   # round robin: NCCL refuses two ranks on one GPU unless it allows them
            # (NCCL_MULTI_RANK_GPU_ENABLE=1 from NCCL 2.30: benchmarks/gpu_check.sh's selftest2 phase)
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count())
        timeout = datetime.timedelta(seconds=timeout_s)
        if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
            # torchrun shares one store across restarts (--max-restarts): give every attempt its own key
            # space, or a restarted worker would meet stale rendezvous keys of the attempt that died.
            world = int(os.environ["WORLD_SIZE"])
            base = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=False,
                                 timeout=timeout)
            attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
            store = dist.PrefixStore(f"parallel3d/attempt_{attempt}", base)
            dist.init_process_group(backend, store=store, rank=int(os.environ["RANK"]), world_size=world,
                                    timeout=timeout)
        else:
            dist.init_process_group(backend, timeout=timeout)
    return dist.get_rank(), dist.get_world_size()
