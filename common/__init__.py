"""The vocabulary every pdserve process shares, with no torch or numpy: sampling parameters and
the structured-output spec, request outputs and engine stats, errors, KV events and prefix
hashes, the tokenizer and detokenizer, and asyncio and thread utilities. The router imports
this and never the engine."""
