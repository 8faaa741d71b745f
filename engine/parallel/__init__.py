"""Tensor, expert and pipeline parallelism across processes of one worker, and core sharing between workers."""
