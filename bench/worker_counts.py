"""What the workers' steps did between two readings of their /metrics (the noisy-neighbour
benchmark's per-phase account: tokens computed, step seconds and steps by kind, seconds stood
aside, steps stopped, commands held)."""
from __future__ import annotations


async def worker_counts(url: str, auth: dict) -> dict | None:
    """What every worker's steps have done so far, from their /metrics: `tokens` computed
    (`pdserve:computed_tokens_total`, prompts and decodes) and `step_s`, seconds stepping
    (`pdserve:step_seconds_sum`), in all and by role (`roles`: each role's prompt and decode
    tokens and its step seconds by kind, plain / contended / window: where A's price goes);
    None where the server has no such workers to ask (another server, or a router that does
    not list them)."""
    import httpx

    try:
        async with httpx.AsyncClient(timeout=10, headers=auth) as http:
            workers = (await http.get(url + "/admin/workers")).json()["workers"]
            out: dict = {"tokens": 0, "step_s": 0.0, "roles": {}}
            for w in workers:
                host = w["address"].rpartition(":")[0]
                text = (await http.get(f"http://{host}:{w['metrics_port']}/metrics")).text
                role, counts = out["roles"].setdefault(w["role"], {}), role_counts(text)
                for key, value in counts.items():
                    role[key] = role.get(key, 0.0) + value
                out["tokens"] += role_sum(counts, "tokens")
                out["step_s"] += role_sum(counts, "s")
            return out
    except (httpx.HTTPError, KeyError, TypeError, ValueError):
        return None


def role_counts(text: str) -> dict[str, float]:
    """One worker's counters from its /metrics text: `<kind>_tokens` (prompt, decode) and
    `<kind>_s` and `<kind>_steps` (step seconds and steps: plain, contended, window), `yielded`
    (seconds it stood aside for a peer's more urgent steps), `stopped` (steps it stopped for a
    more urgent request), `held` and `held_wait` (less urgent commands held back for its more
    urgent work, and their wait), `peer_wait` and `peer_waits_out` (seconds its urgent steps
    waited for less urgent peers' cores, and the waits that ran out)."""
    import re

    out: dict[str, float] = {}
    for kind, v in re.findall(r'^pdserve:computed_tokens_total\{[^}]*kind="(\w+)"[^}]*\} (\S+)$', text, re.M):
        out[f"{kind}_tokens"] = out.get(f"{kind}_tokens", 0.0) + float(v)
    for stat, suffix in (("sum", "s"), ("count", "steps")):
        for labels, v in re.findall(rf"^pdserve:step_seconds_{stat}\{{([^}}]*)\}} (\S+)$", text, re.M):
            kind = "contended" if 'contended="true"' in labels else "window" if 'window="true"' in labels else "plain"
            out[f"{kind}_{suffix}"] = out.get(f"{kind}_{suffix}", 0.0) + float(v)
    for key, name in (("yielded", "yielded_seconds_total"), ("stopped", "stopped_steps_total"),
                      ("held", "held_commands_total"), ("held_wait", "held_command_seconds_total"),
                      ("peer_wait", "peer_wait_seconds_total"), ("peer_waits_out", "peer_waits_out_total")):
        out[key] = sum(float(v) for v in re.findall(rf"^pdserve:{name}\{{[^}}]*\}} (\S+)$", text, re.M))
    return out


def role_sum(counts: dict[str, float], suffix: str) -> float:
    """The sum of one worker's counters named `<kind>_<suffix>`."""
    return sum(v for k, v in counts.items() if k.endswith("_" + suffix))


def minus(after: dict | None, before: dict | None) -> dict | None:
    """What the workers did between two `worker_counts` readings; None if either is missing."""
    if after is None or before is None:
        return None
    roles = {r: {k: round(v - before["roles"].get(r, {}).get(k, 0.0), 2) for k, v in c.items()}
             for r, c in after["roles"].items()}
    return {"tokens": after["tokens"] - before["tokens"], "step_s": after["step_s"] - before["step_s"], "roles": roles}
