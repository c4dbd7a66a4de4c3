"""Reading and writing experiment configs: YAML presets plus dotted `key=value` overrides (every key:
docs/configuration.md). The sections themselves are typed dataclasses in `config_sections.py`, re-exported here.

The model section is whatever dataclass the caller passes as `model_cls` (normally
`models.config.ModelConfig`): `parallel3d` must not import `models`, so the loader is generic and what the
library reads of a model config is declared by `TransformerShape`.

Every value is parsed by its field's type, so `parallel.sp=true`, `train.lr=3e-4` and
`model.rope_scaling.factor=8` all land typed, and a misspelt key fails at once, naming the key and the
valid ones. `validate.resolve_and_validate` then checks the whole config against the world size, with one clear
`ConfigError` per broken constraint, before any process group exists (so no rank can hang on bad input).
"""
from __future__ import annotations

import copy
import dataclasses
import difflib
import typing
from typing import Any, Optional, Sequence

import yaml

from parallel3d.training.config_sections import (  # noqa: F401  (re-exported: callers import them here)
    CheckpointConfig, ConfigError, DataConfig, ExperimentConfig, LogConfig, ParallelConfig, TrainConfig,
    TransformerShape, timeline_window)


_SHARED = frozenset({int, float, str, bool, type(None)})


def copied(value: Any) -> Any:
    """A deep copy of a config (or of any of its values): dataclasses, lists, tuples and dicts copied
    through, numbers, strings and None shared, anything else deep-copied. What copy.deepcopy gives, 5x
    faster: `launch/plan.py --search` validates (and so copies) one config per layout it considers, tens
    of thousands of them for 70B on 64 GPUs."""
    kind = type(value)
    if kind in _SHARED:
        return value
    if kind is list:
        return [v if type(v) in _SHARED else copied(v) for v in value]
    if kind is tuple:
        return tuple(v if type(v) in _SHARED else copied(v) for v in value)
    if kind is dict:
        return {k: v if type(v) in _SHARED else copied(v) for k, v in value.items()}
    if dataclasses.is_dataclass(kind) and hasattr(value, "__dict__"):
        new = object.__new__(kind)
        new.__dict__.update({k: v if type(v) in _SHARED else copied(v) for k, v in value.__dict__.items()})
        return new
    return copy.deepcopy(value)


# ----------------------------------------------------------------------------- typed parsing

def _section_types(model_cls: type) -> dict[str, type]:
    hints = typing.get_type_hints(ExperimentConfig)
    hints["model"] = model_cls
    return hints


def _field_types(cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _unknown(key: str, valid: Sequence[str]) -> ConfigError:
    name = key.rsplit(".", 1)[-1]
    close = difflib.get_close_matches(name, valid, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return ConfigError(f"unknown config key {key!r}{hint}; valid keys here: {', '.join(valid)}")


def _yaml_scalar(text: str) -> Any:
    """YAML-parse an override value; YAML 1.1 reads '3e-4' as a string, so retry it as a float."""
    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ConfigError(f"cannot parse value {text!r}: {e}") from None
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return value
    return value


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Convert `value` (from YAML, or an override string) to type `tp`, or raise naming `key`."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is typing.Union:
        inner = [a for a in args if a is not type(None)]
        if value is None or (isinstance(value, str) and value.strip().lower() in ("null", "none", "~", "")):
            return None
        return _coerce(value, inner[0], key)
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, key)
    if tp is Any:
        return _yaml_scalar(value) if isinstance(value, str) else value
    is_list, is_dict = tp is list or origin is list, tp is dict or origin is dict
    if isinstance(value, str) and (tp in (int, float, bool) or is_list or is_dict):
        value = _yaml_scalar(value)          # "true", "1", "3e-4", "[1, 2]", "{factor: 8}"
    if tp is bool and type(value) is int and value in (0, 1):
        value = bool(value)
    elif tp is int and type(value) is float and value.is_integer():
        value = int(value)
    elif tp is float and type(value) is int:
        value = float(value)
    ok = isinstance(value, (list, tuple)) if is_list else isinstance(value, dict) if is_dict \
        else type(value) is tp if tp in (int, float, bool, str) else True
    if not ok:
        raise ConfigError(f"{key}: expected {getattr(tp, '__name__', tp)}, got {value!r}")
    if is_list:
        return [_coerce(v, args[0], f"{key}[{i}]") if args else v for i, v in enumerate(value)]
    return dict(value) if is_dict else value


def _build(cls: type, data: Any, prefix: str) -> Any:
    """Construct dataclass `cls` from a mapping, rejecting unknown keys and coercing each value."""
    if data is None:
        data = {}
    if dataclasses.is_dataclass(data) and not isinstance(data, type):
        data = dataclasses.asdict(data)
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix}: expected a mapping, got {data!r}")
    types = _field_types(cls)
    kwargs = {}
    for k, v in data.items():
        if k not in types:
            raise _unknown(f"{prefix}.{k}", list(types))
        kwargs[k] = _coerce(v, types[k], f"{prefix}.{k}")
    return cls(**kwargs)


def _apply_override(raw: dict, item: str, model_cls: type) -> None:
    """Set one `a.b.c=value` into the raw nested dict, checking the key path against the types."""
    if "=" not in item:
        raise ConfigError(f"override {item!r} is not of the form key=value (e.g. parallel.tp=2)")
    key, text = item.split("=", 1)
    parts = key.strip().split(".")
    types: Optional[dict[str, Any]] = _section_types(model_cls)
    node = raw
    for i, name in enumerate(parts):
        path = ".".join(parts[: i + 1])
        last = i == len(parts) - 1
        if types is None:                    # inside a free-form dict field (e.g. model.rope_scaling)
            if last:
                node[name] = _yaml_scalar(text)
                return
            child = node.get(name)
            if child is None:
                node[name] = child = {}
            elif not isinstance(child, dict):
                raise ConfigError(f"{path} is not a mapping; cannot set {key!r}")
            node = child
            continue
        if name not in types:
            raise _unknown(path, list(types))
        tp = types[name]
        if typing.get_origin(tp) is typing.Union:
            tp = [a for a in typing.get_args(tp) if a is not type(None)][0]
        if last:
            node[name] = text
            return
        if dataclasses.is_dataclass(tp):
            types = _field_types(tp)
        elif tp is dict or typing.get_origin(tp) is dict:
            types = None
        else:
            raise ConfigError(f"{path} is a {getattr(tp, '__name__', tp)}, not a section; "
                              f"cannot set {key!r}")
        child = node.get(name)
        if not isinstance(child, dict):
            node[name] = child = {}
        node = child


def config_from_dict(data: dict, model_cls: type, overrides: Sequence[str] = ()) -> ExperimentConfig:
    """Build an ExperimentConfig from a nested dict (e.g. checkpoint metadata) plus overrides."""
    raw = copy.deepcopy(data) if data else {}
    if not isinstance(raw, dict):
        raise ConfigError(f"config must be a mapping of sections, got {type(raw).__name__}")
    for item in overrides:
        _apply_override(raw, item, model_cls)
    types = _section_types(model_cls)
    unknown = [k for k in raw if k not in types]
    if unknown:
        raise _unknown(unknown[0], list(types))
    return ExperimentConfig(**{k: _build(types[k], raw.get(k), k) for k in types})


def load_config(path: Optional[str], overrides: Sequence[str], model_cls: type) -> ExperimentConfig:
    """Read the YAML file at `path` (None: all defaults) and apply dotted `key=value` overrides."""
    data: dict = {}
    if path is not None:
        try:
            with open(path) as f:
                data = yaml.safe_load(f) or {}
        except FileNotFoundError:
            raise ConfigError(f"config file {path!r} does not exist") from None
        except yaml.YAMLError as e:
            raise ConfigError(f"config file {path!r} is not valid YAML: {e}") from None
    return config_from_dict(data, model_cls, overrides)


def to_dict(cfg: ExperimentConfig) -> dict:
    """Plain nested dict (YAML/JSON-able); `config_from_dict(to_dict(c), type(c.model)) == c`."""
    return dataclasses.asdict(cfg)


def save_yaml(cfg: ExperimentConfig, path: str) -> None:
    """Write the config as YAML that `load_config` reads back to an equal config."""
    with open(path, "w") as f:
        yaml.safe_dump(to_dict(cfg), f, sort_keys=False)
