"""A step's LoRA: which rows of the flat batch run under which adapter, and the updates.

Rows of different adapters and of the base share one step (the base linear layers run once
over all rows); for each adapter present, its rows are gathered, `(x[rows] @ A.T) @ B.T` is
computed and added back into the base output at those rows (`index_add_`): one gather, two
small matmuls and one scatter per adapter and fused matrix, whatever the number of requests
or tokens (the segmented form of punica's / S-LoRA's gathered matmul, in torch ops). When one
adapter has every row of the step, the gather and scatter are skipped. On a model that runs
its C kernels (`native`), fp32 CPU updates are computed row by row by the C routine the C
decode step calls (engine/kernels/native/lora.c), so both paths give a row the same bits. On
CUDA (with triton installed), or where the model asks for it (`triton`: a model on the Triton
attention backend, the CPU then running Triton's interpreter in fp32), one Triton launch per
fused matrix updates every adapter's rows at once (engine/kernels/triton_lora.py: the
segmented gathered matmul, rows grouped by adapter once per step).

The runner builds a `LoRABatch` per step (None when no row has an adapter: the model then
runs exactly as without LoRA, the C decode step included); `LlamaForCausalLM.forward` (and
Gemma 3's) picks the kernels with `batch.use_kernels_of(model)` and hands each decoder layer
`batch.layer(i)`.
"""
from __future__ import annotations

import torch

from pdserve.engine.kernels.native import lora as native_lora
from pdserve.engine.model.lora import LoRAAdapter


class LoRALayer:
    """The step's adapters at one decoder layer."""

    def __init__(self, batch: "LoRABatch", index: int):
        self.batch, self.index = batch, index

    def add(self, fused: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y += each adapter's update of fused matrix `fused` ("qkv", "o", "gate_up", "down")
        at its rows, in place; x is that matrix's input (T, in), y its output (T, out)."""
        segments = self.batch.triton_segments(x, y)
        if segments is not None:
            from pdserve.engine.kernels import triton_lora
            return triton_lora.sgmv_add(x, y, segments, self.index, fused)
        for adapter, rows in self.batch.groups:
            m = adapter.layers[self.index].get(fused)
            if m is None:
                continue
            if self.batch.native and native_lora.usable(x, y, m.a):  # the C decode step's routine: the same bits
                native_lora.rows_add(x, y, m.a, native_lora.bt_of(m), rows)
            elif rows is None:
                y.addmm_(x @ m.a.T, m.b.T)  # (T, r) @ (r, out)
            else:
                y.index_add_(0, rows, (x.index_select(0, rows) @ m.a.T) @ m.b.T)
        return y


class LoRABatch:
    """Per adapter present in a step, the rows it runs on (None: every row)."""

    def __init__(self, groups: list[tuple[LoRAAdapter, torch.Tensor | None]]):
        self.groups = groups
        self.native = False  # fp32 CPU updates by the C routine (set where the model runs its C kernels)
        # the Triton kernel: None picks it on CUDA when triton is installed; True asks for it on
        # any device (the model sets it on the Triton attention backend); False never
        self.triton: bool | None = None
        self._segments = None  # triton_lora.Segments, built at the step's first Triton update

    @classmethod
    def of_spans(cls, spans: list[tuple[int, int, LoRAAdapter | None]], num_rows: int,
                 device: str | torch.device = "cpu") -> "LoRABatch | None":
        """From the step's (first row, end row, adapter or None for the base) spans; None if no
        span has an adapter."""
        by_id: dict[int, tuple[LoRAAdapter, list[tuple[int, int]]]] = {}
        for lo, hi, adapter in spans:
            if adapter is not None and hi > lo:
                by_id.setdefault(adapter.id, (adapter, []))[1].append((lo, hi))
        if not by_id:
            return None
        groups = []
        for adapter, ranges in by_id.values():
            if sum(hi - lo for lo, hi in ranges) == num_rows:
                groups.append((adapter, None))
            else:  # one arange per request's span, not a Python loop over tokens
                rows = torch.cat([torch.arange(lo, hi) for lo, hi in ranges]).to(device)
                groups.append((adapter, rows))
        return cls(groups)

    def use_kernels_of(self, model) -> None:
        """Follow the model's kernels: the C routine where it runs its C kernels, the Triton
        kernel where it runs the Triton attention backend (else on CUDA only)."""
        from pdserve.engine.kernels.attention import TritonAttentionBackend

        self.native = model.native_ops
        self.triton = True if isinstance(model.backend, TritonAttentionBackend) else None

    def layer(self, index: int) -> LoRALayer:
        return LoRALayer(self, index)

    def triton_segments(self, x: torch.Tensor, y: torch.Tensor):
        """The step's rows grouped by adapter for the Triton kernel (built once per step), or
        None where these tensors take the torch or C path."""
        if self.triton is False or (self.triton is None and not x.is_cuda) or not _triton_installed():
            return None
        from pdserve.engine.kernels import triton_lora

        dtype = next(m.a.dtype for a, _ in self.groups for layer in a.layers for m in layer.values())
        if not triton_lora.usable(x, y, dtype):
            return None
        if self._segments is None:
            self._segments = triton_lora.Segments(self.groups, x.shape[0], x.device)
        return self._segments

    @property
    def adapters(self) -> list[LoRAAdapter]:
        return [a for a, _ in self.groups]


def _triton_installed() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True
