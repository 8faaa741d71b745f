"""The operator's keys file (router/keys.py) without a network: each fault refused with its
line, a key's tenant and priority ceiling applied whatever its client sends, and a reload that
keeps the keys in force when the new file is bad."""
from __future__ import annotations

import pytest

from pdserve.router.errors import APIError
from pdserve.router.keys import KeyRing, KeysFileError, digest, parse
from pdserve.router.tenancy import RequestContext

A, B, GW = "sk-team-a-0123456789", "sk-team-b-9876543210", "sk-gateway-555"


def entry(key: str, tenant: str, **fields) -> str:
    lines = ["[[key]]", f'digest = "{digest(key)}"', f'tenant = "{tenant}"']
    for k, v in fields.items():
        lines.append(f"{k} = " + (f'"{v}"' if isinstance(v, str) else str(v).lower() if isinstance(v, bool)
                                  else repr(v).replace("'", '"')))
    return "\n".join(lines) + "\n\n"


def test_a_file_gives_each_key_its_tenant_ceiling_models_and_trust():
    keys = parse(entry(A, "team-a") + entry(B, "team-b", priority_ceiling=-10, over_ceiling="refuse",
                                               models=["SmolLM2-135M-Instruct"], name="b")
                 + entry(GW, "gateway", trusted=True))
    a, b, gw = keys[digest(A)], keys[digest(B)], keys[digest(GW)]
    assert (a.tenant, a.priority_ceiling, a.refuse_over_ceiling, a.trusted, a.name) == ("team-a", 0, False, False,
                                                                                         "key 1")
    assert (b.priority_ceiling, b.refuse_over_ceiling, b.name) == (-10, True, "b")
    assert b.allows("SmolLM2-135M-Instruct") and not b.allows("sql") and a.allows("sql") and gw.trusted
    assert A not in str(keys) and digest(A).startswith("sha256:")  # never in clear


@pytest.mark.parametrize("text,line,match", [
    (entry(A, "a") + entry(B, "b", colour="red"), 5, "unknown field 'colour'"),
    (entry(A, "a") + entry(A, "again"), 5, "the same digest as 'key 1'"),
    (entry(A, "a", priority_ceiling=-5, over_ceiling="maybe"), 1, "over_ceiling must be"),
    (f'[[key]]\ntenant = "a"\nkey = "{A}"\n', 1, "holds a key in clear"),
    (f'# the team\n\n[[key]]\ndigest = "{digest(A)}"\n', 3, "needs its tenant"),
    ('[[key]]\ndigest = "sha256:abc"\ntenant = "a"\n', 1, "64 lowercase hex"),
    (entry(A, "a", models="all"), 1, "models must be a list"),
    (entry(A, "a", priority=-1), 1, "priority -1 is more urgent than the key's priority_ceiling 0"),
    (entry(A, "a", priority="high"), 1, "priority must be an integer"),
])
def test_a_bad_file_is_refused_with_the_line_of_its_fault(text, line, match):
    with pytest.raises(KeysFileError, match=rf"keys\.toml line {line} .*{match}"):
        parse(text, "keys.toml")


def test_a_toml_syntax_error_names_its_line():
    with pytest.raises(KeysFileError, match=r"line 2"):
        parse("[[key]]\ndigest = \n", "keys.toml")


def test_a_keys_ceiling_and_tenant_hold_whatever_the_client_sends():
    keys = parse(entry(A, "team-a") + entry(B, "team-b", priority_ceiling=-10, over_ceiling="refuse")
                 + entry(GW, "gateway", trusted=True, priority_ceiling=-100))
    a, b, gw = keys[digest(A)], keys[digest(B)], keys[digest(GW)]
    posing = {"x-pdserve-tenant": "team-b", "x-pdserve-priority": "-50"}
    ctx = RequestContext.for_key(a, posing, body_priority=-100)
    assert (ctx.tenant, ctx.priority) == ("team-a", 0)  # clamped to its ceiling, not the header's tenant
    assert RequestContext.for_key(a, {}, body_priority=7).priority == 7  # less urgent: as asked
    assert RequestContext.for_key(b, {}, body_priority=-10).priority == -10
    with pytest.raises(APIError) as e:
        RequestContext.for_key(b, {}, body_priority=-11)
    assert e.value.status == 403 and e.value.code == "priority_not_allowed"
    ctx = RequestContext.for_key(gw, posing, body_priority=0)  # a gateway speaks for its users
    assert (ctx.tenant, ctx.priority) == ("team-b", -50)
    assert RequestContext.for_key(gw, {}, body_priority=0).tenant == "gateway"


def test_the_ring_reloads_a_changed_file_and_keeps_the_old_keys_when_the_new_one_is_bad(tmp_path):
    path = tmp_path / "keys.toml"
    path.write_text(entry(A, "team-a"))
    now = [0.0]
    ring = KeyRing(path, clock=lambda: now[0])
    assert ring.lookup(A).tenant == "team-a" and ring.lookup(B) is None and ring.lookup("") is None
    path.write_text(entry(B, "team-b"))  # A revoked, B issued
    now[0] += 0.5
    assert ring.lookup(A) is not None  # not looked at yet: once a second at most
    now[0] += 1.0
    assert ring.lookup(A) is None and ring.lookup(B).tenant == "team-b" and ring.reloads == 1
    path.write_text(entry(B, "team-b") + entry(A, "team-a", colour="red"))
    now[0] += 1.0
    assert ring.lookup(B).tenant == "team-b" and ring.lookup(A) is None  # the bad file changed nothing
    assert "line 5" in ring.error and "colour" in ring.error
    path.write_text(entry(B, "team-b") + entry(A, "team-a"))
    assert ring.reload() and ring.error == "" and ring.lookup(A).tenant == "team-a"  # SIGHUP's path


def test_a_missing_or_bad_file_at_start_is_an_error(tmp_path):
    with pytest.raises(KeysFileError, match="cannot read"):
        KeyRing(tmp_path / "none.toml")
    (tmp_path / "bad.toml").write_text("[[key]]\ntenant = 'a'\n")
    with pytest.raises(KeysFileError, match="line 1"):
        KeyRing(tmp_path / "bad.toml")


def test_a_keys_rate_limits_refuse_with_openai_headers_and_count_out_what_ended():
    import asyncio

    from pdserve.router.ratelimit import MemoryCounts, RateLimiter

    now = [600.0]  # a minute's start
    lim = RateLimiter(MemoryCounts(clock=lambda: now[0]), clock=lambda: now[0])
    keys = parse(entry(A, "a", requests_per_minute=2, tokens_per_minute=100) + entry(B, "b", max_concurrent=1))
    a, b = keys[digest(A)], keys[digest(B)]

    async def run():
        t1 = await lim.enter("a", a)
        assert t1.headers["x-ratelimit-remaining-requests"] == "1" and t1.headers["x-ratelimit-limit-tokens"] == "100"
        await lim.leave(t1, 60)
        t2 = await lim.enter("a", a)
        assert t2.headers["x-ratelimit-remaining-requests"] == "0" and t2.headers["x-ratelimit-remaining-tokens"] == "40"
        with pytest.raises(APIError) as e:
            await lim.enter("a", a)
        assert e.value.status == 429 and e.value.code == "rate_limit_requests"
        assert e.value.headers["Retry-After"] == "60" and e.value.headers["x-ratelimit-remaining-requests"] == "0"
        await lim.leave(t2, 50)  # 110 tokens this minute
        now[0] += 61  # the next minute: both counts start again
        t3 = await lim.enter("a", a)
        assert t3.headers["x-ratelimit-remaining-requests"] == "1"
        await lim.leave(t3, 100)
        with pytest.raises(APIError) as e:
            await lim.enter("a", a)  # its tokens are spent this minute
        assert e.value.code == "rate_limit_tokens"
        held = await lim.enter("b", b)
        with pytest.raises(APIError) as e:
            await lim.enter("b", b)
        assert e.value.code == "rate_limit_concurrent" and e.value.headers["Retry-After"] == "1"
        await lim.leave(held, 0)
        await lim.leave(held, 0)  # counted out once only
        await lim.leave(await lim.enter("b", b), 0)
        assert await lim.in_flight("rl:b") == (0, 0)

    asyncio.run(run())


def test_a_negative_limit_or_a_bad_redis_policy_is_refused_with_its_line():
    with pytest.raises(KeysFileError, match=r"line 1 .*requests_per_minute must be an integer >= 0"):
        parse(entry(A, "a", requests_per_minute=-1), "keys.toml")
    with pytest.raises(KeysFileError, match=r"line 1 .*on_redis_error must be"):
        parse(entry(A, "a", on_redis_error="maybe"), "keys.toml")


def test_a_keys_own_priority_is_its_requests_when_they_send_none():
    """The operator decides: a batch key's requests run at its `priority` unless they ask for
    another, which its ceiling still holds; a key without one leaves the default (0)."""
    keys = parse(entry(A, "batch", priority=5) + entry(B, "chat", priority_ceiling=-10, priority=-5)
                 + entry(GW, "plain"))
    batch, chat, plain = keys[digest(A)], keys[digest(B)], keys[digest(GW)]
    assert (batch.priority, chat.priority, plain.priority) == (5, -5, None)
    assert RequestContext.for_key(batch, {}, body_priority=None).priority == 5
    assert RequestContext.for_key(batch, {}, body_priority=9).priority == 9  # sent: as asked
    assert RequestContext.for_key(batch, {}, body_priority=-3).priority == 0  # sent: clamped to the ceiling
    assert RequestContext.for_key(chat, {}, body_priority=None).priority == -5
    assert RequestContext.for_key(plain, {}, body_priority=None).priority == 0
    assert RequestContext.for_key(batch, {"x-pdserve-priority": "-9"}, body_priority=None).priority == 5  # not trusted


def test_a_body_without_priority_is_told_from_one_that_sends_the_default():
    from pdserve.router.protocol import ChatCompletionRequest, CompletionRequest
    from pdserve.router.responses_api import ResponsesRequest
    from pdserve.router.tenancy import sent_priority

    assert sent_priority(CompletionRequest(model="m", prompt="x")) is None
    assert sent_priority(CompletionRequest(model="m", prompt="x", priority=0)) == 0
    assert sent_priority(ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "x"}], priority=3)) == 3
    assert sent_priority(ResponsesRequest(model="m", input="x")) is None
