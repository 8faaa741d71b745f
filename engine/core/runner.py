"""Model runner: turns a scheduled step into input tensors, runs the model, returns logits.

Rows are laid out decode-first (one row per request taking a single token) and then each
prefill chunk as a contiguous span, which is the layout `AttentionMetadata` describes.
Logits are computed only for rows whose request completes this step.
"""
from __future__ import annotations

import torch

from pdserve.engine.kernels.attention import AttentionMetadata, PrefillSpan
from pdserve.engine.core.block_manager import BlockManager
from pdserve.engine.kv.cache import KVCache
from pdserve.engine.model.llama import LlamaForCausalLM
from pdserve.engine.model.lora_batch import LoRABatch
from pdserve.engine.core.scheduler import ScheduledChunk


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, kv_cache: KVCache, blocks: BlockManager, tp=None):
        """`tp`: the tensor-parallel group (engine/parallel/tp.py) this runner is rank 0 of."""
        self.model, self.tp = model, tp
        self.kv_cache = kv_cache
        self.blocks = blocks
        self.block_size = kv_cache.block_size
        self._kv_layers = kv_cache.layers()
        self.device = kv_cache.kv.device
        self._prompt_spans: list = []
        self._all_rows: frozenset[str] = frozenset()

    def _build(self, chunks: list[ScheduledChunk]):
        bs = self.block_size
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        decode_tables: list[list[int]] = []
        decode_lens: list[int] = []
        spans: list[PrefillSpan] = []
        sample_rows: list[int] = []
        split = self.model.prompt_rows is not None  # prompt rows run apart: a 1-token prompt chunk is a span
        for c in chunks:
            req = c.request
            start, n = req.num_computed_tokens, c.num_new_tokens
            table = self.blocks.block_table(req.request_id)
            row = len(ids)
            ids.extend(req.all_token_ids[start:start + n])
            pos.extend(range(start, start + n))
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, start + n))
            prompt = min(n, max(req.num_prompt_tokens - start, 0))
            if n == 1 and not (split and prompt):
                decode_tables.append(table)
                decode_lens.append(start + 1)
            else:
                spans.append(PrefillSpan(row, row + n, start, table, prompt))
            if req.request_id in self._all_rows:  # speculative chunk: every position is checked
                sample_rows.extend(range(row, row + n))
            elif c.completes:
                sample_rows.append(row + n - 1)
            if req.params.prompt_logprobs is not None and start + 1 < req.num_prompt_tokens:
                self._prompt_spans.append((req, row, start, n))
        width = max((len(t) for t in decode_tables), default=0)
        tables = torch.tensor([t + [0] * (width - len(t)) for t in decode_tables], dtype=torch.long).reshape(len(decode_tables), width)
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=self.device),
            num_decode_tokens=len(decode_tables), decode_block_tables=tables.to(self.device),
            decode_seq_lens=torch.tensor(decode_lens, dtype=torch.long, device=self.device),
            prefills=spans, block_size=bs)
        return (torch.tensor(ids, dtype=torch.long, device=self.device),
                torch.tensor(pos, dtype=torch.long, device=self.device), meta, sample_rows)

    def _order(self, chunks: list[ScheduledChunk]) -> list[ScheduledChunk]:
        """Decode rows first (the attention backend expects that layout), then the spans; a
        1-token prompt chunk is a span where the model runs prompt rows apart (`_build`)."""
        split = self.model.prompt_rows is not None
        one = [c.num_new_tokens == 1 and not (split and c.request.num_computed_tokens < c.request.num_prompt_tokens)
               for c in chunks]
        return [c for c, o in zip(chunks, one) if o] + [c for c, o in zip(chunks, one) if not o]

    @torch.inference_mode()
    def execute(self, chunks: list[ScheduledChunk], after_layer=None,
                all_rows: frozenset[str] = frozenset()) -> tuple[list[ScheduledChunk], torch.Tensor]:
        """Run one step. Returns the chunks that complete (in row order) and their logits:
        one row each, or every row of the chunks of the requests in `all_rows`.
        after_layer(i): called as soon as layer i has written this step's K/V (in a pipeline,
        for every layer once the pass is through)."""
        ordered = self._order(chunks)
        self._prompt_spans, self._all_rows = [], all_rows
        input_ids, positions, meta, sample_rows = self._build(ordered)
        passes = self._prompt_passes()
        sampled = None if len(sample_rows) == input_ids.shape[0] else sample_rows  # None: every row
        lora = self._lora_batch(ordered)
        if self.tp is not None:  # the other ranks run the same step (its rows' adapters too), and the same logits passes
            self.tp.step(input_ids, positions, meta, [(lo, hi) for _, _, lo, hi in passes], sampled,
                         getattr(after_layer, "tp_plan", None), lora)
        self.model.backend.prepare(meta)
        # a pipeline's layers run on several ranks: their KV streams once the pass is through (pp.py)
        staged, after_layer = (after_layer, None) if getattr(self.tp, "pipeline", False) else (None, after_layer)
        if lora is None:
            hidden = self.model(input_ids, positions, self._kv_layers, meta, after_layer)
        else:  # only LlamaForCausalLM's forward takes a LoRA batch (the registry refuses others)
            hidden = self.model(input_ids, positions, self._kv_layers, meta, after_layer, lora=lora)
        if staged is not None:
            for i in range(self.model.config.num_hidden_layers):
                staged(i)
        for req, first, lo, hi in passes:
            self._prompt_logprobs(req, hidden[lo:hi], first)
        logits = self.model.compute_logits(hidden if sampled is None else hidden[sampled])
        return [c for c in ordered if c.completes], logits

    @torch.inference_mode()
    def launch(self, chunks: list[ScheduledChunk]):
        """A pipeline's rank 0: start one micro-batch (no prompt logprobs, layer streams nor
        adapters; engine/core/micro_batches.py): the step goes to the other stages and this
        stage's layers run; its result lands later (`land`, micro-batches in launch order)."""
        ordered = self._order(chunks)
        self._prompt_spans, self._all_rows = [], frozenset()
        input_ids, positions, meta, sample_rows = self._build(ordered)
        sampled = None if len(sample_rows) == input_ids.shape[0] else sample_rows
        self.tp.step(input_ids, positions, meta, [], sampled)
        self.model.backend.prepare(meta)
        self.model.pp.defer = True
        try:
            self.model(input_ids, positions, self._kv_layers, meta, None)
        finally:
            self.model.pp.defer = False
        return ordered, sampled

    @torch.inference_mode()
    def land(self, launched) -> tuple[list[ScheduledChunk], torch.Tensor]:
        """The oldest micro-batch in flight's completing chunks and logits (as `execute`'s)."""
        ordered, sampled = launched
        hidden = self.model.pp.land(self.device)
        return [c for c in ordered if c.completes], self.model.compute_logits(hidden if sampled is None else hidden[sampled])

    def _lora_batch(self, ordered: list[ScheduledChunk]) -> LoRABatch | None:
        """Which rows run under which adapter (rows laid out as `_build` does); None: no adapter."""
        spans, row = [], 0
        for c in ordered:
            spans.append((row, row + c.num_new_tokens, c.request.lora))
            row += c.num_new_tokens
        return LoRABatch.of_spans(spans, row, self.device)

    def _prompt_passes(self, rows_per_pass: int = 64) -> list[tuple]:
        """The prompt-logprob passes of this step, (request, position of its first row, first
        row, end row): a few rows at a time, as full-vocabulary logits of a long prompt would
        not fit."""
        passes = []
        for req, row, start, n in self._prompt_spans:
            end = min(n, req.num_prompt_tokens - 1 - start)  # rows that predict a prompt token
            passes += [(req, start + a, row + a, row + min(end, a + rows_per_pass)) for a in range(0, end, rows_per_pass)]
        return passes

    def _prompt_logprobs(self, req, hidden: torch.Tensor, first: int) -> None:
        """Append the logprobs of the prompt tokens that `hidden`'s rows (positions first..)
        predict to `req.prompt_logprobs`. Recomputed positions (after a preemption) are not
        appended twice."""
        from pdserve.common.outputs import TokenLogprobs

        if req.prompt_logprobs is None:
            req.prompt_logprobs = []
        k = req.params.prompt_logprobs
        lp = torch.log_softmax(self.model.compute_logits(hidden).float(), dim=-1)
        top = torch.topk(lp, k, dim=-1) if k else None
        for j in range(lp.shape[0]):
            target = first + j + 1
            if target != len(req.prompt_logprobs) + 1:
                continue
            tok = req.all_token_ids[target]
            req.prompt_logprobs.append(TokenLogprobs(tok, float(lp[j, tok]), list(zip(
                top.indices[j].tolist(), top.values[j].tolist())) if top is not None else []))
