"""The cluster of the end-to-end router tests (tests/test_router_e2e.py,
tests/test_router_e2e_errors.py): a prefill worker, a decode worker and the router on
loopback with the real default model, one per module that imports these fixtures; at
teardown every KV block is back and no request is left."""
from __future__ import annotations

import pytest

from pdserve.deploy.local import LocalCluster
from tests.helpers.clusters import local_config


@pytest.fixture(scope="module")
def cluster(smollm):
    loaded, tok = smollm
    cfg = local_config(64 << 20)
    c = LocalCluster(loaded, tok, cfg).start()
    yield c
    c.stop()
    for eng in c.engines():
        assert eng.blocks.num_used_blocks == 0 and not eng.has_unfinished_requests()


@pytest.fixture
def client(cluster):
    from openai import OpenAI
    return OpenAI(base_url=cluster.url + "/v1", api_key="unused", max_retries=0)
