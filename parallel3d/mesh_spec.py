"""Mesh arithmetic (pure): rank <-> coordinates and the rank lists of every group.

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

from dataclasses import dataclass

DIMS = ("tp", "cp", "dp", "pp", "ep", "edp", "dp_cp", "embedding", "world")
HSDP_DIMS = ("dp_shard", "edp_shard", "dp_rep")   # see the module docstring
NODE_DIMS = ("dp_node", "edp_node")                # hpZ; built lazily (ParallelContext.clone)
ALL_DIMS = DIMS + HSDP_DIMS + NODE_DIMS
# the coordinates all members of a group share (MeshSpec._key); every other group shares (tp, pp)
_PINNED = {"tp": ("cp", "dp", "pp"), "cp": ("tp", "dp", "pp"), "dp": ("tp", "cp", "pp"), "pp": ("tp", "cp", "dp")}


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
        """The ranks of `rank`'s `dim` group, ascending ([] for a middle stage's 'embedding'). Only ranks that
        share the coordinates every member shares (_PINNED) are looked at: a context of one rank at 16,384
        asks for 15 groups, and building every group of each took 2 s."""
        if dim not in ALL_DIMS:
            raise ValueError(f"unknown mesh dimension {dim!r}; known: {ALL_DIMS}")
        if dim == "world":
            return list(range(self.world_size))
        if dim == "embedding":
            pipe = self.group_of("pp", rank)
            ends = sorted({pipe[0], pipe[-1]})
            return ends if rank in ends else []   # middle pipeline stages hold no embedding
        c = self.coords(rank)
        key, pinned = self._key(dim, c), _PINNED.get(dim, ("tp", "pp"))
        span = {d: [getattr(c, d)] if d in pinned else range(getattr(self, d)) for d in ("tp", "cp", "dp", "pp")}
        near = sorted(self.rank(tp, cp, dp, pp) for pp in span["pp"] for dp in span["dp"] for cp in span["cp"]
                      for tp in span["tp"])
        return [r for r in near if self._key(dim, self.coords(r)) == key]


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


def check_node_size(gpus_per_node: int, world_size: int, ranks_per_node: int) -> None:
    """parallel.gpus_per_node against the launcher's ranks per node (torchrun's LOCAL_WORLD_SIZE): a mesh
    node (`gpus_per_node` consecutive ranks: hpZ's intra-node groups, the planner's NVLink domain) must lie
    inside one launcher node, or its "intra-node" traffic crosses the network. Smaller mesh nodes that tile a
    launcher node are allowed (a sub-node domain), and so is a world that fits in one launcher node."""
    if world_size <= ranks_per_node or ranks_per_node % gpus_per_node == 0:
        return
    raise ValueError(f"parallel.gpus_per_node={gpus_per_node} does not fit the launcher's {ranks_per_node} ranks "
                     f"per node (LOCAL_WORLD_SIZE) at world size {world_size}: a mesh node would span two "
                     f"machines; set parallel.gpus_per_node={ranks_per_node} (or a divisor of it)")
