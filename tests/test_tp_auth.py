"""The tensor-parallel group admits only the ranks its parent started (engine/parallel/group.py):
a peer without the group's secret is refused by rank 0 and refuses a rank 0 without it; a
message that is not sealed by rank 0 (forged, tampered or replayed) is refused before it is
parsed; what rank 0 sends decodes without unpickling, and nothing else decodes. (TP=2 still
answering as TP=1 is tests/test_tp.py's, over the real processes and their secret.)"""
import json
import threading
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from pdserve.engine.kernels.attention import AttentionMetadata, PrefillSpan
from pdserve.engine.parallel.group import Group, group_store
from pdserve.engine.parallel.wire import PeerRefused, decode, encode, group_secret, seal, store_prefix

TIMEOUT_S = 60.0


def form(secrets: list[bytes], raw_store: bool = False) -> dict[int, object]:
    """A group of len(secrets) ranks in threads, rank r proving secrets[r], on one rendezvous
    store (`raw_store`: the TCPStore's own keys, which a local outsider can reach; else under
    the prefix of secrets[0]). Returns each rank's Group or the exception it raised."""
    world = len(secrets)
    host = dist.TCPStore("127.0.0.1", 0, world, True, timeout=timedelta(seconds=TIMEOUT_S), wait_for_workers=False)
    out: dict[int, object] = {}

    def join(rank: int):  # each rank its own connection to the store, as each process has
        own = host if rank == 0 else dist.TCPStore("127.0.0.1", host.port, world, False,
                                                   timeout=timedelta(seconds=TIMEOUT_S))
        s = own if raw_store else dist.PrefixStore(store_prefix(secrets[0]), own)
        try:
            out[rank] = Group(rank, world, s, TIMEOUT_S, secrets[rank])
        except Exception as e:  # noqa: BLE001 - the test reads what each rank raised
            out[rank] = e
    threads = [threading.Thread(target=join, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT_S * 2)
    return out


def test_a_peer_without_the_group_secret_is_refused_and_refuses_a_rank_0_without_it():
    secret = group_secret()
    # an outsider who reached the rendezvous store (not the secret) takes rank 1's place
    got = form([secret, group_secret()], raw_store=True)
    assert isinstance(got[0], PeerRefused) and "ranks [1] did not prove the group's secret" in str(got[0])
    assert isinstance(got[1], PeerRefused) and "failed its check" in str(got[1])
    # ... or rank 0's: the honest rank 1 refuses it
    got = form([group_secret(), secret], raw_store=True)
    assert isinstance(got[1], PeerRefused) and isinstance(got[0], PeerRefused)
    # with the secret on every rank the group forms
    got = form([secret, secret])
    assert all(isinstance(g, Group) for g in got.values()), got


def test_messages_not_sealed_by_rank_0_are_refused_forged_tampered_or_replayed():
    secret = group_secret()
    got = form([secret, secret])
    rank0, rank1 = got[0], got[1]
    step = ("step", torch.arange(5), [[0, 2]], None)

    def exchange(send) -> object:
        box = {}
        t = threading.Thread(target=lambda: box.setdefault("r", _receive(rank1)))
        t.start()
        send()
        t.join(TIMEOUT_S)
        return box["r"]

    first = seal(rank0.key, rank0.seq, encode(step))
    received = exchange(lambda: rank0._send_raw(first))
    assert received[0] == "step" and torch.equal(received[1], torch.arange(5)) and received[2:] == [[[0, 2]], None]
    rank0.seq += 1
    replayed = exchange(lambda: rank0._send_raw(first))
    assert isinstance(replayed, PeerRefused) and "failed its check" in str(replayed)
    rank0.seq += 1
    forged = seal(secret, rank0.seq, encode(("stop",)))  # the secret itself is not the session key
    assert isinstance(exchange(lambda: rank0._send_raw(forged)), PeerRefused)
    rank0.seq += 1
    tampered = bytearray(seal(rank0.key, rank0.seq, encode(("import", [1, 2]))))
    tampered[-2] ^= 1
    assert isinstance(exchange(lambda: rank0._send_raw(bytes(tampered))), PeerRefused)
    for g in got.values():
        g.close()


def _receive(group: Group):
    try:
        out = group.receive()
    except PeerRefused as e:
        group.seq += 1  # this test's rank goes on; a real rank exits here
        return e
    return out


def test_steps_decode_without_unpickling_and_nothing_else_decodes():
    meta = AttentionMetadata(slot_mapping=torch.tensor([3, 4, 40]), num_decode_tokens=1,
                             decode_block_tables=torch.tensor([[0, 2]], dtype=torch.int32),
                             decode_seq_lens=torch.tensor([17]), prefills=[PrefillSpan(1, 3, 16, [5, 6])],
                             block_size=16, backend_state={"derived": torch.ones(2)})
    step = ("step", torch.tensor([7, 8, 9]), torch.tensor([16, 0, 1]), meta, [(0, 2)], None, [([5, 6], 2)],
            torch.tensor([1.5], dtype=torch.bfloat16), torch.empty(0, 4))
    back = decode(encode(step))
    assert back[0] == "step" and torch.equal(back[1], step[1]) and torch.equal(back[2], step[2])
    m = back[3]
    assert torch.equal(m.slot_mapping, meta.slot_mapping) and m.decode_block_tables.dtype == torch.int32
    assert m.prefills == meta.prefills and m.num_decode_tokens == 1 and m.block_size == 16
    assert m.backend_state == {}  # derived again on each rank
    assert back[4:7] == [[[0, 2]], None, [[[5, 6], 2]]]
    assert back[7].dtype == torch.bfloat16 and back[7].item() == 1.5 and back[8].shape == (0, 4)
    with pytest.raises(TypeError):
        encode(("step", {"a": 1}))  # no free-form objects on the wire
    for bad in (raw({"body": {"tensor": 0}, "tensors": [["object", [1]]]}, b"x" * 8),  # a dtype it does not know
                encode(("x", torch.arange(3)))[:-1],  # shorter than its tensors
                encode(("x", torch.arange(3))) + b"\0",  # longer
                raw({"body": [{"pickle": "Y29zCnN5c3RlbQ=="}], "tensors": []}),  # a part it does not know
                raw({"body": {"meta": [1, 2]}, "tensors": []}),  # metadata of the wrong shape
                b"\0\0\0\0\0\0\0\5junk!"):
        with pytest.raises(PeerRefused):
            decode(bad)
    for module in ("group.py", "wire.py", "tp.py"):  # no peer data is unpickled anywhere in the group
        src = (Path(__file__).parents[1] / "engine" / "parallel" / module).read_text()
        assert "import pickle" not in src and "pickle.load" not in src, module


def raw(header: dict, tail: bytes = b"") -> bytes:
    """A message as `encode` frames one, with any header."""
    h = json.dumps(header).encode()
    return len(h).to_bytes(8, "big") + h + tail


def test_the_rendezvous_keys_are_under_the_secret():
    a, b = group_secret(), group_secret()
    assert store_prefix(a) != store_prefix(b) and a.hex() not in store_prefix(a)
    host, store = group_store("127.0.0.1", 0, 1, True, TIMEOUT_S, a)
    store.set("rank-addr", "here")
    assert host.check([f"{store_prefix(a)}/rank-addr"]) and not host.check(["rank-addr"])
