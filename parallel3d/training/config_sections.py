"""The sections of an experiment config, as typed dataclasses: parallel, train, data, checkpoint, log, and the
protocol of what the library reads from the model section (every key: docs/configuration.md).

Each field's comment is its documentation: `training/docgen.py` renders docs/configuration.md from it. Reading
and writing configs (YAML, `key=value` overrides) is `training/config.py`, which re-exports these names.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Protocol


class ConfigError(ValueError):
    """A configuration problem; the message names the offending keys and values."""


class TransformerShape(Protocol):
    """What the library reads from a model config (models/config.ModelConfig is one): validation, FLOP and
    parameter counts. The library never imports a model; it declares what it needs."""
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int                # 0: hidden_size // num_heads
    attention: str               # attention backend (flash_attn needs its package)
    ffn_hidden_size: int
    max_seq_len: int
    tie_embeddings: bool
    num_experts: int
    moe_top_k: int
    moe_ffn_hidden_size: int
    num_shared_experts: int
    first_k_dense: int
    qk_norm: bool                # RMSNorm over each query and key head (adds 2 * head_dim per layer)
    attention_type: str          # mha | mla (Multi-Latent Attention counts its own projections)
    q_lora_rank: int             # mla dims (read only when attention_type == "mla")
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    mtp_depth: int               # multi-token prediction modules (count as more MoE layers)

    def validate(self) -> None: ...


@dataclass
class ParallelConfig:
    tp: int = 1                  # tensor-parallel degree: each layer's weights split over tp ranks
    pp: int = 1                  # pipeline-parallel degree: the layers split into pp stages
    dp: int = 0                  # 0: whatever the world size leaves (world // (tp*cp*pp))
    cp: int = 1                  # context-parallel degree: each sequence split over cp ranks
    ep: int = 1                  # expert-parallel degree, folded over tp*cp*dp with etp (each EP rank holds num_experts/ep)
    etp: int = 1                 # expert tensor parallelism: each expert's ffn split over etp ranks (1: whole experts; tp: the pre-folding split)
    sp: bool = False             # Megatron sequence parallelism; a no-op (resolved to False) when tp == 1
    cp_mode: str = "ring"        # how attention spans CP ranks: ring passes K/V, allgather gathers it, ulysses swaps heads
    zero: int = 0                # ZeRO stage: 1 shards optimizer state over DP, 2 also gradients, 3 also parameters
    schedule: str = "1f1b"       # pipeline schedule (interleaved: virtual_stages chunks a rank; zb-v, dualpipe-v: 2 in a V)
    virtual_stages: int = 1      # model chunks per pipeline rank (interleaved only)
    layers_per_stage: Optional[list[int]] = None  # one entry per (virtual) stage; None: even split
    bucket_size: int = 0         # parameters per gradient bucket; 0: max(40M, 1M x DP x CP) (Megatron's rule)
    bucket_size_mb: float = 0.0  # > 0: MiB of gradient per bucket instead (overrides bucket_size); 0: unset
    timeout_s: float = 600.0     # collective timeout: a hung peer ends the job with the op named
    offload_optimizer: str = "none"  # fp32 master + Adam state in host memory (cpu) or files (nvme); AdamW on the CPU
    offload_params: str = "none"  # zero=3: the parameter shard lives in host memory (cpu) or files (nvme) between uses
    offload_dir: Optional[str] = None  # nvme: directory for the per-rank state files (fast local disk)
    offload_buffer_mb: float = 64.0  # nvme: host buffer pool that every read and write streams through
    dp_shard: int = 0            # HSDP: ZeRO shards over groups of dp_shard DP ranks, replicated across (0: all dp)
    grad_compression: str = "none"  # compressed gradient reduction, ZeRO-0/1, error feedback (data_parallel/compression.py)
    powersgd_rank: int = 4       # rank r of PowerSGD's P (m, r) and Q (n, r)
    topk_ratio: float = 0.01     # top-k: fraction of each bucket's entries sent per step
    compression_start_step: int = 10  # steps before this one reduce uncompressed (warm-up)
    zero_quantized_weights: bool = False    # ZeRO++ qwZ: ZeRO-3 parameter all-gathers as int8 blocks + scales
    zero_hpz: bool = False       # ZeRO++ hpZ: backward gathers from a secondary copy sharded inside the node
    zero_quantized_gradients: bool = False  # ZeRO++ qgZ: gradient reduce-scatter as int8 all-to-all
    quant_block: int = 256       # values per quantisation scale (qwZ, qgZ)
    zero3_fp8_gather: bool = False  # ZeRO-3 gathers the fp8 linears' weights as e4m3 + scales (train.fp8 on)
    overlap_param_gather: bool = False  # ZeRO-1/2: the step's parameter all-gathers run beside the next forward
    ep_overlap: bool = False     # MoE: a backward and another microbatch's forward run in turns, each one's expert all-to-alls beside the other's compute (1f1b, interleaved, dualpipe-v)
    gpus_per_node: int = 8       # ranks per node (consecutive), for hpZ's intra-node groups


@dataclass
class TrainConfig:
    micro_batch_size: int = 1    # sequences per forward/backward on one DP rank
    global_batch_size: int = 8   # sequences per optimizer step over all DP ranks
    num_microbatches: int = 0    # derived by resolve_and_validate: global / (micro * dp); if set, must agree
    seq_len: int = 128           # tokens per training sequence (<= model.max_seq_len)
    steps: int = 20              # optimizer steps to run
    seed: int = 1234             # seed of the initial weights and the synthetic data (the same for every layout)
    precision: str = "fp32"      # compute dtype of the model; bf16/fp16 keep fp32 master weights and Adam state
    lr: float = 3e-4             # peak learning rate (reached after warmup_steps)
    min_lr: float = 3e-5         # learning rate at the end of the decay
    warmup_steps: int = 0        # steps of linear warmup from lr/warmup_steps to lr
    lr_schedule: str = "cosine"  # decay after warmup, from lr to min_lr (lr_schedule.py)
    lr_decay_steps: int = 0      # 0: decay over train.steps
    weight_decay: float = 0.1    # AdamW decoupled weight decay
    beta1: float = 0.9           # AdamW first-moment decay
    beta2: float = 0.95          # AdamW second-moment decay
    eps: float = 1e-8            # AdamW denominator epsilon
    adamw_block: int = 0         # elements per AdamW block; 0: by device (128K on a CPU, 16M on a GPU)
    optimizer: str = "adamw"     # muon: Muon for the hidden matrices (projections, experts), AdamW for the rest
    muon_lr: float = 0.0         # Muon's peak learning rate, following train.lr's schedule; 0: train.lr
    muon_momentum: float = 0.95  # Muon's momentum (its buffer B <- mu B + (1 - mu) G)
    muon_nesterov: bool = True   # Muon orthogonalises G + mu (B - G) instead of B
    muon_ns_steps: int = 5       # Newton-Schulz iterations per matrix and step
    muon_weight_decay: Optional[float] = None  # Muon's decoupled weight decay; None: train.weight_decay
    muon_adjust_lr_fn: str = "match_rms_adamw"  # lr per matrix shape: match_rms_adamw (0.2 sqrt(max dim): AdamW's lr serves) or original
    muon_ns_precision: str = "bf16"  # dtype of the Newton-Schulz iteration (bf16 as torch.optim.Muon, or fp32)
    muon_tp_mode: str = "gather"  # TP-split matrices: gather (join the shards, exact) or blockwise (each shard alone)
    grad_clip: float = 1.0       # 0: no clipping
    activation_checkpointing: str = "none"  # recompute in backward: full = each block, selective = the attention core
    # Megatron's --recompute-method block: N beyond a chunk's layers recomputes all of them (clamped per chunk)
    recompute_layers: int = 0    # the first N layers of every pipeline chunk recomputed whole, the rest follow activation_checkpointing
    activation_offload: bool = False  # saved activations to host memory during forward (offload/activations.py)
    compile: bool = False        # torch.compile each transformer block (per block: PP and checkpointing keep working)
    fp8: str = "none"            # linear-layer matmuls in float8, tensorwise or rowwise scales (bf16 precision)
    eval_interval: int = 0       # 0: no periodic evaluation
    eval_steps: int = 10         # batches of data.eval_path per evaluation
    nan_policy: str = "skip"     # non-finite loss or gradients: skip drops the step and goes on, stop raises
    loss_scale: float = 0.0      # fp16 only; 0: dynamic scaling, >0: static scale
    initial_loss_scale: float = 65536.0  # fp16 dynamic scaling: the starting scale
    loss_scale_window: int = 1000  # good steps before the dynamic scale doubles
    min_loss_scale: float = 1.0  # fp16 dynamic scaling: the scale never goes below this


@dataclass
class DataConfig:
    path: Optional[str] = None       # 1-D .npy token file; None: the trainer's built-in synthetic demo data
    eval_path: Optional[str] = None  # 1-D .npy token file for evaluation (train.eval_interval, launch/evaluate.py)
    tokenizer: Optional[str] = None  # tokenizer.json the data was prepared with; convert_hf export falls back to it
    paths: Any = None                # mixture: [[0.7, a.npy], [0.3, b.npy]] or "a.npy:0.7,b.npy:0.3" (data.py)
    document_masking: bool = False   # attend only within each packed document (EOS ends a document)
    eos_id: Optional[int] = None     # None: from the token file's sidecar (prepare_data.py); needed for documents
    reset_positions: Optional[bool] = None  # positions restart at each document; None: = document_masking


@dataclass
class CheckpointConfig:
    save_dir: Optional[str] = None  # directory for checkpoints (step_N subdirectories); None: no saving
    load_dir: Optional[str] = None  # checkpoint (or directory of them) to resume from; any layout reshards on load
    interval: int = 0            # 0: save only at the end (when save_dir is set)
    keep: int = 0                # 0: keep every checkpoint
    async_save: bool = False     # write checkpoints in a background thread while training goes on


@dataclass
class LogConfig:
    jsonl: Optional[str] = None  # path of a JSON-lines metrics file (one record per step)
    tensorboard: Optional[str] = None  # directory; needs the tensorboard package (pip install tensorboard)
    interval: int = 1            # progress-line interval (the jsonl gets every step)
    peak_flops: Optional[float] = None  # per-device peak FLOP/s for MFU; None: table / CPU measurement
    timeline: Optional[str] = None     # PATH.png|.json|.csv: measured vs simulated pipeline timeline of one step
    timeline_step: int = -1            # which step (0-based) log.timeline records; -1: the last
    timeline_steps: int = 1            # steps log.timeline records, ending at timeline_step (JSON: each; chart, CSV: the last)


def timeline_window(log: LogConfig, steps: int) -> range:
    """The steps (0-based) log.timeline records in a run of `steps`: log.timeline_steps of them, ending at
    log.timeline_step (-1: the last); empty without log.timeline. Validation requires it to start at >= 0."""
    if log.timeline is None:
        return range(0)
    last = log.timeline_step % max(steps, 1)
    return range(last - log.timeline_steps + 1, last + 1)


@dataclass
class ExperimentConfig:
    model: Any
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    log: LogConfig = field(default_factory=LogConfig)
