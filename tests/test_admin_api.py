"""The pools' admin endpoints over HTTP: sizes are asked for as JSON, from the operator's
tools, not from a web page of another site (no API key is needed on loopback)."""
from __future__ import annotations

from fastapi.testclient import TestClient

from pdserve.router.app import create_admin_app


class Pools:
    """The actuator side of the admin endpoints (PoolControl's interface), recording what it is asked."""

    def __init__(self):
        self.pools, self.asked = {"prefill": 1, "decode": 1}, []

    def sizes(self) -> dict[str, int]:
        return dict(self.pools)

    def check(self, sizes: dict) -> None:
        for role, n in sizes.items():
            if role not in self.pools or not isinstance(n, int) or n < 0:
                raise ValueError(f"bad size for {role!r}")

    async def scale(self, sizes: dict) -> dict[str, int]:
        self.asked.append(sizes)
        self.pools |= sizes
        return self.sizes()


def test_scale_needs_json_from_the_operator_not_a_page_of_another_site():
    pools = Pools()
    http = TestClient(create_admin_app(pools, ()))
    # what a page of another site can send without a CORS preflight: refused, nothing resized
    r = http.post("/admin/scale", content='{"decode": 3}', headers={"Content-Type": "text/plain"})
    assert r.status_code == 415 and r.json()["error"]["code"] == "unsupported_media_type"
    r = http.post("/admin/scale", content="decode=3", headers={"Content-Type": "application/x-www-form-urlencoded"})
    assert r.status_code == 415
    r = http.post("/admin/scale", json={"decode": 3}, headers={"Sec-Fetch-Site": "cross-site"})
    assert r.status_code == 403 and r.json()["error"]["code"] == "cross_site"
    assert pools.asked == []
    # the operator's tools (curl, `pdserve scale`): JSON, no browser labels
    r = http.post("/admin/scale", json={"decode": 3})
    assert r.status_code == 200 and r.json() == {"pools": {"prefill": 1, "decode": 3}}
    r = http.post("/admin/scale", content='{"decode": 2}', headers={"Content-Type": "application/json; charset=utf-8"})
    assert r.status_code == 200 and pools.asked == [{"decode": 3}, {"decode": 2}]
    assert http.post("/admin/scale", json={"embedding": 1}).status_code == 400


def test_the_ray_pools_are_the_routers_pool_control():
    """The router owns the interface (router/control.py); the Ray pools of `pdserve up` and
    this test's recorder both provide it, and a refused size is refused by the pools' check."""
    import pytest

    from pdserve.deploy.launch import RayPools
    from pdserve.router.control import PoolControl

    assert isinstance(Pools(), PoolControl)
    pools = RayPools([])
    assert isinstance(pools, PoolControl) and pools.sizes() == {}
    with pytest.raises(ValueError, match="no 'decode' pool"):
        pools.check({"decode": 2})
