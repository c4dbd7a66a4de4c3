"""Mesh arithmetic (pure): rank <-> coordinates and the rank lists of every group.

Rank order (innermost first): TP, CP, DP, PP. TP ranks are consecutive so they share a node / NVLink
domain; PP is outermost so pipeline stages span nodes.

    rank = tp_r + tp * (cp_r + cp * (dp_r + dp * pp_r))

    world = 8, tp=2 cp=1 dp=2 pp=2:     pp0: [0 1 | 2 3]   pp1: [4 5 | 6 7]
                                              tp   tp            tp   tp
                                              \\-dp-/            \\-dp-/

Expert parallelism is folded over the TP x CP x DP ranks of one pipeline stage ("MoE parallel folding"):
index them L = tp_r + tp * (cp_r + cp * dp_r) (their rank order inside the stage, rank = L + stage * pp_r
with stage = tp*cp*dp). The expert mesh orders them etp innermost, then ep, then expert-DP:

    etp_r = L % etp     ep_r = (L // etp) % ep     edp_r = L // (etp * ep)     (ep * etp divides tp*cp*dp)

    etp  same (pp, L // etp)              the ranks splitting one expert's ffn (size etp)
    ep   same (pp, L % etp, L // (etp*ep)) the all-to-all group, each rank num_experts/ep experts (size ep)
    edp  same (pp, L % (etp*ep))          replicas of one expert slice: expert gradients are summed here
                                          (size tp*cp*dp / (ep*etp))

    stage of 8, tp=2 dp=4, ep=4 etp=1:  L = 0 1 2 3 4 5 6 7
                                        ep  [0 1 2 3][0 1 2 3]    ep groups {0..3} {4..7}: EP spans TP and DP
                                        edp  0 0 0 0  1 1 1 1     edp groups {0,4} {1,5} {2,6} {3,7}

etp == tp is the layout before folding, exactly: then etp groups are the tp groups, L // tp = cp_r + cp * dp_r,
and ep / edp are runs / strides of the DP x CP ranks sharing a TP rank (ep dividing dp*cp).

HSDP (`dp_shard` = K, dividing dp; 0 or dp: plain ZeRO over all of DP x CP): ZeRO shards over blocks of K
consecutive DP ranks (times all CP and, for experts, TP ranks) and replicates across the dp/K blocks. A block
is a run of B = tp*K*cp consecutive L (of one TP rank's DP x CP ranks for dense weights):

    dp_shard   same (tp, pp, L // B)                 dense shard group, size K*cp
    edp_shard  same (pp, L % (etp*ep), L // B)        expert shard group, size B/(etp*ep) (etp*ep must divide B)
    dp_rep     same (pp, L % B)                      replica group, size dp/K (dense and expert alike)

so a sum over DP x CP (or expert-DP) is a sum inside the shard group followed by one across replicas.
Without HSDP the shard groups *are* dp_cp / edp (the same Group objects) and dp_rep has size 1.
ZeRO++ hpZ gathers from a secondary copy inside a node (nodes: `gpus_per_node` consecutive ranks):
dp_node / edp_node are the members of one shard group on one node (process groups made on first use).
"""
from __future__ import annotations

from dataclasses import dataclass

DIMS = ("tp", "cp", "dp", "pp", "etp", "ep", "edp", "dp_cp", "embedding", "world")
HSDP_DIMS = ("dp_shard", "edp_shard", "dp_rep")   # see the module docstring
NODE_DIMS = ("dp_node", "edp_node")                # hpZ; built lazily (ParallelContext.clone)
ALL_DIMS = DIMS + HSDP_DIMS + NODE_DIMS
# the coordinates all members of a group share (MeshSpec._key); every other dense group shares (tp, pp)
_PINNED = {"tp": ("cp", "dp", "pp"), "cp": ("tp", "dp", "pp"), "dp": ("tp", "cp", "pp"), "pp": ("tp", "cp", "dp")}
EXPERT_DIMS = ("etp", "ep", "edp", "edp_shard", "edp_node")  # folded over a stage: MeshSpec._expert_members


@dataclass(frozen=True)
class Coords:
    tp: int
    cp: int
    dp: int
    pp: int
    ep: int
    edp: int
    etp: int


@dataclass(frozen=True)
class MeshSpec:
    """Degrees of every parallel dimension. world = tp * cp * dp * pp; ep * etp divides tp * cp * dp."""
    tp: int = 1
    cp: int = 1
    dp: int = 1
    pp: int = 1
    ep: int = 1
    etp: int = 1        # expert tensor parallelism: each expert's ffn split over etp ranks (module docstring)
    dp_shard: int = 0   # HSDP shard degree K over DP (0: all of dp); resolved to dp when 0
    gpus_per_node: int = 8  # node size (consecutive ranks), for ZeRO++ hpZ's intra-node groups

    def __post_init__(self) -> None:
        for name in ("tp", "cp", "dp", "pp", "ep", "etp"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"parallel.{name} must be a positive integer, got {value!r}")
        check_expert_fold(self.tp, self.cp, self.dp, self.ep, self.etp)
        check_dp_shard(self.dp_shard, self.dp, self.cp, self.ep, self.tp, self.etp)
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
                  dp: int = 0, dp_shard: int = 0, gpus_per_node: int = 8, etp: int = 1) -> "MeshSpec":
        """dp=0 means 'what the world size leaves'. Raises ValueError when the degrees do not divide."""
        inner = tp * cp * pp
        if world_size % inner:
            raise ValueError(f"world size {world_size} is not divisible by tp*cp*pp={tp}*{cp}*{pp}={inner}")
        if dp == 0:
            dp = world_size // inner
        if inner * dp != world_size:
            raise ValueError(f"tp*cp*dp*pp={tp}*{cp}*{dp}*{pp}={inner * dp} does not equal the world "
                             f"size {world_size}")
        return cls(tp=tp, cp=cp, dp=dp, pp=pp, ep=ep, etp=etp, dp_shard=dp_shard, gpus_per_node=gpus_per_node)

    @classmethod
    def of(cls, parallel) -> "MeshSpec":
        """The mesh of a resolved `parallel` config section (training/config_sections.py's ParallelConfig, dp filled)."""
        p = parallel
        return cls(tp=p.tp, cp=p.cp, dp=p.dp, pp=p.pp, ep=p.ep, etp=p.etp, dp_shard=p.dp_shard,
                   gpus_per_node=p.gpus_per_node)

    @property
    def world_size(self) -> int:
        return self.tp * self.cp * self.dp * self.pp

    @property
    def stage_size(self) -> int:
        """Ranks of one pipeline stage (tp * cp * dp), over which the experts are folded."""
        return self.tp * self.cp * self.dp

    @property
    def edp(self) -> int:
        return self.stage_size // (self.ep * self.etp)

    # ---- rank <-> coordinates -------------------------------------------------------------------
    def rank(self, tp: int = 0, cp: int = 0, dp: int = 0, pp: int = 0) -> int:
        return tp + self.tp * (cp + self.cp * (dp + self.dp * pp))

    def coords(self, rank: int) -> Coords:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside world of size {self.world_size}")
        tp, rest = rank % self.tp, rank // self.tp
        cp, rest = rest % self.cp, rest // self.cp
        dp, pp = rest % self.dp, rest // self.dp
        local = rank % self.stage_size  # L of the module docstring
        return Coords(tp=tp, cp=cp, dp=dp, pp=pp, ep=(local // self.etp) % self.ep,
                      edp=local // (self.etp * self.ep), etp=local % self.etp)

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
        rank = self.rank(c.tp, c.cp, c.dp, c.pp)
        local, block, fold = rank % self.stage_size, self.tp * self.dp_shard * self.cp, self.etp * self.ep
        node = rank // self.gpus_per_node
        return {
            "tp": (c.cp, c.dp, c.pp),
            "cp": (c.tp, c.dp, c.pp),
            "dp": (c.tp, c.cp, c.pp),
            "pp": (c.tp, c.cp, c.dp),
            "dp_cp": (c.tp, c.pp),
            "etp": (c.pp, local // self.etp),
            "ep": (c.pp, local % self.etp, local // fold),
            "edp": (c.pp, local % fold),
            "dp_shard": (c.tp, c.pp, local // block),
            "edp_shard": (c.pp, local % fold, local // block),
            "dp_rep": (c.pp, local % block),
            "dp_node": (c.tp, c.pp, local // block, node),
            "edp_node": (c.pp, local % fold, local // block, node),
        }[dim]

    def _expert_members(self, dim: str, rank: int) -> list[int]:
        """The ranks of `rank`'s expert group (EXPERT_DIMS) straight from the folding arithmetic, ascending."""
        stage, local = rank - rank % self.stage_size, rank % self.stage_size
        fold, block = self.etp * self.ep, self.tp * self.dp_shard * self.cp
        if dim == "etp":
            first, step, count = local - local % self.etp, 1, self.etp
        elif dim == "ep":
            first, step, count = local - local % fold + local % self.etp, self.etp, self.ep
        elif dim == "edp":
            first, step, count = local % fold, fold, self.edp
        else:  # edp_shard, edp_node: the expert-DP ranks inside this rank's HSDP block (and node)
            first, step, count = local - local % block + local % fold, fold, block // fold
        members = [stage + first + i * step for i in range(count)]
        if dim == "edp_node":
            members = [r for r in members if r // self.gpus_per_node == rank // self.gpus_per_node]
        return members

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
        if dim in EXPERT_DIMS:
            self.coords(rank)  # range check
            return self._expert_members(dim, rank)
        c = self.coords(rank)
        key, pinned = self._key(dim, c), _PINNED.get(dim, ("tp", "pp"))
        span = {d: [getattr(c, d)] if d in pinned else range(getattr(self, d)) for d in ("tp", "cp", "dp", "pp")}
        near = sorted(self.rank(tp, cp, dp, pp) for pp in span["pp"] for dp in span["dp"] for cp in span["cp"]
                      for tp in span["tp"])
        return [r for r in near if self._key(dim, self.coords(r)) == key]


def expert_folds(tp: int, cp: int, dp: int) -> list[tuple[int, int]]:
    """Every (ep, etp) a stage of tp*cp*dp ranks can fold its experts over (check_expert_fold's rule), etp
    first: what a layout search enumerates."""
    stage = tp * cp * dp
    ranks = [d for d in range(1, stage + 1) if stage % d == 0]
    return [(ep, etp) for etp in ranks for ep in ranks if _folds(stage, ep, etp)]


def _folds(stage: int, ep: int, etp: int) -> bool:
    return stage % (ep * etp) == 0


def check_expert_fold(tp: int, cp: int, dp: int, ep: int, etp: int) -> None:
    """Experts fold over the tp*cp*dp ranks of a stage: ep * etp must divide them (module docstring)."""
    if not _folds(tp * cp * dp, ep, etp):
        raise ValueError(f"parallel.ep*etp={ep}*{etp}={ep * etp} must divide tp*cp*dp={tp}*{cp}*{dp}={tp * cp * dp}: "
                         f"expert parallelism is folded over the TP x CP x DP ranks of a pipeline stage")


def check_dp_shard(dp_shard: int, dp: int, cp: int = 1, ep: int = 1, tp: int = 1, etp: int = 1) -> None:
    """parallel.dp_shard (HSDP): 0 (all of dp) or a divisor of dp; expert weights shard over the expert-DP
    ranks of one shard block (its tp*dp_shard*cp ranks), so ep*etp must divide tp*dp_shard*cp."""
    if not isinstance(dp_shard, int) or dp_shard < 0:
        raise ValueError(f"parallel.dp_shard must be 0 (all of dp) or a positive integer, got {dp_shard!r}")
    if dp_shard and dp % dp_shard:
        raise ValueError(f"parallel.dp_shard={dp_shard} must divide parallel.dp={dp}")
    block = tp * dp_shard * cp
    if dp_shard and block % (ep * etp):
        raise ValueError(f"parallel.dp_shard={dp_shard}: HSDP shards expert weights inside each block of "
                         f"tp*dp_shard*cp={tp}*{dp_shard}*{cp}={block} ranks, which parallel.ep*etp={ep}*{etp}"
                         f"={ep * etp} must divide")


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
