"""Where converted model files are cached on this host, and how a model file is identified:
shared by the engine's weight loader and the tokenizer (which the router loads without the engine)."""
from __future__ import annotations

import hashlib
import os
from pathlib import Path

_CACHE_FORMAT = "pdserve-gguf-v1"


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
