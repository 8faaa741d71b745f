"""The committed stubs in protos/ are what protos/generate.sh produces from the .proto files."""
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_generated_stubs_are_fresh(tmp_path):
    protos = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "protos").glob("*.proto"))
    assert protos, "no .proto files"
    subprocess.run([sys.executable, "-m", "grpc_tools.protoc", "-I", str(ROOT), f"--python_out={tmp_path}",
                    f"--grpc_python_out={tmp_path}", f"--pyi_out={tmp_path}", *protos], check=True, cwd=ROOT)
    generated = sorted((tmp_path / "protos").glob("*"))
    assert generated
    for fresh in generated:
        committed = ROOT / "protos" / fresh.name
        assert committed.exists(), f"{committed.name} is not committed: run protos/generate.sh"
        assert committed.read_text() == fresh.read_text(), f"{committed.name} is stale: run protos/generate.sh"
