"""The prefill service.

In: prompts with destination KV blocks on a decode worker. Out: the first token and the KV
blocks, pushed through kv_transfer. Runs the shared engine with a prefill-only policy.
"""
