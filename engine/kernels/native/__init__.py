"""Weight-only quantized CPU matmul kernels (woq.c), compiled at first use and loaded with ctypes.

`int8_matmul(x, q, scales)` and `q4_1_matmul(x, packed, d, m)` compute `x @ dequant(W).T` for
fp32 x (M, K) at decode-sized M, reading 4x (int8) or ~5.3x (Q4_1) fewer weight bytes than fp32.
Formats are documented in woq.c; `quantize_int8` / `quantize_q4_1` produce them.

The C file is built with the system C compiler (no torch headers, ~1 s) into
`$PDSERVE_CACHE_DIR/native/woq-<hash>.so` (default ~/.cache/pdserve/native/); the hash covers
the source, the flags and the compiler, so an edit or a different CPU class rebuilds. The flags
are those of the best instruction set this CPU has (cpu.py: AVX-512 VNNI, AVX-VNNI, AVX2 or
portable C), chosen at the first load; PDSERVE_ISA names a lower one. Each
build goes to a private temp file and is renamed into place: processes racing on the first
build each produce a complete library and the last rename wins, none loads a half-written one.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

from .compile import compile_library
from .cpu import ISA_ENV, ISAS, UnknownISA, build_flags, cpu_flags, isa, isas  # noqa: F401  (the build's target)

# one library from every C file here: weight-only matmuls (woq.c), paged decode attention (attention.c;
# runs of a prompt's rows together: attention_rows.c), 8-bit KV stores (kv_store.c), fused elementwise ops
# (fused.c), Q4_1 x int8 matmuls (w4a8.c, bound in w4a8.py), Q8_0 x int16 matmuls (q8a16.c, bound in
# q8a16.py), sampling (sampling.c), a whole decode step's layers (step.c, bound in step.py; its matmul over
# nibble-packed weights: w4a8n.c), LoRA updates (lora.c, bound in lora.py), bf16 matmuls and prompt attention
# on AMX tiles (amx.c, amx_attention.c; in AVX-512 BF16 vectors: bf16_attention.c; all bound in amx.py), the
# grid check of a model's matrices at load (grids.c, bound in weight_formats.py), the waits of a group's
# shared-memory collectives (shm.c, bound in engine/parallel/shm.py); the headers are shared by them
SRC: tuple[Path, ...] | Path = tuple(Path(__file__).with_name(n)
                                     for n in ("woq.c", "attention.c", "attention_rows.c", "kv_store.c", "fused.c", "w4a8.c", "q8a16.c", "sampling.c",
                                               "step.c", "step_split.c", "step_team.c", "w4a8n.c", "lora.c", "peak.c", "amx.c",
                                               "amx_attention.c", "bf16_attention.c", "grids.c", "shm.c"))
HEADERS = tuple(Path(__file__).with_name(n)
                for n in ("vecmath.h", "kvformat.h", "attend.h", "vnni.h", "flash.h", "step_lora.h", "share.h",
                          "step.h"))
_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_i8 = _q8 = _q4 = _attn = _silu_mul = _rope = _sample = _norm = _store8 = _load8 = None  # bound C functions, looked up once
BOUND = ("_lib", "_i8", "_q8", "_q4", "_attn", "_silu_mul", "_rope", "_sample", "_norm", "_store8", "_load8")  # what load() sets (tests reset them all)


class NativeKernelUnavailable(RuntimeError):
    """The native kernels cannot be built or loaded here (no C compiler, or it failed)."""


def _cache_dir() -> Path:
    root = os.environ.get("PDSERVE_CACHE_DIR") or Path.home() / ".cache" / "pdserve"
    return Path(root) / "native"


def _flags() -> list[str]:
    # an ISA's flags only where the CPU has it (a cached .so with AVX2 code would SIGILL
    # elsewhere); without AVX2 woq.c compiles its scalar path. -fopenmp links libgomp.so.1,
    # which resolves to the copy torch already loaded (same soname; torch is imported above):
    # one thread pool.
    return ["-O3", "-fPIC", "-shared", "-fopenmp", *build_flags(isa())]


def _compiler() -> str:
    cc = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if not cc:
        raise NativeKernelUnavailable("no C compiler found (install gcc or set CC) to build the native WOQ kernels")
    return cc


def _sources(src) -> list[Path]:
    src = src or SRC
    return [src] if isinstance(src, Path) else list(src)


def library_path(src=None) -> Path:
    """Where the library for the sources (default: every C file here), the flags and the compiler lives."""
    srcs = _sources(src)
    cc, flags = _compiler(), _flags()
    try:
        version = subprocess.run([cc, "--version"], check=False, capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired) as e:
        raise NativeKernelUnavailable(f"cannot run the C compiler {cc!r}: {e}") from e
    code = b"\0".join(p.read_bytes() for p in [*srcs, *HEADERS])
    key = hashlib.sha256(code + "\0".join([cc, version, *flags]).encode()).hexdigest()[:16]
    return _cache_dir() / f"{srcs[0].stem}-{key}.so"


def build(src=None) -> Path:
    """Compile `src` (a path or paths; default every C file here) unless the cached library for its hash exists; returns its
    path. Raises NativeKernelUnavailable (with the compiler's stderr) when it cannot."""
    src = src or SRC
    out = library_path(src)
    if out.exists():
        return out
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=out.stem + ".", suffix=".tmp", dir=out.parent)
    except OSError as e:
        raise NativeKernelUnavailable(f"cannot write the native kernel cache {out.parent}: {e}") from e
    os.close(fd)
    try:
        with tempfile.TemporaryDirectory(prefix=out.stem + ".", dir=out.parent) as objs:
            compile_library(_compiler(), _flags(), _sources(src), Path(objs), tmp, NativeKernelUnavailable)
        os.replace(tmp, out)  # atomic: a concurrent loader sees the old state or a complete file
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


def load() -> ctypes.CDLL:
    """Build if needed, load once per process and bind the argument types."""
    global _lib, _i8, _q8, _q4, _attn, _silu_mul, _rope, _sample, _norm, _store8, _load8
    if _lib is not None:
        return _lib
    with _lock:
        if _lib is None:
            try:
                lib = ctypes.CDLL(str(build()))
            except OSError as e:
                raise NativeKernelUnavailable(f"loading the native WOQ kernels failed: {e}") from e
            p, i64, c_int = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
            lib.woq_int8_matmul.argtypes = [p, p, p, p, i64, i64, i64, c_int]
            lib.woq_q4_1_matmul.argtypes = [p, p, p, p, p, i64, i64, i64, c_int]
            lib.woq_q8_0_matmul.argtypes = [p, p, p, p, i64, i64, i64, c_int]
            lib.woq_int8_matmul.restype = lib.woq_q4_1_matmul.restype = lib.woq_q8_0_matmul.restype = None
            lib.paged_decode_attention_f32.argtypes = [p, p, p, p, p, p, p] + [c_int] * 6 + [ctypes.c_float, c_int,
                                                                                             c_int]
            lib.paged_decode_attention_f32.restype = c_int
            lib.silu_mul_f32.argtypes = [p, p, i64, i64, c_int]
            lib.rope_f32.argtypes = [p, i64, i64, c_int, c_int, p, p, p, c_int]
            lib.silu_mul_f32.restype = lib.rope_f32.restype = None
            lib.sample_rows_f32.argtypes = [p, i64, i64, i64, p, p, p, p, c_int]
            lib.sample_rows_f32.restype = c_int
            lib.add_rms_norm_f32.argtypes = [p, p, p, p, i64, i64, ctypes.c_float, c_int]
            lib.add_rms_norm_f32.restype = None
            lib.kv_store_8bit.argtypes = [p, p, p] + [c_int] * 5
            lib.kv_load_8bit.argtypes = [p, p, i64] + [c_int] * 3
            lib.kv_store_8bit.restype = lib.kv_load_8bit.restype = None
            _i8, _q8, _q4 = lib.woq_int8_matmul, lib.woq_q8_0_matmul, lib.woq_q4_1_matmul
            _attn = lib.paged_decode_attention_f32
            _silu_mul, _rope, _sample = lib.silu_mul_f32, lib.rope_f32, lib.sample_rows_f32
            _norm, _store8, _load8 = lib.add_rms_norm_f32, lib.kv_store_8bit, lib.kv_load_8bit
            _lib = lib
    return _lib


def available() -> bool:
    """True if the kernels build and load here (the first call may compile, ~1 s)."""
    try:
        load()
        return True
    except NativeKernelUnavailable:
        return False


def bound_runs(bound) -> bool:
    """Whether a kernel module's `_bound()` (its C function, or False) gives a kernel here."""
    try:
        return bool(bound())
    except NativeKernelUnavailable:
        return False


# the formats' Python side: what the matmul kernels read (w ~ dequant(q))
from .weight_formats import (  # noqa: E402,F401
    dequantize_int8, dequantize_q4_1, dequantize_q8_0, quantize_int8, quantize_q4_1, quantize_q8_0)


# ------------------------------------------------------------------ matmuls (hot path)

_F32, _I8, _U8 = torch.float32, torch.int8, torch.uint8

# The checks below are what a call costs besides the kernel (~2.5 us: torch.empty ~1 us, the
# ctypes call ~0.6 us): `is_cpu` rather than `device.type` (5x cheaper), unpacking shapes once.


def _bad(what: str, *tensors: torch.Tensor) -> ValueError:
    got = ", ".join(f"{t.dtype} {tuple(t.shape)} contiguous={t.is_contiguous()} {t.device}" for t in tensors)
    return ValueError(f"{what}; got {got}")


def int8_matmul(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """y (M, N) fp32 = x @ (q * scales[:, None]).T; x fp32 (M, K), q int8 (N, K), scales fp32 (N,),
    all contiguous CPU tensors."""
    if _i8 is None:
        load()
    try:
        n, k = q.shape
        m, kx = x.shape
    except ValueError:
        raise _bad("x and q must be 2-D", x, q) from None
    if x.dtype is not _F32 or q.dtype is not _I8 or scales.dtype is not _F32 or kx != k or scales.shape != (n,) \
            or not (x.is_contiguous() and q.is_contiguous() and scales.is_contiguous()) \
            or not (x.is_cpu and q.is_cpu and scales.is_cpu):
        raise _bad("expected contiguous CPU tensors x fp32 (M, K), q int8 (N, K), scales fp32 (N,)", x, q, scales)
    y = torch.empty(m, n, dtype=_F32)  # the tuple form costs 0.3 us more
    _i8(x.data_ptr(), q.data_ptr(), scales.data_ptr(), y.data_ptr(), m, n, k, torch.get_num_threads())
    return y


def q8_0_matmul(x: torch.Tensor, q: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """y (M, N) fp32 = x @ dequantize_q8_0(q, d).T; x fp32 (M, K), q int8 (N, K) with K % 32 == 0,
    d fp32 (N, K/32), all contiguous CPU tensors."""
    if _q8 is None:
        load()
    try:
        n, k = q.shape
        m, kx = x.shape
    except ValueError:
        raise _bad("x and q must be 2-D", x, q) from None
    if x.dtype is not _F32 or q.dtype is not _I8 or d.dtype is not _F32 or kx != k or k & 31 \
            or d.shape != (n, k >> 5) or not (x.is_contiguous() and q.is_contiguous() and d.is_contiguous()) \
            or not (x.is_cpu and q.is_cpu and d.is_cpu):
        raise _bad("expected contiguous CPU tensors x fp32 (M, K), q int8 (N, K) with K % 32 == 0, "
                   "d fp32 (N, K/32)", x, q, d)
    y = torch.empty(m, n, dtype=_F32)
    _q8(x.data_ptr(), q.data_ptr(), d.data_ptr(), y.data_ptr(), m, n, k, torch.get_num_threads())
    return y


def q4_1_matmul(x: torch.Tensor, packed: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """y (M, N) fp32 = x @ dequantize_q4_1(packed, d, m).T; x fp32 (M, K), the rest as produced by
    quantize_q4_1 (packed uint8 (N, K/2), d and m fp32 (N, K/32), K % 32 == 0)."""
    if _q4 is None:
        load()
    try:
        n, half = packed.shape
        rows, kx = x.shape
    except ValueError:
        raise _bad("x and packed must be 2-D", x, packed) from None
    k = 2 * half
    groups = (n, k >> 5)
    if x.dtype is not _F32 or packed.dtype is not _U8 or d.dtype is not _F32 or m.dtype is not _F32 \
            or kx != k or k & 31 or d.shape != groups or m.shape != groups \
            or not (x.is_contiguous() and packed.is_contiguous() and d.is_contiguous() and m.is_contiguous()) \
            or not (x.is_cpu and packed.is_cpu and d.is_cpu and m.is_cpu):
        raise _bad("expected contiguous CPU tensors x fp32 (M, K), packed uint8 (N, K/2) with K % 32 == 0, "
                   "d and m fp32 (N, K/32)", x, packed, d, m)
    y = torch.empty(rows, n, dtype=_F32)
    _q4(x.data_ptr(), packed.data_ptr(), d.data_ptr(), m.data_ptr(), y.data_ptr(), rows, n, k,
        torch.get_num_threads())
    return y


_I64 = torch.int64
_KV = {torch.float32: 0, torch.bfloat16: 1, torch.int8: 2, torch.float8_e4m3fn: 3}  # attention.c KV_*


def paged_attention_tables(block_tables: torch.Tensor, seq_lens: torch.Tensor,
                           block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A step's block tables (B, max_blocks) and lengths (B,) as the kernel reads them (int64,
    contiguous), checked: every length >= 1 and covered by its row. Once per step: each
    layer's `paged_decode_attention(..., checked=True)` then skips the check."""
    tables, lens = block_tables.to(_I64).contiguous(), seq_lens.to(_I64).contiguous()
    B = tables.shape[0] if tables.dim() == 2 else -1
    if B < 0 or lens.shape != (B,) or B and (int(lens.min()) < 1 or tables.shape[1] * block_size < int(lens.max())):
        raise _bad("every sequence needs a block table row covering its length", tables, lens)
    return tables, lens


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, checked: bool = False,
                           skips: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of one query per sequence over its paged K/V, read in place (attention.c).
    q (B, H, D) fp32; caches (num_blocks, block_size, KVH, W) fp32 or bf16 (W = D), or int8 or
    fp8 e4m3 codes with their scales (W = D + 4, engine/kv/formats.py), contiguous; block_tables
    (B, max_blocks) and seq_lens (B,) int64. `checked`: the tables come from
    `paged_attention_tables` for this cache's block size. `skips` (B,) int64: keys at the head
    of each row's table it does not see (attention.window_tables). Returns (B, H, D)."""
    if _attn is None:
        load()
    q = q.contiguous()
    try:
        B, H, D = q.shape
        nb, bs, kvh, dk = k_cache.shape
    except ValueError:
        raise _bad("q must be (B, H, D) and the caches (num_blocks, block_size, KVH, D)", q, k_cache) from None
    if q.dtype is not _F32 or k_cache.dtype not in _KV or v_cache.dtype is not k_cache.dtype:
        raise _bad("expected fp32 q and fp32, bf16, int8 or fp8 caches (dtype)", q, k_cache, v_cache)
    fmt = _KV[k_cache.dtype]
    if v_cache.shape != k_cache.shape or dk != (D + 4 if fmt >= 2 else D) or H % kvh or not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise _bad("query heads must be a multiple of the KV heads, with the caches' head dim and shape", q, k_cache,
                   v_cache)
    tables, lens = (block_tables, seq_lens) if checked else paged_attention_tables(block_tables, seq_lens, bs)
    if tables.shape[0] != B:
        raise _bad("one block table row per query", q, tables)
    if skips is not None and (skips.dtype is not _I64 or skips.shape != (B,) or not skips.is_contiguous()):
        raise _bad("skips must be (B,) contiguous int64", q, skips)
    out = torch.empty_like(q)
    if B and _attn(q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), tables.data_ptr(), lens.data_ptr(),
                   None if skips is None else skips.data_ptr(), out.data_ptr(), B, H, kvh, D, bs, tables.shape[1],
                   D ** -0.5, torch.get_num_threads(), fmt):
        raise MemoryError("paged_decode_attention: no memory for its scratch buffers")
    return out


def kv_store_8bit(x: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor) -> None:
    """Quantize new K or V rows x (T, KVH, D) fp32 into an int8 or fp8 cache (num_blocks,
    block_size, KVH, D + 4) at flat slots (T,) int64, codes and scale as
    engine/kv_format.encode writes them (attention.c kv_store_8bit). Slots are checked."""
    if _store8 is None:
        load()
    x = x.contiguous()
    fmt = _KV.get(cache.dtype, 0)
    if (x.dtype is not _F32 or x.dim() != 3 or fmt < 2 or cache.dim() != 4 or not cache.is_contiguous()
            or cache.shape[2:] != (x.shape[1], x.shape[2] + 4) or slots.dtype is not _I64 or slots.shape != x.shape[:1]):
        raise _bad("expected fp32 rows (T, KVH, D), an 8-bit cache (blocks, bs, KVH, D + 4) and int64 slots (T,)",
                   x, cache, slots)
    slots = slots.contiguous()
    if slots.numel() and (int(slots.min()) < 0 or int(slots.max()) >= cache.shape[0] * cache.shape[1]):
        raise _bad("every slot must lie in the cache", slots)
    _store8(x.data_ptr(), cache.data_ptr(), slots.data_ptr(), x.shape[0], x.shape[1], x.shape[2], fmt,
            torch.get_num_threads())


def kv_load_8bit(rows: torch.Tensor) -> torch.Tensor:
    """8-bit KV rows (..., D + 4) int8 or fp8 (codes, then the scale) -> fp32 (..., D), code *
    scale, as engine/kv_format.decode computes it (kv_store.c)."""
    if _load8 is None:
        load()
    fmt = _KV.get(rows.dtype, 0)
    if fmt < 2 or rows.dim() < 1 or rows.shape[-1] < 5 or rows.shape[-1] % 4 or rows.device.type != "cpu":
        raise _bad("expected CPU int8 or fp8 rows (..., D + 4) with D % 4 == 0", rows)
    rows = rows.contiguous()
    D = rows.shape[-1] - 4
    out = torch.empty(*rows.shape[:-1], D, dtype=_F32)
    _load8(rows.data_ptr(), out.data_ptr(), out.numel() // D, D, fmt, torch.get_num_threads())
    return out


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU's activation in one pass (fused.c): (T, 2I) fp32 contiguous [gate | up] ->
    silu(gate) * up, (T, I)."""
    if _silu_mul is None:
        load()
    if gate_up.dtype is not _F32 or gate_up.dim() != 2 or gate_up.shape[1] % 2 or not gate_up.is_contiguous():
        raise _bad("expected a contiguous fp32 (T, 2I) gate/up tensor", gate_up)
    T, I2 = gate_up.shape
    out = torch.empty(T, I2 // 2, dtype=_F32)
    _silu_mul(gate_up.data_ptr(), out.data_ptr(), T, I2 // 2, torch.get_num_threads())
    return out


def add_rms_norm(h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The residual add and RMSNorm in one pass (fused.c): h += delta in place (unless delta
    is None), and returns weight * h / sqrt(mean(h^2) + eps). h, delta (T, D) and weight (D,)
    contiguous fp32 CPU."""
    if _norm is None:
        load()
    ok = h.dtype is _F32 and h.dim() == 2 and h.is_contiguous() and h.is_cpu and weight.shape == (h.shape[1],) \
        and weight.dtype is _F32 and weight.is_contiguous()
    if not ok or delta is not None and (delta.shape != h.shape or delta.dtype is not _F32 or not delta.is_contiguous()):
        raise _bad("expected contiguous fp32 CPU h and delta (T, D) and weight (D,)",
                   *(t for t in (h, delta, weight) if t is not None))
    out = torch.empty_like(h)
    _norm(h.data_ptr(), delta.data_ptr() if delta is not None else None, weight.data_ptr(), out.data_ptr(),
          h.shape[0], h.shape[1], eps, torch.get_num_threads())
    return out


def rope_positions(positions: torch.Tensor, table_len: int) -> torch.Tensor:
    """A step's positions as `rope_` reads them (int64, contiguous), checked to lie inside
    tables of `table_len` rows. Once per step: each layer's `rope_(..., checked=True)` then
    skips the check."""
    pos = positions.to(_I64).contiguous()
    if pos.dim() != 1 or pos.shape[0] and (int(pos.min()) < 0 or int(pos.max()) >= table_len):
        raise _bad("every row needs a position inside the tables", pos)
    return pos


def rope_(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int,
          head_dim: int, checked: bool = False) -> torch.Tensor:
    """RoPE in place (fused.c) on the first `heads` heads of each row of x (T, W) fp32 with
    unit stride along W (the q and k parts of a fused qkv row); cos/sin (max_positions,
    head_dim) contiguous tables, positions (T,) int64 within them (`checked`: from
    `rope_positions` for these tables). Returns x."""
    if _rope is None:
        load()
    if x.dtype is not _F32 or x.dim() != 2 or x.stride(1) != 1 or heads * head_dim > x.shape[1] or head_dim % 2:
        raise _bad("expected fp32 (T, W) rows with unit stride holding the rotated heads", x)
    if cos.shape != sin.shape or cos.dim() != 2 or cos.shape[1] != head_dim or not (
            cos.is_contiguous() and sin.is_contiguous() and cos.dtype is _F32 and sin.dtype is _F32):
        raise _bad("expected contiguous fp32 (max_positions, head_dim) cos/sin tables", cos, sin)
    pos = positions if checked else rope_positions(positions, cos.shape[0])
    if pos.shape != (x.shape[0],):
        raise _bad("one position per row", x, pos)
    _rope(x.data_ptr(), x.shape[0], x.stride(0), heads, head_dim, cos.data_ptr(), sin.data_ptr(), pos.data_ptr(),
          torch.get_num_threads())
    return x


def sample_rows(logits: torch.Tensor, rows: list[int], inv_temps: list[float], uniforms: list[float]) -> list[int]:
    """Inverse-CDF draws (sampling.c): for each i, the token drawn from row rows[i] of logits
    (N, V) fp32 CPU with unit stride along V, at inverse temperature inv_temps[i] with the
    uniform uniforms[i] in [0, 1). A -inf logit is never drawn."""
    if _sample is None:
        load()
    if logits.dtype is not _F32 or logits.dim() != 2 or logits.stride(1) != 1 or not logits.is_cpu:
        raise _bad("expected CPU fp32 (N, V) logits with unit stride along V", logits)
    if not len(rows) == len(inv_temps) == len(uniforms) or any(not 0 <= r < logits.shape[0] for r in rows):
        raise ValueError(f"sample_rows: {len(rows)} rows (of {logits.shape[0]}), {len(inv_temps)} temperatures, "
                         f"{len(uniforms)} uniforms")
    n = len(rows)
    idx = torch.tensor(rows, dtype=_I64)
    inv, u = torch.tensor(inv_temps, dtype=_F32), torch.tensor(uniforms, dtype=_F32)
    out = torch.empty(n, dtype=_I64)
    if n and _sample(logits.data_ptr(), logits.shape[1], logits.stride(0), n, idx.data_ptr(), inv.data_ptr(),
                     u.data_ptr(), out.data_ptr(), torch.get_num_threads()):
        raise MemoryError("sample_rows: no memory for its scratch buffers")
    return out.tolist()
