"""What reference checks (against transformers, between architectures) read out of an engine."""
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
