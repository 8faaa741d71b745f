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

import enum
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


@dataclass(frozen=True)
class WorkerIdentity:
    """What a Stats proof binds: who answers, which service, and at which address. A record
    whose identity the worker behind its address does not prove is not that worker."""

    worker_id: str = ""
    role: str = ""     # the service it answers: "prefill" | "decode"
    address: str = ""  # host:port, as registered and dialled

    @property
    def named(self) -> bool:
        return bool(self.worker_id or self.role or self.address)


def service_role(role: str) -> str:
    """The service a registered role answers: an aggregated worker is a decode worker that
    prefills itself, and proves the role "decode"."""
    return "decode" if role == "aggregated" else role


def _fields(*parts: bytes | str) -> bytes:
    """Length-prefixed fields: no two different tuples share an encoding (so a proof for one
    identity never verifies for another, however the strings split)."""
    raw = [p.encode() if isinstance(p, str) else p for p in parts]
    return b"".join(len(r).to_bytes(4, "big") + r for r in raw)


def token_proof(token: str, side: str, nonce: bytes, who: WorkerIdentity = WorkerIdentity()) -> bytes:
    """HMAC-SHA256 of (`side`, nonce, worker id, role, address) under the cluster token: shows
    the token is held without sending it, for this exchange and this identity (`side`:
    "request" from the caller, "reply" from the worker)."""
    msg = _fields(side, nonce, who.worker_id, who.role, who.address)
    return hmac.new(token.encode(), msg, hashlib.sha256).digest()


def stats_request(token: str, expect: WorkerIdentity = WorkerIdentity()):
    """A Stats/CachedBlocks request that proves the token and names the worker it expects at
    the address it dials (the router: the registry record's); check the reply with
    `check_reply`. An empty `expect` takes whichever worker answers (tools, tests)."""
    from .worker_pb2 import StatsRequest

    nonce = os.urandom(16)
    return StatsRequest(nonce=nonce, worker_id=expect.worker_id, role=expect.role, address=expect.address,
                        proof=token_proof(token, "request", nonce, expect))


def named_identity(msg) -> WorkerIdentity:
    """The identity a StatsRequest names, or a WorkerStats/BlockSnapshot claims."""
    return WorkerIdentity(msg.worker_id, msg.role, msg.address)


class ReplyCheck(enum.Enum):
    PROVEN = "proven"              # the token holder named in the request answered
    NO_TOKEN = "no token"          # the reply does not prove the cluster token
    OTHER_WORKER = "other worker"  # a token holder, but not the one expected at that address


def check_reply(token: str, request, reply) -> ReplyCheck:
    """Whether `reply` (WorkerStats or BlockSnapshot) proves the token for `request`'s nonce,
    and comes from the identity the request named (any identity, if it named none)."""
    claimed = named_identity(reply)
    if not hmac.compare_digest(reply.proof, token_proof(token, "reply", request.nonce, claimed)):
        return ReplyCheck.NO_TOKEN
    expected = named_identity(request)
    return ReplyCheck.PROVEN if not expected.named or claimed == expected else ReplyCheck.OTHER_WORKER


def proves(token: str, request, reply) -> bool:
    """`check_reply` is PROVEN."""
    return check_reply(token, request, reply) is ReplyCheck.PROVEN


async def check_stats_request(token: str, request, context, me: WorkerIdentity) -> bytes:
    """Abort the RPC unless the request proves the cluster token (UNAUTHENTICATED) and names
    this worker, if it names one (PERMISSION_DENIED: the caller dialled another worker's
    record, e.g. through a relay); returns the reply's proof, over `me`."""
    named = named_identity(request)
    if not request.nonce or not hmac.compare_digest(request.proof, token_proof(token, "request", request.nonce,
                                                                               named)):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong cluster token")
    if named.named and named != me:
        await context.abort(grpc.StatusCode.PERMISSION_DENIED,
                            f"this is worker {me.worker_id} ({me.role}) at {me.address}, not {named.worker_id} "
                            f"({named.role}) at {named.address}")
    return token_proof(token, "reply", request.nonce, me)


async def check_cluster_token(expected: str, given: str, context) -> None:
    """Abort the RPC unless `given` is the cluster token (constant-time compare)."""
    if not hmac.compare_digest(given.encode(), expected.encode()):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong cluster token")


@dataclass(frozen=True)
class SecurityConfig:
    api_keys: tuple[str, ...] = field(default=(), repr=False)
    """Accepted `Authorization: Bearer` keys on the API; empty: no authentication (unless a
    keys file is given). Such a key is the operator's: every endpoint, any priority."""
    keys_file: str = ""
    """The operator's keys file (router/keys.py): each key's digest, tenant, priority ceiling,
    models and whether it may speak for others; "": none."""
    cluster_token: str = field(default="", repr=False)
    """Shared secret every internal gRPC call carries ("": none)."""
    tls: TLSConfig = field(default_factory=TLSConfig)
    """Mutual TLS on every internal gRPC connection (disabled when empty)."""
