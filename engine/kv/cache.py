"""Paged KV cache tensors, sized from a memory budget.

One preallocated tensor `(layers, 2, num_blocks, block_size, n_kv_heads, head_dim)` holds K
(index 0) and V (index 1) of every layer, so the KV of a set of blocks is one indexed slice:
that is what export/import (the kv_transfer hook) move. In an 8-bit format the last
dimension also carries each row's scale (kv_format.py).
"""
from __future__ import annotations

import ctypes
import math
import mmap
import sys

import torch

from pdserve.engine.config import CacheConfig, ModelConfig
from pdserve.common.errors import KVTransferError
from pdserve.engine.kv.formats import CHOICES, FORMATS, KVFormat, format_of


def kv_format(choice: str, model_dtype: torch.dtype, device: str | torch.device,
              int8_activations: bool = False) -> KVFormat:
    """The cache's format for CacheConfig.kv_cache_dtype `choice` ("auto", "fp32", "bf16",
    "fp8", "int8"). "auto": bf16 for an fp32 model on the CPU whose matrices quantize their
    activations (`int8_activations`: numerics "auto" on a Q4_1 GGUF, which answer as llama.cpp
    does, and llama.cpp keeps 16-bit K/V too), else the model's dtype. bf16 K/V are half the
    bytes a decode step reads (a 32-row step at 300 tokens of context: ~440 -> ~220 MB) and
    ship, for no measurable perplexity (docs/performance.md, KV cache formats). Raises ValueError
    where no attention path reads it (on a GPU, a float dtype other than the model's: the Triton
    kernels read the model's or 8-bit codes)."""
    if choice == "auto":
        on_cpu_fp32 = str(device) == "cpu" and model_dtype == torch.float32
        return FORMATS["bfloat16"] if int8_activations and on_cpu_fp32 else format_of(model_dtype)
    want = FORMATS[CHOICES[choice]]
    if str(device) != "cpu" and not want.quantized and want.dtype != model_dtype:
        raise ValueError(f"--kv-cache-dtype {choice} with a {model_dtype} model runs on the CPU only "
                         f"(the GPU attention kernels read the model's dtype), not on {device}")
    return want


def engine_kv_format(config, model) -> KVFormat:
    """The format an engine of EngineConfig `config` gives `model`'s cache (`kv_format`; its
    "auto" asks whether the model's matrices quantize their activations)."""
    return kv_format(config.cache.kv_cache_dtype, getattr(torch, config.dtype), config.device,
                     model.int8_activation_matrices() > 0)


HUGE_PAGE = 2 << 20
MADV_HUGEPAGE = 14


def advise_huge_pages(t: torch.Tensor) -> bool:
    """Ask Linux to back the whole 2 MB pages inside `t`'s memory with transparent huge pages
    (before they are first touched); False where it did not take the advice (another OS, THP
    off). A decode step's attention reads each row's blocks from anywhere in the pool, and with
    4 KB pages nearly every block missed the TLB: 32 rows x 300 keys on one Xeon core 6-15%
    faster on huge pages (bench/NOTES.md)."""
    if sys.platform != "linux" or t.device.type != "cpu":
        return False
    start = t.data_ptr()
    lo, hi = -(-start // HUGE_PAGE) * HUGE_PAGE, (start + t.numel() * t.element_size()) // HUGE_PAGE * HUGE_PAGE
    if hi <= lo:
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return libc.madvise(lo, hi - lo, MADV_HUGEPAGE) == 0


def zeros_on_huge_pages(shape: tuple[int, ...], dtype: torch.dtype, device: str | torch.device) -> torch.Tensor:
    """torch.zeros, on transparent huge pages where the OS gives them (`advise_huge_pages`). On
    the CPU the memory is an anonymous mapping, zero until written and made by the OS page by
    page as blocks are first used: zeroing a 1 GB cache up front took 0.3 s on 4 KB pages and
    0.9-2.5 s on huge pages (the kernel compacts memory for each), in every worker's start, and
    held the whole budget in memory before a request used any of it."""
    count = math.prod(shape)
    if torch.device(device).type != "cpu" or not count:
        return torch.zeros(shape, dtype=dtype, device=device)
    memory = mmap.mmap(-1, count * dtype.itemsize)  # the tensor keeps it mapped
    t = torch.frombuffer(memory, dtype=dtype, count=count).view(shape)
    advise_huge_pages(t)
    return t


def bytes_per_block(model: ModelConfig, block_size: int, fmt: KVFormat) -> int:
    """K and V of every layer for one block, scales included."""
    return 2 * model.num_hidden_layers * block_size * model.num_key_value_heads * fmt.bytes_per_row(model.head_dim)


class KVCache:
    def __init__(self, model: ModelConfig, cache: CacheConfig, fmt: KVFormat | torch.dtype = torch.float32,
                 device: str | torch.device = "cpu"):
        self.format = fmt if isinstance(fmt, KVFormat) else format_of(fmt)
        self.head_dim = model.head_dim
        per_block = bytes_per_block(model, cache.block_size, self.format)
        self.num_blocks = cache.kv_cache_memory // per_block
        if self.num_blocks < 1:
            raise ValueError(
                f"kv_cache_memory={cache.kv_cache_memory} bytes holds no block: one block of "
                f"{cache.block_size} tokens needs {per_block} bytes for this model")
        self.block_size = cache.block_size
        self.bytes_per_block = per_block
        # zeros, not empty: padded attention slots must hold finite values (0 * NaN = NaN)
        self.kv = zeros_on_huge_pages((model.num_hidden_layers, 2, self.num_blocks, cache.block_size,
                                       model.num_key_value_heads, self.format.row_width(model.head_dim)),
                                      self.format.dtype, device)

    @property
    def layout(self) -> tuple[int, ...]:
        """(layers, 2, block_size, n_kv_heads, head_dim): what a KV import must match."""
        L, two, _, bs, h, _ = self.kv.shape
        return (L, two, bs, h, self.head_dim)

    def layers(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [(self.kv[i, 0], self.kv[i, 1]) for i in range(self.kv.shape[0])]

    def export_blocks(self, block_ids: list[int], layers: tuple[int, int] | None = None) -> torch.Tensor:
        """A copy of these blocks' KV, (layers, 2, len(block_ids), block_size, n_kv, hd);
        `layers`: only layers [start, end)."""
        kv = self.kv if layers is None else self.kv[layers[0]:layers[1]]
        return kv[:, :, torch.tensor(block_ids, dtype=torch.long)].clone()

    def import_blocks(self, block_ids: list[int], data: torch.Tensor) -> None:
        expected = (self.kv.shape[0], 2, len(block_ids), *self.kv.shape[3:])
        if tuple(data.shape) != expected:
            raise KVTransferError(f"KV data has shape {tuple(data.shape)}, expected {expected}")
        if data.dtype != self.kv.dtype:
            raise KVTransferError(f"KV data has dtype {data.dtype}, the cache holds {self.format.name}")
        self.kv[:, :, torch.tensor(block_ids, dtype=torch.long)] = data.to(self.kv.device)
