"""A GGUF file's metadata and tensor records, read straight from the bytes (no torch, no
numpy: the loader, engine/model/weights.py, maps each tensor's bytes from its record).

gguf's `GGUFReader` wraps every value of the file in numpy views, each vocabulary entry among
them: parsing Gemma 3's 262,144-entry vocabulary took it ~10 s, and the loader and the
tokenizer each parsed the file once (every first start of a model on a machine, every clean
CI run). Here a string is one slice of the mapped file and a numeric array one `frombuffer`:
the default model's whole metadata in ~0.1 s, its header alone (`vocab=False`) in ~20 ms."""
from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

from pdserve.common.errors import ModelLoadError

# GGUF value types: struct codes of the scalars; 8 is a string, 9 an array
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9
# the vocabulary's arrays: without `vocab` only their length is kept (as `{key}.count`)
VOCAB_ARRAYS = ("tokens", "merges", "token_type", "scores")
_ALIGNMENT = 32  # the data section's alignment when general.alignment is not given


class _Cursor:
    """Reads GGUF values from a buffer at a moving offset, in the file's byte order."""

    def __init__(self, buf, order: str, at: int):
        self.buf, self.order, self.at = buf, order, at

    def scalar(self, code: str):
        (v,) = struct.unpack_from(self.order + code, self.buf, self.at)
        self.at += struct.calcsize(code)
        return v

    def string(self) -> str:
        n = self.scalar("Q")
        s = bytes(self.buf[self.at:self.at + n]).decode("utf-8", errors="replace")
        self.at += n
        return s

    def value(self, kind: int, keep: bool = True):
        """The value of GGUF type `kind`; an array not kept (`keep` False) is skipped and its
        length returned."""
        if kind in _SCALARS:
            return self.scalar(_SCALARS[kind])
        if kind == _STRING:
            return self.string()
        if kind != _ARRAY:
            raise ModelLoadError(f"GGUF value type {kind} is not one this reader knows")
        item, n = self.scalar("I"), self.scalar("Q")
        if item in _SCALARS:
            return self._scalars(item, n, keep)
        if item == _STRING:
            return self._strings(n, keep)
        values = [self.value(item) for _ in range(n)]
        return values if keep else n

    def _scalars(self, item: int, n: int, keep: bool):
        code = _SCALARS[item]
        start, self.at = self.at, self.at + n * struct.calcsize(code)
        if not keep:
            return n
        if self.at > len(self.buf):
            raise struct.error(f"an array of {n} values runs past the file's end")
        return list(struct.unpack_from(f"{self.order}{n}{code}", self.buf, start))

    def _strings(self, n: int, keep: bool):
        buf, at, length, out = self.buf, self.at, struct.Struct(self.order + "Q").unpack_from, []
        for _ in range(n):
            (k,) = length(buf, at)
            if keep:
                out.append(bytes(buf[at + 8:at + 8 + k]).decode("utf-8", errors="replace"))
            at += 8 + k
        self.at = at
        return out if keep else n


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor's record: its name, its dims in the file's order (fastest first), its ggml
    type's number, and its bytes' offset from the file's start."""
    name: str
    dims: tuple[int, ...]
    kind: int
    offset: int


def _open(path: Path):
    with open(path, "rb") as fh:
        try:
            return mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
        except ValueError as err:  # an empty file
            raise ModelLoadError(f"{path}: not a GGUF file ({err})") from None


def _read(buf, path: Path, vocab: bool, tensors: bool) -> tuple[dict, list[GGUFTensor]]:
    if buf[:4] != b"GGUF":
        raise ModelLoadError(f"{path}: not a GGUF file (no GGUF magic)")
    order = "<" if struct.unpack_from("<I", buf, 4)[0] < 0x10000 else ">"  # a big-endian file's version reads byte-swapped
    cur = _Cursor(buf, order, 4)
    version = cur.scalar("I")
    if version < 2:
        raise ModelLoadError(f"{path}: GGUF version {version} is too old (2 or later)")
    meta, records = {}, []
    try:
        n_tensors = cur.scalar("Q")
        for _ in range(cur.scalar("Q")):
            key, kind = cur.string(), cur.scalar("I")
            counted = not vocab and key.startswith("tokenizer.ggml.") and key.rsplit(".", 1)[-1] in VOCAB_ARRAYS
            meta[f"{key}.count" if counted else key] = cur.value(kind, keep=not counted)
        if tensors:
            for _ in range(n_tensors):
                name, n_dims = cur.string(), cur.scalar("I")
                dims = tuple(cur.scalar("Q") for _ in range(n_dims))
                records.append((name, dims, cur.scalar("I"), cur.scalar("Q")))
    except struct.error as err:
        raise ModelLoadError(f"{path}: GGUF metadata ends early ({err})") from None
    align = int(meta.get("general.alignment", _ALIGNMENT))
    start = -(-cur.at // align) * align
    meta["GGUF.byte_order"] = order
    return meta, [GGUFTensor(name, dims, kind, start + off) for name, dims, kind, off in records]


def gguf_header(path: Path, vocab: bool = False) -> dict:
    """The metadata of the GGUF file at `path`: scalars and strings as Python values, arrays as
    lists; the vocabulary's arrays as `{key}.count` only unless `vocab`."""
    with _open(path) as buf:
        meta, _ = _read(buf, path, vocab, tensors=False)
    del meta["GGUF.byte_order"]
    return meta


def gguf_contents(path: Path) -> tuple[dict, list[GGUFTensor], str]:
    """The metadata (vocabulary included), every tensor's record and the byte order ('<' or
    '>') of the GGUF file at `path`."""
    with _open(path) as buf:
        meta, records = _read(buf, path, vocab=True, tensors=True)
    return meta, records, meta.pop("GGUF.byte_order")
