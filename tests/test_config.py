"""Typed config: YAML + dotted overrides, round trip, and one clear message per invalid combination."""
from __future__ import annotations

import os
import sys
import warnings

import pytest

from parallel3d.models.config import ModelConfig
from parallel3d.training.config import ConfigError, ExperimentConfig, config_from_dict, load_config, save_yaml, to_dict
from parallel3d.training.validate import ConfigWarning, resolve_and_validate

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PRESETS = {"tiny": 4, "llama3_8b": 8, "llama3_70b": 32, "llama3_405b": 8192, "mixtral_8x7b": 32, "deepseek_moe": 8,
           "qwen3_8b": 8, "qwen3_30b_a3b": 16, "qwen3_235b_a22b": 256,
           "llama_100m": 1}


def cfg(*overrides: str) -> ExperimentConfig:
    return load_config(None, list(overrides), ModelConfig)


def test_defaults_and_override_types():
    c = cfg("parallel.tp=2", "train.lr=3e-4", "parallel.sp=true", "model.rope_scaling.factor=8",
            "train.precision=bf16", "data.path=tokens.npy", "log.peak_flops=1e12",
            "parallel.layers_per_stage=[1, 1]", "model.extra={a: 1}", "train.warmup_steps=1e1")
    assert c.parallel.tp == 2 and isinstance(c.parallel.tp, int)
    assert c.train.lr == 3e-4 and isinstance(c.train.lr, float)
    assert c.parallel.sp is True
    assert c.model.rope_scaling == {"factor": 8}
    assert c.train.precision == "bf16" and c.data.path == "tokens.npy"
    assert c.log.peak_flops == 1e12
    assert c.parallel.layers_per_stage == [1, 1]
    assert c.model.extra == {"a": 1}
    assert c.train.warmup_steps == 10
    assert isinstance(c.model, ModelConfig)


@pytest.mark.parametrize("text,expected", [("true", True), ("false", False), ("1", True), ("0", False)])
def test_bool_parsing(text, expected):
    assert cfg(f"parallel.sp={text}").parallel.sp is expected


def test_optional_null_and_bad_types():
    assert cfg("data.path=x", "data.path=null").data.path is None
    with pytest.raises(ConfigError, match="parallel.tp: expected int"):
        cfg("parallel.tp=two")
    with pytest.raises(ConfigError, match="parallel.sp: expected bool"):
        cfg("parallel.sp=maybe")
    with pytest.raises(ConfigError, match="not of the form key=value"):
        cfg("parallel.tp")


def test_unknown_keys_name_key_and_list_valid():
    with pytest.raises(ConfigError) as e:
        cfg("parallel.tpp=2")
    msg = str(e.value)
    assert "parallel.tpp" in msg and "did you mean 'tp'" in msg and "cp_mode" in msg
    with pytest.raises(ConfigError, match="unknown config key 'optim'"):
        cfg("optim.lr=1")
    with pytest.raises(ConfigError, match="unknown config key 'model.hidden'"):
        cfg("model.hidden=1")
    with pytest.raises(ConfigError, match="not a section"):
        cfg("train.lr.x=1")


def test_unknown_key_in_yaml(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("train:\n  lr: 1.0e-3\n  learning_rate: 2\n")
    with pytest.raises(ConfigError, match="train.learning_rate"):
        load_config(str(p), [], ModelConfig)
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(str(tmp_path / "missing.yaml"), [], ModelConfig)


def test_yaml_then_overrides_round_trip(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("parallel:\n  tp: 4\ntrain:\n  lr: 3e-4\nmodel:\n  rope_scaling: {factor: 8.0}\n")
    c = load_config(str(p), ["parallel.tp=2", "model.rope_scaling.low_freq_factor=1.0"], ModelConfig)
    assert c.parallel.tp == 2 and c.train.lr == 3e-4    # YAML 1.1 reads 3e-4 as a string: coerced
    assert c.model.rope_scaling == {"factor": 8.0, "low_freq_factor": 1.0}
    out = tmp_path / "saved.yaml"
    save_yaml(c, str(out))
    assert load_config(str(out), [], ModelConfig) == c
    assert config_from_dict(to_dict(c), ModelConfig) == c


def test_resolve_fills_dp_and_microbatches_without_mutating():
    c = cfg("parallel.tp=2", "train.global_batch_size=8", "train.micro_batch_size=2")
    r = resolve_and_validate(c, 4)
    assert (r.parallel.dp, r.train.num_microbatches) == (2, 2)
    assert c.parallel.dp == 0 and c.train.num_microbatches == 0
    assert resolve_and_validate(cfg("parallel.sp=true"), 1).parallel.sp is False   # no-op at tp=1


def bad(world: int, *overrides: str, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        resolve_and_validate(cfg(*overrides), world)


MOE = ("model.num_experts=4", "model.moe_top_k=2")


@pytest.mark.parametrize("world,overrides,match", [
    (8, ["parallel.tp=3"], r"world size 8 is not divisible by tp\*cp\*pp=3\*1\*1=3"),
    (8, ["parallel.tp=2", "parallel.dp=2"], r"tp\*cp\*dp\*pp=2\*1\*2\*1=4 does not equal the world size 8"),
    (8, ["parallel.tp=8", "model.hidden_size=96", "model.num_heads=6", "model.num_kv_heads=2",
         "train.global_batch_size=1"], r"model.num_heads=6 is not divisible by parallel.tp=8"),
    (6, ["parallel.tp=3", "model.num_heads=6", "model.num_kv_heads=2", "model.hidden_size=96",
         "train.global_batch_size=2"], r"model.num_kv_heads=2 and parallel.tp=3: one must divide the other"),
    (4, ["parallel.tp=2", "parallel.ep=4", "parallel.etp=2", *MOE],
     r"parallel.ep\*etp=4\*2=8 must divide tp\*cp\*dp=2\*1\*2=4"),
    (2, ["parallel.etp=2"], r"parallel.etp=2 needs a MoE model"),
    (2, ["parallel.etp=2", *MOE, "model.moe_ffn_hidden_size=25"],
     r"model.moe_ffn_hidden_size=25 \(the expert ffn\) is not divisible by parallel.etp=2"),
    (4, ["parallel.tp=2", "parallel.ep=2", "parallel.etp=2", "parallel.dp_shard=1", "parallel.zero=2", *MOE],
     r"which parallel.ep\*etp=2\*2=4 must divide"),
    (2, ["parallel.etp=0", *MOE], r"parallel.etp must be >= 1"),
    (2, ["parallel.ep=2"], r"parallel.ep=2 needs a MoE model"),
    (6, ["parallel.ep=3", "train.global_batch_size=6", *MOE], r"model.num_experts=4 is not divisible by parallel.ep=3"),
    (1, ["train.global_batch_size=6", "train.micro_batch_size=4"],
     r"train.global_batch_size=6 is not divisible by micro_batch_size\*dp = 4\*1 = 4"),
    (2, ["parallel.cp=2", "train.seq_len=126"], r"train.seq_len: sequence length 126 is not divisible by 2\*cp = 4"),
    (2, ["parallel.tp=2", "parallel.sp=true", "train.seq_len=127"],
     r"train.seq_len=127 must be divisible by tp\*cp = 2\*1 with sequence parallelism"),
    (4, ["parallel.tp=2", "parallel.cp=2", "parallel.cp_mode=ulysses", "model.num_heads=6",
         "model.num_kv_heads=2", "model.hidden_size=96"], r"cp_mode=ulysses needs the heads per tp rank"),
    (2, ["parallel.pp=2", "parallel.schedule=interleaved"], r"needs parallel.virtual_stages >= 2"),
    (2, ["parallel.pp=2", "parallel.schedule=interleaved", "parallel.virtual_stages=2", "model.num_layers=4",
         "train.global_batch_size=3"], r"needs the number of microbatches \(3\) divisible by parallel.pp=2"),
    (2, ["parallel.pp=2", "parallel.virtual_stages=2"], r"virtual_stages=2 needs schedule=interleaved"),
    (1, ["parallel.pp=1", "parallel.schedule=interleaved", "parallel.virtual_stages=2", "model.num_layers=4"],
     r"schedule=interleaved needs parallel.pp >= 2"),
    (4, ["parallel.pp=4", "model.num_layers=1"], r"cannot split 1 layers into 4 pipeline stages"),
    (2, ["parallel.pp=2", "parallel.layers_per_stage=[1,2]"], r"sums to 3, but the model has 2 layers"),
    (2, ["parallel.pp=2", "parallel.layers_per_stage=[2]"], r"layers_per_stage has 1 entries but there are 2 pipeline stages"),
    (1, ["train.precision=fp8"], r"train.precision='fp8' is not one of fp32, bf16, fp16"),
    (1, ["parallel.zero=4"], r"parallel.zero=4 is not one of 0, 1, 2, 3"),
    (1, ["parallel.cp_mode=tree"], r"parallel.cp_mode='tree' is not one of"),
    (1, ["parallel.schedule=dualpipe"], r"parallel.schedule='dualpipe' is not one of"),
    (1, ["train.activation_checkpointing=some"], r"train.activation_checkpointing='some'"),
    (1, ["train.nan_policy=ignore"], r"train.nan_policy='ignore'"),
    (1, ["train.seq_len=512"], r"train.seq_len=512 exceeds model.max_seq_len=256"),
    (1, ["train.num_microbatches=3"], r"train.num_microbatches=3 disagrees"),
    (1, ["model.num_heads=3"], r"model.hidden_size=64 is not divisible by model.num_heads=3"),
    (1, ["model.num_experts=2", "model.moe_top_k=3"], r"model.moe_top_k=3 must be in \[1"),
])
def test_invalid_combinations(world, overrides, match):
    bad(world, *overrides, match=match)


def test_valid_advanced_layouts():
    r = resolve_and_validate(cfg("parallel.tp=4", "model.num_kv_heads=2", "parallel.sp=true"), 4)
    assert r.parallel.sp and r.parallel.dp == 1          # tp > kv heads: replicated kv heads
    r = resolve_and_validate(cfg("parallel.tp=2", "parallel.cp=2", "parallel.pp=2", "parallel.ep=2",
                                 "model.num_layers=4", "train.global_batch_size=4", *MOE), 8)
    assert (r.parallel.dp, r.train.num_microbatches) == (1, 4)
    # parallel folding: EP over TP x DP (ep = tp*dp at etp=1), and a config written before parallel.etp
    # (ep dividing dp*cp) still validates, now with whole experts per rank
    r = resolve_and_validate(cfg("parallel.tp=2", "parallel.ep=8", "model.num_experts=8", "model.moe_top_k=2",
                                 "train.global_batch_size=4"), 8)
    assert (r.parallel.dp, r.parallel.ep, r.parallel.etp) == (4, 8, 1)
    r = resolve_and_validate(cfg("parallel.tp=2", "parallel.ep=2", *MOE), 4)
    assert (r.parallel.dp, r.parallel.ep, r.parallel.etp) == (2, 2, 1)


def _config_warnings(world: int, *overrides: str) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        resolve_and_validate(cfg(*overrides), world)
    return [str(w.message) for w in caught if issubclass(w.category, ConfigWarning)]


def test_experts_replicated_over_tp_warn():
    """etp=1 ep=1 under TP holds every expert whole on each TP rank: valid, but tp times the expert weights and
    a MoE layer's activations 1.64x / 3.28x their 1/tp share at tp 2 / 4 (tests/test_tp_region.py's measure):
    one warning naming the keys and the fold that avoids it, no error."""
    msgs = _config_warnings(4, "parallel.tp=2", "parallel.sp=true", *MOE)
    assert len(msgs) == 1 and "parallel.ep=1 parallel.etp=1 at parallel.tp=2" in msgs[0]
    assert "set parallel.ep=2 (EP folded over the TP ranks) or parallel.etp=2" in msgs[0]
    assert _config_warnings(8, "parallel.tp=4", "parallel.ep=2", *MOE)        # ep*etp=2 < tp=4: still copies
    for ok in (("parallel.tp=2", "parallel.ep=2", *MOE), ("parallel.tp=2", "parallel.etp=2", *MOE),
               ("parallel.tp=2", "parallel.ep=4", *MOE), ("parallel.ep=2", *MOE), ("parallel.tp=2",)):
        assert not _config_warnings(4, *ok), ok


def test_under_torchrun_rank_0_alone_prints_a_config_warning(monkeypatch):
    """launch/common.load_and_validate: every rank validates the same config, so, as with its errors, only rank 0
    shows the warning (not once per rank of the job)."""
    sys.path.insert(0, os.path.join(ROOT, "launch"))
    import common
    overrides = ["parallel.tp=2", "parallel.sp=true", *MOE]
    seen = {}
    for rank in ("0", "1"):
        monkeypatch.setenv("RANK", rank)
        monkeypatch.setenv("WORLD_SIZE", "4")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            common.load_and_validate(os.path.join(ROOT, "configs", "tiny.yaml"), overrides)
        seen[rank] = [w for w in caught if issubclass(w.category, ConfigWarning)]
    assert len(seen["0"]) == 1 and not seen["1"]


@pytest.mark.parametrize("name,world", sorted(PRESETS.items()))
def test_presets_load_and_validate(name, world):
    c = load_config(os.path.join(ROOT, "configs", f"{name}.yaml"), [], ModelConfig)
    r = resolve_and_validate(c, world)
    assert r.parallel.tp * r.parallel.cp * r.parallel.pp * r.parallel.dp == world
    assert r.train.num_microbatches >= 1


def test_tiny_preset_is_the_cpu_demo():
    r = resolve_and_validate(load_config(os.path.join(ROOT, "configs", "tiny.yaml"), [], ModelConfig), 4)
    assert (r.parallel.tp, r.parallel.dp) == (2, 2)
    assert r.data.path is None and r.train.precision == "fp32" and r.model.vocab_size == 256


def test_fast_path_choices_are_refused_clearly():
    """model.expert_impl / model.attention outside their choices, and flash_attn without its package, end
    in one ConfigError before any process group exists."""
    import importlib.util

    from ckpt_helpers import make_config
    from parallel3d.training.config import ConfigError

    with pytest.raises(ConfigError, match="expert_impl"):
        make_config(["model.expert_impl=fastest"], 1)
    with pytest.raises(ConfigError, match="attention"):
        make_config(["model.attention=xformers"], 1)
    if importlib.util.find_spec("flash_attn") is None:
        with pytest.raises(ConfigError, match="pip install flash-attn"):
            make_config(["model.attention=flash_attn"], 1)


def test_overlap_param_gather_needs_zero_1_or_2():
    assert resolve_and_validate(cfg("parallel.zero=2", "parallel.overlap_param_gather=true"), 2).parallel.overlap_param_gather
    for zero in (0, 3):
        with pytest.raises(ConfigError, match="overlap_param_gather=true needs parallel.zero=1 or 2"):
            resolve_and_validate(cfg(f"parallel.zero={zero}", "parallel.overlap_param_gather=true"), 2)


def test_copied_config_equals_a_deep_copy_and_shares_nothing_mutable():
    """training.config.copied (what resolve_and_validate copies with, for speed) against copy.deepcopy."""
    import copy

    from parallel3d.models.config import ModelConfig
    from parallel3d.training.config import copied, load_config

    cfg = load_config("configs/tiny.yaml", ["parallel.layers_per_stage=[1,1]", "model.extra.tags=[1,2]"],
                      ModelConfig)
    got = copied(cfg)
    assert got == copy.deepcopy(cfg) and type(got) is type(cfg)
    assert got.parallel.layers_per_stage == [1, 1] and got.model.extra == {"tags": [1, 2]}
    for a, b in ((got, cfg), (got.model, cfg.model), (got.parallel, cfg.parallel), (got.train, cfg.train),
                 (got.parallel.layers_per_stage, cfg.parallel.layers_per_stage), (got.model.extra, cfg.model.extra),
                 (got.model.extra["tags"], cfg.model.extra["tags"])):
        assert a is not b
    got.model.extra["tags"].append(3)
    assert cfg.model.extra == {"tags": [1, 2]}
