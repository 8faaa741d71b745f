#!/usr/bin/env bash
# Regenerates the Python stubs next to the .proto files (the generated code is committed;
# tests/test_protos.py fails when it is stale). Needs grpcio-tools (a test dependency).
set -euo pipefail
cd "$(dirname "$0")/.."
python -m grpc_tools.protoc -I . --python_out=. --grpc_python_out=. --pyi_out=. protos/*.proto
