"""Device mesh: `MeshSpec` is pure rank arithmetic; `ParallelContext` holds the built process groups.

Rank order (innermost first): TP, CP, DP, PP. TP ranks are consecutive so they share a node / NVLink
domain; PP is outermost so pipeline stages span nodes.

    rank = tp_r + tp * (cp_r + cp * (dp_r + dp * pp_r))

    world = 8, tp=2 cp=1 dp=2 pp=2:     pp0: [0 1 | 2 3]   pp1: [4 5 | 6 7]
                                              tp   tp            tp   tp
                                              \\-dp-/            \\-dp-/

Expert parallelism is carved out of the DP x CP ranks that share (tp_r, pp_r): index them
j = cp_r + cp * dp_r; EP groups are consecutive runs of `ep` indices, and the ranks with the same
position inside their EP group form the expert-data-parallel group (size dp*cp/ep) over which expert
weights are replicated and their gradients reduced.

HSDP (`dp_shard` = K, dividing dp; 0 or dp: plain ZeRO over all of DP x CP): ZeRO shards over blocks of K
consecutive DP ranks (times all CP ranks) and replicates across the dp/K blocks. With j as above,

    dp_shard   same (tp, pp, j // (K*cp))           dense shard group, size K*cp
    edp_shard  same (tp, pp, j % ep, j // (K*cp))   expert shard group, size K*cp/ep (ep must divide K*cp)
    dp_rep     same (tp, pp, j % (K*cp))            replica group, size dp/K (dense and expert alike)

so a sum over DP x CP (or expert-DP) is a sum inside the shard group followed by one across replicas.
Without HSDP the shard groups *are* dp_cp / edp (the same Group objects) and dp_rep has size 1.
ZeRO++ hpZ gathers from a secondary copy inside a node (nodes: `gpus_per_node` consecutive ranks):
dp_node / edp_node are the members of one shard group on one node (process groups made on first use).
"""
from __future__ import annotations

import datetime
import os
from dataclasses import dataclass, field
from typing import Optional

import torch

from parallel3d.comm import CommStats, Group

DIMS = ("tp", "cp", "dp", "pp", "ep", "edp", "dp_cp", "embedding", "world")
HSDP_DIMS = ("dp_shard", "edp_shard", "dp_rep")   # see the module docstring
NODE_DIMS = ("dp_node", "edp_node")                # hpZ; built lazily (ParallelContext.clone)
ALL_DIMS = DIMS + HSDP_DIMS + NODE_DIMS


@dataclass(frozen=True)
class Coords:
    tp: int
    cp: int
    dp: int
    pp: int
    ep: int
    edp: int


@dataclass(frozen=True)
class MeshSpec:
    """Degrees of every parallel dimension. world = tp * cp * dp * pp; ep divides dp * cp."""
    tp: int = 1
    cp: int = 1
    dp: int = 1
    pp: int = 1
    ep: int = 1
    dp_shard: int = 0   # HSDP shard degree K over DP (0: all of dp); resolved to dp when 0
    gpus_per_node: int = 8  # node size (consecutive ranks), for ZeRO++ hpZ's intra-node groups

    def __post_init__(self) -> None:
        for name in ("tp", "cp", "dp", "pp", "ep"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"parallel.{name} must be a positive integer, got {value!r}")
        if (self.dp * self.cp) % self.ep:
            raise ValueError(f"parallel.ep={self.ep} must divide dp*cp={self.dp}*{self.cp}="
                             f"{self.dp * self.cp}: expert parallelism is carved out of the DP x CP ranks")
        check_dp_shard(self.dp_shard, self.dp, self.cp, self.ep)
        if not isinstance(self.gpus_per_node, int) or self.gpus_per_node < 1:
            raise ValueError(f"parallel.gpus_per_node must be a positive integer, got {self.gpus_per_node!r}")
        if self.dp_shard == 0:
            object.__setattr__(self, "dp_shard", self.dp)

    @property
    def hsdp(self) -> bool:
        """ZeRO shards over part of DP and replicates across the rest."""
        return self.dp_shard != self.dp

    @classmethod
    def for_world(cls, world_size: int, tp: int = 1, cp: int = 1, pp: int = 1, ep: int = 1,
                  dp: int = 0, dp_shard: int = 0, gpus_per_node: int = 8) -> "MeshSpec":
        """dp=0 means 'what the world size leaves'. Raises ValueError when the degrees do not divide."""
        inner = tp * cp * pp
        if world_size % inner:
            raise ValueError(f"world size {world_size} is not divisible by tp*cp*pp={tp}*{cp}*{pp}={inner}")
        if dp == 0:
            dp = world_size // inner
        if inner * dp != world_size:
            raise ValueError(f"tp*cp*dp*pp={tp}*{cp}*{dp}*{pp}={inner * dp} does not equal the world "
                             f"size {world_size}")
        return cls(tp=tp, cp=cp, dp=dp, pp=pp, ep=ep, dp_shard=dp_shard, gpus_per_node=gpus_per_node)

    @property
    def world_size(self) -> int:
        return self.tp * self.cp * self.dp * self.pp

    @property
    def edp(self) -> int:
        return self.dp * self.cp // self.ep

    # ---- rank <-> coordinates -------------------------------------------------------------------
    def rank(self, tp: int = 0, cp: int = 0, dp: int = 0, pp: int = 0) -> int:
        return tp + self.tp * (cp + self.cp * (dp + self.dp * pp))

    def coords(self, rank: int) -> Coords:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside world of size {self.world_size}")
        tp, rest = rank % self.tp, rank // self.tp
        cp, rest = rest % self.cp, rest // self.cp
        dp, pp = rest % self.dp, rest // self.dp
        j = cp + self.cp * dp
        return Coords(tp=tp, cp=cp, dp=dp, pp=pp, ep=j % self.ep, edp=j // self.ep)

    # ---- groups -----------------------------------------------------------------------------------
    def groups(self, dim: str) -> list[list[int]]:
        """Rank lists of every group of one kind (see DIMS). Each kind except 'embedding' partitions the world."""
        if dim not in ALL_DIMS:
            raise ValueError(f"unknown mesh dimension {dim!r}; known: {ALL_DIMS}")
        if dim == "world":
            return [list(range(self.world_size))]
        if dim == "embedding":
            return self._embedding_groups()
        buckets: dict[tuple, list[int]] = {}
        for r in range(self.world_size):
            buckets.setdefault(self._key(dim, self.coords(r)), []).append(r)
        return list(buckets.values())

    def _key(self, dim: str, c: Coords) -> tuple:
        """Coordinates shared by all members of the rank's `dim` group (the ones that do not vary)."""
        j, block = c.cp + self.cp * c.dp, self.dp_shard * self.cp
        node = self.rank(c.tp, c.cp, c.dp, c.pp) // self.gpus_per_node
        return {
            "tp": (c.cp, c.dp, c.pp),
            "cp": (c.tp, c.dp, c.pp),
            "dp": (c.tp, c.cp, c.pp),
            "pp": (c.tp, c.cp, c.dp),
            "dp_cp": (c.tp, c.pp),
            "ep": (c.tp, c.pp, j // self.ep),
            "edp": (c.tp, c.pp, j % self.ep),
            "dp_shard": (c.tp, c.pp, j // block),
            "edp_shard": (c.tp, c.pp, j % self.ep, j // block),
            "dp_rep": (c.tp, c.pp, j % block),
            "dp_node": (c.tp, c.pp, j // block, node),
            "edp_node": (c.tp, c.pp, j % self.ep, j // block, node),
        }[dim]

    def _embedding_groups(self) -> list[list[int]]:
        """First and last pipeline stage of each pipeline (for tied input/output embeddings)."""
        out = []
        for pipe in self.groups("pp"):
            out.append(sorted({pipe[0], pipe[-1]}))
        return out

    def group_of(self, dim: str, rank: int) -> list[int]:
        for ranks in self.groups(dim):
            if rank in ranks:
                return ranks
        return []  # only 'embedding' may not contain a rank (middle pipeline stages)


def check_dp_shard(dp_shard: int, dp: int, cp: int = 1, ep: int = 1) -> None:
    """parallel.dp_shard (HSDP): 0 (all of dp) or a divisor of dp; expert weights shard over the expert-DP
    ranks of one shard block, so ep must divide dp_shard*cp."""
    if not isinstance(dp_shard, int) or dp_shard < 0:
        raise ValueError(f"parallel.dp_shard must be 0 (all of dp) or a positive integer, got {dp_shard!r}")
    if dp_shard and dp % dp_shard:
        raise ValueError(f"parallel.dp_shard={dp_shard} must divide parallel.dp={dp}")
    if dp_shard and (dp_shard * cp) % ep:
        raise ValueError(f"parallel.dp_shard={dp_shard}: HSDP shards expert weights inside each block of "
                         f"dp_shard*cp={dp_shard * cp} DP x CP ranks, which parallel.ep={ep} must divide")


def check_hpz(spec: MeshSpec) -> None:
    """hpZ keeps a secondary copy sharded over the shard group's members on one node: each node must hold
    an equal, contiguous run of every shard group (e.g. gpus_per_node a multiple of tp*cp*dp_shard, or
    of tp*cp with dp_shard a multiple of the DP ranks per node)."""
    for shard_dim, node_dim in (("dp_shard", "dp_node"), ("edp_shard", "edp_node")):
        for shard in spec.groups(shard_dim):
            parts = [g for g in spec.groups(node_dim) if g[0] in shard]
            sizes = {len(g) for g in parts}
            contiguous = all(shard[shard.index(g[0]): shard.index(g[0]) + len(g)] == g for g in parts)
            if len(sizes) != 1 or not contiguous:
                raise ValueError(f"parallel.zero_hpz: parallel.gpus_per_node={spec.gpus_per_node} splits the "
                                 f"ZeRO shard group {shard} unevenly across nodes ({parts}); choose "
                                 f"gpus_per_node so that every node holds the same run of each shard group")


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
        """Without HSDP the shard groups are the DP x CP / expert-DP groups themselves."""
        return {} if spec.hsdp else {"dp_shard": "dp_cp", "edp_shard": "edp"}

    @property
    def world_size(self) -> int:
        return self.spec.world_size

    def groups(self) -> dict[str, Optional[Group]]:
        """Every group field by name (ALL_DIMS order; without HSDP the shard groups repeat dp_cp / edp)."""
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

    @classmethod
    def single(cls, device: str | torch.device = "cpu") -> "ParallelContext":
        """World size 1: plain single-device PyTorch, torch.distributed untouched."""
        return cls.create(MeshSpec(), 0, device)

    @classmethod
    def simulated(cls, spec: MeshSpec, rank: int, device: str | torch.device = "meta") -> "ParallelContext":
        """Rank `rank` of `spec` alone, its groups answered by comm's simulated backend (no processes): the
        off-CPU dry run of the real training step (tests/test_fake_device.py) runs through it. The default
        `meta` device is the stand-in for CUDA on CPU-only builds (shapes, devices and placement rules, no
        values)."""
        from parallel3d.comm import SimulatedProcessGroup

        ctx = cls.create(spec, rank, device, "simulated")
        for group in ctx.groups().values():
            if group is not None and group.size > 1:
                group.pg = SimulatedProcessGroup()
        return ctx

    @classmethod
    def build(cls, spec: MeshSpec, device: Optional[torch.device] = None,
              timeout_s: float = 600.0) -> "ParallelContext":
        """Create the process groups of `spec` on an initialised default group (every rank must call)."""
        import torch.distributed as dist

        if spec.world_size == 1 and not dist.is_initialized():
            return cls.single(device or "cpu")
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
        timeout = datetime.timedelta(seconds=timeout_s)
        aliases = cls._aliases(spec)
        for dim in ALL_DIMS:
            if dim in aliases or (dim in HSDP_DIMS and not spec.hsdp) or dim in NODE_DIMS:
                continue   # the same Group as dp_cp / edp, or size 1 (dp_rep without HSDP)
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
                f"pp={s.pp} ep={s.ep}, coords={self.coords})")


def init_distributed(backend: Optional[str] = None, timeout_s: float = 600.0) -> tuple[int, int]:
    """Initialise the default process group from torchrun's environment. Returns (rank, world_size).

    Without torchrun variables (plain `python`), does nothing and returns (0, 1).
    """
    import torch.distributed as dist

    if "WORLD_SIZE" not in os.environ or int(os.environ["WORLD_SIZE"]) == 1 and "MASTER_ADDR" not in os.environ:
        return 0, 1
    if not dist.is_initialized():
        backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
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
