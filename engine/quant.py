"""Linear-layer kernels: how `x @ W.T` runs, chosen once per weight matrix at load.

A decode step at small batch is bound by the bytes of weights it reads, so the kernel is where
weight-only quantization pays (SmolLM2-135M: 540 MB of fp32 weights per step, 135 MB in int8).

- `PlainLinear`: `F.linear` (GPUs, bf16/fp16 models, or no oneDNN).
- `OneDNNLinear`: fp32 on a oneDNN-blocked copy of the weight (the CPU default).
- `Int8Linear`: int8 weights, one scale per output channel; each activation row is quantized
  on the fly with its own scale and the GEMM runs in int8 with int32 accumulation (fbgemm).
- `Fp16Linear`: fp16 weights, fp32 activations and math (fbgemm): half the bytes, ~lossless.

Every kernel is batch invariant: a row's result does not depend on the other rows in the
batch, so a request's greedy output is the same alone or batched.
"""
from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F

QUANTIZATIONS = ("none", "int8", "fp16")


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


class Int8Linear:
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


def make_linear(w: torch.Tensor, quantization: str = "none", packed: bool = True):
    """The kernel for one (out, in) weight. `quantization` is one of QUANTIZATIONS; with
    "none", `packed` picks oneDNN's layout for fp32 CPU weights."""
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {quantization!r}")
    on_cpu = w.device.type == "cpu"
    if quantization != "none":
        if not on_cpu or not fbgemm_available():
            raise QuantizationUnavailable(
                f"--quantization {quantization} needs torch's fbgemm CPU kernels"
                f" (device {w.device.type}, engines {torch.backends.quantized.supported_engines})")
        torch.backends.quantized.engine = "fbgemm"
        return Int8Linear(w) if quantization == "int8" else Fp16Linear(w)
    if packed and on_cpu and w.dtype == torch.float32 and onednn_available():
        return OneDNNLinear(w)
    return PlainLinear(w)
