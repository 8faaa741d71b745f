"""LLMEngine and what it drives: scheduler, block manager, requests, model runner, config."""
