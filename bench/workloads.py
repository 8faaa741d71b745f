"""Workloads and arrival times of `pdserve bench`: pure functions of a seed, no network.

A workload is a list of `Session`s. A session is one or more `Turn`s sent one after the other
(a multi-turn conversation; every other workload has one turn per session); the load
generator starts sessions at their arrival times. Prompts are built from a fixed word list
(no downloads) so a seed always gives the same text. With a tokenizer, only words that are a
single token after a space are used: a prompt of N such words is exactly N tokens, and two
prompts that share their first S words share their first S tokens (what a prefix cache sees).
Without a tokenizer a word stands in for a token (an approximation: English text runs at
about 1.3 tokens per word).
"""
from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass, field
from pathlib import Path

# Common English words: a fixed vocabulary for prompts (plain text a chat model reads without surprise).
WORDS = """
time year people way day man thing woman life child world school state family student group country problem
hand part place case week company system program question work government number night point home water room
mother area money story fact month lot right study book eye job word business issue side kind head house
service friend father power hour game line end member law car city name president team minute idea body
information back parent face others level office door health person art war history party result change
morning reason research girl guy moment air teacher force education foot boy age policy music market sense
nation plan college interest death experience effect class control care field development role effort rate
heart drug show leader light voice wife police mind price report decision son view relationship town road
arm difference value building action model season society tax director position player record paper space
ground form event official matter center couple site project activity star table need court oil situation
cost industry figure street image phone data picture practice piece land product doctor wall patient worker
news test movie north love support technology step baby computer type attention film tree source organization
hair window evidence population truth song river stone garden ocean mountain silver yellow green blue red
quiet small large early late young old good new great little long high different important public
bad same able free sure clear full special easy strong whole real best black white simple open short
single common poor natural significant similar hot dead central happy serious ready left physical general
environmental financial blue democratic dark various entire close legal religious cold final main huge
popular traditional cultural wide deep rich heavy bright soft warm fresh clean dry strange sweet wild
walk run read write speak listen build carry watch follow stop create begin help show hear play move live
believe bring happen sit stand lose pay meet include continue learn lead understand grow offer remember
love consider appear buy wait serve die send expect stay fall cut reach kill remain suggest raise pass sell
""".split()


@dataclass(frozen=True)
class Turn:
    """One request. `prompt` is the whole prompt (completions API) or this turn's user message
    (chat API); `input_len` its length in tokens (words when approximated)."""
    prompt: str
    input_len: int
    output_len: int


@dataclass(frozen=True)
class Session:
    """Turns sent in order, each after the previous reply (chat history grows with each reply).
    `api` is "completions" or "chat"; `arrival` the trace's own start time (s), else None."""
    turns: tuple[Turn, ...]
    api: str = "completions"
    system: str = ""
    arrival: float | None = None
    group: int | None = None
    think_s: float = 0.0
    """Seconds between a reply and the session's next turn (an agent running its tool)."""


@dataclass
class Vocabulary:
    """Builds prompts of exact token lengths from `WORDS` (see the module docstring)."""
    tokenizer: object | None = None
    words: list[str] = field(default_factory=list)

    def __post_init__(self):
        if not self.words:
            ws = sorted(set(WORDS))
            if self.tokenizer is not None:
                ws = [w for w in ws if len(self.tokenizer.encode(" " + w, add_special_tokens=False)) == 1]
            self.words = ws
        assert len(self.words) >= 64, "too few single-token words for varied prompts"

    @property
    def exact(self) -> bool:
        """Whether lengths are real token counts (a tokenizer) rather than word counts."""
        return self.tokenizer is not None

    def text(self, rng: random.Random, n: int) -> str:
        """`n` tokens of text: ' w1 w2 ... wn' (each ' word' is one token)."""
        return "".join(" " + rng.choice(self.words) for _ in range(n))

    def count(self, text: str) -> int:
        """Tokens in `text` (words without a tokenizer)."""
        if self.tokenizer is not None:
            return len(self.tokenizer.encode(text, add_special_tokens=False))
        return len(text.split())


def parse_range(spec: str | int) -> tuple[int, int]:
    """'128' -> (128, 128); '64:256' -> (64, 256): lengths drawn uniformly in [min, max]."""
    if isinstance(spec, int):
        lo = hi = spec
    else:
        parts = str(spec).split(":")
        if len(parts) > 2 or not all(p.strip().isdigit() for p in parts):
            raise ValueError(f"length {spec!r}: expected N or MIN:MAX")
        lo, hi = int(parts[0]), int(parts[-1])
    if not 0 < lo <= hi:
        raise ValueError(f"length {spec!r}: need 0 < MIN <= MAX")
    return lo, hi


def random_workload(vocab: Vocabulary, n: int, input_len: tuple[int, int], output_len: tuple[int, int],
                    seed: int, api: str = "completions") -> list[Session]:
    """`n` independent prompts, lengths uniform in the given [min, max] ranges."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        i, o = rng.randint(*input_len), rng.randint(*output_len)
        out.append(Session((Turn(vocab.text(rng, i), i, o),), api))
    return out


def shared_prefix_workload(vocab: Vocabulary, num_groups: int, prompts_per_group: int, system_len: int,
                           question_len: int, output_len: tuple[int, int], seed: int,
                           api: str = "completions") -> list[Session]:
    """`num_groups` × `prompts_per_group` prompts: each group's prompts start with the same
    system prompt of `system_len` tokens, then a question of `question_len` tokens. Groups
    are interleaved in a seeded random order, as independent users' requests arrive."""
    rng = random.Random(seed)
    systems = [vocab.text(rng, system_len) for _ in range(num_groups)]
    out = []
    for g, system in enumerate(systems):
        for _ in range(prompts_per_group):
            o = rng.randint(*output_len)
            q = vocab.text(rng, question_len)
            if api == "chat":
                out.append(Session((Turn(q.lstrip(), question_len, o),), api, system=system.lstrip(), group=g))
            else:
                out.append(Session((Turn(system + q, system_len + question_len, o),), api, group=g))
    rng.shuffle(out)
    return out


def multi_turn_workload(vocab: Vocabulary, num_conversations: int, num_turns: int, input_len: tuple[int, int],
                        output_len: tuple[int, int], system_len: int, seed: int) -> list[Session]:
    """Chat conversations of `num_turns` user messages; each turn resends the whole history
    (system prompt, earlier messages and the server's own replies) via /v1/chat/completions."""
    rng = random.Random(seed)
    out = []
    for c in range(num_conversations):
        system = vocab.text(rng, system_len).lstrip() if system_len else ""
        turns = []
        for _ in range(num_turns):
            i, o = rng.randint(*input_len), rng.randint(*output_len)
            turns.append(Turn(vocab.text(rng, i).lstrip(), i, o))
        out.append(Session(tuple(turns), "chat", system=system, group=c))
    return out


def agentic_workload(vocab: Vocabulary, num_sessions: int, num_turns: int, system_len: int,
                     result_len: tuple[int, int], output_len: tuple[int, int], think_s: float,
                     seed: int) -> list[Session]:
    """Agent sessions: a system prompt of tool definitions, a task, then turns that each append
    a tool's result to the whole history resent so far (the agent's calls are the server's own
    replies), `think_s` apart: each request reuses nearly all of its input."""
    rng = random.Random(seed)
    out = []
    for c in range(num_sessions):
        system = "Tools: " + vocab.text(rng, max(system_len - 2, 1)).lstrip()
        turns = []
        for k in range(num_turns):
            n = rng.randint(*result_len)
            head = "Task:" if k == 0 else "Tool result:"
            turns.append(Turn(head + vocab.text(rng, n), n + 2, rng.randint(*output_len)))
        out.append(Session(tuple(turns), "chat", system=system, group=c, think_s=think_s))
    return out


def load_trace(path: str | Path) -> list[dict]:
    """Records of a JSONL trace: timestamp (s), input_len, output_len, optional prompt and
    hash_ids (Mooncake's input_length/output_length names are accepted too)."""
    records = []
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        r = json.loads(line)
        try:
            records.append({"timestamp": float(r["timestamp"]),
                            "input_len": int(r.get("input_len", r.get("input_length"))),
                            "output_len": int(r.get("output_len", r.get("output_length"))),
                            "prompt": r.get("prompt"), "hash_ids": r.get("hash_ids")})
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"{path}:{n}: expected timestamp, input_len and output_len ({e})") from None
    return records


def trace_workload(vocab: Vocabulary, records: list[dict], seed: int, block_size: int = 512,
                   api: str = "completions") -> list[Session]:
    """Replays trace records. A record's `prompt` is sent as is; otherwise its text is built
    from `hash_ids`: each id is one block of `block_size` tokens whose words depend only on
    (seed, id), so records sharing ids share that prefix; tokens beyond the blocks are
    unique to the record. Arrivals are the timestamps, relative to the first."""
    t0 = min((r["timestamp"] for r in records), default=0.0)
    blocks: dict[int, str] = {}
    out = []
    for k, r in enumerate(records):
        n = r["input_len"]
        if r.get("prompt"):
            text = r["prompt"]
        else:
            parts, have = [], 0
            for h in (r.get("hash_ids") or []):
                if have >= n:
                    break
                if h not in blocks:
                    blocks[h] = vocab.text(random.Random(f"{seed}:block:{h}"), block_size)
                take = min(block_size, n - have)
                parts.append(blocks[h] if take == block_size else _first_words(blocks[h], take))
                have += take
            parts.append(vocab.text(random.Random(f"{seed}:record:{k}"), n - have))
            text = "".join(parts)
        out.append(Session((Turn(text, n, r["output_len"]),), api, arrival=r["timestamp"] - t0))
    return out


def _first_words(text: str, n: int) -> str:
    return "".join(" " + w for w in text.split()[:n])


# ---- arrivals ----------------------------------------------------------------------------
def arrival_offsets(n: int, rate: float, burstiness: float, seed: int) -> list[float]:
    """Start times (s from the start) of `n` arrivals at `rate` per second. Gaps are gamma
    distributed with shape `burstiness` and mean 1/rate: 1.0 is a Poisson process, below 1
    burstier, above 1 more regular. An infinite rate sends everything at once."""
    if n <= 0:
        return []
    if math.isinf(rate):
        return [0.0] * n
    if rate <= 0 or burstiness <= 0:
        raise ValueError("request rate and burstiness must be > 0")
    rng = random.Random(f"{seed}:arrivals")
    scale = 1.0 / (rate * burstiness)  # gamma mean = shape * scale = 1 / rate
    t, out = 0.0, [0.0]
    for _ in range(n - 1):
        t += rng.gammavariate(burstiness, scale)
        out.append(t)
    return out


def trace_offsets(arrivals: list[float], rate: float | None) -> list[float]:
    """A trace's own arrival times, or (with `rate`) the same pattern stretched or squeezed to
    a mean of `rate` arrivals per second (infinite: all at once)."""
    if rate is None:
        return list(arrivals)
    if math.isinf(rate):
        return [0.0] * len(arrivals)
    span = max(arrivals, default=0.0)
    if len(arrivals) < 2 or span <= 0:
        return [k / rate for k in range(len(arrivals))]
    factor = (len(arrivals) - 1) / rate / span
    return [a * factor for a in arrivals]


def workload_summary(sessions: list[Session]) -> dict:
    """What the workload asks for: request count and total input/output tokens."""
    turns = [t for s in sessions for t in s.turns]
    return {"sessions": len(sessions), "requests": len(turns), "input_tokens": sum(t.input_len for t in turns),
            "output_tokens": sum(t.output_len for t in turns)}
