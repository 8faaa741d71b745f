"""What reference checks (against transformers, between architectures) read out of an engine, and
the fp64 attention the bf16 attention kernels are checked against."""
from __future__ import annotations

import torch

from pdserve.common.sampling_params import SamplingParams
from pdserve.engine.core.engine import LLMEngine
from pdserve.engine.core.scheduler import ScheduledChunk


def engine_logits(engine: LLMEngine, ids: list[int]) -> torch.Tensor:
    """Logits at every prompt position from one prefill through the paged path."""
    req = engine._make_request("ref", ids, SamplingParams(max_tokens=1))
    assert engine.blocks.allocate("ref", len(ids))
    try:
        input_ids, positions, meta, _ = engine.runner._build([ScheduledChunk.of(req, len(ids))])
        with torch.inference_mode():
            engine.runner.model.backend.prepare(meta)
            hidden = engine.runner.model(input_ids, positions, engine.runner._kv_layers, meta)
            return engine.runner.model.compute_logits(hidden)
    finally:
        engine.blocks.free("ref")


def bf16_attention_reference(q, kc, vc, table: list[int], lens, query_bf16: bool = True) -> torch.Tensor:
    """fp64 attention of bf16-rounded keys and values and scaled queries (D = 64), the queries
    rounded to bf16 (the AMX kernel, amx_attention.c) or not (`query_bf16` False: the vector
    kernel, bf16_attention.c, which keeps ~16 bits of each)."""
    keys, vals = (torch.cat([c[b] for b in table]).bfloat16().double() for c in (kc, vc))
    g = q.shape[1] // kc.shape[2]
    out = torch.empty(q.shape, dtype=torch.float64)
    for i, n in enumerate(lens.tolist()):
        qs = (q[i] * 64 ** -0.5).bfloat16().double() if query_bf16 else q[i].double() * 64 ** -0.5
        for h in range(q.shape[1]):
            out[i, h] = torch.softmax(keys[:n, h // g] @ qs[h], 0) @ vals[:n, h // g]
    return out
