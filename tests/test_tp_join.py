"""The ranks of a tensor-parallel group join in two steps (engine/parallel/group.py): each
rank's process says it has loaded its slice, and rank 0 lets the group form once all have.
Ranks slower to start than the collectives' timeout still join (a fresh interpreter on a
loaded host took longer than a 3 s group timeout); a rank that exits first fails the start at
once, and one that never loads fails it at the start's own limit, not later."""
from __future__ import annotations

import subprocess
import sys
import time

import pytest

from pdserve.engine.parallel.group import RankFailed, await_loaded, group_store
from pdserve.engine.parallel.wire import group_secret


def _rank(port: int, secret: bytes, rank: int, delay_s: float, code: int | None = None) -> subprocess.Popen:
    """A rank's process that starts `delay_s` late and announces itself (or exits with `code`)."""
    if code is not None:
        body = f"import sys, time; time.sleep({delay_s}); sys.exit({code})"
    else:
        body = (f"import time; time.sleep({delay_s})\n"
                "from pdserve.engine.parallel.group import announce_loaded, group_store\n"
                f"_, s = group_store('127.0.0.1', {port}, 3, False, 60.0, bytes.fromhex('{secret.hex()}'))\n"
                f"announce_loaded(s, {rank}, 60.0)")
    return subprocess.Popen([sys.executable, "-c", body])


@pytest.fixture
def rendezvous():
    """Rank 0's store with a 0.5 s timeout (the collectives'), and the processes a test starts."""
    secret = group_secret()
    host, store = group_store("127.0.0.1", 0, 3, True, 0.5, secret)
    procs: list[subprocess.Popen] = []
    yield host.port, secret, store, procs
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait(timeout=30)


def test_ranks_slower_than_the_timeout_join_and_hear_that_the_group_forms(rendezvous):
    port, secret, store, procs = rendezvous
    procs += [_rank(port, secret, r, delay_s=1.5) for r in (1, 2)]  # 3x the store's timeout
    await_loaded(store, procs, join_s=120.0)
    assert [p.wait(timeout=60) for p in procs] == [0, 0]  # each one saw the group start


def test_a_rank_that_exits_before_it_loads_fails_the_start_at_once(rendezvous):
    port, secret, store, procs = rendezvous
    procs += [_rank(port, secret, 1, 0.0, code=3), _rank(port, secret, 2, delay_s=300.0)]
    t0 = time.monotonic()
    with pytest.raises(RankFailed, match=r"rank 1 exited \(code 3\) before it joined"):
        await_loaded(store, procs, join_s=300.0)
    assert time.monotonic() - t0 < 60  # not at the start's limit


def test_a_rank_that_never_loads_fails_the_start_at_its_limit(rendezvous):
    port, secret, store, procs = rendezvous
    procs += [_rank(port, secret, 1, delay_s=0.0), _rank(port, secret, 2, delay_s=300.0)]
    with pytest.raises(RankFailed, match=r"ranks \[2\] did not load within 3 s"):
        await_loaded(store, procs, join_s=3.0)
