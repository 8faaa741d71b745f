"""`pdserve up --models-file FILE`: the base models a cluster serves side by side, read from
TOML (or JSON) into `ServedModel`s (pdserve.config). A pure core (`served_models`, over
parsed data) and a thin shell that reads the file (`load_models_file`). Each model's pools
start from the command line's pools (--prefill, --decode-cpus, ...) and its engine from the
command line's engine; the file overrides them per model. Format: docs/models.md.

    [[model]]
    name = "smollm2"
    path = "default"                      # a GGUF file or model directory; "default": SmolLM2
    lora_modules = { sql = "/adapters/sql" }
    [model.decode]
    replicas = 2
    kv_cache_dtype = "int8"
"""
from __future__ import annotations

import json
import tomllib
from dataclasses import replace
from pathlib import Path

from pdserve.config import PoolConfig, ServedModel
from pdserve.engine.config import EngineConfig, LoRAConfig

MODEL_KEYS = ("name", "path", "lora_modules", "max_loras", "max_lora_rank", "max_model_len", "prefill", "decode")
POOL_KEYS = {"replicas": int, "tp": int, "ep": int, "pp": int, "pp_layers": list, "kv_cache_dtype": str,
             "num_cpus": (int, float), "num_gpus": (int, float), "max_queue": int, "resource": str}
_TYPE_NAMES = {int: "an integer", str: "a string", (int, float): "a number", list: "a list of integers"}


class ModelsFileError(ValueError):
    """The models file is unreadable or says something pdserve cannot serve: the message names
    the file, the model and the key."""


def _check_type(value, want, where: str):
    items = value if want is list and isinstance(value, list) else []  # a list's items: integers
    if isinstance(value, bool) or not isinstance(value, want) or any(
            isinstance(v, bool) or not isinstance(v, int) for v in items):
        raise ModelsFileError(f"{where} must be {_TYPE_NAMES[want]}, got {value!r}")
    return value


def _pool(base: PoolConfig, table, where: str) -> PoolConfig:
    if not isinstance(table, dict):
        raise ModelsFileError(f"{where} must be a table of {', '.join(POOL_KEYS)}, got {table!r}")
    unknown = sorted(set(table) - set(POOL_KEYS))
    if unknown:
        raise ModelsFileError(f"{where}: unknown key {unknown[0]!r} (known: {', '.join(POOL_KEYS)})")
    for key, value in table.items():
        _check_type(value, POOL_KEYS[key], f"{where}.{key}")
    try:
        return replace(base, **table)
    except ValueError as e:
        raise ModelsFileError(f"{where}: {e}") from None


def _lora(base: LoRAConfig, table: dict, where: str, root: Path) -> LoRAConfig:
    modules = table.get("lora_modules", {})
    if not isinstance(modules, dict) or not all(isinstance(v, str) and v for v in modules.values()):
        raise ModelsFileError(f"{where}.lora_modules must be a table of name = \"path\", got {modules!r}")
    max_loras = _check_type(table.get("max_loras", max(len(modules), base.max_loras)), int, f"{where}.max_loras")
    rank = _check_type(table.get("max_lora_rank", base.max_lora_rank), int, f"{where}.max_lora_rank")
    try:
        return LoRAConfig(max_loras=max_loras, max_lora_rank=rank,
                          modules=tuple((name, str(root / path)) for name, path in modules.items()))
    except ValueError as e:
        raise ModelsFileError(f"{where}: {e}") from None


def _model(table, i: int, engine: EngineConfig, prefill: PoolConfig, decode: PoolConfig, root: Path) -> ServedModel:
    where = f"model {i + 1}"
    if not isinstance(table, dict):
        raise ModelsFileError(f"{where} must be a table, got {table!r}")
    if isinstance(table.get("name"), str):
        where = f"model {table['name']!r}"
    unknown = sorted(set(table) - set(MODEL_KEYS))
    if unknown:
        raise ModelsFileError(f"{where}: unknown key {unknown[0]!r} (known: {', '.join(MODEL_KEYS)})")
    for key in ("name", "path"):
        if key not in table:
            raise ModelsFileError(f"{where}: {key!r} is required")
        _check_type(table[key], str, f"{where}.{key}")
    path = table["path"]
    if path != "default" and not Path(path).is_absolute():
        path = str(root / path)  # relative to the file, not to where `pdserve up` runs
    if path != "default" and not Path(path).exists():
        raise ModelsFileError(f"{where}.path: {path} does not exist")
    model_len = _check_type(table.get("max_model_len", engine.max_model_len), int, f"{where}.max_model_len")
    engine = replace(engine, model="" if path == "default" else path, max_model_len=model_len,
                     lora=_lora(engine.lora, table, where, root))
    try:
        return ServedModel(name=table["name"], engine=engine, prefill=_pool(prefill, table.get("prefill", {}),
                                                                             f"{where}.prefill"),
                           decode=_pool(decode, table.get("decode", {}), f"{where}.decode"))
    except ValueError as e:
        raise ModelsFileError(f"{where}: {e}") from None


def served_models(data, engine: EngineConfig, prefill: PoolConfig, decode: PoolConfig,
                  root: Path = Path(".")) -> tuple[ServedModel, ...]:
    """The models of a parsed models file (`{"model": [table, ...]}`), each from the given
    engine and pools with the file's keys applied; relative paths are taken from `root`."""
    if not isinstance(data, dict) or set(data) != {"model"} or not isinstance(data["model"], list) or not data["model"]:
        keys = sorted(data) if isinstance(data, dict) else type(data).__name__
        raise ModelsFileError(f"expected one or more [[model]] tables and nothing else, got {keys}")
    models = tuple(_model(t, i, engine, prefill, decode, root) for i, t in enumerate(data["model"]))
    names = [m.name for m in models] + [a for m in models for a, _ in m.engine.lora.modules]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ModelsFileError(f"the model or adapter name {twice[0]!r} is given more than once")
    return models


def load_models_file(path: str, engine: EngineConfig, prefill: PoolConfig, decode: PoolConfig) -> tuple[ServedModel, ...]:
    """The models of the TOML (or, by its .json suffix, JSON) file at `path`; ModelsFileError
    naming the file for anything wrong in it."""
    p = Path(path)
    try:
        text = p.read_text()
        data = json.loads(text) if p.suffix == ".json" else tomllib.loads(text)
        return served_models(data, engine, prefill, decode, p.resolve().parent)
    except (OSError, ValueError) as e:  # tomllib's and json's errors are ValueErrors
        raise ModelsFileError(f"--models-file {path}: {e}") from None
