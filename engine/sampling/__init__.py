"""Sampling: the sampler, grammar masks, n-gram and draft-model speculation."""
