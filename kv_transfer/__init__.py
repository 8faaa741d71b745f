"""KV block transport (filled by the "Disaggregated serving" issue).

In: KV blocks exported by a prefill engine. Out: the same blocks imported into a decode
engine's pre-allocated blocks, checked (header, checksum) and leased.
"""
