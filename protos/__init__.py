"""Protobuf contracts between processes and their generated stubs (later issues)."""
