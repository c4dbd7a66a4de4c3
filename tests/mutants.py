"""Mutants the suite must kill (make mutants; not in CI): a test that cannot fail is a defect, and this checks
that the tests guarding the parallel paths still can.

Each mutant is a small, plausible defect in the code (a missing reduction, a skipped wait, a wrong scale, a
state not restored on resume) and the test that must fail on it. The runner copies the working tree to a
temporary directory, checks that every named test passes there unmutated, then applies one mutant at a time
and runs its test: a mutant whose test still passes survived, and one whose `old` text no longer occurs
exactly once is stale (the code moved: point the mutant at the new code). Either exits 1.

    python tests/mutants.py [ID ...]       (about 10 minutes on 2 cores for the whole list)

The list came from an audit (2026-12-08) of 63 mutants: those that survived every test at first (Muon's
fused parts under TP, a constant muon_lr, each epoch's shuffle, the fp16 scaler's resume, positions restarting
without masking, qwZ's bf16 scales, evaluation order, Llama 3.1's RoPE scaling through Hugging Face, YaRN's
optional keys) got the tests named here. Not listed: mutants that change nothing observable (the global RNG restore: no model here
draws from it; hpZ's clearing of secondary copies that the next forward's gather overwrites; the planner's
microbatch count, which changes only planning time), and the ring-attention and pipeline-receive waits, which
the suite catches by a hang (minutes of timeouts).
"""
from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Mutant:
    id: str
    file: str
    old: str
    new: str
    test: str   # a pytest node id that must fail on the mutant


DP, MOE, TP = "parallel3d/data_parallel/", "parallel3d/expert_parallel/", "parallel3d/tensor_parallel/"
MUTANTS = [
    # ---- gradient reductions and the global norm ----
    Mutant("router-grad-not-summed-over-tp", MOE + "router.py", "std=std, grad_reduce=tp_groups,",
           "std=std, grad_reduce=(),", "tests/test_moe_parity.py::test_moe_parity[tp2-sp]"),
    Mutant("sp-norm-grad-not-summed", TP + "layers.py", 'grad_reduce=("tp",) if tp_sp else (),', "grad_reduce=(),",
           "tests/test_launch.py::test_layout_losses_match_world_size_1[tp=2-pp=2-sp=true]"),
    Mutant("expert-grads-over-dense-dp", DP + "build.py", "    return ctx.edp if expert else ctx.dp_cp",
           "    return ctx.dp_cp", "tests/test_launch.py::test_moe_expert_parallel_losses_match_world_size_1"),
    Mutant("tied-embedding-grads-not-summed", DP + "sync.py",
           "                    if g is not None and g.size > 1:\n                        views.setdefault",
           '                    if g is not None and g.size > 1 and name != "embedding":\n'
           "                        views.setdefault",
           "tests/test_fused_head.py::test_fused_head_trainer_parity[pp2_tied]"),
    Mutant("norm-counts-zero0-replicas", DP + "clip.py", "    if zero == 0 and b.group.rank != 0:\n        return False\n",
           "", "tests/test_dp_parity.py::test_dp_parity[tp1-dp2-zero0-acc1-sp0]"),
    Mutant("norm-counts-tp-replicas", DP + "clip.py", "    for name in s.meta.replicated:\n", "    for name in ():\n",
           "tests/test_dp_parity.py::test_dp_parity[tp2-dp2-zero1-acc2-sp1]"),
    Mutant("norm-counts-hsdp-replicas", DP + "clip.py", "if b.replica is not None and b.replica.rank != 0:",
           "if False:", "tests/test_hsdp.py::test_hsdp_parity_through_trainer[zero=1-dp_shard=2]"),
    Mutant("token-count-not-global", "parallel3d/training/trainer.py",
           "        comm.all_reduce(count, self.ctx.dp_cp)\n", "",
           "tests/test_launch.py::test_layout_losses_match_world_size_1[tp=1-cp=2]"),
    Mutant("norms-decayed", DP + "build.py", "named.append((name, p, not no_decay(name, p)))",
           "named.append((name, p, True))", "tests/test_dp_parity.py::test_dp_parity[tp1-dp4-zero3-acc1-sp0]"),
    # ---- waits: NCCL's rules on the strict backend ----
    Mutant("expert-rows-read-before-wait", MOE + "dispatch.py",
           '        comm.wait_work(work, self.async_group, "all_to_all")\n        return out', "        return out",
           "tests/test_ep_overlap.py::test_overlapped_pairs_match_world_size_1_on_the_strict_backend[1f1b-pp1-dp2-ep2]"),
    Mutant("offloaded-segment-read-before-copy", DP + "publishing.py", "            self.published.wait(b)\n",
           "            pass\n",
           "tests/test_strict_backend.py::test_nccl_paths_on_the_strict_backend_match_world_size_1[offload-zero1]"),
    Mutant("hsdp-second-hop-not-waited", DP + "sync.py", '            wait_work(p.work, b.replica, "all_reduce")\n', "",
           "tests/test_strict_backend.py::test_nccl_paths_on_the_strict_backend_match_world_size_1[overlap-zero2-hsdp]"),
    Mutant("zero3-gather-not-waited", DP + "zero3.py",
           '        for b, full, group, work, primary in unit.pending:\n            wait_work(work, group, "all_gather")\n',
           "        for b, full, group, work, primary in unit.pending:\n",
           "tests/test_strict_backend.py::test_nccl_paths_on_the_strict_backend_match_world_size_1[moe-ep-eq-dp-zero3]"),
    Mutant("offloaded-activation-changed-in-place-unnoticed", "parallel3d/offload/activations.py",
           "        packed.check_unmodified()                   # only", "        pass                   # only",
           "tests/test_activation_offload.py::test_prefetch_goes_one_block_ahead_and_kept_tensors_come_back_as_themselves"),
    Mutant("activation-used-before-its-copy", "parallel3d/offload/activations.py",
           "        dev, ticket = packed.up\n        ticket.wait()\n", "        dev, ticket = packed.up\n",
           "tests/test_activation_offload.py::test_offload_is_exact_and_moves_activations[tp-pp-sp-selective]"),
    # ---- MoE ----
    Mutant("balancing-bias-wrong-way", MOE + "router.py", "torch.sign(load.mean() - load)",
           "torch.sign(load - load.mean())", "tests/test_moe_router.py::test_bias_update_moves_load_towards_balance"),
    Mutant("aux-loss-f-sums-to-k", MOE + "router.py", "f = counts.float() / (top_k * tokens)", "f = counts.float() / tokens",
           "tests/test_moe_router.py::test_aux_loss_balanced_is_one_and_matches_hugging_face"),
    Mutant("aux-scope-global-not-reduced", MOE + "layer.py",
           'scoped = self.aux_scope == "global" and self.dp_cp.size > 1', "scoped = False",
           "tests/test_moe_parity.py::test_moe_parity[ep2]"),
    Mutant("capacity-in-rank-order-under-cp", MOE + "router.py",
           "keep_sorted = capacity_keep_mask(all_idx[:, order], capacity, num_experts)",
           "keep_sorted = capacity_keep_mask(all_idx, capacity, num_experts)",
           "tests/test_moe_parity.py::test_moe_parity[tp2-cp2-ep2-sp-capacity]"),
    Mutant("z-loss-not-squared", MOE + "router.py", "torch.logsumexp(logits, dim=-1).square().sum()",
           "torch.logsumexp(logits, dim=-1).abs().sum()", "tests/test_moe_router.py::test_z_loss_and_sigmoid_balance_probs"),
    Mutant("sequence-balance-f-scale", MOE + "router.py", "f = stats[:, e:].detach() * (e / (top_k * seq_len))",
           "f = stats[:, e:].detach() * (e / seq_len)",
           "tests/test_deepseek_units.py::test_sequence_balance_loss_is_the_reports_formula"),
    Mutant("mtp-loss-not-averaged-over-depth", "models/moe.py", "return total * (self.cfg.mtp_loss_coef / len(self.mtp))",
           "return total * self.cfg.mtp_loss_coef",
           "tests/test_deepseek_units.py::test_multi_token_prediction_loss_is_the_reports_formula"),
    # ---- Muon ----
    Mutant("muon-adjust-lr-transposed", DP + "muon.py", "return lr * math.sqrt(max(1, rows / cols))",
           "return lr * math.sqrt(max(1, cols / rows))", "tests/test_muon.py::test_fused_parts_are_orthogonalised_one_by_one"),
    Mutant("muon-parts-offsets-global", DP + "muon.py", "        start += local * cols\n", "        start += part * cols\n",
           "tests/test_muon.py::test_fused_parts_split_over_tp_are_orthogonalised_one_by_one"),
    Mutant("muon-shape-of-the-tp-shard", DP + "muon_step.py",
           "return m.full if self.gather and m.split is not None else (m.rows, m.cols)", "return (m.rows, m.cols)",
           "tests/test_muon.py::test_layout_parity_through_trainer[tp2-gather]"),
    Mutant("muon-lr-ignores-the-schedule", DP + "muon_step.py",
           "return lr if not self.muon_lr else self.muon_lr * lr / self.base_lr",
           "return lr if not self.muon_lr else self.muon_lr", "tests/test_muon.py::test_muon_lr_follows_the_schedule_of_lr"),
    Mutant("muon-always-nesterov", DP + "muon_step.py", "c.muon_momentum, c.muon_nesterov, c.muon_ns_steps",
           "c.muon_momentum, True, c.muon_ns_steps",
           "tests/test_muon.py::test_world1_equals_torch_muon_and_adamw[fp32-plain-nodecay]"),
    # ---- lossy communication ----
    Mutant("powersgd-residual-unscaled", DP + "compression.py", "_write(res, b, s, m - approx * inv)",
           "_write(res, b, s, m - approx)", "tests/test_compression.py::test_error_feedback_keeps_the_whole_gradient[0-powersgd]"),
    Mutant("topk-residual-keeps-sent-values", DP + "compression.py",
           "        res[idx] = 0                                          # e_i: what was not sent\n", "",
           "tests/test_compression.py::test_error_feedback_keeps_the_whole_gradient[0-topk]"),
    Mutant("qwz-quantises-with-the-unrounded-scale", DP + "quantize.py",
           "    scale = scale.to(scale_dtype).float()  # quantise with the scale the receiver will see\n", "",
           "tests/test_zeropp.py::test_quantize_error_is_half_a_step_per_block[scale_dtype1]"),
    Mutant("hpz-secondary-from-the-wrong-slice", DP + "zero3.py",
           "self.secondary[id(b)] = full[node.rank * part: (node.rank + 1) * part].clone()",
           "self.secondary[id(b)] = full[0: part].clone()", "tests/test_zeropp.py::test_hpz_is_exact_through_trainer[hpz]"),
    Mutant("fp8-weight-amax-not-reduced-over-tp", TP + "fp8.py",
           "return _cast(weight, axis, weight_reduce_group(kind, group, axis), E4M3, _backend(casts), col_major)",
           "return _cast(weight, axis, None, E4M3, _backend(casts), col_major)",
           "tests/test_fp8_gather.py::test_fp8_gather_is_bit_exact_and_halves_the_gather_bytes[rowwise-dp2-tp2-sp]"),
    # ---- data, evaluation, schedules ----
    Mutant("every-epoch-in-epoch-0s-order", "parallel3d/training/data.py", "np.random.default_rng([self.seed, epoch])",
           "np.random.default_rng([self.seed, 0])", "tests/test_data.py::test_epochs_cover_every_sample_once"),
    Mutant("eos-starts-the-next-document", "parallel3d/context_parallel/documents.py",
           "    return torch.cumsum(is_eos, dim=1) - is_eos\n", "    return torch.cumsum(is_eos, dim=1)\n",
           "tests/test_documents.py::test_document_ids_and_positions"),
    Mutant("positions-never-restart", "parallel3d/training/trainer.py",
           "        if reset_positions:\n            positions = document_positions(doc)",
           "        if False:\n            positions = document_positions(doc)",
           "tests/test_documents_layouts.py::test_positions_restart_without_masking"),
    Mutant("evaluation-shuffled", "parallel3d/training/trainer.py", "cfg.train.seed, shuffle=False)",
           "cfg.train.seed, shuffle=True)",
           "tests/test_trainer_regressions.py::test_evaluate_reads_the_first_batches_of_the_file_in_order"),
    Mutant("evaluation-loss-not-summed-over-pp", "parallel3d/training/trainer.py",
           "        comm.all_reduce(total, ctx.pp)\n        return read_float(total", "        return read_float(total",
           "tests/test_pipeline_vshape_trainer.py::test_v_schedules_match_world_size_1[2-2-zb-v-true]"),
    Mutant("cosine-one-step-ahead", "parallel3d/training/lr_schedule.py", "min(1.0, (step - warmup) / span)",
           "min(1.0, (step - warmup + 1) / span)", "tests/test_metrics.py::test_lr_warmup_peak_cosine_end"),
    Mutant("fp16-scale-grows-a-step-late", DP + "precision.py", "self.good_steps >= self.window",
           "self.good_steps > self.window", "tests/test_precision.py::test_fp16_overflow_skips_on_all_ranks[inject_inf_step]"),
    # ---- the planner: the bytes and host reads of the whole step from a shortened dry run ----
    Mutant("planner-scales-the-tail-bytes-too", "parallel3d/planner/estimate.py",
           "        out[key] = int(total - inside + inside * m / m_run)", "        out[key] = int(total * m / m_run)",
           "tests/test_planner_accuracy.py::test_compare_prints_the_plan_beside_a_real_cpu_run"),
    Mutant("planner-per-layer-syncs-not-scaled", "parallel3d/planner/estimate.py",
           "n * m // m_run if key in PER_LAYER else n", "n",
           "tests/test_host_syncs.py::test_jsonl_rows_and_plan_json_report_host_syncs"),
    # ---- Hugging Face checkpoints ----
    Mutant("llama3-rope-scaling-not-imported", "models/hf_llama.py",
           '    scaling = hf.get("rope_scaling") or (rope if rope.get("rope_type") == "llama3" else None)',
           "    scaling = None", "tests/test_hf_parity.py::test_import_logits_match_and_export_round_trips[llama3-rope-scaling]"),
    Mutant("llama3-rope-scaling-not-exported", "models/hf_llama.py", '    if m.get("rope_scaling"):\n        rope = {',
           "    if False:\n        rope = {",
           "tests/test_hf_parity.py::test_import_logits_match_and_export_round_trips[llama3-rope-scaling]"),
    Mutant("yarn-range-always-truncated", "models/mla.py", '    if scaling.get("truncate", True):\n', "    if True:\n",
           "tests/test_deepseek_hf.py::test_import_logits_and_loss_match_then_export_round_trips[yarn_explicit]"),
    Mutant("yarn-explicit-attention-factor-ignored", "models/mla.py", '    attention_factor = scaling.get("attention_factor")\n',
           "    attention_factor = None\n",
           "tests/test_deepseek_hf.py::test_import_logits_and_loss_match_then_export_round_trips[yarn_explicit]"),
    Mutant("yarn-betas-swapped", "models/mla.py", "    low, high = dim_of(beta_fast), dim_of(beta_slow)",
           "    low, high = dim_of(beta_slow), dim_of(beta_fast)",
           "tests/test_deepseek_hf.py::test_import_logits_and_loss_match_then_export_round_trips[plain_q_yarn]"),
    Mutant("qk-norms-swapped", "models/llama.py", "            q, k = self.q_norm(q), self.k_norm(k)  # per head",
           "            q, k = self.k_norm(q), self.q_norm(k)  # per head",
           "tests/test_qwen3_hf.py::test_import_logits_loss_and_export_round_trip[qwen3-False-{}]"),
    Mutant("fused-gate-up-swapped", "models/hf_experts.py", "    gate, up = t.chunk(2, dim=1)  # (E, f, h) each",
           "    up, gate = t.chunk(2, dim=1)  # (E, f, h) each", "tests/test_moe_hf.py::test_in_memory_fused_names_map_like_saved_files"),
    Mutant("mixtral-w1-w3-swapped", "models/hf_mixtral.py", '_PROJ_TO_W = {"gate_proj": "w1", "up_proj": "w3"',
           '_PROJ_TO_W = {"gate_proj": "w3", "up_proj": "w1"',
           "tests/test_moe_hf.py::test_import_logits_match_and_export_round_trips[False]"),
    # ---- checkpoints ----
    Mutant("scaler-window-reset-on-resume", DP + "precision.py", '        self.good_steps = int(d.get("good_steps", 0))\n',
           "        self.good_steps = 0\n", "tests/test_checkpoint_io.py::test_fp16_loss_scaler_resumes_mid_window"),
    Mutant("other-data-stream-accepted", "parallel3d/training/data.py",
           '        for key in ("seed", "global_batch_size", "num_samples", "shuffle"):\n', "        for key in ():\n",
           "tests/test_checkpoint_io.py::test_other_data_stream_is_refused"),
    Mutant("compression-residuals-not-loaded", "parallel3d/checkpoint/load.py",
           "        if same_layout:\n            _load_local_state", "        if False:\n            _load_local_state",
           "tests/test_compression.py::test_residuals_are_checkpointed"),
    Mutant("state-buffers-not-loaded", "parallel3d/checkpoint/load.py", "        for name, b in state_buffers(chunk):",
           "        for name, b in []:", "tests/test_deepseek_hf.py::test_import_logits_and_loss_match_then_export_round_trips[q_lora]"),
    # ---- bad input, before any rank hangs ----
    Mutant("ulysses-heads-unchecked", "parallel3d/context_parallel/ulysses.py",
           "        return cp // hk\n    raise", "        return cp // hk\n    return 1\n    raise",
           "tests/test_cp_attention.py::test_bad_inputs_raise_clear_errors"),
    Mutant("cp-sequence-length-unchecked", "parallel3d/context_parallel/sharding.py", "    if cp > 1 and seq_len % (2 * cp):",
           "    if False:", "tests/test_cp_sharding.py::test_sequence_not_divisible_by_2cp_is_a_clear_error"),
    Mutant("experts-over-ep-unchecked", MOE + "experts.py", "    if num_experts % ep:", "    if False:",
           "tests/test_moe_dispatch.py::test_bad_expert_configs"),
]


def copy_tree(dst: Path) -> None:
    """The working tree as it is (tracked and untracked files git does not ignore), without build outputs."""
    names = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, capture_output=True,
                           check=True).stdout.decode().split("\0")
    for name in filter(None, names):
        src = ROOT / name
        if src.is_symlink() or src.is_file():   # (parallel3d/kernels and parallel3d/models are links)
            (dst / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst / name, follow_symlinks=False)


def run_pytest(tree: Path, tests: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", *tests], cwd=tree, capture_output=True, text=True,
                          timeout=1800)


def main(argv: list[str]) -> int:
    chosen = [m for m in MUTANTS if not argv or m.id in argv]
    unknown = set(argv) - {m.id for m in MUTANTS}
    if unknown:
        print(f"error: no mutant named {', '.join(sorted(unknown))}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="mutants-") as d:
        tree = Path(d)
        copy_tree(tree)
        clean = run_pytest(tree, sorted({m.test for m in chosen}))
        if clean.returncode != 0:
            print("error: the named tests fail without any mutant:\n" + clean.stdout[-3000:], file=sys.stderr)
            return 1
        bad = []
        for m in chosen:
            path = tree / m.file
            source = path.read_text()
            if source.count(m.old) != 1:
                bad.append(m.id)
                print(f"{m.id:48} STALE ({source.count(m.old)} matches in {m.file})", flush=True)
                continue
            path.write_text(source.replace(m.old, m.new))
            t0 = time.monotonic()
            try:
                result = run_pytest(tree, [m.test])
            finally:
                path.write_text(source)
            killed = result.returncode == 1   # 1: tests failed (2-5: interrupted, usage, nothing collected)
            if not killed:
                bad.append(m.id)
            print(f"{m.id:48} {'killed' if killed else f'SURVIVED (pytest exit {result.returncode})'} "
                  f"{time.monotonic() - t0:5.0f} s", flush=True)
    print(f"{len(chosen) - len(bad)} of {len(chosen)} mutants killed" + (f"; not: {', '.join(bad)}" if bad else ""))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
