"""Running an in-process engine to its end, and checking it is left clean: shared by the
tests that compare a split engine (tensor or pipeline parallel) with one engine."""
from __future__ import annotations

import os
import signal

import pytest

from pdserve.common.sampling_params import SamplingParams
from pdserve.engine.parallel.tp import RankFailed

GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, logprobs=3)


def clean(e) -> None:
    """Nothing left running and every KV block back in the pool."""
    assert not e.has_unfinished_requests() and e.blocks.num_used_blocks == 0
    e.blocks.check_invariants()


def run(e, ps, params: SamplingParams = GREEDY) -> tuple[list[list[int]], list[list[float]]]:
    """Each prompt of `ps` as its own request, all at once, stepped to the end: (tokens,
    sampled-token logprobs) per prompt, in order."""
    ids = [f"r{i}" for i in range(len(ps))]
    for rid, p in zip(ids, ps):
        e.add_request(rid, p, params)
    toks, lps = {r: [] for r in ids}, {r: [] for r in ids}
    while e.has_unfinished_requests():
        for o in e.step():
            toks[o.request_id] += o.new_token_ids
            lps[o.request_id] += [lp.logprob for lp in o.logprobs]
    return [toks[r] for r in ids], [lps[r] for r in ids]


def handoff(src, dst, ps, streamed: list | None = None, check_streams=None) -> list[list[int]]:
    """Each prompt of `ps` prefilled on `src`, its KV exported and imported into `dst`, which
    decodes 12 tokens greedily: the tokens per prompt (the first from `src`). `streamed`: a
    list that collects `src`'s layer streams (every 2 layers) of each prompt, given with the
    exported KV to `check_streams(streamed, kv)` and then cleared."""
    out = []
    for i, p in enumerate(ps):
        rid = f"h{i}"
        src.add_request(rid, p, SamplingParams(max_tokens=1, temperature=0, ignore_eos=True), hold_kv=True)
        if streamed is not None:
            src.stream_kv_layers(rid, lambda a, b, kv: streamed.append((a, b, kv)), group=2)
        first = None
        while src.has_unfinished_requests():
            for o in src.step():
                first = o.new_token_ids[0]
        _, kv = src.export_kv(rid)
        src.release_kv(rid)
        if streamed is not None:
            check_streams(streamed, kv)
            streamed.clear()
        dst.add_remote_request(rid, p, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
        dst.import_kv(rid, kv, first)
        toks = [first]
        while dst.has_unfinished_requests():
            for o in dst.step():
                toks += o.new_token_ids
        out.append(toks)
    return out


def kill_rank_mid_stream(e, prompt: list[int], rank: int) -> None:
    """A 200-token stream of `prompt` on the split engine `e`; after 3 steps its follower
    `rank` (e.tp.procs index) is killed: rank 0's next steps raise RankFailed, every block
    comes back, and every other rank is taken down at once."""
    e.add_request("a", prompt, SamplingParams(max_tokens=200, ignore_eos=True))
    for _ in range(3):
        e.step()
    os.kill(e.tp.procs[rank].pid, signal.SIGKILL)
    e.tp.procs[rank].wait(10)
    with pytest.raises(RankFailed):
        for _ in range(50):
            e.step()
    e.abort_all()
    clean(e)
    assert all(p.wait(10) is not None for p in e.tp.procs)

