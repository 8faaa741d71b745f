#!/usr/bin/env bash
# Regenerates the Python stubs of the .proto files into protos/ (or into $1), importing each
# other as `pdserve.protos` (the installed name of this folder). The generated code is
# committed; tests/test_protos.py fails when it is stale. Needs grpcio-tools (a test dependency).
set -euo pipefail
cd "$(dirname "$0")/.."
out="$(realpath -m "${1:-protos}")"
tree="$(mktemp -d)"
trap 'rm -rf "$tree"' EXIT
mkdir -p "$tree/src/pdserve" "$tree/out"
cp -r protos "$tree/src/pdserve/protos"
(cd "$tree/src" && python -m grpc_tools.protoc -I . --python_out=../out --grpc_python_out=../out --pyi_out=../out \
    pdserve/protos/*.proto)
mkdir -p "$out"
cp "$tree"/out/pdserve/protos/* "$out/"
