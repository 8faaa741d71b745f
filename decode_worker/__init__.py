"""The decode service.

In: admitted requests from the router. Out: streamed token ids. Allocates KV blocks, has a
prefill worker fill them (or prefills locally), then decodes in its continuous batch.
"""
