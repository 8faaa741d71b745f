"""OpenAI-compatible HTTP router (filled by the "Disaggregated serving" issue).

In: OpenAI requests from clients. Out: SSE/JSON responses. Calls decode workers over gRPC,
follows the global prefix index through KV events in Redis.
"""
