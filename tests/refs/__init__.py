"""References computed once by transformers and kept as data (tests/data/refs/NAME.json), with
the versions that made them: `make refs` (`python -m tests.refs.make`) writes them, the tests
read them (`load`), and tests/test_refs.py checks that the script still reproduces one of them,
so they cannot rot. Logits are kept as a view small enough to commit: per position the top
entries, a fixed sample of the rest and the log-sum-exp over the whole vocabulary."""
from __future__ import annotations

import hashlib
import json
import platform
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import torch

DATA = Path(__file__).resolve().parents[1] / "data" / "refs"
TOP, SAMPLE = 16, 64  # per position: the top entries, and a strided sample of the vocabulary
DIGITS = 5  # logits and logprobs are kept to 1e-5: the tests compare to 1e-4 at the finest


class MissingReference(FileNotFoundError):
    """A reference file is not in tests/data/refs: `make refs` writes it."""


def versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for package in ("torch", "transformers", "gguf", "tokenizers"):
        try:
            out[package] = version(package)
        except PackageNotFoundError:  # a package the reference did not use
            continue
    return out


def path_of(name: str) -> Path:
    return DATA / f"{name}.json"


def load(name: str) -> dict:
    path = path_of(name)
    if not path.exists():
        raise MissingReference(f"{path} is missing: `make refs` writes it")
    return json.loads(path.read_text())


def dump(name: str, data: dict) -> Path:
    path = path_of(name)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"versions": versions(), **data}, separators=(",", ":")) + "\n")
    return path


def rounded(values) -> list[float]:
    return [round(float(v), DIGITS) for v in values]


def logit_view(logits: torch.Tensor) -> dict:
    """A [positions, vocab] tensor as kept: top-TOP ids and values per position, the values at
    SAMPLE ids spread over the vocabulary, each position's log-sum-exp and the largest |logit|."""
    logits = logits.float()
    top = logits.topk(TOP, dim=-1)
    sample = torch.linspace(0, logits.shape[-1] - 1, SAMPLE).long()
    return {"top_ids": top.indices.tolist(), "top": [rounded(r) for r in top.values],
            "sample_ids": sample.tolist(), "sample": [rounded(r) for r in logits[:, sample]],
            "lse": rounded(logits.logsumexp(-1)), "max_abs": round(float(logits.abs().max()), DIGITS)}


def logit_diff(got: torch.Tensor, view: dict) -> float:
    """The largest difference between `got` ([positions, vocab]) and the kept view: at the top
    and sampled entries and in each position's log-sum-exp (which all of the vocabulary sums to)."""
    got = got.float()
    top = got.gather(-1, torch.tensor(view["top_ids"]))
    diffs = [(top - torch.tensor(view["top"])).abs().max(),
             (got[:, view["sample_ids"]] - torch.tensor(view["sample"])).abs().max(),
             (got.logsumexp(-1) - torch.tensor(view["lse"])).abs().max()]
    return max(float(d) for d in diffs)


def digest(t: torch.Tensor) -> str:
    """A tensor's exact value: its shape and the SHA-256 of its fp32 bytes."""
    t = t.detach().float().contiguous()
    return f"{list(t.shape)}:{hashlib.sha256(t.numpy().tobytes()).hexdigest()}"
