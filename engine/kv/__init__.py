"""The paged KV cache and its storage formats (fp32, bf16, int8 and fp8 codes with a scale per row),
the tiers under it (tiers.py) and its blocks by content hash for peer pulls (peer.py)."""
