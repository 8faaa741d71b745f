"""KV transfer: bit-exact delivery over gRPC, UCX and in-process, every refusal path (the same
suite for every wire transport), and the prefill -> transfer -> decode hand-off on two real
engines (tiny model)."""
import asyncio

import pytest
import torch

from pdserve.engine.kv import formats as kv_format
from pdserve.common.errors import KVTransferError
from pdserve.common.sampling_params import SamplingParams
from pdserve.kv_transfer.grpc_transport import GrpcKVSender, GrpcKVServer
from pdserve.kv_transfer.local import LocalKVSender
from pdserve.kv_transfer.receiver import KVReceiver
from pdserve.kv_transfer.wire import iter_chunks, make_header, tensor_bytes

LAYOUT = (2, 2, 16, 2, 16)  # the tiny model: layers, K/V, block size, kv heads, head dim
FP = "tiny-0"


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def random_kv(n_blocks, layers=2, seed=0):
    return torch.randn(layers, 2, n_blocks, 16, 2, 16, generator=torch.Generator().manual_seed(seed))


@pytest.fixture(params=["grpc", "ucx"])
def wire(request):
    """Every wire transport runs the same suite."""
    if request.param == "ucx":
        pytest.importorskip("ucxx", reason="the UCX transport needs pdserve[ucx]")
    return request.param


def with_wire(wire, fn, receiver, **sender_kw):
    async def main():
        if wire == "ucx":
            from pdserve.kv_transfer.ucx_transport import UcxKVSender, UcxKVServer
            server, sender = UcxKVServer(receiver), UcxKVSender("prefill-0", **sender_kw)
        else:
            server, sender = GrpcKVServer(receiver), GrpcKVSender("prefill-0", **sender_kw)
        addr = await server.start()
        try:
            return await fn(sender, addr)
        finally:
            await sender.close()
            await server.stop()
    return asyncio.run(main())


def push(sender, addr, kv, rid="r1", blocks=(3, 4, 5), tokens=40, fp=FP, timeout=10.0, first=7):
    return sender.push(addr, rid, kv, dest_block_ids=list(blocks), num_tokens=tokens, first_token=first,
                       model_fingerprint=fp, timeout_s=timeout)


@pytest.mark.parametrize("n_blocks", [1, 3, 64])  # 64 blocks = 1 MiB+: several chunks
def test_wire_delivers_random_blocks_bit_exact(n_blocks, wire):
    rx = KVReceiver(FP, LAYOUT)
    blocks = list(range(10, 10 + n_blocks))
    rx.expect("r1", blocks, n_blocks * 16 - 3, timeout_s=30)
    kv = random_kv(n_blocks, seed=n_blocks)
    with_wire(wire, lambda s, a: push(s, a, kv, blocks=blocks, tokens=n_blocks * 16 - 3), rx)
    [arrival] = rx.take_ready()
    assert arrival.request_id == "r1" and arrival.first_token == 7 and torch.equal(arrival.kv, kv)
    assert rx.pending() == []


def prepared_chunks(kv, chunk_bytes=4096):
    """A valid push of `kv` for lease ("r1", blocks [3, 4, 5], 40 tokens), as chunks to tamper with."""
    payload = tensor_bytes(kv)
    header = make_header("r1", kv, sender_id="p", model_fingerprint=FP, dest_block_ids=[3, 4, 5],
                         num_tokens=40, first_token=7, payload=payload)
    return list(iter_chunks(header, payload, chunk_bytes))


def test_corrupted_chunk_is_refused(wire):
    rx = KVReceiver(FP, LAYOUT)
    rx.expect("r1", [3, 4, 5], 40, timeout_s=30)
    chunks = prepared_chunks(random_kv(3))
    bad = bytearray(chunks[2].data)
    bad[100] ^= 0xFF
    chunks[2].data = bytes(bad)
    with pytest.raises(KVTransferError, match="checksum"):
        with_wire(wire, lambda s, a: s.push_chunks(a, iter(chunks), 10.0), rx)
    assert rx.take_ready() == []


def test_truncated_and_oversized_pushes_are_refused(wire):
    rx = KVReceiver(FP, LAYOUT)
    rx.expect("r1", [3, 4, 5], 40, timeout_s=30)
    chunks = prepared_chunks(random_kv(3))
    with pytest.raises(KVTransferError, match="truncated"):
        with_wire(wire, lambda s, a: s.push_chunks(a, iter(chunks[:-1]), 10.0), rx)
    with pytest.raises(KVTransferError, match="more than"):
        with_wire(wire, lambda s, a: s.push_chunks(a, iter(chunks + chunks[1:2]), 10.0), rx)


@pytest.mark.parametrize("change, message", [
    (dict(fp="other-model"), "fingerprint"),
    (dict(rid="nobody"), "unknown or expired"),
    (dict(blocks=(3, 4, 6)), "do not match the lease"),
    (dict(tokens=41), "do not match the lease"),
])
def test_mismatched_headers_are_refused(change, message, wire):
    rx = KVReceiver(FP, LAYOUT)
    rx.expect("r1", [3, 4, 5], 40, timeout_s=30)
    with pytest.raises(KVTransferError, match=message):
        with_wire(wire, lambda s, a: push(s, a, random_kv(3), **change), rx)
    assert rx.take_ready() == []


def test_wrong_layout_dtype_and_token_are_refused(wire):
    rx = KVReceiver(FP, LAYOUT, cluster_token="s3cret")
    rx.expect("r1", [3, 4, 5], 40, timeout_s=30)
    with pytest.raises(KVTransferError, match="cluster token"):
        with_wire(wire, lambda s, a: push(s, a, random_kv(3)), rx, cluster_token="guess")
    with pytest.raises(KVTransferError, match="layout"):
        with_wire(wire, lambda s, a: push(s, a, random_kv(3, layers=3)), rx, cluster_token="s3cret")
    with_wire(wire, lambda s, a: push(s, a, random_kv(3)), rx, cluster_token="s3cret")
    assert len(rx.take_ready()) == 1


@pytest.mark.parametrize("sent,held", [("bfloat16", "float32"), ("float32", "bfloat16"), ("int8", "int8"),
                                       ("float8_e4m3fn", "float8_e4m3fn"), ("float32", "int8"),
                                       ("int8", "float32"), ("float8_e4m3fn", "int8"), ("int8", "bfloat16")])
def test_kv_of_another_dtype_is_converted_as_it_lands(wire, sent, held):
    """Pools with different KV formats: the receiver takes the sender's format (the header
    names it and its scale layout, the payload size follows it) and lands the blocks in its
    own, as its cache would store them; 8-bit blocks and their scales cross bit for bit."""
    rx = KVReceiver(FP, LAYOUT, dtype=held)
    rx.expect("r1", [3, 4, 5], 40, timeout_s=30)
    kv = kv_format.encode(random_kv(3), kv_format.FORMATS[sent])
    assert kv.shape[-1] == (20 if kv_format.FORMATS[sent].quantized else 16)
    with_wire(wire, lambda s, a: push(s, a, kv), rx)
    (arrival,) = rx.take_ready()
    want = kv_format.convert(kv, kv_format.FORMATS[held])
    assert arrival.kv.dtype == want.dtype
    assert torch.equal(arrival.kv.view(torch.uint8), want.view(torch.uint8))


def test_a_receiver_that_converts_none_refuses_another_format_by_name():
    rx = KVReceiver(FP, LAYOUT, dtype="int8", convert=False)
    rx.expect("r1", [3, 4, 5], 40, timeout_s=30)
    for fmt in ("float32", "float8_e4m3fn"):
        kv = kv_format.encode(random_kv(3), kv_format.FORMATS[fmt])
        header = make_header("r1", kv, sender_id="prefill-0", model_fingerprint=FP, dest_block_ids=[3, 4, 5],
                             num_tokens=40, first_token=7)
        with pytest.raises(KVTransferError, match=f"{fmt} KV, but this worker's cache holds int8 and converts none"):
            rx.accept_tensor(header, kv)
    kv = kv_format.encode(random_kv(3), kv_format.FORMATS["int8"])
    rx.accept_tensor(make_header("r1", kv, sender_id="prefill-0", model_fingerprint=FP, dest_block_ids=[3, 4, 5],
                                 num_tokens=40, first_token=7), kv)
    assert len(rx.take_ready()) == 1


def test_quantized_kv_with_another_scale_layout_or_size_is_refused(wire):
    """A header naming 8-bit codes must name the scale layout this worker reads, and the
    payload must carry a scale per row."""
    rx = KVReceiver(FP, LAYOUT, dtype="int8")
    rx.expect("r1", [3, 4, 5], 40, timeout_s=30)
    kv = kv_format.encode(random_kv(3), kv_format.FORMATS["int8"])
    header = make_header("r1", kv, sender_id="prefill-0", model_fingerprint=FP, dest_block_ids=[3, 4, 5],
                         num_tokens=40, first_token=7, payload=tensor_bytes(kv))
    assert header.dtype == "int8" and header.kv_scales == "token-head-f32" and list(header.layout)[-1] == 16
    for change, message in ((dict(kv_scales="block-head-f16"), "scale layout"), (dict(kv_scales=""), "scale layout"),
                            (dict(payload_bytes=header.payload_bytes - 3 * 16 * 2 * 2 * 2 * 4), "payload of")):
        bad = type(header)()
        bad.CopyFrom(header)
        for k, v in change.items():
            setattr(bad, k, v)
        with pytest.raises(KVTransferError, match=message):
            rx.check_header(bad)
    rx.check_header(header)


def test_unknown_sender_refused_when_senders_are_named(wire):
    rx = KVReceiver(FP, LAYOUT)
    rx.expect("r1", [3, 4, 5], 40, timeout_s=30, senders={"prefill-9"})
    with pytest.raises(KVTransferError, match="unexpected sender 'prefill-0'"):
        with_wire(wire, lambda s, a: push(s, a, random_kv(3)), rx)


def test_lease_expiry_and_late_push(wire):
    clock = Clock()
    rx = KVReceiver(FP, LAYOUT, clock=clock)
    rx.expect("r1", [3, 4, 5], 40, timeout_s=5)
    rx.expect("r2", [6], 10, timeout_s=50)
    clock.t = 6
    assert rx.expired() == ["r1"] and rx.pending() == ["r2"]
    with pytest.raises(KVTransferError, match="unknown or expired"):
        with_wire(wire, lambda s, a: push(s, a, random_kv(3)), rx)


def test_unreachable_receiver_and_timeout_fail_cleanly(wire):
    async def main():
        if wire == "ucx":
            from pdserve.kv_transfer.ucx_transport import UcxKVSender
            sender, target = UcxKVSender("p"), "ucx://127.0.0.1:1"
        else:
            sender, target = GrpcKVSender("p"), "127.0.0.1:1"
        try:
            await push(sender, target, random_kv(1), blocks=(1,), tokens=5, timeout=2.0)
        finally:
            await sender.close()
    with pytest.raises(KVTransferError, match="UNAVAILABLE|timed out|failed"):
        asyncio.run(main())

    rx = KVReceiver(FP, LAYOUT)
    rx.expect("r1", [3, 4, 5], 40, timeout_s=30)

    async def slow_chunks(chunks):
        for c in chunks:
            yield c
            await asyncio.sleep(0.5)

    with pytest.raises(KVTransferError, match="timed out after 0.5s"):
        with_wire(wire, lambda s, a: s.push_chunks(a, slow_chunks(prepared_chunks(random_kv(3))), 0.5), rx)
    assert rx.take_ready() == []


def test_layer_wise_pushes_assemble_the_request(wire):
    rx = KVReceiver(FP, LAYOUT)
    rx.expect("r1", [3, 4], 20, timeout_s=30)
    kv = random_kv(2)

    async def two_halves(s, a):
        for layer in (1, 0):  # any order
            await s.push(a, "r1", kv[layer:layer + 1], dest_block_ids=[3, 4], num_tokens=20, first_token=7,
                         model_fingerprint=FP, timeout_s=10, layer_start=layer)
            if layer == 1:
                assert rx.take_ready() == []  # incomplete: not ready yet
    with_wire(wire, two_halves, rx)
    [arrival] = rx.take_ready()
    assert torch.equal(arrival.kv, kv)


def test_local_transport_same_checks_no_copy():
    rx = KVReceiver(FP, LAYOUT)
    rx.expect("r1", [3, 4, 5], 40, timeout_s=30)
    sender = LocalKVSender({"decode-0": rx})
    kv = random_kv(3)
    with pytest.raises(KVTransferError, match="fingerprint"):
        asyncio.run(push(sender, "decode-0", kv, fp="x"))
    asyncio.run(push(sender, "decode-0", kv))
    [arrival] = rx.take_ready()
    assert arrival.kv.data_ptr() == kv.data_ptr()


@pytest.mark.parametrize("transport", ["grpc", "ucx", "local"])
def test_prefill_decode_handoff_matches_one_engine(make_engine, transport):
    """Prefill on one engine, ship the blocks, decode on another: the same greedy tokens."""
    prompts = [[(7 * i + j) % 500 + 3 for j in range(20 + 13 * i)] for i in range(3)]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    expected = make_engine().generate(prompts, params)
    prefill, decode = make_engine(), make_engine()
    fp = prefill.loaded.fingerprint
    rx = KVReceiver(fp, decode.kv_cache.layout)

    async def run(sender, target):
        for i, p in enumerate(prompts):
            rid = f"h{i}"
            dest = decode.add_remote_request(rid, p, params)
            rx.expect(rid, dest, len(p), timeout_s=30)
            prefill.add_request(rid, p, SamplingParams(max_tokens=1, temperature=0, ignore_eos=True), hold_kv=True)
            first = [o.new_token_ids[0] for o in prefill.step()][0]
            tokens, kv = prefill.export_kv(rid)
            try:
                await sender.push(target, rid, kv, dest_block_ids=dest, num_tokens=len(tokens), first_token=first,
                                  model_fingerprint=fp, timeout_s=10)
            finally:
                prefill.release_kv(rid)

    if transport == "ucx":
        pytest.importorskip("ucxx", reason="the UCX transport needs pdserve[ucx]")
    if transport != "local":
        with_wire(transport, run, rx)
    else:
        asyncio.run(run(LocalKVSender({"d": rx}), "d"))
    got = {}
    for arrival in rx.take_ready():
        out = decode.import_kv(arrival.request_id, arrival.kv, arrival.first_token)
        got[arrival.request_id] = list(out.new_token_ids)
    while decode.has_unfinished_requests():
        for o in decode.step():
            got[o.request_id].extend(o.new_token_ids)
    assert [got[f"h{i}"] for i in range(3)] == expected


def test_failed_transfer_frees_destination_blocks(make_engine, wire):
    decode = make_engine()
    rx = KVReceiver("tiny-0", decode.kv_cache.layout)
    dest = decode.add_remote_request("r", list(range(3, 40)), SamplingParams(max_tokens=4))
    rx.expect("r", dest, 37, timeout_s=30)
    with pytest.raises(KVTransferError):
        with_wire(wire, lambda s, a: s.push(a, "r", random_kv(len(dest)), dest_block_ids=dest, num_tokens=37,
                                      first_token=1, model_fingerprint="wrong", timeout_s=5), rx)
    # the decode worker's failure path: drop the lease, abort the request -> blocks back
    rx.cancel("r")
    assert decode.abort("r")
    assert decode.blocks.num_used_blocks == 0


@pytest.mark.parametrize("src_bs, dst_bs, first", [(16, 8, 0), (16, 32, 0), (16, 8, 24), (8, 32, 32), (32, 16, 48),
                                                   (16, 16, 32)])
def test_reblock_keeps_every_token_in_order(src_bs, dst_bs, first):
    """The re-paged KV holds exactly tokens [first, num_tokens), in order, zero after."""
    from pdserve.kv_transfer.relayout import reblock

    num_tokens, offset = 99, first // src_bs * src_bs
    n_src = -(-(num_tokens - offset) // src_bs)
    kv = torch.arange(2 * 2 * n_src * src_bs * 3, dtype=torch.float32).view(2, 2, n_src, src_bs, 3, 1)
    out = reblock(kv, offset, first, num_tokens, dst_bs)
    assert out.shape == (2, 2, -(-(num_tokens - first) // dst_bs), dst_bs, 3, 1)
    flat_in = kv.reshape(2, 2, -1, 3, 1)[:, :, first - offset:num_tokens - offset]
    flat_out = out.reshape(2, 2, -1, 3, 1)
    assert torch.equal(flat_out[:, :, :num_tokens - first], flat_in)
    if src_bs == dst_bs and first == offset:
        assert out.data_ptr() == kv.data_ptr()  # nothing to convert: no copy
    else:
        assert not flat_out[:, :, num_tokens - first:].any()
    with pytest.raises(ValueError):
        reblock(kv, offset, first, num_tokens + src_bs * 2, dst_bs)


def test_a_push_starting_at_the_wrong_token_is_refused(wire):
    rx = KVReceiver(FP, LAYOUT)
    rx.expect("r1", [3, 4], 40, timeout_s=30, first_token_index=16)  # blocks await tokens 16..39
    with pytest.raises(KVTransferError, match="starts at token 0"):
        with_wire(wire, lambda s, a: push(s, a, random_kv(3), blocks=(3, 4)), rx)
    with_wire(wire, lambda s, a: s.push(a, "r1", random_kv(2), dest_block_ids=[3, 4], num_tokens=40, first_token=7,
                                        model_fingerprint=FP, timeout_s=10, token_offset=16), rx)
    [arrival] = rx.take_ready()
    assert arrival.kv.shape[2] == 2


def test_a_huge_message_is_refused_before_anything_reads_it():
    """gRPC buffers a whole message before the servicer can check its header and token: the
    KV server takes at most 8 chunks' worth per message, so a peer without the token cannot
    make it hold 64 MiB messages."""
    import grpc

    from pdserve.kv_transfer.grpc_transport import CHANNEL_OPTIONS, MAX_RECEIVE_BYTES
    from pdserve.protos import kv_transfer_pb2 as kpb
    from pdserve.protos import kv_transfer_pb2_grpc as kpb_grpc

    rx = KVReceiver(FP, LAYOUT, cluster_token="s3cret")

    async def main():
        server = GrpcKVServer(rx)
        addr = await server.start()
        try:
            async with grpc.aio.insecure_channel(addr, options=CHANNEL_OPTIONS) as ch:
                async def chunks():
                    yield kpb.KVChunk(data=b"\0" * (MAX_RECEIVE_BYTES + 1))
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await kpb_grpc.KVTransferStub(ch).Push(chunks(), timeout=10)
                return e.value.code()
        finally:
            await server.stop()
    assert asyncio.run(main()) == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert rx.pending() == []
