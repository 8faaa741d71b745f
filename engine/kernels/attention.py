"""Attention over the paged KV cache, behind a small kernel interface.

The runner describes one step in backend-neutral terms (`AttentionMetadata`: where each new
token's K/V goes, the block table of every decoding request, the spans of prefill chunks);
a backend writes the new K/V into the cache and computes attention. `TorchAttentionBackend`
is the reference (CPU and GPU); a Triton backend can replace it without touching the model
or the scheduler.

Row layout of a step: the first `num_decode_tokens` rows are decode tokens (one per request),
then the prefill chunks, each a contiguous span of rows.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.nn.functional as F

from pdserve.engine.kernels import native
from pdserve.engine.kv import formats as kv_format


def window_tables(tables: torch.Tensor, lens: torch.Tensor, window: int,
                  block_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The (tables, lens, skips) with which each row attends only to its last `window` keys:
    its table starts at the block holding its window's first key, its length counts from
    there, and `skips` masks the keys of that block before the window. The kernel then
    reads at most window + block_size - 1 keys a row, whatever the context."""
    start = (lens - window).clamp(min=0)
    first = start // block_size
    width = tables.shape[1]
    cols = (torch.arange(width, device=tables.device).unsqueeze(0) + first.unsqueeze(1)).clamp(max=width - 1)
    return (tables.gather(1, cols).contiguous(), (lens - first * block_size).contiguous(),
            (start - first * block_size).contiguous())


@dataclass
class PrefillSpan:
    """One request's prefill chunk: rows [start, end) of the step, after `num_cached` tokens
    whose K/V are already in the cache (a prefix-cache hit or an earlier chunk). Its first
    `prompt_rows` rows are prompt tokens (the rest: generated tokens recomputed, or speculative
    drafts), which a model with AMX prompt rows computes in bf16 (engine/model/quant.py)."""

    start: int
    end: int
    num_cached: int
    block_table: list[int]
    prompt_rows: int = 0


# meta.backend_state's key for the step's prompt rows ((start, end) ranges) where the model runs
# them in bf16 on AMX (engine/model/quant.PromptRows): their attention then does too
AMX_PROMPT_ROWS = "amx_prompt_rows"
# meta.backend_state's key for the position from which the model's prompt rows attend in bf16
# (AVX-512 BF16 vectors, engine/kernels/native/bf16_attention.c), where it has no AMX prompt rows
BF16_PROMPTS_FROM = "bf16_prompts_from"
# That position under "auto" on a CPU with AVX-512 BF16: a long prompt's attention is most of
# its prefill in fp32 (2,048 tokens: half of it on a Zen 4), and in bf16 it runs 2-3x faster
# (a 250-token prefill 7% faster from 128 on); below it bf16 gains nothing measurable (64- and
# 128-token prompts), and each row it takes is rounded a little more (perplexity on 1,024-token
# windows +0.0 / +0.3 / +0.4% against fp32 attention, bench/NOTES.md), so those rows stay fp32
BF16_ATTENTION_FROM = 128


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor          # (T,) flat cache slot of each new token's K/V
    num_decode_tokens: int
    decode_block_tables: torch.Tensor   # (D, max_blocks) block ids, padded with 0
    decode_seq_lens: torch.Tensor       # (D,) tokens in context incl. the new one
    prefills: list[PrefillSpan]
    block_size: int
    backend_state: dict = field(default_factory=dict)  # per-step tensors a backend derives once

    def prompt_ranges(self) -> list[tuple[int, int]]:
        """The (start, end) rows of the step that are prompt tokens."""
        return [(sp.start, sp.start + sp.prompt_rows) for sp in self.prefills if sp.prompt_rows]

    def prompt_ranges_from(self, position: int) -> list[tuple[int, int]]:
        """The (start, end) rows of the step that are prompt tokens at `position` or later (a
        span's row i is at position num_cached + i)."""
        spans = ((sp.start + max(0, position - sp.num_cached), sp.start + sp.prompt_rows) for sp in self.prefills)
        return [(lo, hi) for lo, hi in spans if lo < hi]

    def bf16_prompt_ranges(self) -> list[tuple[int, int]]:
        """The rows whose attention runs in bf16 vectors (BF16_PROMPTS_FROM): none unless the
        model set that position for this step."""
        position = self.backend_state.get(BF16_PROMPTS_FROM)
        return [] if position is None or not self.prefills else self.prompt_ranges_from(position)


class AttentionBackend(Protocol):
    def prepare(self, meta: AttentionMetadata) -> None:
        """Derive per-step tensors once (shared by every layer)."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: AttentionMetadata, window: int = 0) -> torch.Tensor:
        """q: (T, n_heads, hd); k, v: (T, n_kv, hd); caches: (num_blocks, block_size, n_kv, hd).
        Stores k/v at `meta.slot_mapping` and returns the attention output (T, n_heads, hd).
        window > 0: each query sees only the last `window` keys up to its own (sliding-window
        attention); 0: all of them."""


def _flat(cache: torch.Tensor) -> torch.Tensor:
    """A layer's paged K or V as (slots, n_kv, row_width)."""
    return cache.view(-1, *cache.shape[2:])


def _gather(cache: torch.Tensor, index: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows `index` of a paged K or V (blocks of (num_blocks, bs, n_kv, W), or slots of its
    flat view) as `dtype` (..., head_dim). index_select copies whole rows; advanced indexing
    is ~5x slower here."""
    if not kv_format.format_of(cache.dtype).quantized:
        return cache.index_select(0, index).to(dtype)
    return kv_format.decode(cache.view(torch.uint8).index_select(0, index).view(cache.dtype), dtype)


class TorchAttentionBackend:
    """Reference backend: gathers each request's cached K/V and calls SDPA."""

    def prepare(self, meta: AttentionMetadata) -> None:
        st = meta.backend_state
        bs = meta.block_size
        if meta.num_decode_tokens:
            self._decode_plan(meta)
        spans = []
        for sp in meta.prefills:
            n = sp.end - sp.start
            if sp.num_cached == 0:
                spans.append((sp, None))
                continue
            ctx = sp.num_cached + n
            dev = meta.slot_mapping.device  # everything on the cache's device (CPU or CUDA)
            table = torch.tensor(sp.block_table[: (ctx + bs - 1) // bs], dtype=torch.long, device=dev)
            slots = (table.unsqueeze(-1) * bs + torch.arange(bs, device=dev)).reshape(-1)[:ctx]
            spans.append((sp, slots))
        st["prefill_spans"] = spans

    def _decode_plan(self, meta: AttentionMetadata) -> None:
        """The decode rows' gather: whole blocks (contiguous 16-token runs), not single slots
        (far fewer, larger copies); padding entries point at block 0 and are masked out."""
        st, bs = meta.backend_state, meta.block_size
        n_blocks = (int(meta.decode_seq_lens.max()) + bs - 1) // bs
        st["decode_blocks"] = meta.decode_block_tables[:, :n_blocks].reshape(-1)
        st["decode_pos"] = torch.arange(n_blocks * bs, device=meta.decode_seq_lens.device)

    def _decode_mask(self, meta: AttentionMetadata, window: int) -> torch.Tensor:
        """The decode rows' additive float mask (D, 1, 1, L), built once a step per window:
        SDPA would convert a bool mask in every layer."""
        st = meta.backend_state
        key = ("decode_mask", window)
        if key not in st:
            if "decode_blocks" not in st:
                self._decode_plan(meta)
            pos, lens = st["decode_pos"].unsqueeze(0), meta.decode_seq_lens.unsqueeze(1)
            valid = (pos < lens) & ((pos >= lens - window) if window else True)
            valid = valid[:, None, None, :]
            st[key] = torch.zeros(valid.shape, device=valid.device).masked_fill_(~valid, float("-inf"))
        return st[key]

    @staticmethod
    def _span_mask(st: dict, i: int, sp: PrefillSpan, ctx: int, window: int, device) -> torch.Tensor:
        """(1, 1, n, ctx), once a step per span and window: query j, at absolute position
        num_cached + j, sees the keys up to its own (with a window, only the last `window`)."""
        key = ("span_mask", i, window)
        if key not in st:
            qpos = (sp.num_cached + torch.arange(sp.end - sp.start, device=device)).unsqueeze(1)
            kpos = torch.arange(ctx, device=device).unsqueeze(0)
            mask = kpos <= qpos
            if window:
                mask &= kpos > qpos - window
            st[key] = mask[None, None]
        return st[key]

    def forward(self, q, k, v, k_cache, v_cache, meta, window: int = 0):
        self.store(k, v, k_cache, v_cache, meta)
        out = torch.empty_like(q)
        D = meta.num_decode_tokens
        if D:
            out[:D] = self.decode(q[:D], k_cache, v_cache, meta, window)
        self.prefill(q, k, v, k_cache, v_cache, meta, out, window)
        return out

    def store(self, k, v, k_cache, v_cache, meta) -> None:
        """Write the step's new K/V into their cache slots (rounded to the cache's dtype)."""
        fmt = kv_format.format_of(k_cache.dtype)
        for new, cache in ((k, k_cache), (v, v_cache)):
            rows = kv_format.encode(new, fmt)  # (T, n_kv, row_width)
            # as bytes: index_copy_ has no 8-bit float kernel
            if fmt.quantized:
                _flat(cache).view(torch.uint8).index_copy_(0, meta.slot_mapping, rows.view(torch.uint8))
            else:
                _flat(cache).index_copy_(0, meta.slot_mapping, rows)

    def decode(self, q, k_cache, v_cache, meta, window: int = 0) -> torch.Tensor:
        """Attention of the decode rows (one query per sequence) over their cached keys."""
        D, n_kv, hd = q.shape[0], k_cache.shape[2], q.shape[2]
        mask = self._decode_mask(meta, window)
        blocks = meta.backend_state["decode_blocks"]
        kd = _gather(k_cache, blocks, q.dtype).view(D, -1, n_kv, hd).transpose(1, 2)  # (D, n_kv, L, hd)
        vd = _gather(v_cache, blocks, q.dtype).view(D, -1, n_kv, hd).transpose(1, 2)
        o = F.scaled_dot_product_attention(q.unsqueeze(2), kd, vd, attn_mask=mask, enable_gqa=True)
        return o.squeeze(2)

    def prefill(self, q, k, v, k_cache, v_cache, meta, out, window: int = 0) -> None:
        """Attention of each prefill span (causal, over its cached prefix too) into `out`."""
        k_flat, v_flat = _flat(k_cache), _flat(v_cache)
        if k_cache.dtype != q.dtype:  # attend to what the cache holds, rounded as stored
            fmt = kv_format.format_of(k_cache.dtype)
            k, v = (kv_format.decode(kv_format.encode(x, fmt), q.dtype) for x in (k, v))
        st = meta.backend_state
        for i, (sp, slots) in enumerate(st["prefill_spans"]):
            n = sp.end - sp.start
            qs = q[sp.start:sp.end].transpose(0, 1).unsqueeze(0)  # (1, n_heads, n, hd)
            if slots is None:  # nothing cached before this chunk: attend within it, causally
                ks = k[sp.start:sp.end].transpose(0, 1).unsqueeze(0)
                vs = v[sp.start:sp.end].transpose(0, 1).unsqueeze(0)
                if window and window < n:
                    mask = self._span_mask(st, i, sp, n, window, q.device)
                    o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, enable_gqa=True)
                else:
                    o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True)
            else:
                ks = _gather(k_flat, slots, q.dtype).transpose(0, 1).unsqueeze(0)  # (1, n_kv, ctx, hd)
                vs = _gather(v_flat, slots, q.dtype).transpose(0, 1).unsqueeze(0)
                mask = self._span_mask(st, i, sp, sp.num_cached + n, window, q.device)
                o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, enable_gqa=True)
            out[sp.start:sp.end] = o.squeeze(0).transpose(0, 1)


class TritonAttentionBackend(TorchAttentionBackend):
    """The GPU path: new K/V written by a Triton kernel, decode attention read from the paged
    blocks in place (no per-layer gather into a dense copy); prefill spans as in the torch
    backend. Chosen automatically on CUDA when triton is installed."""

    def prepare(self, meta: AttentionMetadata) -> None:
        decode_tokens, meta.num_decode_tokens = meta.num_decode_tokens, 0  # no gather plan needed
        try:
            super().prepare(meta)
        finally:
            meta.num_decode_tokens = decode_tokens

    def store(self, k, v, k_cache, v_cache, meta) -> None:
        if kv_format.format_of(k_cache.dtype).quantized:  # quantized by torch ops: a step's new rows only
            return super().store(k, v, k_cache, v_cache, meta)
        from pdserve.engine.kernels.triton_kernels import store_kv
        store_kv(k, v, k_cache, v_cache, meta.slot_mapping)

    def decode(self, q, k_cache, v_cache, meta, window: int = 0) -> torch.Tensor:
        if window:  # sliding-window layers: the torch path (its gather plan made on first use)
            return super().decode(q, k_cache, v_cache, meta, window)
        from pdserve.engine.kernels.triton_kernels import paged_decode_attention
        return paged_decode_attention(q, k_cache, v_cache, meta.decode_block_tables, meta.decode_seq_lens).to(q.dtype)


class NativeAttentionBackend(TorchAttentionBackend):
    """The CPU path (fp32): every row of a step, decode or prefill, attends by one C kernel
    (engine/kernels/native/attention.c) that reads its sequence's K/V from the paged blocks in place
    (the torch backend first copies them into a dense tensor per layer; at 32 streams that
    copy plus SDPA took ~30% of a decode step). A prefill row is a query at its position over
    the keys up to it, written into the cache just before: so a row's attention is the same
    float computation whether its prefix was cached, its prompt chunked, its batch larger or
    it was a speculative guess (with int8 activations, "auto", a rounding difference there
    would otherwise change outputs). 4x faster than SDPA on this CPU from 64 to 2,000 tokens."""

    def prepare(self, meta: AttentionMetadata) -> None:
        self._rows(meta)
        st = meta.backend_state
        # converted and checked once per step, not in each layer's call
        st["tables"], st["lens"] = native.paged_attention_tables(st["tables"], st["lens"], meta.block_size)

    def _rows(self, meta: AttentionMetadata) -> None:
        """Every row's block table and length into meta.backend_state."""
        st = meta.backend_state
        if not meta.prefills:
            st["tables"], st["lens"] = meta.decode_block_tables, meta.decode_seq_lens
            return
        dev = meta.slot_mapping.device
        width = max([len(sp.block_table) for sp in meta.prefills] + [meta.decode_block_tables.shape[1]])
        tables, lens = [], []
        if meta.num_decode_tokens:
            dt = meta.decode_block_tables
            tables.append(F.pad(dt, (0, width - dt.shape[1])) if dt.shape[1] < width else dt)
            lens.append(meta.decode_seq_lens)
        for sp in meta.prefills:
            n = sp.end - sp.start
            row = torch.zeros(width, dtype=torch.long, device=dev)
            row[:len(sp.block_table)] = torch.tensor(sp.block_table, dtype=torch.long, device=dev)
            tables.append(row.expand(n, width))
            lens.append(torch.arange(sp.num_cached + 1, sp.num_cached + n + 1, device=dev))
        st["tables"], st["lens"] = torch.cat(tables), torch.cat(lens)

    def forward(self, q, k, v, k_cache, v_cache, meta, window: int = 0):
        self.store(k, v, k_cache, v_cache, meta)
        tables, lens, skips = self._rows_for(meta, window)
        if meta.prefills and kv_format.format_of(k_cache.dtype).quantized:
            return self._forward_8bit_prefill(q, k_cache, v_cache, meta, window)
        prompt, tiles = meta.backend_state.get(AMX_PROMPT_ROWS), True
        if not prompt:
            prompt, tiles = meta.bf16_prompt_ranges(), False
        if prompt and not window:
            from pdserve.engine.kernels.native import amx
            if amx.attention_fits(q, k_cache):
                return self._forward_bf16_prompts(q, k_cache, v_cache, tables, lens, prompt, tiles)
        return native.paged_decode_attention(q, k_cache, v_cache, tables, lens, checked=True, skips=skips)

    @staticmethod
    def _forward_bf16_prompts(q, k_cache, v_cache, tables, lens, prompt: list[tuple[int, int]],
                              tiles: bool) -> torch.Tensor:
        """The prompt rows (`prompt`: (start, end) ranges) in bf16, on AMX tiles
        (engine/kernels/native/amx_attention.c) or in AVX-512 BF16 vectors (bf16_attention.c),
        every other row by the fp32 kernel."""
        from pdserve.engine.kernels.native import amx
        out, at, t = torch.empty_like(q), 0, q.shape[0]
        for lo, hi in [*prompt, (t, t)]:
            if at < lo:
                out[at:lo] = native.paged_decode_attention(q[at:lo], k_cache, v_cache, tables[at:lo], lens[at:lo],
                                                           checked=True)
            if lo < hi:
                out[lo:hi] = amx.attention(q[lo:hi], k_cache, v_cache, tables[lo:hi], lens[lo:hi], tiles)
            at = hi
        return out

    def _rows_for(self, meta: AttentionMetadata, window: int):
        """Every row's (tables, lens, skips): as prepared, or (once a step per window) cut to
        the blocks of each row's window."""
        st = meta.backend_state
        if not window:
            return st["tables"], st["lens"], None
        key = ("window", window)
        if key not in st:
            st[key] = window_tables(st["tables"], st["lens"], window, meta.block_size)
        return st[key]

    def _forward_8bit_prefill(self, q, k_cache, v_cache, meta, window: int = 0) -> torch.Tensor:
        """A step with prefill rows over an 8-bit cache: the prompts' blocks are decoded once
        (not once per row: a 4k-token prompt's rows would decode ~8M key rows per layer), and
        the prefill rows attend over that fp32 copy of them. The 8-bit kernel is bitwise the
        fp32 kernel over the decoded rows, so a row's result is the same either way."""
        st, D = meta.backend_state, meta.num_decode_tokens
        tables, lens, skips = self._rows_for(meta, window)
        key = ("prefill_blocks", window)
        if key not in st:  # once per step: the prompts' blocks, and the rows' tables into their copy
            blocks, local = torch.unique(tables[D:], return_inverse=True)
            st[key] = blocks, local.to(torch.int64).contiguous()
        blocks, local_tables = st[key]
        out = torch.empty_like(q)
        if D:
            out[:D] = native.paged_decode_attention(q[:D], k_cache, v_cache, tables[:D], lens[:D], checked=True,
                                                    skips=None if skips is None else skips[:D])
        kf, vf = (kv_format.decode(c.view(torch.uint8).index_select(0, blocks).view(c.dtype)).contiguous()
                  for c in (k_cache, v_cache))
        out[D:] = native.paged_decode_attention(q[D:], kf, vf, local_tables, lens[D:], checked=True,
                                                skips=None if skips is None else skips[D:])
        return out

    def store(self, k, v, k_cache, v_cache, meta) -> None:
        """8-bit caches quantized by one C call per tensor (torch's ops took ~10 ms of a 30-layer
        decode step at one row); float caches by index_copy_."""
        if not kv_format.format_of(k_cache.dtype).quantized:
            return super().store(k, v, k_cache, v_cache, meta)
        native.kv_store_8bit(k, k_cache, meta.slot_mapping)
        native.kv_store_8bit(v, v_cache, meta.slot_mapping)

    def decode(self, q, k_cache, v_cache, meta, window: int = 0) -> torch.Tensor:
        """The decode rows alone (one query per sequence)."""
        tables, lens, skips = meta.decode_block_tables, meta.decode_seq_lens, None
        if window:
            tables, lens, skips = window_tables(tables.to(torch.int64), lens.to(torch.int64), window,
                                                       meta.block_size)
        return native.paged_decode_attention(q, k_cache, v_cache, tables, lens, skips=skips)


ATTENTION_BACKENDS = ("auto", "torch", "native", "triton")


def default_backend(device: str, dtype: torch.dtype = torch.float32, choice: str = "auto") -> AttentionBackend:
    """Triton kernels on CUDA (when triton is installed), the native C kernel on CPU in fp32
    (when it builds), the torch reference otherwise. An explicit `choice` that cannot run here
    raises instead of falling back."""
    if choice not in ATTENTION_BACKENDS:
        raise ValueError(f"attention backend must be one of {', '.join(ATTENTION_BACKENDS)}, got {choice!r}")
    if choice == "torch":
        return TorchAttentionBackend()
    on_cuda = str(device).startswith("cuda")
    if choice == "triton" or (choice == "auto" and on_cuda):
        try:
            import triton  # noqa: F401
            return TritonAttentionBackend()
        except ImportError:
            if choice == "triton":
                raise
            return TorchAttentionBackend()
    if str(device) == "cpu" and dtype == torch.float32:
        from pdserve.engine.kernels.native import NativeKernelUnavailable, load
        try:
            load()
            return NativeAttentionBackend()
        except NativeKernelUnavailable:
            if choice == "native":
                raise
    elif choice == "native":
        raise ValueError(f"the native attention kernel runs on the CPU in float32, not {device} {dtype}")
    return TorchAttentionBackend()
