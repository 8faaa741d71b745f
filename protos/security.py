"""Transport security of the internal gRPC services (decode, prefill, KV transfer).

Without TLS the services listen in plaintext and authenticate callers by the cluster token
alone, which suits loopback and private networks. With TLS every internal connection is
mutual TLS: each server presents the cluster's certificate and requires a client
certificate signed by the cluster's CA, and each client checks the server against that CA.
One certificate/key pair per host (or one for the whole cluster) signed by one CA is enough;
`server_name` lets clients verify a shared certificate whatever address they dial (pods in
Kubernetes get arbitrary IPs).
"""
from __future__ import annotations

import hashlib
import hmac
import os
from dataclasses import dataclass, field
from pathlib import Path

import grpc


class TLSConfigError(ValueError):
    """The TLS settings are incomplete or their files cannot be read."""


@dataclass(frozen=True)
class TLSConfig:
    cert_file: str = ""     # this process's certificate chain (PEM)
    key_file: str = ""      # its private key (PEM)
    ca_file: str = ""       # the CA that signs every cluster member's certificate (PEM)
    server_name: str = ""   # name to verify in servers' certificates ("": the dialled host)

    @property
    def enabled(self) -> bool:
        return bool(self.cert_file or self.key_file or self.ca_file)

    def _read(self) -> tuple[bytes, bytes, bytes]:
        missing = [n for n in ("cert_file", "key_file", "ca_file") if not getattr(self, n)]
        if missing:
            raise TLSConfigError(f"TLS needs a certificate, its key and the CA; missing: {', '.join(missing)}")
        try:
            return tuple(Path(getattr(self, n)).read_bytes() for n in ("cert_file", "key_file", "ca_file"))
        except OSError as e:
            raise TLSConfigError(f"cannot read a TLS file: {e}") from e

    def server_credentials(self) -> grpc.ServerCredentials:
        cert, key, ca = self._read()
        return grpc.ssl_server_credentials([(key, cert)], root_certificates=ca, require_client_auth=True)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        cert, key, ca = self._read()
        return grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)


def add_port(server: grpc.aio.Server, address: str, tls: TLSConfig | None) -> int:
    """Bind `server` to `address`, with mutual TLS when `tls` is enabled; returns the port."""
    if tls is not None and tls.enabled:
        return server.add_secure_port(address, tls.server_credentials())
    return server.add_insecure_port(address)


def open_channel(target: str, tls: TLSConfig | None, options: list | tuple = ()) -> grpc.aio.Channel:
    """A client channel to `target`, presenting the cluster certificate when `tls` is enabled."""
    options = list(options)
    if tls is not None and tls.enabled:
        if tls.server_name:
            options.append(("grpc.ssl_target_name_override", tls.server_name))
        return grpc.aio.secure_channel(target, tls.channel_credentials(), options=options)
    return grpc.aio.insecure_channel(target, options=options)


def token_proof(token: str, side: str, nonce: bytes) -> bytes:
    """HMAC-SHA256 of `side:nonce` under the cluster token: shows the token is held without
    sending it (`side`: "request" from the caller, "reply" from the worker)."""
    return hmac.new(token.encode(), side.encode() + b":" + nonce, hashlib.sha256).digest()


def stats_request(token: str):
    """A Stats/CachedBlocks request that proves the token; check the reply with `proves`."""
    from .worker_pb2 import StatsRequest

    nonce = os.urandom(16)
    return StatsRequest(nonce=nonce, proof=token_proof(token, "request", nonce))


def proves(token: str, request, reply) -> bool:
    """Whether `reply` (WorkerStats or BlockSnapshot) proves the token for `request`'s nonce."""
    return hmac.compare_digest(reply.proof, token_proof(token, "reply", request.nonce))


async def check_stats_request(token: str, request, context) -> bytes:
    """Abort the RPC unless the request proves the cluster token; returns the reply's proof."""
    if not hmac.compare_digest(request.proof, token_proof(token, "request", request.nonce)) or not request.nonce:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong cluster token")
    return token_proof(token, "reply", request.nonce)


async def check_cluster_token(expected: str, given: str, context) -> None:
    """Abort the RPC unless `given` is the cluster token (constant-time compare)."""
    if not hmac.compare_digest(given.encode(), expected.encode()):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong cluster token")


@dataclass(frozen=True)
class SecurityConfig:
    api_keys: tuple[str, ...] = field(default=(), repr=False)
    """Accepted `Authorization: Bearer` keys on the API; empty: no authentication."""
    cluster_token: str = field(default="", repr=False)
    """Shared secret every internal gRPC call carries ("": none)."""
    tls: TLSConfig = field(default_factory=TLSConfig)
    """Mutual TLS on every internal gRPC connection (disabled when empty)."""
