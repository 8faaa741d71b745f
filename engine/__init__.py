"""The LLM engine that prefill and decode workers both run, in rooms:

- `core/`: `LLMEngine` (`engine.py`) and its async wrapper, the scheduler, the block manager,
  requests, the model runner, the engine's config and flags;
- `kv/`: the paged KV cache (`cache.py`) and its formats (fp32, bf16, int8/fp8 codes: `formats.py`);
- `model/`: architectures (`llama.py`, `gemma3.py`), weight loading, weight quantization, export;
- `kernels/`: attention backends, Triton kernels, the native C kernels;
- `sampling/`: the sampler, grammar masks, n-gram and draft-model speculation;
- `parallel/`: tensor parallelism and core sharing.

In: token ids and `SamplingParams` (`pdserve.common`). Out: tokens with finish reasons, step
by step. No networking, Ray or HTTP here.
"""
