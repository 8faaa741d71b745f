"""A whole decode step's decoder layers in one C call (step.c): the Llama family's common
case with W4A8 weights and a paged KV cache in fp32, bf16 or 8-bit codes (int8, fp8).

The matmuls read nibble-packed weights (`nibbles`: half of w4a8.c's bytes, the same result),
with their scales and minima in fp16 where those are all fp16 values (`half_scales`: a GGUF's
Q4_1 grid; the widened values are the same, a sixth fewer bytes a step).
`StepWeights(hidden, heads, ..., layers, final_norm)` holds the model's shape and the
per-layer pointer array (built once per model: the tensors it points into are kept alive
with it), and `one_region`, which of step.c's two schedules runs (the same result);
`kv_pointers(kv_caches)` the per-layer K/V pointers (once per KV cache); `run(...)` one step,
checking what varies per step (positions, slots, tables) and nothing it was given at
construction. Given a stop word, a step stops at a layer's end when the word is below its
threshold (`Stopped`).
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from . import _bad, load

_fn = _nib = _half = None
_F32, _I64 = torch.float32, torch.int64
PTRS = 22  # pointers per layer (step.c STEP_PTRS)
# a step of more rows than this reads the byte weights (where given): at prompt-chunk sizes the
# step is bound by its arithmetic, and unpacking nibbles costs more than their bytes save (one
# thread, gate_up: 46 against 36 GMAC/s at 32 rows, 56 against 64 at 256)
BYTE_ROWS = 64
# the caches step.c stores into (kvformat.h's codes); an 8-bit cache's rows are head_dim codes and a scale
KV_FORMATS = {torch.float32: 0, torch.bfloat16: 1, torch.int8: 2, torch.float8_e4m3fn: 3}
STOPPED = -4  # step.c STEP_STOPPED
# the rows of a larger decode step split between at most this many threads, each reading every
# weight once a step (beyond, the extra reads would cost more than the barriers they save)
SPLIT_MAX_THREADS = 4


# step.c's step_hook: (layer, where: 0 its end, 1 after its attention, 2 after its MLP's first matmul)
_HOOK = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int64, ctypes.c_int64)


class Stopped(Exception):
    """`run` stopped at a layer's end: its stop word was below its threshold there. Nothing it
    computed counts: the K/V it stored (the new rows' slots, of the layers it ran) is
    overwritten when the rows are computed again."""


class _Dims(ctypes.Structure):
    """step.c's step_dims, field for field."""
    _fields_ = [(n, ctypes.c_int64) for n in ("layers", "hidden", "heads", "kv_heads", "head_dim", "inter",
                                              "block_size", "max_blocks")] + [("eps", ctypes.c_float),
                                                                               ("scale", ctypes.c_float),
                                                                               ("max_positions", ctypes.c_int64),
                                                                               ("num_slots", ctypes.c_int64),
                                                                               ("kv_fmt", ctypes.c_int64),
                                                                               ("byte_rows", ctypes.c_int64),
                                                                               ("n_bf16", ctypes.c_int64),
                                                                               ("bf16_ranges", ctypes.c_void_p)]


def _bound():
    global _fn, _nib, _half
    if _fn is None:
        lib = load()
        p, i64 = ctypes.c_void_p, ctypes.c_int64
        lib.decode_step_ptrs.restype = ctypes.c_int
        if lib.decode_step_ptrs() != PTRS:
            raise RuntimeError("step.c and step.py disagree on the per-layer pointers")
        lib.decode_step_llama.argtypes = [ctypes.POINTER(_Dims), p, p, p, p, p, p, p, p, p, p, p, i64, ctypes.c_int,
                                          ctypes.c_int, p, p, ctypes.c_int32, _HOOK]
        lib.decode_step_llama.restype = ctypes.c_int
        lib.w4a8n_matmul.argtypes = [p, p, p, p, p, i64, i64, i64, ctypes.c_int, ctypes.c_int]
        lib.w4a8n_matmul.restype = ctypes.c_int
        lib.w4a8n_half_scales.restype = ctypes.c_int
        lib.decode_step_taken.restype = ctypes.c_int64
        lib.decode_step_last_threads.restype = ctypes.c_int
        _fn, _nib, _half = lib.decode_step_llama, lib.w4a8n_matmul, bool(lib.w4a8n_half_scales())
    return _fn


def last_threads() -> int:
    """The threads the last op of this process's latest step with a region per op ran on (the
    step's hook may change them midway); 0 before any."""
    _bound()
    return int(load().decode_step_last_threads())


def rows_taken() -> int:
    """Rows the split schedule's threads have taken over from slower ones, in this process so far."""
    _bound()
    return int(load().decode_step_taken())


def nibbles(q: torch.Tensor) -> torch.Tensor:
    """w4a8.pack's one-byte-per-weight q (N/8, K/4, 8, 4) as step.c's nibbles (N/8, K/8, 32):
    k-quads 2p and 2p + 1 of a column block in the low and high nibbles of one vector."""
    pairs = q.reshape(q.shape[0], q.shape[1] // 2, 2, 32)
    return (pairs[:, :, 0] | (pairs[:, :, 1] << 4)).contiguous()


def half_scales(d: torch.Tensor, m: torch.Tensor) -> torch.Tensor | None:
    """w4a8.pack's d, m (N/8, K/32, 8) fp32 as w4a8n.c's dm fp16 (N/8, K/32, 2, 8): each group's
    8 scales, then its 8 minima. None where this build cannot read them or a value is not an
    fp16 value (then the fp32 ones serve: a scale must widen back to itself)."""
    _bound()
    if not _half or d.dtype is not _F32 or m.dtype is not _F32 or d.shape != m.shape or d.shape[-1:] != (8,):
        return None
    dm = torch.stack([d, m], dim=-2).to(torch.float16).contiguous()
    return dm if torch.equal(dm.float(), torch.stack([d, m], dim=-2)) else None


def nibble_matmul(x: torch.Tensor, wn: torch.Tensor, d: torch.Tensor, m: torch.Tensor,
                  dm: torch.Tensor | None = None) -> torch.Tensor:
    """w4a8.matmul(x, q, d, m) bitwise, from `nibbles(q)`: y (M, N) fp32 for x fp32 (M, K);
    `dm`: `half_scales(d, m)`, read instead of d and m."""
    _bound()
    nb, pairs, width = wn.shape
    n, k = nb * 8, pairs * 8
    if wn.dtype is not torch.uint8 or width != 32 or not wn.is_contiguous() or d.shape != (nb, k // 32, 8) \
            or m.shape != d.shape or not (d.is_contiguous() and m.is_contiguous()) or k % 32:
        raise _bad("expected nibbles (N/8, K/8, 32) and w4a8.pack's d, m", wn, d, m)
    if dm is not None and (dm.dtype is not torch.float16 or dm.shape != (nb, k // 32, 2, 8) or not dm.is_contiguous()
                           or not _half):
        raise _bad("expected half_scales' dm fp16 (N/8, K/32, 2, 8), on a build that reads it", dm)
    if x.dtype is not _F32 or x.dim() != 2 or x.shape[1] != k or not x.is_contiguous():
        raise _bad(f"expected contiguous x fp32 (M, {k})", x)
    y = torch.empty(x.shape[0], n, dtype=_F32)
    dp, mp = (d.data_ptr(), m.data_ptr()) if dm is None else (dm.data_ptr(), dm.data_ptr())
    if _nib(x.data_ptr(), wn.data_ptr(), dp, mp, y.data_ptr(), x.shape[0], n, k, torch.get_num_threads(),
            int(dm is not None)):
        raise RuntimeError("w4a8n matmul: needs AVX2 and memory for the quantized activations")
    return y


@dataclass
class LayerWeights:
    """One layer's tensors as the step reads them: the two RMSNorm weights (hidden,) fp32,
    each matrix as (nibbles(q), d, m) of w4a8.pack's (q, d, m), `byte_q` the four matrices'
    q themselves (qkv, o, gate_up, down; empty: steps of every size read the nibbles), and
    `half` their `half_scales` (each None where not fp16 values; empty: none)."""

    input_norm: torch.Tensor
    post_norm: torch.Tensor
    qkv: tuple
    o: tuple
    gate_up: tuple
    down: tuple
    byte_q: tuple = ()
    half: tuple = ()


class StepWeights:
    """The model's constants for `run`: its shape and every layer's weight pointers."""

    def __init__(self, hidden: int, heads: int, kv_heads: int, head_dim: int, inter: int, eps: float,
                 layers: list[LayerWeights], final_norm: torch.Tensor):
        _bound()
        self.layers, self.final_norm = layers, final_norm  # kept alive: the array points into them
        self.hidden, self.heads, self.kv_heads, self.head_dim = hidden, heads, kv_heads, head_dim
        self.inter, self.eps = inter, eps
        ptrs = []
        for lw in layers:
            tensors = [lw.input_norm, lw.post_norm, *lw.qkv, *lw.o, *lw.gate_up, *lw.down]
            for t in tensors:
                if not (t.is_contiguous() and t.is_cpu):
                    raise _bad("step weights must be contiguous CPU tensors", t)
            ptrs += [t.data_ptr() for t in tensors]
            for t in lw.byte_q:
                if not (t.is_contiguous() and t.is_cpu and t.dtype is torch.uint8):
                    raise _bad("step byte weights must be contiguous CPU uint8 tensors", t)
            ptrs += [t.data_ptr() for t in lw.byte_q] if len(lw.byte_q) == 4 else [None] * 4
            half = lw.half or (None,) * 4
            for t, (_, d, _) in zip(half, (lw.qkv, lw.o, lw.gate_up, lw.down)):
                if t is not None and not (t.dtype is torch.float16 and t.is_contiguous() and t.is_cpu
                                          and t.shape == (*d.shape[:2], 2, 8) and _half):
                    raise _bad("step fp16 scales must be half_scales' form, on a build that reads them", t)
            ptrs += [None if t is None else t.data_ptr() for t in half]
        self.array = (ctypes.c_void_p * len(ptrs))(*ptrs)
        self._kv_cached = None  # (key, pointer array, the list) of the last KV cache
        self.one_region = True  # the whole step on one OpenMP team (step.c team_step); False: a region per op
        # ... for steps of up to this many rows: measured (bench/decode-step-results.json) one
        # team 7.9 vs 8.7 ms at 1 row, 21.4 vs 22.5 at 4; a region per op 48.6 vs 49.9 at 8, 161 vs 192 at 32
        self.team_rows = 4
        # larger decode-only steps (`_schedule`): 2 the rows split between the threads (a thread done
        # with its rows takes half of a slower one's), 0 a region per op; 3 split from every row on the
        # first thread (the others take theirs: the hand-over path, for tests)
        self.split_rows = 2

    def kv_pointers(self, kv_caches: list) -> ctypes.Array:
        """Every layer's (K, V) pointers, cached while the same list of the same tensors is passed
        (the runner passes one list for the engine's life)."""
        key = (id(kv_caches), len(kv_caches), kv_caches[0][0].data_ptr(), kv_caches[-1][1].data_ptr())
        cached = self._kv_cached  # one read: engines sharing the model may step from other threads
        if cached is not None and cached[0] == key:
            return cached[1]
        ptrs = [t.data_ptr() for kv in kv_caches for t in kv]
        array = (ctypes.c_void_p * len(ptrs))(*ptrs)
        self._kv_cached = (key, array, kv_caches)  # the list kept alive: its id stays its own
        return array


def _ranges(rows: list[tuple[int, int]], M: int, one_team: bool) -> torch.Tensor:
    """bf16_rows as step.c reads them (int64 pairs), checked: ascending, disjoint, inside the step."""
    flat = [int(x) for pair in rows for x in pair]
    if rows and (one_team or any(len(p) != 2 for p in rows) or flat != sorted(flat) or flat[0] < 0 or flat[-1] > M):
        raise ValueError(f"expected ascending (start, end) ranges of a step's {M} rows, one_team False; got {rows}")
    return torch.tensor(flat, dtype=_I64)


def run(w: StepWeights, h: torch.Tensor, kv_caches: list, positions: torch.Tensor, cos: torch.Tensor,
        sin: torch.Tensor, slots: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor, lora=None,
        one_team: bool = True, stop: tuple[int, int] | None = None, bf16_rows: list[tuple[int, int]] = (),
        hook=None) -> torch.Tensor:
    """The final normed hidden states (M, hidden) of a step; h (M, hidden) fp32, the
    embeddings, is the residual stream afterwards. kv_caches: per layer (K, V) contiguous
    (num_blocks, block_size, kv_heads, head_dim), all fp32 or all bf16 (the new rows stored
    rounded as .to(torch.bfloat16) rounds), or all int8 or all fp8 (rows head_dim + 4 wide: the
    new rows stored as native.kv_store_8bit stores them); positions and slots (M,) int64 inside the cos/sin
    tables and the cache; tables (M, max_blocks) and lens (M,) as
    native.paged_attention_tables returns them for this cache; lora: a lora.StepLoRA for these
    rows, or None. one_team False: some rows are consecutive positions of one sequence (a prompt
    chunk), which the one-team schedule cannot run (its items store a row's K/V and attend at
    once: a later row of the same sequence could attend before an earlier row's K/V is stored);
    the schedule with a region per op stores every row first. stop: (the address of an int32,
    the stop word, which another thread may write meanwhile; a threshold): at each layer's end
    but the last the step stops, raising `Stopped`, if the word is below the threshold; None:
    it runs to the end. bf16_rows: (start, end) ranges of prompt rows, ascending, whose
    attention runs in bf16 vectors (AttentionMetadata.bf16_prompt_ranges; one_team False).
    hook(layer, where): called on this thread at each layer's end (where 0) and inside it,
    after its attention (1) and after its MLP's first matmul (2), with a region per op; what
    it raises stops the step there and is raised here, and the step's later ops run on the
    thread count (torch.get_num_threads) it leaves."""
    fn = _bound()
    M = h.shape[0]
    k0 = kv_caches[0][0]
    nb, bs = k0.shape[0], k0.shape[1]
    if h.dtype is not _F32 or h.shape != (M, w.hidden) or not h.is_contiguous() or len(kv_caches) != len(w.layers):
        raise _bad(f"expected contiguous fp32 h (M, {w.hidden}) and one (K, V) per layer", h)
    if k0.dtype not in KV_FORMATS or k0.shape[2:] != (w.kv_heads, w.head_dim + (4 if KV_FORMATS[k0.dtype] > 1 else 0)):
        raise _bad("expected fp32, bf16, int8 or fp8 caches (num_blocks, block_size, kv_heads, head_dim; an 8-bit "
                   "cache's rows 4 bytes wider: their scale)", k0)
    _check_rows(M, positions, slots, tables, lens)
    ranges = _ranges(bf16_rows, M, one_team)
    dims = _Dims(len(w.layers), w.hidden, w.heads, w.kv_heads, w.head_dim, w.inter, bs, tables.shape[1], w.eps,
                 w.head_dim ** -0.5, cos.shape[0], nb * bs, KV_FORMATS[k0.dtype], BYTE_ROWS, len(bf16_rows),
                 ranges.data_ptr() if len(bf16_rows) else None)
    out, nt, raised = torch.empty_like(h), torch.get_num_threads(), []
    c_hook = _HOOK() if hook is None else _HOOK(_calling(hook, raised))
    rc = M and fn(ctypes.byref(dims), w.array, w.kv_pointers(kv_caches), w.final_norm.data_ptr(), h.data_ptr(),
                  out.data_ptr(), positions.data_ptr(), cos.data_ptr(), sin.data_ptr(), slots.data_ptr(),
                  tables.data_ptr(), lens.data_ptr(), M, nt, _schedule(w, M, nt) if one_team else 0,
                  None if lora is None else ctypes.addressof(lora), *(stop or (None, 0)), c_hook)
    if raised:
        raise raised[0]
    if rc == STOPPED:
        raise Stopped(f"the stop word fell below {stop[1]}")
    if rc == -2:
        raise _bad("every position must lie in the RoPE tables and every slot in the cache", positions, slots)
    if rc == -3:
        raise _bad("step.c stores into fp32, bf16, int8 or fp8 caches only", k0)
    if rc:
        raise MemoryError("decode step: no memory for its scratch buffers")
    return out


def _calling(hook, raised: list):
    """`hook` as step.c calls it (step_hook): it answers the threads the step's next ops run on,
    torch's count as the hook leaves it (a worker lending or taking back cores sets it there);
    -1 to stop, what it raised kept in `raised`."""
    def call(layer: int, where: int) -> int:
        try:
            hook(layer, where)
        except BaseException as e:  # noqa: BLE001 - raised again by `run`, on its thread
            raised.append(e)
            return -1
        return torch.get_num_threads()
    return call


def _schedule(w: StepWeights, M: int, nt: int) -> int:
    """step.c's schedule for a decode-only step of M rows on nt threads: 1 one team (up to
    team_rows rows), 2 the rows split between the threads (each part through every layer on one
    thread, so each thread reads every weight: on up to SPLIT_MAX_THREADS threads, at least 2
    rows each), 0 a region per op."""
    if not w.one_region:
        return 0
    if M <= w.team_rows:
        return 1
    return w.split_rows if 1 < nt <= SPLIT_MAX_THREADS and M >= 2 * nt else 0


def _check_rows(M: int, positions, slots, tables, lens) -> None:
    """The per-step inputs: int64 contiguous, one per row (the tables and lens come checked
    from native.paged_attention_tables; positions and slots are range-checked in C)."""
    for t in (positions, slots, lens):
        if t.dtype is not _I64 or t.shape != (M,) or not t.is_contiguous():
            raise _bad(f"positions, slots and lens must be contiguous int64 ({M},)", t)
    if tables.dtype is not _I64 or tables.dim() != 2 or tables.shape[0] != M or not tables.is_contiguous():
        raise _bad(f"tables must be contiguous int64 ({M}, max_blocks)", tables)
