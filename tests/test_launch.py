"""The public command line end to end: pretrain/evaluate/convert_hf through subprocesses (and torchrun)."""
import json
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
SMALL = ["model.hidden_size=32", "model.num_layers=4", "model.num_heads=4", "model.num_kv_heads=2",
         "model.ffn_hidden_size=64", "train.seq_len=32", "train.global_batch_size=4", "train.micro_batch_size=1",
         "train.steps=3", "train.precision=fp32", "train.warmup_steps=1", "log.interval=1"]


def _run(args, nproc=1, timeout=240, check=True):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    env.pop("TRITON_INTERPRET", None)
    if nproc == 1:
        cmd = [sys.executable] + args
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"] + args
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    if check and out.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({out.returncode}):\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    return out


def _losses(path):
    return [json.loads(line)["loss"] for line in open(path)]


def assert_log_parity(got_path, ref_path, rtol: float = 1e-5) -> None:
    """The JSONL rows of a run vs world size 1's: loss rel `rtol` and grad_norm (which clipping and Adam
    hide from the losses when every gradient is scaled alike; tests/parity.py) rel parity.NORM_RTOL."""
    from parity import assert_grad_norms

    got, ref = _losses(got_path), _losses(ref_path)
    assert len(got) == len(ref) and all(abs(a - b) <= rtol * abs(b) for a, b in zip(got, ref)), (got, ref)
    norms = [[json.loads(line)["grad_norm"] for line in open(path)] for path in (got_path, ref_path)]
    assert_grad_norms([norms[0]], norms[1], what=str(got_path))


REQUIRED = {"step", "loss", "grad_norm", "lr", "tokens_per_s", "mfu", "peak_mem_bytes", "comm_bytes", "skipped"}


@pytest.fixture(scope="module")
def single_rank_log(tmp_path_factory):
    log = tmp_path_factory.mktemp("ws1") / "m.jsonl"
    _run(["launch/pretrain.py", "--config", "configs/tiny.yaml", "parallel.tp=1", *SMALL, f"log.jsonl={log}"])
    records = [json.loads(line) for line in open(log)]
    assert len(records) == 3 and all(REQUIRED <= set(r) for r in records)
    return log


# CI runs tp2+pp2+sp and cp2 from the command line; the other four are covered there by those (tp), by
# test_timeline_of_a_real_run (interleaved), test_hsdp's CLI run (ZeRO-3) and, for ZeRO-1 with overlapped
# gathers, by test_param_gather_overlap through the Trainer (against world size 1); make sweep runs all six
_SWEEP = pytest.mark.sweep
LAYOUTS = [pytest.param(["parallel.tp=2"], marks=_SWEEP), ["parallel.tp=2", "parallel.pp=2", "parallel.sp=true"],
           ["parallel.tp=1", "parallel.cp=2"],
           pytest.param(["parallel.tp=1", "parallel.pp=2", "parallel.schedule=interleaved",
                         "parallel.virtual_stages=2"], marks=_SWEEP),
           pytest.param(["parallel.tp=2", "parallel.zero=1", "parallel.overlap_param_gather=true"], marks=_SWEEP),
           pytest.param(["parallel.tp=1", "parallel.zero=3"], marks=_SWEEP)]


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda l: "-".join(x.split(".")[1] for x in l))
def test_layout_losses_match_world_size_1(tmp_path, single_rank_log, layout):
    log = tmp_path / "m.jsonl"
    _run(["launch/pretrain.py", "--config", "configs/tiny.yaml", *SMALL, *layout, f"log.jsonl={log}"], nproc=4)
    assert_log_parity(log, single_rank_log)


# The load-balancing loss is a product of batch statistics, so its value depends on which sequences
# form a global microbatch (dp=2 x 2 microbatches groups rows {i, 2+i}; world size 1 groups {2i, 2i+1}).
# The layout comparison therefore uses the z-loss (per token) only; the aux loss is covered by
# tests/test_moe_parity.py with identical microbatch composition.
MOE = ["model.num_experts=4", "model.moe_top_k=2", "model.z_loss_coef=0.001"]


def test_moe_expert_parallel_losses_match_world_size_1(tmp_path):
    logs = [tmp_path / "ws1.jsonl", tmp_path / "ep.jsonl"]
    _run(["launch/pretrain.py", "--config", "configs/tiny.yaml", "parallel.tp=1", *SMALL, *MOE,
          f"log.jsonl={logs[0]}"])
    # EP folded over TP x DP, whole experts (etp=1), each backward paired with the next microbatch's forward
    # (ep_overlap: the all-to-alls in turns; the plain exchange is the Trainer tests' and the sweep's)
    _run(["launch/pretrain.py", "--config", "configs/tiny.yaml", "parallel.tp=2", "parallel.ep=4", "parallel.sp=true",
          "parallel.ep_overlap=true", *SMALL, *MOE, f"log.jsonl={logs[1]}"], nproc=4)
    records = [json.loads(line) for line in open(logs[1])]
    assert any(k.startswith("moe_imbalance") for k in records[0])  # load telemetry in the metrics log
    assert records[0]["comm_bytes"]["ep.all_to_all"] > 0  # this rank's bytes per "<group>.<op>" in the step
    assert_log_parity(logs[1], logs[0])


@pytest.mark.parametrize("overrides, message, where", [
    (["parallel.tp=3"], "world size", "process"),
    (["parallel.tp=1", "model.num_heads=3", "model.num_kv_heads=3"], "num_heads", "main"),
    (["parallel.tp=1", "data.path=/nonexistent/tokens.npy"], "/nonexistent/tokens.npy", "process"),
    (["parallel.tp=1", "train.nosuchkey=1"], "nosuchkey", "main"),
    (["parallel.tp=1", "checkpoint.load_dir=/nonexistent/ckpt"], "/nonexistent/ckpt", "process"),
    (["parallel.tp=1", "parallel.timeout_s=0"], "parallel.timeout_s", "main"),
    (["parallel.tp=1", "train.optimizer=muon", "train.muon_tp_mode=rows"], "train.muon_tp_mode='rows'", "main"),
    (["parallel.tp=1", "parallel.etp=2", "model.num_experts=4", "model.moe_top_k=2"],
     "parallel.ep*etp=1*2=2 must divide tp*cp*dp=1*1*1=1", "main"),
    (["parallel.tp=1", "parallel.ep_overlap=true", "model.num_experts=4", "model.moe_top_k=2"],
     "parallel.ep_overlap=true hides the expert all-to-alls: it needs parallel.ep > 1", "main"),
    pytest.param(["parallel.tp=1", "log.tensorboard=/tmp/tb"], "pip install tensorboard", "main",
                 marks=pytest.mark.skipif(importlib.util.find_spec("tensorboard") is not None,
                                          reason="tensorboard is installed here")),
])
def test_bad_input_gives_one_clear_error(overrides, message, where, capsys, monkeypatch):
    """`process`: the command itself; `main`: pretrain.py's main in this process (what the config check
    refuses ends there before any process group exists, as in the command; 2 s less per case)."""
    if where == "process":
        out = _run(["launch/pretrain.py", "--config", "configs/tiny.yaml", *overrides], check=False, timeout=120)
        code, err = out.returncode, out.stderr
    else:
        from launch import pretrain

        def no_context(cfg, *rest):
            raise AssertionError("the config check let the bad input through")
        monkeypatch.setattr(pretrain, "build_context", no_context)
        with pytest.raises(SystemExit) as end:
            pretrain.main(["--config", "configs/tiny.yaml", *overrides])
        code, err = end.value.code, capsys.readouterr().err
    assert code == 2
    assert message in err and err.strip().startswith("error:"), err
    assert "Traceback" not in err


def test_hf_import_evaluate_and_train(tmp_path):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, intermediate_size=48, max_position_embeddings=64)
    hf = transformers.LlamaForCausalLM(cfg).eval()
    hf.save_pretrained(tmp_path / "hf")
    _run(["launch/convert_hf.py", "import", "--hf-dir", str(tmp_path / "hf"), "--out", str(tmp_path / "ckpt")])
    seq, batch = 16, 8
    tokens = np.random.default_rng(0).integers(0, 64, size=batch * seq + 1).astype(np.uint16)
    np.save(tmp_path / "tokens.npy", tokens)
    conf = str(tmp_path / "ckpt" / "config.yaml")
    out = _run(["launch/evaluate.py", "--config", conf, f"checkpoint.load_dir={tmp_path / 'ckpt'}",
                f"data.path={tmp_path / 'tokens.npy'}", f"train.seq_len={seq}", f"train.global_batch_size={batch}",
                f"train.micro_batch_size={batch}"])
    result = json.loads(out.stdout.strip().splitlines()[-1])
    t = torch.from_numpy(tokens.astype(np.int64))
    windows = torch.stack([t[i * seq: i * seq + seq + 1] for i in range(batch)])
    with torch.no_grad():
        logits = hf(windows[:, :-1]).logits
        ref = torch.nn.functional.cross_entropy(logits.flatten(0, 1), windows[:, 1:].flatten())
    assert result["tokens"] == batch * seq
    assert abs(result["loss"] - ref.item()) < 1e-4
    log = tmp_path / "train.jsonl"
    _run(["launch/pretrain.py", "--config", conf, f"checkpoint.load_dir={tmp_path / 'ckpt'}",
          f"data.path={tmp_path / 'tokens.npy'}", f"train.seq_len={seq}", "train.global_batch_size=2",
          "train.micro_batch_size=1", "train.steps=2", f"log.jsonl={log}"])
    first = _losses(log)[0]   # step 0 trains from the imported weights: loss of the first global batch
    assert first < 5.0 and abs(first - ref.item()) < 0.5


# make sweep: the import and export of Mixtral against transformers is test_moe_hf's, EP from the command line
# test_moe_expert_parallel_losses_match_world_size_1's, an imported checkpoint evaluated and trained from the
# command line test_hf_import_evaluate_and_train's (24 s of CI)
@pytest.mark.sweep
def test_imported_mixtral_evaluates_and_trains_under_expert_parallelism(tmp_path):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.MixtralConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                     num_experts_per_tok=2, max_position_embeddings=64)
    transformers.MixtralForCausalLM(cfg).save_pretrained(tmp_path / "hf")
    _run(["launch/convert_hf.py", "import", "--hf-dir", str(tmp_path / "hf"), "--out", str(tmp_path / "ckpt")])
    np.save(tmp_path / "tokens.npy", np.random.default_rng(0).integers(0, 64, size=8 * 16 + 1).astype(np.uint16))
    common = ["--config", str(tmp_path / "ckpt" / "config.yaml"), f"checkpoint.load_dir={tmp_path / 'ckpt'}",
              f"data.path={tmp_path / 'tokens.npy'}", "train.seq_len=16", "train.global_batch_size=8",
              "train.micro_batch_size=2"]
    single = json.loads(_run(["launch/evaluate.py", *common]).stdout.strip().splitlines()[-1])
    expert = json.loads(_run(["launch/evaluate.py", *common, "parallel.ep=2", "parallel.tp=2"],
                             nproc=4).stdout.strip().splitlines()[-1])
    assert single["tokens"] == expert["tokens"] == 8 * 16
    assert abs(single["loss"] - expert["loss"]) <= 1e-5 * single["loss"]
    log = tmp_path / "train.jsonl"
    _run(["launch/pretrain.py", *common, "parallel.ep=2", "train.steps=2", f"log.jsonl={log}",
          "train.global_batch_size=4", "train.micro_batch_size=1"], nproc=2)
    assert len(_losses(log)) == 2


def test_periodic_evaluation_on_held_out_file(tmp_path):
    data = np.random.default_rng(1).integers(0, 256, size=4096).astype(np.uint16)
    np.save(tmp_path / "train.npy", data)
    np.save(tmp_path / "eval.npy", data[:1024])
    log = tmp_path / "m.jsonl"
    _run(["launch/pretrain.py", "--config", "configs/tiny.yaml", "parallel.tp=1", *SMALL,
          f"data.path={tmp_path / 'train.npy'}", f"data.eval_path={tmp_path / 'eval.npy'}", "train.eval_interval=2",
          "train.eval_steps=2", "train.steps=4", f"log.jsonl={log}"])
    records = [json.loads(line) for line in open(log)]
    assert [("eval_loss" in r) for r in records] == [False, True, False, True]
    assert all(0 < r["eval_loss"] < 10 for r in records if "eval_loss" in r)


def test_timeline_of_a_real_run(tmp_path, capsys):
    """log.timeline records one step on every pipeline rank: every action of the schedule, once, in the
    schedule's order per rank, beside the same schedule simulated with the measured costs."""
    import csv

    from parallel3d.pipeline import build_schedule

    out = _run(["launch/pretrain.py", "--config", "configs/tiny.yaml", "parallel.tp=1", "parallel.pp=2",
                "parallel.schedule=interleaved", "parallel.virtual_stages=2", *SMALL,
                f"log.timeline={tmp_path / 'run.json'}", "log.timeline_step=1", "log.timeline_steps=2"], nproc=2)
    assert "timeline of step 2 (interleaved, pp=2): measured bubble" in out.stdout
    assert "the JSON keeps steps 1-2" in out.stdout
    data = json.loads((tmp_path / "run.json").read_text())
    assert data["step"] == 2 and [s["step"] for s in data["steps"]] == [1, 2]   # as the JSONL numbers them
    assert data["steps"][-1]["measured"] == data["measured"]
    schedule = build_schedule("interleaved", 2, 4, 2)
    for source, rows in (("measured", data["measured"]), ("simulated", data["simulated"]),
                         ("step 1", data["steps"][0]["measured"])):
        for rank in range(2):
            got = [(k, mb, c, peer) for r, k, mb, c, peer, _, _ in sorted((x for x in rows if x[0] == rank),
                                                                          key=lambda x: x[5])
                   if k in ("FORWARD", "BACKWARD")]
            want = [(a.kind.name, a.microbatch, a.chunk, a.peer) for a in schedule[rank] if a.kind.is_compute]
            assert got == want, (source, rank)
        assert all(e >= s for *_, s, e in rows)
    assert 0 <= data["simulated_bubble"] < 1 and 0 <= data["measured_bubble"] < 1
    _run(["launch/pretrain.py", "--config", "configs/tiny.yaml", "parallel.tp=1", "parallel.pp=2", *SMALL,
          f"log.timeline={tmp_path / 'run.csv'}"], nproc=2)
    rows = list(csv.DictReader(open(tmp_path / "run.csv")))
    assert {(r["source"], r["rank"]) for r in rows} == {(s, r) for s in ("measured", "simulated") for r in "01"}
    from launch import pretrain   # refused by the config check, in pretrain.py's main (as in the command)

    with pytest.raises(SystemExit) as bad:
        pretrain.main(["--config", "configs/tiny.yaml", "parallel.tp=1", f"log.timeline={tmp_path / 'run.txt'}"])
    assert bad.value.code == 2 and "log.timeline" in capsys.readouterr().err
    with pytest.raises(SystemExit) as bad:   # more steps than there are up to timeline_step
        pretrain.main(["--config", "configs/tiny.yaml", "parallel.tp=1", f"log.timeline={tmp_path / 'run.json'}",
                       "train.steps=3", "log.timeline_step=1", "log.timeline_steps=3"])
    assert bad.value.code == 2 and "log.timeline_steps=3 must be in [1, 2]" in capsys.readouterr().err
