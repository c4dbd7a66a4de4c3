"""The training loop: data -> (pipeline) forward/backward -> gradient sync -> clip -> AdamW -> metrics.

The trainer knows nothing about a particular model: `build_stage(layer_ids, pre, post)` returns one model
chunk (a module whose forward(x, position_ids, labels) returns hidden states, or the summed token loss on
the chunk holding the head). Everything layout-specific comes from the ParallelContext and the config.

Loss convention (docs/architecture.md section 2.2): each rank's loss is the sum of its token losses divided by the number of
target tokens in the global batch, so DP, CP, microbatching and accumulation leave the loss unchanged.
"""
from __future__ import annotations

import contextlib
import math
import time
from typing import Callable, Optional

import torch
from torch import nn

from parallel3d import comm
from parallel3d.host_sync import read_float, upload
from parallel3d.data_parallel.zero3 import find_units
from parallel3d.mesh import ParallelContext
from parallel3d.offload import ActivationOffload
from parallel3d.pipeline.partition import partition_layers
from parallel3d.pipeline.placement import chunks_per_rank, placement_of, stage_ids
from parallel3d.pipeline.runtime import Record, ScheduleCache, run_pipeline_forward, run_pipeline_step
from parallel3d.pipeline.timeline import to_rows
from parallel3d.tensor_parallel.cross_entropy import IGNORE_INDEX
from parallel3d.tensor_parallel.fp8 import casts_of
from parallel3d.training.config import ExperimentConfig, timeline_window, to_dict
from parallel3d.training.data import BatchSampler, TokenDataset, synthetic_tokens
from parallel3d.training.data_sources import MixtureDataset, MixtureSampler
from parallel3d.training.lr_schedule import lr_at
from parallel3d.training.recompute import apply_recompute_layers

BuildStage = Callable[[list[int], bool, bool], nn.Module]


def comm_bytes(stats: comm.CommStats) -> dict[str, int]:
    """Bytes per "<group>.<op>" recorded since the last reset (comm's accounting convention)."""
    return {f"{group}.{op}": nbytes for (group, op), (_, nbytes) in sorted(stats.summary().items())}


class NonFiniteError(RuntimeError):
    """Loss or gradients were NaN/inf and train.nan_policy=stop."""


def make_dataset(cfg: ExperimentConfig, path: Optional[str], seed_offset: int = 0) -> TokenDataset:
    """The token file, or (path None) the built-in synthetic demo text."""
    seq = cfg.train.seq_len
    if path is None:
        need = (cfg.train.global_batch_size * max(cfg.train.steps, 1) + 1) * seq + 1
        tokens = synthetic_tokens(max(need, 64 * seq), cfg.model.vocab_size, cfg.train.seed + seed_offset)
        return TokenDataset.from_array(tokens, seq, name="<synthetic demo data>")
    return TokenDataset(path, seq, vocab_size=cfg.model.vocab_size)


def split_microbatch(tokens: torch.Tensor, ctx: ParallelContext, eos_id: Optional[int] = None,
                     mask_documents: bool = False, reset_positions: bool = False) -> dict:
    """(b, s+1) token windows -> this rank's ids, labels and positions (its CP shard of the sequence).

    Packed documents (context_parallel/documents.py; eos_id needed): mask_documents adds "documents", the
    per-token document ids of the whole window (every CP rank gets all of them: the ring reads other
    ranks' ids for its key blocks); reset_positions makes position_ids (b, s/cp) restart at each document."""
    ids, labels = tokens[:, :-1], tokens[:, 1:]
    s = ids.shape[1]
    positions = torch.arange(s)  # (s,)
    out = {}
    if mask_documents or reset_positions:
        from parallel3d.context_parallel.documents import Documents, document_ids, document_positions
        doc = document_ids(ids, eos_id)  # (b, s), on the host
        if reset_positions:
            positions = document_positions(doc)  # (b, s)
        if mask_documents:
            out["documents"] = Documents.from_host(doc, ctx.device)
    if ctx.cp.size > 1:
        from parallel3d.context_parallel.sharding import cp_chunk_indices, shard_sequence
        ids = shard_sequence(ids, ctx.cp.size, ctx.cp.rank, dim=1)
        labels = shard_sequence(labels, ctx.cp.size, ctx.cp.rank, dim=1)
        positions = positions.index_select(-1, cp_chunk_indices(s, ctx.cp.size, ctx.cp.rank))
    device = ctx.device
    targets = int((labels != IGNORE_INDEX).sum())  # counted on the host, before the copy: no device sync
    # pinned, non-blocking copies: a pageable copy per microbatch would make the host wait for the device
    return {"ids": upload(ids, device), "labels": upload(labels, device), "position_ids": upload(positions, device),
            "targets": targets, **out}


class Trainer:
    def __init__(self, cfg: ExperimentConfig, ctx: ParallelContext, build_stage: BuildStage,
                 train: bool = True) -> None:
        """train=False (evaluation) builds no optimizer: no fp32 master weights or Adam state."""
        self.cfg, self.ctx = cfg, ctx
        p = cfg.parallel
        v = chunks_per_rank(p.schedule, p.virtual_stages)
        stages = partition_layers(cfg.model.num_layers, p.pp, v, p.layers_per_stage)
        # which global stage each local chunk is: the schedule's placement (pipeline/placement.py)
        self.placement = placement_of(p.schedule)
        self.stage_ids = stage_ids(ctx.coords.pp, p.pp, v, self.placement)
        last = p.pp * v - 1
        if p.ep_overlap:  # the pairs' started all-to-alls' own process group (expert_parallel/layer.py), by all ranks
            ctx.clone("ep")
        with torch.device(ctx.device):  # parameters are created where they live (no host copy first)
            self.chunks = [build_stage(stages[s], s == 0, s == last) for s in self.stage_ids]
        for chunk in self.chunks:
            chunk.init_weights(cfg.train.seed)
        apply_recompute_layers(self.chunks, cfg.train.recompute_layers)
        # fp8 weights cast once per step, reused by its microbatches (not under ZeRO-3: fp8.Fp8Casts)
        self.fp8_casts = casts_of(self.chunks) if p.zero != 3 else []
        self.optimizer = self._build_optimizer() if train else None
        if cfg.data.paths is not None:  # weighted mixture of token files (data_sources.py)
            self.dataset = MixtureDataset.from_spec(cfg.data.paths, cfg.train.seq_len, cfg.model.vocab_size)
            self.sampler = MixtureSampler(self.dataset, cfg.train.global_batch_size, cfg.train.seed)
        else:
            self.dataset = make_dataset(cfg, cfg.data.path)
            self.sampler = BatchSampler(self.dataset, cfg.train.global_batch_size, cfg.train.seed)
        self.step = 0
        self.activation_offload = None
        if cfg.train.activation_offload:  # prefetch block by block (the chunks' transformer blocks)
            self.activation_offload = ActivationOffload()
            self.activation_offload.attach([b for c in self.chunks for b in find_units(c)])
        self.schedules = ScheduleCache()  # each (schedule, p, m, v) built and verified once

    def run_config(self) -> dict:
        """The whole configuration as plain data (what checkpoints record; checkpoint.protocol)."""
        return to_dict(self.cfg)

    def _build_optimizer(self):
        """The chunks under data parallelism (data_parallel/attach.py: ZeRO-3's gathering, then the
        DistributedOptimizer), configured from parallel.* and train.* (DataParallelConfig.from_train_config)."""
        from parallel3d.data_parallel import DataParallelConfig, attach

        return attach(self.chunks, self.ctx, DataParallelConfig.from_train_config(self.cfg))

    # ------------------------------------------------------------------ one optimizer step
    def _microbatches(self, step: int) -> list[dict[str, torch.Tensor]]:
        t = self.cfg.train
        rows = self.sampler.local_batch(step, self.ctx.coords.dp, self.ctx.spec.dp, t.num_microbatches,
                                        t.micro_batch_size)
        return [split_microbatch(mb, self.ctx, **self.document_args()) for mb in rows]

    def document_args(self) -> dict:
        """split_microbatch's packed-document arguments from the data config (validate resolved them)."""
        d = self.cfg.data
        return {"eos_id": d.eos_id, "mask_documents": d.document_masking, "reset_positions": bool(d.reset_positions)}

    def timeline_window(self) -> range:
        """The steps (0-based) log.timeline records (config.timeline_window)."""
        return timeline_window(self.cfg.log, self.cfg.train.steps)

    def _global_token_count(self, mbs: list[dict[str, torch.Tensor]]) -> float:
        """Target tokens of the global batch: this rank's count, summed over DP x CP on the device."""
        local = float(sum(mb["targets"] for mb in mbs))
        count = torch.full((1,), local, device=self.ctx.device)  # NCCL reduces device tensors only
        comm.all_reduce(count, self.ctx.dp_cp)
        return max(read_float(count, self.ctx.stats.syncs, "step", nominal=local * self.ctx.dp_cp.size), 1.0)

    def _forward_backward(self, mbs: list[dict[str, torch.Tensor]], tokens: float,
                          record: Optional[Record] = None) -> torch.Tensor:
        """Sum over microbatches of this rank's loss / tokens (on the last stage; 0 elsewhere). The pipeline
        runtime runs every layout, pp == 1 included (one stage: forward and backward per microbatch)."""
        opt = self.optimizer
        p = self.cfg.parallel
        return run_pipeline_step(self.ctx, self.chunks, p.schedule, mbs, loss_scale=1.0 / tokens,
                                 schedules=self.schedules, record=record, ep_overlap=p.ep_overlap,
                                 backward=lambda loss: opt.scale_loss(loss).backward(),
                                 before_backward=lambda mb, chunk: opt.set_last_microbatch(mb == len(mbs) - 1, chunk))

    def train_step(self, record: Optional[Record] = None) -> dict:
        """One optimizer step. `record`, if given, receives this rank's pipeline actions with their times
        (the planner's dry run); log.timeline's step gathers every pipeline rank's instead."""
        t0 = time.perf_counter()
        cfg, ctx, opt = self.cfg, self.ctx, self.optimizer
        ctx.stats.reset()  # comm_bytes: this rank's traffic in this step
        lr = lr_at(self.step, cfg.train)
        mbs = self._microbatches(self.step)
        tokens = self._global_token_count(mbs)
        opt.zero_grad()
        gather = record is None and self.step in self.timeline_window()
        record = [] if gather else record
        for casts in self.fp8_casts:  # the weights are fixed until the optimizer step below
            casts.open()
        try:
            with self.activation_offload.scope() if self.activation_offload else contextlib.nullcontext():
                loss = self._forward_backward(mbs, tokens, record).reshape(1).float()
        finally:
            for casts in self.fp8_casts:
                casts.close()
        opt.finish_grad_sync()
        comm.all_reduce(loss, ctx.dp_cp)
        comm.all_reduce(loss, ctx.pp)  # only the last stage holds a nonzero loss
        grad_norm = opt.clip_grad_norm(cfg.train.grad_clip)
        loss_value = read_float(loss, ctx.stats.syncs, "step")  # the NaN policy and the log
        finite = math.isfinite(loss_value) and math.isfinite(grad_norm)
        # fp16 overflow is the dynamic loss scaler's business (skip + back off), not a NaN-policy event
        overflow = not finite and opt.scaler is not None and not opt.scaler.static
        if not finite and not overflow and cfg.train.nan_policy == "stop":
            raise NonFiniteError(f"step {self.step}: non-finite loss {loss_value} or grad norm {grad_norm} "
                                 f"(rank {ctx.rank}); train.nan_policy=stop")
        stepped = opt.step(lr) if finite else opt.skip_step()
        if overflow and ctx.rank == 0:
            print(f"step {self.step}: fp16 overflow, step skipped; loss scale -> {opt.loss_scale:g}", flush=True)
        elif not finite:
            print(f"[rank {ctx.rank}] step {self.step}: non-finite loss {loss_value} / grad norm {grad_norm}; "
                  f"step skipped (train.nan_policy=skip)", flush=True)
        timeline = None
        if gather and ctx.is_simulated:  # a rank alone: its own events (its peers' would be copies of them)
            timeline = to_rows(record)
        elif gather:  # every pipeline rank's events, gathered (one JSON all-gather per pipeline)
            timeline = [row for rows in comm.all_gather_json(to_rows(record), ctx.pp) for row in rows]
        self.step += 1
        moved = self.activation_offload.offloaded_bytes if self.activation_offload else 0
        return {"timeline": timeline, "activation_offload_bytes": moved, "step": self.step, "loss": loss_value, "grad_norm": grad_norm, "lr": lr, "skipped": not stepped,
                "loss_scale": opt.loss_scale, "comm_bytes": comm_bytes(ctx.stats),
                "tokens": cfg.train.global_batch_size * cfg.train.seq_len, "elapsed_s": time.perf_counter() - t0,
                "host_syncs": ctx.stats.syncs.summary()}

    @torch.no_grad()
    def evaluate(self, dataset: TokenDataset, steps: int) -> tuple[float, float]:
        """(mean token loss, token count) over the first `steps` global batches of `dataset`, in order."""
        cfg, ctx = self.cfg, self.ctx
        sampler = BatchSampler(dataset, cfg.train.global_batch_size, cfg.train.seed, shuffle=False)
        total, count = torch.zeros(1, device=ctx.device), 0.0
        steps = min(steps, len(dataset) // cfg.train.global_batch_size)
        for chunk in self.chunks:
            chunk.eval()
        for step in range(steps):
            rows = sampler.local_batch(step, ctx.coords.dp, ctx.spec.dp, cfg.train.num_microbatches,
                                       cfg.train.micro_batch_size)
            mbs = [split_microbatch(mb, ctx, **self.document_args()) for mb in rows]
            count += self._global_token_count(mbs)
            total += run_pipeline_forward(ctx, self.chunks, mbs, placement=self.placement).float()
        for chunk in self.chunks:
            chunk.train()
        comm.all_reduce(total, ctx.dp_cp)
        comm.all_reduce(total, ctx.pp)
        return read_float(total, ctx.stats.syncs, "logging") / max(count, 1.0), count
