"""The shared LLM engine that prefill and decode workers both run.

In: token ids (or text via `Tokenizer`) and `SamplingParams`. Out: generated token ids with
finish reasons, step by step. Inside: a Llama-family model (`model.py`, loaded by `weights.py`),
a paged KV cache (`kv_cache.py`) managed block by block with prefix hashing
(`block_manager.py`), a continuous-batching scheduler (`scheduler.py`), attention kernels
behind one interface (`attention.py`), the sampler (`sampler.py`) and text handling
(`tokenizer.py`, `detokenizer.py`). `LLMEngine` (`engine.py`) ties them together; no
networking, Ray or HTTP here.
"""
