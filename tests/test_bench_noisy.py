"""`pdserve bench --workload noisy-neighbour` against a live in-process cluster."""
import json

import pytest


@pytest.mark.slow
def test_noisy_neighbour_workload_reports_each_phase(smollm, tmp_path):
    """The noisy-neighbour run (small): B alone, beside A's flood, and beside it with
    priorities; each phase's B latencies, their ratios to alone, and A's tokens."""
    from pdserve.cli import main
    from pdserve.deploy.local import LocalCluster
    from tests.helpers.clusters import local_config

    loaded, tok = smollm
    cluster = LocalCluster(loaded, tok, local_config(64 << 20)).start()
    out = tmp_path / "noisy.json"
    try:
        rc = main(["bench", "--base-url", cluster.url, "--workload", "noisy-neighbour", "--flood-concurrency", "2",
                   "--flood-input-len", "48", "--chats", "2", "--chat-input-len", "16", "--chat-output-len", "4",
                   "--warmup", "0.5", "--output", str(out)])
        assert rc == 0
    finally:
        cluster.stop()
    res = json.loads(out.read_text())
    assert list(res["phases"]) == ["alone", "flood", "flood+priority"]
    for name, phase in res["phases"].items():
        assert phase["B"]["ok"] == 2 and phase["B"]["ttft_p50_ms"] > 0
        if name != "alone":
            assert phase["A"]["output_tokens_per_s"] > 0 and phase["ratio_to_alone"]["ttft_p50_ms"] > 0
            assert phase["A"]["computed_tokens_per_s"] > 0  # the workers counted A's tokens (B's taken off)
            assert 0 < phase["A"]["ceiling_of_alone"] < 1  # B's own steps took part of the machine
        else:
            assert 0 < phase["B_busy_s"] < phase["B_seconds"]  # the workers stepped for B part of its time
    assert all(e.blocks.num_used_blocks == 0 for e in cluster.engines())


def test_the_price_is_against_a_alone_with_as_many_streams():
    """Each shape's A throughput is judged against A alone with as many streams (the grid has
    one such phase per flood size): output tokens as A's client got them, and the tokens the
    workers computed for A."""
    from pdserve.bench.noisy import _a_rates, _judge, grid

    rates = _a_rates({"tokens": [1.0, 2.5, 3.0, 9.0], "ok": 3}, 1.0, 5.0)  # 3 tokens in 4 s
    assert rates == {"output_tokens_per_s": 0.8, "requests": {"ok": 3}}
    shapes = grid()
    assert [s.flood for s in shapes if not s.chats] == [8, 24, 48]
    phases = {s.name: {"B": {"ttft_p50_ms": 1.0, "ttft_p99_ms": 1.0, "itl_p50_ms": 1.0, "itl_p99_ms": 1.0},
                       "A": {"output_tokens_per_s": 10.0 * s.flood, "computed_tokens_per_s": 100.0 * s.flood}
                       if s.flood else None} for s in shapes}
    phases["48 streams, A 5, tenants"]["A"] = {"output_tokens_per_s": 240.0, "computed_tokens_per_s": 4000.0}
    for name, p in phases.items():
        p["B_seconds"] = 8.0 if name == "48 streams, A 5, tenants" else 5.0
    for s in shapes:
        if not s.flood:
            phases[s.name]["B_busy_s"] = 2.0  # B's steps alone took 2 s of the machine
    _judge(phases, shapes)
    assert phases["48 streams, A 5, tenants"]["A"]["ceiling_of_alone"] == 0.75  # 1 - 2 s / 8 s
    assert phases["48 streams, A 5, tenants"]["A"]["share_of_alone"] == 0.5  # against A alone at 48, not 24
    assert phases["48 streams, A 5, tenants"]["A"]["computed_share_of_alone"] == 0.83
    assert phases["8 streams, A default, no tenant"]["goal_met"]


def test_each_point_is_judged_against_b_alone_just_before_and_after_its_flood_size():
    """The grid runs B alone again after each flood size; a point's ratios are to the mean of
    the B-alone phases around it, so a machine that drifts slower over the run (a shared cloud
    VM) does not read as the flood's harm, nor one that drifts faster as its help."""
    from pdserve.bench.noisy import _judge, grid

    shapes = grid((8, 24))
    names = [s.name for s in shapes]
    assert names[0] == "alone" and names.index("alone after 8 streams") == names.index("8 streams, A only") + 1
    assert names[-1] == "alone after 24 streams"
    itl = {"alone": 4.0, "alone after 8 streams": 6.0, "alone after 24 streams": 10.0}
    phases = {s.name: {"B": {k: itl.get(s.name, 9.0) for k in ("ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms",
                                                                "itl_p99_ms")} if s.chats else None,
                       "A": {"output_tokens_per_s": 1.0} if s.flood else None, "B_seconds": 5.0} for s in shapes}
    for name in itl:
        phases[name]["B_busy_s"] = itl[name] / 4  # 1, 1.5, 2.5 s
    _judge(phases, shapes)
    p8, p24 = phases["8 streams, A 5, tenants"], phases["24 streams, A 5, tenants"]
    assert p8["alone_ms"]["itl_p50_ms"] == 5.0 and p8["ratio_to_alone"]["itl_p50_ms"] == 1.8  # 9 / mean(4, 6)
    assert p24["alone_ms"]["itl_p50_ms"] == 8.0 and p24["ratio_to_alone"]["itl_p50_ms"] == 1.12  # 9 / mean(6, 10)
    assert p8["A"]["ceiling_of_alone"] == 0.75 and p24["A"]["ceiling_of_alone"] == 0.6  # 1 - 1.25 / 5, 1 - 2 / 5
    assert not p8["goal_met"] and p24["goal_met"]


def test_grid_floods_names_the_flood_sizes_and_refuses_what_is_not_one():
    import argparse

    from pdserve.bench.noisy import _flood_sizes, grid

    assert _flood_sizes("24") == (24,) and _flood_sizes("8,48") == (8, 48)
    for bad in ("", "8,x", "0", "-8"):
        with pytest.raises(argparse.ArgumentTypeError, match="stream counts"):
            _flood_sizes(bad)
    assert [s.flood for s in grid((24,)) if not s.chats] == [24]
