"""The committed stubs in protos/ are what protos/generate.sh produces from the .proto files."""
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_generated_stubs_are_fresh(tmp_path):
    assert list((ROOT / "protos").glob("*.proto")), "no .proto files"
    env = os.environ | {"PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    subprocess.run(["bash", str(ROOT / "protos" / "generate.sh"), str(tmp_path)], check=True, cwd=ROOT, env=env)
    generated = sorted(tmp_path.glob("*"))
    assert generated
    for fresh in generated:
        committed = ROOT / "protos" / fresh.name
        assert committed.exists(), f"{committed.name} is not committed: run protos/generate.sh"
        assert committed.read_text() == fresh.read_text(), f"{committed.name} is stale: run protos/generate.sh"


def test_stubs_import_the_installed_package():
    from pdserve.protos import kv_transfer_pb2, worker_pb2

    assert worker_pb2.DESCRIPTOR.name == "pdserve/protos/worker.proto"
    assert kv_transfer_pb2.DESCRIPTOR.name == "pdserve/protos/kv_transfer.proto"
