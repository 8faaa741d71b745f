"""The KV hand-off between groups of different shapes by parts (kv_transfer/stages.py,
engine/parallel/pp_handoff.py): a decode pipeline's address names each rank's layers and KV
heads; a sender cuts its KV by it; a receiver of one rank's rectangle collects pieces of
layers and heads until its rectangle is whole, and a stage's push that comes before its lease
waits for it. `through_workers` runs prompts through a prefill and a decode worker (real gRPC)
around two engines of any shapes, checking that no rank of a pipeline gathers or receives
the whole model's KV (the shapes: tests/test_pp.py, tests/test_pp_tp.py, tests/test_pp_up.py)."""
import asyncio
import itertools
import threading

import pytest
import torch

from pdserve.common.errors import KVTransferError
from pdserve.common.sampling_params import SamplingParams
from pdserve.engine.parallel.pp import PPKVCache
from pdserve.kv_transfer.receiver import KVReceiver
from pdserve.kv_transfer.stages import StageReceiver, pieces, stage_address, targets
from pdserve.kv_transfer.wire import make_header

LAYOUT = (5, 2, 4, 2, 8)  # layers, K/V, block size, KV heads, head dim
_ids = itertools.count()  # request ids, unique over the calls of `through_workers`


def kv_of(layers: int = 5, heads: int = 2, blocks: int = 3) -> torch.Tensor:
    return torch.arange(layers * 2 * blocks * 4 * heads * 8, dtype=torch.float32).view(layers, 2, blocks, 4, heads, 8)


def test_an_address_names_each_rank_s_layers_and_heads_and_a_sender_cuts_its_kv_by_it():
    parts = [(range(3), range(1), "ucx://h:1"), (range(3), range(1, 2), "h:2"), (range(3, 5), range(2), "h:3")]
    address = stage_address(parts, "h")
    assert address == "stages:h|0-3/0-1@ucx://h:1;0-3/1-2@2;3-5/0-2@3" and targets(address, 5, 2) == parts
    assert targets("h:9", 5, 2) == [(range(5), range(2), "h:9")]
    kv = kv_of()
    got = list(pieces(kv, range(5), range(2), address, (5, 2)))  # a single engine's whole KV
    assert [(a, lo, h0, h1) for a, _, lo, h0, h1 in got] == [("ucx://h:1", 0, 0, 1), ("h:2", 0, 1, 2), ("h:3", 3, 0, 0)]
    assert torch.equal(got[1][1], kv[:3, :, :, :, 1:2]) and torch.equal(got[2][1], kv[3:])
    # a stage of layers [2, 4), head 1 of 2: only what it holds, to the ranks that own it
    mine = kv[2:4, :, :, :, 1:2]
    got = list(pieces(mine, range(2, 4), range(1, 2), address, (5, 2)))
    assert [(a, lo, h0, h1) for a, _, lo, h0, h1 in got] == [("h:2", 2, 1, 2), ("h:3", 3, 1, 2)]
    assert torch.equal(got[0][1], kv[2:3, :, :, :, 1:2]) and torch.equal(got[1][1], kv[3:4, :, :, :, 1:2])


def _push(receiver, rid: str, kv: torch.Tensor, layer_start: int, head_start: int = 0, head_end: int = 0):
    h = make_header(rid, kv, sender_id="p", model_fingerprint="fp", dest_block_ids=[7, 8, 9], num_tokens=10,
                    first_token=1, layer_start=layer_start, head_start=head_start, head_end=head_end)
    receiver.accept_tensor(h, kv.contiguous())


def test_a_rank_s_receiver_collects_pieces_of_layers_and_heads_of_its_rectangle():
    kv = kv_of()
    r = KVReceiver("fp", LAYOUT, part=(range(3, 5), range(2)))  # a stage of layers [3, 5), both heads
    r.expect("a", [7, 8, 9], 10, 30)
    with pytest.raises(KVTransferError, match=r"layers \[2, 4\) heads \[0, 1\) does not fit.*layers \[3, 5\)"):
        _push(r, "a", kv[2:4, :, :, :, :1], 2, 0, 1)  # a layer it does not hold
    _push(r, "a", kv[3:5, :, :, :, :1], 3, 0, 1)
    assert r.take("a") is None  # half its heads
    _push(r, "a", kv[3:4, :, :, :, 1:], 3, 1, 2)
    _push(r, "a", kv[4:5, :, :, :, 1:], 4, 1, 2)
    got = r.take("a")
    assert got is not None and torch.equal(got.kv, kv[3:5])
    whole = KVReceiver("fp", LAYOUT)  # one engine's receiver: every piece of every rank's
    whole.expect("b", [7, 8, 9], 10, 30)
    _push(whole, "b", kv[:3], 0)
    _push(whole, "b", kv[3:, :, :, :, 1:], 3, 1, 2)
    _push(whole, "b", kv[3:, :, :, :, :1], 3, 0, 1)
    assert torch.equal(whole.take("b").kv, kv)


def test_a_stage_s_push_waits_for_its_lease_and_a_new_lease_drops_an_old_one_on_its_blocks():
    """And a push for a lease dropped there does not wait."""
    kv = kv_of()
    r = StageReceiver("fp", LAYOUT, part=(range(3), range(2)))
    t = threading.Thread(target=_push, args=(r, "a", kv[:3], 0))
    t.start()  # before its lease: it waits
    r.expect("old", [8, 20], 10, 30)
    r.expect("a", [7, 8, 9], 10, 30)
    t.join(10)
    assert r.pending() == [] and torch.equal(r.take_blocks([7, 8, 9], 1).kv, kv[:3])
    assert r.take_blocks([8, 20], 0.01) is None  # "old" was dropped: block 8 is "a"'s now
    r.expect("b", [1, 2, 3], 10, 30)
    r.cancel("b")  # its hand-off failed on rank 0 (drop_kv): a late push is refused at once
    with pytest.raises(KVTransferError, match="unknown or expired request 'b'"):
        _push(r, "b", kv[:3], 0)


def test_a_rank_s_push_and_server_speak_mutual_tls(tmp_path):
    """A prefill rank's push (ship_part) to a decode rank's own server (StageEndpoint) over
    mutual TLS, converted to bf16 for the wire: its part lands, whole and converted back; a
    plaintext push and a push with another cluster token are refused."""
    trustme = pytest.importorskip("trustme")
    from pdserve.kv_transfer.stages import StageEndpoint, serve_meta, ship_meta, ship_part
    from tests.helpers.clusters import write_identity

    tls = write_identity(trustme.CA(), tmp_path, "c")
    part = (range(3, 5), range(0, 2))
    end = StageEndpoint(serve_meta("127.0.0.1", "fp", "tok", tls, True), LAYOUT, "float32", part)
    try:
        address = stage_address([(range(0, 3), range(0, 2), "127.0.0.1:1"), (*part, f"127.0.0.1:{end.port}")],
                                "127.0.0.1")
        end.receiver.expect("a", [7, 8, 9], 10, 30)
        kv = kv_of()[3:]  # a prefill stage of layers [3, 5): this rank's alone (none to the rank at port 1)

        def meta(**kw):
            return ship_meta(**{"target": address, "request_id": "a", "dest_block_ids": [7, 8, 9], "num_tokens": 10,
                                "first_token": 1, "token_offset": 0, "model_fingerprint": "fp", "lora_identity": "",
                                "timeout_s": 10.0, "sender_id": "p", "cluster_token": "tok", "wire": "bfloat16",
                                "tls": tls} | kw)
        with pytest.raises(KVTransferError, match=f"127.0.0.1:{end.port} failed: UNAVAILABLE"):
            ship_part(kv, range(3, 5), range(2), (5, 2), meta(tls=None))
        with pytest.raises(KVTransferError, match="wrong or missing cluster token"):
            ship_part(kv, range(3, 5), range(2), (5, 2), meta(cluster_token="nope"))
        assert ship_part(kv, range(3, 5), range(2), (5, 2), meta()) == kv.numel() * 2
        got = end.receiver.take_blocks([7, 8, 9], 5)
        assert got is not None and torch.equal(got.kv, kv.to(torch.bfloat16).float())
    finally:
        end.stop()


def through_workers(src, dst, ps: list[list[int]], n: int = 12, **cluster) -> list[list[int]]:
    """Each prompt of `ps` through a decode worker around `dst` that has a prefill worker
    around `src` prefill it (its KV over gRPC, by parts where either is a pipeline), `n`
    greedy tokens each; `cluster`: the workers' settings (tests/helpers/workers.Cluster).
    Checks: every prompt prefilled remotely; a prefill pipeline never gathers (rank 0's
    whole-layout export is not called) and each of its ranks sent its own part alone; a
    decode pipeline's rank 0 receives and writes its own part alone; the bytes pushed are the
    bytes received; every block back in both engines."""
    from tests.helpers.engine_runs import clean
    from tests.helpers.workers import Cluster

    engines, imported = iter((src, dst)), []
    if isinstance(src.kv_cache, PPKVCache):
        src.kv_cache.export_blocks = lambda *a, **k: pytest.fail("a prefill pipeline gathered its KV")
    if isinstance(dst.kv_cache, PPKVCache):
        dst.kv_cache.take_kv = lambda b, d=None, take=dst.kv_cache.take_kv: (imported.append(d.shape), take(b, d))[1]

    async def go():
        async with Cluster(lambda **_: next(engines), policy="fail", **cluster) as c:
            params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
            outs = [(await c.generate(f"w{next(_ids)}", p, params))[0] for p in ps]
            return outs, c.prefill.kv_bytes, c.decode.counters()
    try:
        outs, sent, counts = asyncio.run(go())
    finally:
        for e in (src, dst):
            e.kv_cache.__dict__.pop("export_blocks", None)
            e.kv_cache.__dict__.pop("take_kv", None)
    assert counts["remote_prefills"] == len(ps) and counts["transfer_failures"] == 0, counts
    if isinstance(src.kv_cache, PPKVCache):  # the last prompt's: each rank its layers and heads of it
        kv, shipped = src.kv_cache, src.kv_cache.last_ship
        whole = kv.full.num_hidden_layers * kv.full.num_key_value_heads
        cells = [len(ls) * len(hs) if r % kv.width in kv.owners else 0 for r, (ls, hs) in
                 enumerate(map(kv.part_of, range(kv.group.world)))]
        assert [s * whole for s in shipped] == [sum(shipped) * c for c in cells], shipped
    if isinstance(dst.kv_cache, PPKVCache):
        layers, heads = dst.kv_cache.own
        assert len(imported) == len(ps) and all(s[0] == len(layers) and s[4] == len(heads) for s in imported)
    assert counts["kv_bytes"] == sent  # the hand-offs' KV, counted whole on both sides
    for e in (src, dst):
        clean(e)
    return outs
