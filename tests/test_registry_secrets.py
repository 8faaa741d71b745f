"""Redis passwords, TLS URLs, and secrets kept out of logs: a password-protected embedded
redis-server, URL redaction, and what is logged when Redis refuses or cannot be reached."""
import asyncio

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from pdserve.registry.embedded import EmbeddedRedis
from pdserve.registry.events import EventPublisher
from pdserve.registry.membership import WorkerRecord, WorkerRegistration
from pdserve.registry.urls import connect, redact_secrets, redact_url

PASSWORD = "s3cr:et/p@ss w0rd"  # URL delimiters and a space: it must be percent-encoded in URLs


@pytest.fixture(scope="module")
def redis_with_password():
    with EmbeddedRedis(password=PASSWORD) as r:
        yield r


def test_embedded_redis_with_a_password_requires_it(redis_with_password):
    r = redis_with_password
    assert "s3cr" not in repr(r) and PASSWORD not in r.url
    assert r.url == f"redis://:s3cr%3Aet%2Fp%40ss%20w0rd@{r.host}:{r.port}/0"  # percent-encoded
    assert redis.Redis.from_url(r.url).ping()
    once = Retry(NoBackoff(), 0)  # redis-py retries refused credentials for seconds by default
    with pytest.raises(redis.AuthenticationError):
        redis.Redis(host=r.host, port=r.port, retry=once).set("k", "v")
    with pytest.raises(redis.AuthenticationError):
        redis.Redis(host=r.host, port=r.port, password="wrong", retry=once).ping()


def test_registration_and_discovery_with_a_password(redis_with_password):
    from pdserve.router.cluster import ClusterClient
    from pdserve.router.discovery import RegistryDiscovery

    async def main():
        rec = WorkerRecord("w1", "prefill", "127.0.0.1:1", incarnation="a")
        reg = WorkerRegistration(redis_with_password.url, "pw1", rec)
        assert await reg.beat()
        client = ClusterClient()
        disc = RegistryDiscovery(redis_with_password.url, "pw1", client)
        await disc.sync()
        await reg.stop()
        await disc.close()
        return set(client.workers)

    assert asyncio.run(main()) == {"w1"}


@pytest.mark.parametrize("wrong", ["", ":wrong@", "someone:wrong@"])
def test_a_wrong_or_missing_password_is_a_clear_warning_not_a_crash(redis_with_password, caplog, wrong):
    from pdserve.router.cluster import ClusterClient
    from pdserve.router.discovery import RegistryDiscovery

    url = f"redis://{wrong}{redis_with_password.host}:{redis_with_password.port}/0"

    async def main():
        reg = WorkerRegistration(url, "pw2", WorkerRecord("w1", "decode", "127.0.0.1:1"))
        beat = await reg.beat()
        await reg.stop()  # its delete fails quietly too
        disc = RegistryDiscovery(url, "pw2", ClusterClient())
        await disc.sync()  # keeps routing on what it knew
        await disc.close()
        return beat

    with caplog.at_level("WARNING"):
        assert asyncio.run(main()) is False
    warnings = [r.getMessage() for r in caplog.records]
    assert any("heartbeat of w1 failed" in m and "authentication failed" in m for m in warnings), warnings
    assert any("registry unreachable" in m and "authentication failed" in m for m in warnings), warnings
    assert all("wrong" not in m for m in warnings)


@pytest.mark.parametrize("url, shown", [
    ("redis://127.0.0.1:6379/0", "redis://127.0.0.1:6379/0"),
    ("redis://:hunter2@127.0.0.1:6379/0", "redis://:***@127.0.0.1:6379/0"),
    ("redis://alice:hunter2@redis.internal:6380/3", "redis://alice:***@redis.internal:6380/3"),
    ("redis://hunter2@redis.internal", "redis://***@redis.internal"),  # a lone user part may be a password
    ("redis://:p%40ss%2Fw@h:1/0", "redis://:***@h:1/0"),
    ("redis://:p@ss/w?x#y@h:1/0", "redis://:***@h:1/0"),  # unencoded delimiters: still hidden whole
    ("rediss://bob:pw@h:6380/0?ssl_cert_reqs=required&ssl_ca_certs=/etc/ca.pem",
     "rediss://bob:***@h:6380/0?ssl_cert_reqs=required&ssl_ca_certs=/etc/ca.pem"),
    ("rediss://h:6380/0?ssl_keyfile=/k.pem&ssl_password=kp&ssl_certfile=/c.pem",
     "rediss://h:6380/0?ssl_keyfile=/k.pem&ssl_password=***&ssl_certfile=/c.pem"),
    ("unix://:pw@/run/redis.sock?db=2", "unix://:***@/run/redis.sock?db=2"),
    ("", ""),
])
def test_redact_url(url, shown):
    assert redact_url(url) == shown


def test_redact_secrets_removes_every_form_of_the_password():
    url = "redis://u:p%40ss%2Fword@h:1/0?ssl_password=k%20p"
    text = "p%40ss%2Fword p@ss/word k p k%20p host h:1 user u"
    assert redact_secrets(text, url) == "*** *** *** *** host h:1 user u"
    assert redact_secrets("nothing to hide", "redis://h:1/0") == "nothing to hide"


def test_tls_and_acl_urls_reach_redis_py_unchanged():
    from redis.asyncio.connection import SSLConnection

    r = connect("rediss://alice:p%40ss@redis.example:6380/2?ssl_cert_reqs=required&ssl_ca_certs=/etc/ca.pem")
    pool = r.connection_pool
    assert pool.connection_class is SSLConnection
    kw = pool.connection_kwargs
    assert (kw["username"], kw["password"], kw["host"], kw["port"], kw["db"]) == ("alice", "p@ss", "redis.example", 6380, 2)
    assert (kw["ssl_cert_reqs"], kw["ssl_ca_certs"]) == ("required", "/etc/ca.pem")
    assert "p@ss" not in repr(r)  # redis-py redacts its own repr


def test_a_malformed_url_error_does_not_quote_the_password():
    # an unencoded '/' makes urllib take the rest for a port, and its error quotes it
    with pytest.raises(ValueError) as info:
        connect("redis://:topsecret/morese@h:6379/0")
    msg = str(info.value)
    assert "invalid Redis URL" in msg and "topsecret" not in msg and "morese" not in msg


def test_passwords_never_reach_the_logs_when_redis_is_unreachable(caplog):
    from pdserve.common.kv_events import BlockStored
    from pdserve.registry.embedded import free_port
    from pdserve.router.cluster import ClusterClient
    from pdserve.router.discovery import RegistryDiscovery

    secret = "Zq9-very-secret"
    url = f"redis://admin:{secret}@127.0.0.1:{free_port()}/0"  # nothing listens there

    async def main():
        reg = WorkerRegistration(url, "down", WorkerRecord("w1", "decode", "127.0.0.1:1"))
        beat = await reg.beat()
        # what `pdserve up` shows of a worker that cannot register: why, without the password
        assert "Connect call failed" in reg.last_error and secret not in reg.last_error, reg.last_error
        await reg.stop()
        pub = EventPublisher(url, "down", "w1")
        pub(BlockStored(1, 42, 0, (), -1))
        await pub.flush()
        await pub.stop()
        disc = RegistryDiscovery(url, "down", ClusterClient())
        await disc.sync()
        await disc.close()
        return beat, pub.dropped

    with caplog.at_level("DEBUG"):
        assert asyncio.run(main()) == (False, 1)
    assert caplog.records and all(r.levelname != "ERROR" for r in caplog.records)
    assert secret not in caplog.text
    assert "heartbeat of w1 failed" in caplog.text and "registry unreachable" in caplog.text


def test_up_logs_the_registry_url_without_its_password(tmp_path, monkeypatch, capsys):
    import pdserve.deploy.launch
    import pdserve.deploy.up
    from pdserve.cli import main

    def stop_here(*_):  # just after the registry line; no worker is started
        raise ValueError("stopped by the test")

    monkeypatch.setattr(pdserve.deploy.up, "_start_ray", lambda *_: ("no-ray", None))
    monkeypatch.setattr(pdserve.deploy.up, "_check_placement", lambda *_: None)
    monkeypatch.setattr(pdserve.deploy.launch, "Pool", stop_here)
    model = tmp_path / "m.gguf"
    model.write_bytes(b"")
    assert main(["up", "--model", str(model), "--redis-url", "redis://alice:Zq9-up-secret@127.0.0.1:1/0"]) == 2
    err = capsys.readouterr().err
    assert "registry: redis://alice:***@127.0.0.1:1/0" in err and "stopped by the test" in err
    assert "Zq9-up-secret" not in err

