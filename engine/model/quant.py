"""Linear-layer kernels: how `x @ W.T` runs, chosen once per weight matrix at load.

A decode step at small batch is bound by the bytes of weights it reads, so the kernel is where
weight-only quantization pays (SmolLM2-135M: 540 MB of fp32 weights per step, 135 MB in int8).

- `PlainLinear`: `F.linear` (GPUs, bf16/fp16 models, or no oneDNN).
- `OneDNNLinear`: fp32 on a oneDNN-blocked copy of the weight (the CPU default).
- `WeightOnlyLinear`: int8 (one scale per output channel) or Q4_1 (4 bits, scale and min per
  32 weights: GGUF's format, which is what the default model ships) weights, fp32 activations
  and math. Up to `SMALL_M` rows run on the C kernels of engine/kernels/native (they read the packed
  weights: 4x / 5.3x fewer bytes than fp32); larger batches, which are compute-bound, run on
  oneDNN with the dequantized weights, the same model in fp32 math.
- `W8A8Linear`: int8 weights and int8 activations, each row quantized on the fly with its
  own scale, int32 accumulation (fbgemm): fastest at large batches, ~5% worse perplexity.
- `Fp16Linear`: fp16 weights, fp32 activations and math (fbgemm): half the bytes, ~lossless.
- "exact": a matrix whose fp32 values are exactly a Q4_1 or Q8_0 grid (what a Q4_1 GGUF's
  layers and its LM head dequantize to) runs as an exact `WeightOnlyLinear`: the C kernel
  reads the packed form at small batches, oneDNN the original fp32 values at large ones, so
  the model is the checkpoint's own, in fp32 math. Every other matrix stays fp32 on oneDNN.
- `W4A8Linear`: a Q4_1 grid with each 16 activations of a row in int8 (own scale), integer
  products (engine/kernels/native/w4a8.c), as GGUF runtimes compute a Q4_1 model (with one scale per
  32 there): 1.6-2x the fp32 matmul rate from 4 rows up on AVX2.
- `Q8A16Linear`: a Q8_0 grid (the LM head GGUF checkpoints ship) with int16 activations.
- "auto" (the default): "exact", except that Q4_1 and Q8_0 grids run as `W4A8Linear` and
  `Q8A16Linear` at every batch size where the CPU has AVX2 (one kernel for every M keeps a row's
  result independent of its batch). Quality against fp32 is measured in bench/NOTES.md.
  Where the CPU has AMX (cpu.py's "avx512-amx" build), a model's Q4_1 matrices are
  `PromptBf16Linear`: the rows of prompt tokens run in bf16 on AMX tiles (engine/kernels/native/amx.c,
  2-3x the W4A8 rate there, and closer to fp32), every other row (decodes, speculative drafts,
  a preempted request's generated tokens) on W4A8; which rows are which, the model's
  `PromptRows` says for each step.

Every kernel is batch invariant: a row's result does not depend on the other rows in the
batch, so a request's greedy output is the same alone or batched.
"""
from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F

from pdserve.engine.config import QUANTIZATIONS
from pdserve.engine.kernels.native.weight_formats import grid_form
from pdserve.engine.model.packed_cache import PackedForms

EXACT_TOL = 1e-5  # a matrix is a Q4_1 grid if re-quantizing it moves no weight by more than this x max |w|


class QuantizationUnavailable(RuntimeError):
    """The requested weight quantization has no kernel in this torch build or on this device."""


class PlainLinear:
    def __init__(self, w: torch.Tensor):
        self.w = w

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.w)


def onednn_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


class OneDNNLinear:
    """oneDNN's blocked layout runs these small-M GEMMs 1.5-2x faster than MKL on the plain
    layout (30 layers + LM head of SmolLM2 at 1 row 41 -> 23 ms, at 32 rows 91 -> 49 ms), in
    fp32, same results to ~1e-6. It is the layout torch.compile's CPU freezing uses."""

    def __init__(self, w: torch.Tensor):
        self.packed = torch.ops.mkldnn._reorder_linear_weight(w.detach(), 32)  # tuned for 32 rows

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, None, "none", [], "")


def fbgemm_available() -> bool:
    return "fbgemm" in torch.backends.quantized.supported_engines and hasattr(torch.ops.quantized, "linear_dynamic")


# What fbgemm's kernel needs of the CPU to keep this module's promises (accuracy, and a row's
# result independent of its batch). Measured on an AVX2-only EPYC: w8a8 had 5x the error
# (perplexity x1.41 against x1.05 with VNNI) and fp16 gave rows that depend on the batch.
FBGEMM_CPU_NEEDS = {"w8a8": ("avx512_vnni", "AVX-512 VNNI", "loses accuracy (5x the error)"),
                    "fp16": ("avx512f", "AVX-512", "makes a request's output depend on its batch")}


def fbgemm_cpu_problem(quantization: str, flags: set[str] | None = None) -> str | None:
    """Why `quantization` cannot run right on this CPU, or None if it can."""
    flag, name, harm = FBGEMM_CPU_NEEDS[quantization]
    if flags is None:
        from pdserve.engine.kernels.native import cpu_flags  # the C kernels' build reads the same flags
        flags = cpu_flags()
    if flags and flag not in flags:  # no flags known (not Linux): trust fbgemm
        return (f"--quantization {quantization} needs a CPU with {name} (this one has "
                f"{'AVX2' if 'avx2' in flags else 'neither'}): fbgemm's kernel here {harm}; int8 or q4_1 "
                "(weight-only) run on every CPU")
    return None


def small_m(flags: set[str] | None = None) -> int:
    """The most rows the weight-only C kernels take (more run on oneDNN), per CPU. Measured
    crossovers with oneDNN fp32 (whole decode steps of SmolLM2, 2 threads): ~12 rows on an
    AVX-512 EPYC, where oneDNN uses AVX-512 and the kernels AVX2; on an AVX2-only EPYC the
    kernels were still 5-14% faster at 32 and 48 rows (bench/NOTES.md)."""
    if flags is None:
        from pdserve.engine.kernels.native import cpu_flags
        flags = cpu_flags()
    return 8 if "avx512f" in flags or not flags else 48


class WeightOnlyLinear:
    """int8, Q4_1 or Q8_0 weights; see the module docstring. Raises QuantizationUnavailable when the
    C kernels cannot be built here (no compiler)."""

    SMALL_M = small_m()

    def __init__(self, w: torch.Tensor, fmt: str, exact: tuple | None = None):
        """`fmt`: "int8", "q4_1" or "q8_0". `exact`: `w`'s packed form when `w` is exactly that
        grid (`exact_grid`): larger batches then run on `w` itself, not on a re-quantized copy."""
        from pdserve.engine.kernels import native
        try:
            native.load()
        except native.NativeKernelUnavailable as e:
            raise QuantizationUnavailable(f"--quantization {fmt} needs the native kernels: {e}") from e
        if fmt in ("q4_1", "q8_0") and w.shape[1] % 32:
            raise QuantizationUnavailable(f"--quantization {fmt} needs input sizes divisible by 32, got {w.shape[1]}")
        if fmt == "q8_0":
            self.packed, self.kernel = exact or native.quantize_q8_0(w), native.q8_0_matmul
            self.dequantized = w.detach() if exact else native.dequantize_q8_0(*self.packed)
        elif fmt == "int8":
            self.packed, self.kernel = native.quantize_int8(w), native.int8_matmul
            self.dequantized = native.dequantize_int8(*self.packed)
        else:
            self.packed, self.kernel = exact or native.quantize_q4_1(w), native.q4_1_matmul
            self.dequantized = w.detach() if exact else native.dequantize_q4_1(*self.packed)
        self.large = OneDNNLinear(self.dequantized) if onednn_available() else PlainLinear(self.dequantized)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] <= self.SMALL_M:
            return self.kernel(x.contiguous(), *self.packed)
        return self.large(x)


class W4A8Linear:
    """An exact Q4_1 grid, int8 activations per 16 (see the module docstring). Holds one byte
    per weight in the kernel's layout, not an fp32 copy."""

    def __init__(self, packed: tuple, laid_out: bool = False):
        """`packed`: the grid's Q4_1 form, or with `laid_out` already `w4a8.pack`'s."""
        from pdserve.engine.kernels.native import w4a8
        self.packed = tuple(packed) if laid_out else w4a8.pack(*packed)
        w4a8.check_packed(*self.packed)  # once: each call then checks x alone
        self.kernel = w4a8.matmul

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernel(x.contiguous(), *self.packed, checked=True)


class Q8A16Linear:
    """An exact Q8_0 grid (a GGUF's LM head) with each 32 activations of a row in int16 (own
    scale), integer products (engine/kernels/native/q8a16.c): one kernel for every M (a row's logits
    do not depend on its batch), at one row at the memory roof where the fp32 activations'
    kernel took 1.9x as long; int8 activations there cost 1.7% perplexity, int16 ones nothing
    measurable. Holds one byte per weight, no fp32 copy."""

    def __init__(self, packed: tuple, laid_out: bool = False):
        """`packed`: the grid's Q8_0 form, or with `laid_out` already `q8a16.pack`'s."""
        from pdserve.engine.kernels.native import q8a16
        self.packed = tuple(packed) if laid_out else q8a16.pack(*packed)
        self.kernel = q8a16.matmul

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernel(x.contiguous(), *self.packed)


class PromptRows:
    """Which rows of the model's current step are prompt tokens, as (start, end) ranges: set by
    the model's forward for one step (`of`), read by its `PromptBf16Linear`s. Outside a step, or
    for a call with another row count (a subset of the step's rows), there are none."""

    def __init__(self):
        self.ranges: list[tuple[int, int]] = []
        self.rows = 0

    def set(self, ranges: list[tuple[int, int]], rows: int) -> None:
        merged: list[list[int]] = []
        for lo, hi in ranges:
            if hi <= lo:
                continue
            if merged and merged[-1][1] == lo:
                merged[-1][1] = hi
            else:
                merged.append([lo, hi])
        self.ranges, self.rows = [(lo, hi) for lo, hi in merged], rows

    def clear(self) -> None:
        self.ranges, self.rows = [], 0


def amx_prompt_rows(quantization: str) -> PromptRows | None:
    """A `PromptRows` for a model whose prompt rows run on AMX (quantization "auto", a CPU with
    AMX and the tiles granted), else None."""
    if quantization != "auto":
        return None
    from pdserve.engine.kernels.native import amx
    return PromptRows() if amx.available() else None


def bf16_attention_from(quantization: str) -> int | None:
    """From which position a model without AMX prompt rows attends its prompt rows in AVX-512
    BF16 vectors (engine/kernels/attention.py BF16_ATTENTION_FROM): under "auto" on a CPU (and a
    build) with AVX-512 BF16; else None, every row in fp32."""
    from pdserve.engine.kernels.attention import BF16_ATTENTION_FROM
    from pdserve.engine.kernels.native import amx
    return BF16_ATTENTION_FROM if quantization == "auto" and amx.vector_attention_available() else None


class PromptBf16Linear(W4A8Linear):
    """A `W4A8Linear` whose prompt rows (its model's `PromptRows`) run in bf16 on AMX tiles:
    the grid's values rounded to bf16, each activation rounded to bf16, fp32 sums. Holds the
    bf16 copy besides the W4A8 bytes (3 bytes a weight in all)."""

    def __init__(self, packed: tuple, w: torch.Tensor, rows: PromptRows):
        super().__init__(packed)
        from pdserve.engine.kernels.native import amx
        self.tiles, self.rows, self.amx = amx.pack(w), rows, amx.matmul

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        ranges, t = self.rows.ranges, x.shape[0]
        if not ranges or self.rows.rows != t:
            return self.kernel(x.contiguous(), *self.packed, checked=True)
        x = x.contiguous()
        if ranges[0] == (0, t):
            return self.amx(x, self.tiles)
        y, at = torch.empty(t, self.tiles.shape[0] * 16), 0
        for lo, hi in ranges:
            if at < lo:
                y[at:lo] = self.kernel(x[at:lo], *self.packed, checked=True)
            y[lo:hi] = self.amx(x[lo:hi], self.tiles)
            at = hi
        if at < t:
            y[at:] = self.kernel(x[at:], *self.packed, checked=True)
        return y


def w4a8_fits(w: torch.Tensor) -> bool:
    """Whether `W4A8Linear` runs this (out, in) matrix here: AVX2 and whole blocks of 8 outputs."""
    from pdserve.engine.kernels.native import w4a8
    return w.shape[0] % 8 == 0 and w4a8.available()


class W8A8Linear:
    """W8A8 with dynamic per-row activation scales.

    fbgemm quantizes the activations of a call with one scale for the whole tensor, which
    would make a row's precision depend on its neighbours (and a request's output on the
    batch). Each row is therefore scaled to max |x| = 1 first and an anchor row holding -1 and
    +1 is appended: every call then quantizes over exactly [-1, 1], i.e. per row, and the
    per-row scale is multiplied back into the output (x @ W.T is linear in each row).

    Activations keep all 8 bits (reduce_range off). With 7 bits, SmolLM2's perplexity rose
    18%; with 8 it rises ~5% (bench/NOTES.md). Per-row scales are the weak point: a few outlier
    channels set each row's scale."""

    def __init__(self, w: torch.Tensor):
        w = w.detach().float()
        scale = (w.abs().amax(1) / 127).clamp_(min=1e-12).double()
        with warnings.catch_warnings():  # quantized tensors are deprecated; fbgemm's prepack still takes them
            warnings.simplefilter("ignore", UserWarning)
            q = torch.quantize_per_channel(w, scale, torch.zeros(w.shape[0], dtype=torch.long), 0, torch.qint8)
        self.params = torch.ops.quantized.linear_prepack(q, None)
        self.anchor = torch.zeros(1, w.shape[1])
        self.anchor[0, 0], self.anchor[0, -1] = -1.0, 1.0

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        s = x.abs().amax(-1, keepdim=True).clamp_(min=1e-30)
        y = torch.ops.quantized.linear_dynamic(torch.cat([x / s, self.anchor]), self.params, False)
        return y[:-1].mul_(s)


class Fp16Linear:
    def __init__(self, w: torch.Tensor):
        self.params = torch.ops.quantized.linear_prepack_fp16(w.detach().float(), None)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.quantized.linear_dynamic_fp16(x, self.params)


def exact_grid(w: torch.Tensor) -> tuple[str, tuple] | None:
    """("q4_1" or "q8_0", the packed form) of the fp32 CPU matrix `w` if `w` is exactly that
    grid (each group of 32 along K is q * d + m, q in 0..15, or q * d, q in -127..127, as GGUF
    checkpoints dequantize) and the C kernels load; else None."""
    from pdserve.engine.kernels import native
    if w.device.type != "cpu" or w.dtype != torch.float32 or w.dim() != 2 or w.shape[1] % 32:
        return None
    try:
        native.load()
    except native.NativeKernelUnavailable:
        return None
    return grid_form(w, EXACT_TOL)


def _amx_fits(w: torch.Tensor) -> bool:
    from pdserve.engine.kernels.native import amx
    return amx.fits(w)


def _grid_forms(w: torch.Tensor, quantization: str, amx_rows: bool) -> tuple[str, tuple]:
    """What "auto"/"exact" derive from `w`, tagged: "w4a8" or "q8a16" (the kernel's layout, under
    "auto"), "q4_1" or "q8_0" (the grid's packed form: "exact", a matrix W4A8 does not fit, or
    AMX prompt rows), "" (not a grid)."""
    grid = exact_grid(w)
    if grid is None:
        return "", ()
    if quantization == "auto" and w4a8_fits(w) and not (grid[0] == "q4_1" and amx_rows):
        from pdserve.engine.kernels.native import q8a16, w4a8
        return ("w4a8", w4a8.pack(*grid[1])) if grid[0] == "q4_1" else ("q8a16", q8a16.pack(*grid[1]))
    return grid


def make_linear(w: torch.Tensor, quantization: str = "none", packed: bool = True,
                prompt_rows: PromptRows | None = None, forms: PackedForms | None = None):
    """The kernel for one (out, in) weight. `quantization` is one of QUANTIZATIONS; with
    "none" (and "auto"/"exact" for a matrix that is not a grid), `packed` picks oneDNN's layout
    for fp32 CPU weights. `prompt_rows` (`amx_prompt_rows`): a Q4_1 grid under "auto" runs its
    model's prompt rows on AMX (`PromptBf16Linear`). `forms` (engine/model/packed_cache.py):
    where the grid check's and the packers' results are recorded or replayed from."""
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {quantization!r}")
    on_cpu = w.device.type == "cpu"
    if quantization in ("auto", "exact"):
        amx_rows = prompt_rows if prompt_rows is not None and w4a8_fits(w) and _amx_fits(w) else None
        derive = lambda: _grid_forms(w, quantization, amx_rows is not None)  # noqa: E731
        tag, tensors = forms.take(tuple(w.shape), derive) if forms is not None and amx_rows is None else derive()
        if tag == "w4a8":
            return W4A8Linear(tensors, laid_out=True)
        if tag == "q8a16":
            return Q8A16Linear(tensors, laid_out=True)
        if tag == "q4_1" and amx_rows is not None:
            return PromptBf16Linear(tensors, w, amx_rows)
        if tag:
            return WeightOnlyLinear(w, tag, exact=tensors)
        quantization = "none"
    if quantization in ("int8", "q4_1"):
        if not on_cpu:
            raise QuantizationUnavailable(f"--quantization {quantization} runs on the CPU, not {w.device.type}")
        return WeightOnlyLinear(w, quantization)
    if quantization != "none":
        if not on_cpu or not fbgemm_available():
            raise QuantizationUnavailable(
                f"--quantization {quantization} needs torch's fbgemm CPU kernels"
                f" (device {w.device.type}, engines {torch.backends.quantized.supported_engines})")
        problem = fbgemm_cpu_problem(quantization)
        if problem:
            raise QuantizationUnavailable(problem)
        torch.backends.quantized.engine = "fbgemm"  # process-wide; the prepacked weights need it
        return W8A8Linear(w) if quantization == "w8a8" else Fp16Linear(w)
    if packed and on_cpu and w.dtype == torch.float32 and onednn_available():
        return OneDNNLinear(w)
    return PlainLinear(w)
