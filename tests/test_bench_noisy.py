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
    assert all(e.blocks.num_used_blocks == 0 for e in cluster.engines())
