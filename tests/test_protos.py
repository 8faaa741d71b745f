"""The committed stubs in protos/ are what protos/generate.sh produces from the .proto files."""
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# What a generator stamps with its own version: a patch release of grpcio-tools (1.85.1 -> 1.85.4)
# or of its bundled protobuf changes these lines and nothing else. The committed stamps stay at
# the oldest version the package accepts, since the stubs refuse a runtime older than the stamp.
_STAMPS = (
    (re.compile(r"^GRPC_GENERATED_VERSION = '[^']*'$", re.M), "GRPC_GENERATED_VERSION = <stamp>"),
    (re.compile(r"^# Protobuf Python Version: .*$", re.M), "# Protobuf Python Version: <stamp>"),
    (re.compile(r"(Domain\.PUBLIC,\n)\s*\d+,\n\s*\d+,\n\s*\d+,\n"), r"\1<stamp>\n"),
)


def _unstamped(text: str) -> str:
    for pattern, mask in _STAMPS:
        text = pattern.sub(mask, text)
    return text


def test_stamps_are_masked_and_nothing_else():
    """The mask hides a generator's version and keeps every other difference visible."""
    stub = (ROOT / "protos" / "worker_pb2.py").read_text()
    grpc_stub = (ROOT / "protos" / "worker_pb2_grpc.py").read_text()
    bumped = re.sub(r"(Domain\.PUBLIC,\n\s*)\d+", r"\g<1>99", stub.replace("Version: ", "Version: 9"))
    assert bumped != stub and _unstamped(bumped) == _unstamped(stub)
    assert _unstamped(grpc_stub.replace("GRPC_GENERATED_VERSION = '", "GRPC_GENERATED_VERSION = '9")) \
        == _unstamped(grpc_stub)
    assert _unstamped(stub.replace("SamplingParams", "SamplingParamz")) != _unstamped(stub)


def test_generated_stubs_are_fresh(tmp_path):
    assert list((ROOT / "protos").glob("*.proto")), "no .proto files"
    env = os.environ | {"PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    subprocess.run(["bash", str(ROOT / "protos" / "generate.sh"), str(tmp_path)], check=True, cwd=ROOT, env=env)
    generated = sorted(tmp_path.glob("*"))
    assert generated
    for fresh in generated:
        committed = ROOT / "protos" / fresh.name
        assert committed.exists(), f"{committed.name} is not committed: run protos/generate.sh"
        assert _unstamped(committed.read_text()) == _unstamped(fresh.read_text()), \
            f"{committed.name} is stale: run protos/generate.sh"


def test_stubs_import_the_installed_package():
    from pdserve.protos import kv_transfer_pb2, worker_pb2

    assert worker_pb2.DESCRIPTOR.name == "pdserve/protos/worker.proto"
    assert kv_transfer_pb2.DESCRIPTOR.name == "pdserve/protos/kv_transfer.proto"


def _non_default(f):
    """A value of SamplingParams field `f` that differs from its default (and survives float32)."""
    from pdserve.common.structured import Structured

    return {"max_tokens": 77, "temperature": 0.5, "top_p": 0.25, "top_k": 7, "min_p": 0.125, "seed": 2**62 + 5,
            "repetition_penalty": 1.5, "presence_penalty": -0.75, "frequency_penalty": 0.5, "min_tokens": 3,
            "logit_bias": {11: -100.0, 12: 2.5}, "stop": ["###"], "stop_token_ids": [2, 3], "ignore_eos": True,
            "logprobs": 4, "prompt_logprobs": 0, "structured": Structured("regex", "[ab]+"), "cache_salt": "tenant-a",
            "priority": -7, "tenant": "acme",
            }[f.name]


def test_sampling_params_round_trip_every_field():
    """Every field of SamplingParams crosses the wire and comes back equal, alone and all at
    once; stop strings do not travel (the router applies them on text). A field added to
    SamplingParams without a wire form fails here."""
    from dataclasses import fields

    from pdserve.common.sampling_params import SamplingParams
    from pdserve.protos import worker_pb2 as pb
    from pdserve.protos.convert import params_from_proto, params_to_proto

    travel = [f for f in fields(SamplingParams) if f.name != "stop"]
    for f in travel:
        p = SamplingParams(**{f.name: _non_default(f)})
        assert params_from_proto(params_to_proto(p)) == p, f.name
    every = SamplingParams(**{f.name: _non_default(f) for f in travel})
    assert params_from_proto(params_to_proto(every)) == every
    back = params_from_proto(params_to_proto(SamplingParams(stop=["###"])))
    assert back.stop == []
    # unset optionals stay unset (None is "no limit" / "no logprobs", not 0)
    none = SamplingParams(max_tokens=None, seed=None, logprobs=None, prompt_logprobs=None)
    assert params_from_proto(params_to_proto(none)) == none
    # documented bounds survive float32: what the router accepted, a worker accepts
    for edge in (SamplingParams(repetition_penalty=0.01), SamplingParams(repetition_penalty=10.0, top_p=1e-3,
                                                                          min_p=1.0, temperature=100.0)):
        edge.validate()
        params_from_proto(params_to_proto(edge)).validate()
    wire = {d.name for d in pb.SamplingParams.DESCRIPTOR.fields}
    assert wire == {f.name for f in travel} - {"structured"} | {"structured_kind", "structured_spec"}
