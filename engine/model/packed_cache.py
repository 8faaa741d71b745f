"""What a model's load derives from its grid matrices, kept on disk so the next load skips it.

Under "auto" and "exact" every fused matrix is checked for being exactly a Q4_1 or Q8_0 grid
(`quant.exact_grid`, a pass over its fp32 values) and a grid is packed into its kernel's
layout (`w4a8.pack`, `q8a16.pack`): 0.6-0.7 s of a ~0.85 s load of the default model, paid
by every worker and every engine. Both are pure functions of the weights, so the first load
records their results (`PackedForms`, in the order `fuse` asks for them) and writes them to
`$PDSERVE_CACHE_DIR/forms/<model>-<quantization>-<key>.forms.safetensors` (165 MB for the
default model under "auto"); a later load of the same source file (path, size and mtime, as
the conversion cache keys it) with the same quantization and the same code replays them
instead of computing them. A tensor-parallel rank's slice and a pipeline stage's layers
(engine/parallel/tp.py, pp.py) are other matrices: each such part has a file of its own. Only
GGUF files' models are cached (a Hugging Face directory is seldom a grid, and a directory
written for one run would leave its files behind); a file whose source is gone is removed at
the next write.

The key covers the source's identity, the quantization, and the code that defines the forms
(this file, quant.py, the grid check and the packers, the conversion, the models' fuse order,
the parts' slicing: `_CODE`): an edit to any of them makes a new key, and the old file is
pruned. A replayed entry whose shape is not the matrix's raises
`StaleForms`, and the load starts over computing (a cache file is never trusted over the
weights' shapes); an unreadable file is ignored and rewritten.
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import torch

from pdserve.common.model_files import cache_dir, file_fingerprint

# what decides the forms and their order: the checks and packers, the conversion of the weights,
# the models' fuse order, and the slicing of a rank's or a stage's part
_CODE = ("packed_cache.py", "quant.py", "../kernels/native/weight_formats.py", "../kernels/native/grids.c",
         "../kernels/native/w4a8.py", "../kernels/native/q8a16.py", "weights.py", "llama.py", "gemma3.py",
         "../parallel/shard.py", "../parallel/pp.py", "../parallel/degrees.py", "../../common/model_files.py")
SUFFIX = ".forms.safetensors"


class StaleForms(RuntimeError):
    """A cached entry does not fit the matrix the load asks for it."""


class PackedForms:
    """The derived forms of one model's matrices, in the order the load asks for them: each
    entry a tag (what it is: "" for "not a grid") and a tuple of tensors. Records (`replay`
    None) or replays a cache file's entries."""

    def __init__(self, replay: list[tuple[str, tuple[torch.Tensor, ...]]] | None = None):
        self.replay, self.recorded, self.at = replay, [], 0

    def take(self, shape: tuple[int, ...], compute) -> tuple[str, tuple[torch.Tensor, ...]]:
        """The next entry: replayed, or `compute()`'s (tag, tensors), recorded. `shape`: the
        matrix's, checked against the replayed entry's."""
        if self.replay is None:
            tag, tensors = compute()
            self.recorded.append((shape, tag, tuple(t.contiguous() for t in tensors)))
            return tag, tensors
        if self.at >= len(self.replay):
            raise StaleForms(f"the cache holds {len(self.replay)} entries, the model asks for more")
        want, tag, tensors = self.replay[self.at]
        if tuple(want) != tuple(shape):
            raise StaleForms(f"entry {self.at} was made for a {tuple(want)} matrix, not {tuple(shape)}")
        self.at += 1
        return tag, tensors

    def complete(self) -> bool:
        """Whether a replay used every entry (a model that asks for fewer is not the cached one)."""
        return self.replay is None or self.at == len(self.replay)


def _code_key() -> str:
    here, h = Path(__file__).parent, hashlib.sha256()
    for name in _CODE:
        f = here / name
        h.update(f.read_bytes() if f.exists() else name.encode())  # an install without one: still one key
        h.update(b"\0")
    return h.hexdigest()[:16]


def cache_path(path: Path, quantization: str, part: str = "") -> Path:
    """Where the forms of GGUF file `path`'s model (or of its `part`: a rank's slice, a stage)
    under `quantization` live."""
    key = hashlib.sha256(f"{file_fingerprint(path)}|{quantization}|{part}|{_code_key()}".encode()).hexdigest()[:24]
    name = "-".join(x for x in (path.name.split(".")[0], quantization, part) if x)
    return cache_dir() / "forms" / f"{name}-{key}{SUFFIX}"


def load(file: Path) -> PackedForms | None:
    """A replaying PackedForms from `file`, or None when it is missing or unreadable."""
    if not file.exists():
        return None
    try:
        from safetensors.torch import load_file
        from safetensors import safe_open
        with safe_open(str(file), "pt") as f:
            meta = json.loads(f.metadata()["pdserve_forms"])
        tensors = load_file(str(file))
        return PackedForms([(shape, tag, tuple(tensors[f"{i}.{j}"] for j in range(n)))
                            for i, (shape, tag, n) in enumerate(meta)])
    except Exception:  # half-written by a crashed process, or foreign: computed again
        return None


def save(forms: PackedForms, file: Path, source: Path) -> None:
    """Write a recording to `file` atomically (concurrent workers never read half a file) and
    prune the files of the same source the key no longer names. The cache is best effort: a
    read-only or full disk only costs the next load its time (what was half written is
    removed), never this load."""
    from safetensors.torch import save_file
    meta = [(list(shape), tag, len(tensors)) for shape, tag, tensors in forms.recorded]
    tensors = {f"{i}.{j}": t for i, (_, _, ts) in enumerate(forms.recorded) for j, t in enumerate(ts)}
    tmp = file.with_suffix(f".tmp{os.getpid()}")
    try:
        file.parent.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(tmp), metadata={"pdserve_forms": json.dumps(meta), "pdserve_source": str(source.resolve())})
        os.replace(tmp, file)
    except Exception:  # OSError, or safetensors' own error for a failed write
        tmp.unlink(missing_ok=True)
        return
    _prune(file, source.resolve())


def _prune(kept: Path, source: Path) -> None:
    """Remove this source's files for the same quantization and part under older keys, and
    every file whose source is gone."""
    from safetensors import safe_open
    stem = kept.name.rsplit("-", 1)[0]
    for f in kept.parent.glob(f"*{SUFFIX}"):
        if f == kept:
            continue
        try:
            with safe_open(str(f), "pt") as h:
                other = (h.metadata() or {}).get("pdserve_source")
        except Exception:
            continue
        same_part = f.name.startswith(stem + "-") and "-" not in f.name[len(stem) + 1:]
        if other and ((same_part and other == str(source)) or not Path(other).exists()):
            f.unlink(missing_ok=True)
