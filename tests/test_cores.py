"""Cores lent between workers of one host (engine/parallel/cores.py): a worker steps on its peers'
threads only while every peer is idle, gives them back as soon as one is busy, and a dead
peer's cores count as free."""
import subprocess
import sys
import time

import pytest

from pdserve.engine.parallel import cores
from pdserve.engine.parallel.cores import CoreShare


@pytest.fixture(autouse=True)
def no_check_interval(monkeypatch):
    monkeypatch.setattr(cores, "CHECK_INTERVAL_S", 0.0)


def share(tmp_path, name, own=1, max_threads=4):
    applied = []
    s = CoreShare(tmp_path, name, own_threads=own, max_threads=max_threads, set_threads=applied.append)
    return s, applied


def test_a_worker_borrows_idle_peers_threads_and_gives_them_back(tmp_path):
    host = tmp_path / "host"
    prefill, p_applied = share(host, "prefill-0")
    decode, d_applied = share(host, "decode-0", own=2)
    assert prefill.step_threads() == 3  # decode idle: its 2 threads join prefill's own 1
    assert decode.step_threads() == 2   # prefill busy: decode keeps to its own
    assert prefill.step_threads() == 1  # decode busy now: back to its own
    decode.idle()
    assert prefill.step_threads() == 3
    assert p_applied == [3, 1, 3] and d_applied == []  # only changes are applied
    prefill.close()
    assert [p.name for p in host.iterdir()] == ["decode-0.busy"]
    decode.close()
    assert not host.exists()  # the last one out removes the directory


def test_a_step_under_way_gives_back_borrowed_threads_and_takes_lent_ones(tmp_path, monkeypatch):
    """Within a step (its layer hook): a peer that became busy since the step began gets its
    threads back at the next look, and one gone idle lends them again; an idle worker's look
    changes nothing, and no look within CHECK_INTERVAL_S of the last."""
    decode, d_applied = share(tmp_path, "decode-0")
    prefill, p_applied = share(tmp_path, "prefill-0")
    assert decode.retune() == 1 and d_applied == []  # idle: nothing to retune
    assert decode.step_threads() == 2  # prefill idle: its thread lent
    assert prefill.step_threads() == 1  # decode busy: its own alone
    assert decode.retune() == 1  # mid-step: the borrowed thread goes back
    prefill.idle()
    assert decode.retune() == 2 and d_applied == [2, 1, 2]
    monkeypatch.setattr(cores, "CHECK_INTERVAL_S", 60.0)
    assert prefill.step_threads() == 1
    assert decode.retune() == 2 and d_applied == [2, 1, 2]  # looked just now: not again yet
    for s in (decode, prefill):
        s.close()


def test_never_more_than_the_machine_and_one_busy_peer_stops_lending(tmp_path):
    a, _ = share(tmp_path, "a", own=1, max_threads=2)
    b, _ = share(tmp_path, "b", own=1, max_threads=2)
    c, _ = share(tmp_path, "c", own=1, max_threads=2)
    assert a.step_threads() == 2  # b and c idle, but the machine has 2
    assert b.step_threads() == 1  # a is busy: no lending, even though c is idle
    for s in (a, b, c):
        s.close()


def test_a_dead_peers_cores_are_free(tmp_path):
    me, _ = share(tmp_path, "me")
    peer = subprocess.Popen([sys.executable, "-c", (
        "import sys, time; from pdserve.engine.parallel.cores import CoreShare; "
        f"s = CoreShare({str(tmp_path)!r}, 'peer', own_threads=2, max_threads=4, set_threads=lambda n: None); "
        "s.step_threads(); print('busy', flush=True); time.sleep(60)")], stdout=subprocess.PIPE, text=True)
    try:
        assert peer.stdout.readline().strip() == "busy"
        assert me.step_threads() == 1
        peer.kill()
        peer.wait(10)
        deadline = time.monotonic() + 5
        while me.step_threads() != 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert me.threads == 3  # its lock went with the process; its file still says it owned 2
    finally:
        peer.kill()
        peer.stdout.close()
        me.close()


def test_bad_sizes_are_refused(tmp_path):
    with pytest.raises(ValueError):
        CoreShare(tmp_path, "x", own_threads=0)


def test_a_worker_with_only_less_urgent_work_stands_aside_for_a_busy_peer(tmp_path):
    prefill, _ = share(tmp_path, "prefill-0")  # floods of priority 5
    decode, d_applied = share(tmp_path, "decode-0")  # an interactive stream of priority -1
    assert prefill.step_threads(5) == 2  # decode idle: prefill borrows its thread
    assert not decode.yields_to_peer(-1)  # prefill's work is less urgent
    assert decode.step_threads(-1) == 1  # both busy now
    assert prefill.yields_to_peer(5)  # decode steps for more urgent work
    assert not prefill.yields_to_peer(-1)  # work as urgent as the peer's does not stand aside
    prefill.idle()
    assert decode.step_threads(-1) == 2  # prefill stood aside: decode takes both cores
    assert d_applied == [2]
    assert not decode.yields_to_peer(-1)  # a peer standing aside is not busy
    decode.idle()
    assert not prefill.yields_to_peer(5)  # the urgent work is done (its owner idles)
    prefill.close()
    decode.close()


def test_equal_priorities_never_stand_aside(tmp_path):
    a, _ = share(tmp_path, "a")
    b, _ = share(tmp_path, "b")
    a.step_threads()
    b.step_threads()
    assert not a.yields_to_peer(0) and not b.yields_to_peer(0)
    for s in (a, b):
        s.close()


def test_a_torn_or_foreign_record_reads_as_nothing_owned(tmp_path):
    me, _ = share(tmp_path, "me")
    (tmp_path / "junk.busy").write_text("not a record")
    assert me.step_threads(3) == 1  # junk's file is unlocked but owns nothing readable
    assert not me.yields_to_peer(3)
    me.close()


def test_a_look_taken_to_decide_on_standing_aside_still_lends_the_threads(tmp_path, monkeypatch):
    """The engine thread asks `yields_to_peer` and then `step_threads` within one look's
    interval: the threads an idle peer owns must reach the step all the same."""
    monkeypatch.setattr(cores, "CHECK_INTERVAL_S", 3600.0)  # one look for the whole test
    peer, _ = share(tmp_path, "prefill-0")
    me, applied = share(tmp_path, "decode-0", max_threads=2)
    assert not me.yields_to_peer(0)  # this takes the look
    assert me.step_threads(0) == 2 and applied == [2]
    for s in (peer, me):
        s.close()


def test_an_urgent_step_waits_briefly_for_a_less_urgent_peer_to_lend_its_cores(tmp_path):
    """A peer busy with less urgent work is waited for (it stands aside at its next step), at
    most the timeout; once it has, the urgent worker steps on its cores too. A peer as urgent
    is not waited for."""
    import threading

    peer, _ = share(tmp_path, "prefill-0")
    me, applied = share(tmp_path, "decode-0", max_threads=2)
    peer.step_threads(5)
    me.step_threads(0)
    threading.Timer(0.05, peer.idle).start()  # the peer's step ends and it stands aside
    waited = me.wait_for_peers(5.0)
    assert 0.03 < waited < 2.0 and me.threads == 2 and applied[-1] == 2
    assert me.peer_wait_s == waited and me.peer_waits_out == 0  # counted (pdserve:peer_wait_seconds_total)
    peer.step_threads(0)  # as urgent: stepping beside it at once
    assert me.wait_for_peers(5.0) < 0.5
    for s in (peer, me):
        s.close()


def test_after_a_wait_that_ran_out_the_next_steps_do_not_wait_until_the_peer_stops(tmp_path):
    """A peer in a long step (a prompt chunk from before its urgent window) is waited for once;
    the urgent steps after run at once on this worker's own threads, until a look finds the
    peer stood aside: then a later long step is waited for again."""
    peer, _ = share(tmp_path, "prefill-0")
    me, _ = share(tmp_path, "decode-0", max_threads=2)
    peer.step_threads(5)
    me.step_threads(0)
    assert me.wait_for_peers(0.05) >= 0.05 and me.threads == 1  # ran out: the peer still steps
    assert me.peer_waits_out == 1 and me.peer_wait_s >= 0.05  # counted (pdserve:peer_waits_out_total)
    t0 = time.monotonic()
    for _ in range(5):
        assert me.wait_for_peers(0.05) == 0.0
    assert time.monotonic() - t0 < 0.05
    peer.idle()
    time.sleep(0.03)  # past CHECK_INTERVAL_S: the next look sees it
    assert not me.yields_to_peer(0) and me.step_threads(0) == 2
    peer.step_threads(5)
    assert me.wait_for_peers(0.05) >= 0.05  # a new long step: waited for again
    for s in (peer, me):
        s.close()



def test_a_peers_urgent_window_is_seen_busy_or_not_until_it_closes(tmp_path):
    """A worker publishes its scheduler's urgent window (the most urgent priority it stepped for
    lately, and until when); its peers see it at their next look whether it is busy or idle, so
    their chunks are short when its next urgent request comes, and not after the window."""
    peer, _ = share(tmp_path, "decode-0")
    me, _ = share(tmp_path, "prefill-0")
    until = time.monotonic() + 0.2
    peer.step_threads(-10, (-10, until))
    peer.idle()  # the urgent chat ended: the window stays open
    assert not me.yields_to_peer(5)  # nobody busy: nothing to stand aside for
    assert me.peer_urgency is None and me.peer_window[0] == -10 and me.peer_window[1] == pytest.approx(until, abs=1e-3)
    time.sleep(0.25)
    me.yields_to_peer(5)
    assert me.peer_window is None  # closed
    for s in (peer, me):
        s.close()


def test_a_long_step_pauses_at_a_layers_end_while_a_peer_steps_for_more_urgent_work(tmp_path, monkeypatch):
    """Mid-step, a worker with less urgent work lends its cores to a busy, more urgent peer
    (its lock goes, so the peer steps on both) until that peer's urgent work is done, then
    takes its own back; a peer as urgent, or less, is not paused for."""
    import threading

    monkeypatch.setattr(cores, "PAUSE_CHECK_S", 0.0)
    me, _ = share(tmp_path, "prefill-0", max_threads=2)
    peer, _ = share(tmp_path, "decode-0", max_threads=2)
    me.step_threads(0)
    peer.step_threads(0)
    assert me.pause_for_peers(0) == 0.0 and me.pauses == 0  # as urgent: no pause
    peer.step_threads(-10)  # the peer's urgent step comes
    lent = []
    threading.Timer(0.05, lambda: (lent.append(peer.idle_peer_threads()), peer.step_threads(0))).start()
    paused = me.pause_for_peers(0)
    assert 0.03 < paused < 2.0 and me.pauses == 1 and me.busy
    assert lent == [1]  # while paused, its thread was free for the peer
    assert me.pause_for_peers(0) == 0.0  # the peer's urgent work is done
    for s in (me, peer):
        s.close()


def test_a_long_pause_looks_at_the_peers_ever_less_often(tmp_path, monkeypatch):
    """A worker paused for a peer's urgent stream wakes up to look at the peers at most every
    PAUSE_POLL_S[1] once the pause is long: each look takes a core the urgent peer's thread team
    steps on (a look every millisecond made a one-row step 20-50% slower on a 2-core Xeon); it
    still ends within that of the peer's urgent work ending."""
    import threading

    monkeypatch.setattr(cores, "PAUSE_CHECK_S", 0.0)
    me, _ = share(tmp_path, "prefill-0", max_threads=2)
    peer, _ = share(tmp_path, "decode-0", max_threads=2)
    me.step_threads(0)
    peer.step_threads(-10)
    looks, scan = [], me._scan
    monkeypatch.setattr(me, "_scan", lambda: (looks.append(time.monotonic()), scan())[1])
    ended = []
    threading.Timer(0.4, lambda: (ended.append(time.monotonic()), peer.step_threads(0))).start()
    me.pause_for_peers(0)
    assert me.pauses == 1 and ended
    assert time.monotonic() - ended[0] < cores.PAUSE_POLL_S[1] + 0.05  # it resumed soon after
    assert len(looks) <= 40  # ~25 looks in 0.4 s (every 16 ms once long), not ~400 (every 1 ms)
    for s in (me, peer):
        s.close()


def test_a_peer_standing_aside_lends_its_threads_only_to_work_more_urgent_than_its_own(tmp_path):
    """A worker that stands aside (or pauses) with work of its own steps again as soon as no
    peer's work is more urgent: a step for work not more urgent than its own must not count on
    its threads (they would be wanted twice: a 2-thread team beside another process's thread on
    2 cores). One with nothing to do lends them to any step."""
    prefill, _ = share(tmp_path, "prefill-0", max_threads=2)  # the flood's chunks, priority 0
    decode, applied = share(tmp_path, "decode-0", max_threads=2)
    prefill.step_threads(0)
    decode.step_threads(-10)  # an urgent stream's step
    assert prefill.yields_to_peer(0)
    prefill.idle(pending=True)
    assert decode.step_threads(-10) == 2  # more urgent than the prefill's work: both cores
    assert decode.step_threads(0) == 1  # the urgent stream is done: the prefill steps again now
    assert decode.step_threads(5) == 1  # less urgent still
    prefill.step_threads(0)  # it does
    prefill.idle()  # and then has nothing to do
    assert decode.step_threads(5) == 2
    assert applied == [2, 1, 2]
    for s in (prefill, decode):
        s.close()
