"""Python's cyclic garbage collector kept off the startup heap.

A full collection walks every container object alive: in a worker or the router after start-up
that is ~225-280k objects (modules, functions, types of torch, gRPC, FastAPI...), and each full
collection took 43-234 ms beside a 48-stream flood on the Xeon, holding the GIL, so an urgent
client's token waited that long (bench/NOTES.md). `freeze_startup` collects once and moves
everything alive to the permanent generation, which later collections skip: they walk only
what was made since (requests, outputs, metrics)."""
from __future__ import annotations

import gc


def freeze_startup() -> int:
    """Collect, then freeze every object alive now; returns how many were frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
