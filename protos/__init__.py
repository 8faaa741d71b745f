"""The contracts between processes: the `.proto` files and their generated stubs
(`generate.sh` regenerates them), the conversions between engine types and messages
(`convert.py`), the conventions of refusals and errors across gRPC (`status.py`), and the
internal services' TLS and cluster token (`security.py`)."""
