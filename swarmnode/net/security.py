"""Who may talk to a node: optional TLS for gRPC, mutual TLS with the swarm's CA, and a swarm token on
every RPC (docs/design.md "Trust" has the threat model).

- `--swarm-token`: every RPC must carry it (metadata `x-swarmnode-token`); a call without it, or with
  another, ends UNAUTHENTICATED before any handler runs. It is compared in constant time and never
  logged, echoed or exported. It also namespaces the run's DHT keys (`dht_namespace`), so a node without
  it cannot even find the swarm's records.
- `--tls-cert/--tls-key`: the node serves gRPC over TLS with that certificate, and uses it as a client.
- `--tls-ca`: the CA that signs the swarm's certificates. Clients verify a node's certificate against
  it (certificates need the advertised host, name or IP, among their subject alternative names), and
  the server requires a client certificate it signed *in the TLS handshake*: a caller without one never
  reaches a handler, not even health; gRPC reports that refusal to the caller as UNAVAILABLE (the
  server closes the connection during the handshake), which `swarmnode status/fetch` explain in one
  line. A node's certificate names its node id (`util.validate.is_node_id_hex`) as its subject common
  name, so the averaging reducer knows which member is speaking from the connection itself
  (`authenticated_node_id`); a node refuses to start with a certificate that names another id.
  There is no per-call proof: a handshake cannot be replayed to another node or for another request.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import hmac
import inspect
import ipaddress
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
from cryptography import x509
from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519, rsa

from swarmnode.util.validate import is_node_id_hex

TOKEN_HEADER = "x-swarmnode-token"
_REFUSAL = "this swarm requires credentials the call did not carry"


@dataclass(frozen=True)
class Security:
    """A node's transport security; the default is none (plain gRPC, no token)."""

    token: str | None = field(default=None, repr=False)
    tls_cert: bytes | None = field(default=None, repr=False)
    tls_key: bytes | None = field(default=None, repr=False)
    tls_ca: bytes | None = field(default=None, repr=False)

    @classmethod
    def from_files(cls, token: str | None, cert: Path | None, key: Path | None, ca: Path | None) -> Security:
        """Read the PEM files; ValueError naming the flag when one cannot be read or parsed."""
        security = cls(token, _read(cert, "--tls-cert"), _read(key, "--tls-key"), _read(ca, "--tls-ca"))
        _ = security._certificate  # parsed now: a bad certificate or key fails at start-up
        return security

    @property
    def tls(self) -> bool:
        return self.tls_cert is not None or self.tls_ca is not None

    @property
    def mutual_tls(self) -> bool:
        """The node serves TLS and requires every caller's certificate, signed by `tls_ca`, in the
        handshake: the caller's node id is then known from its connection."""
        return self.tls_cert is not None and self.tls_key is not None and self.tls_ca is not None

    def server_credentials(self) -> grpc.ServerCredentials | None:
        if self.tls_cert is None or self.tls_key is None:
            return None
        if self.tls_ca is None:
            return grpc.ssl_server_credentials([(self.tls_key, self.tls_cert)])
        return grpc.ssl_server_credentials(
            [(self.tls_key, self.tls_cert)], root_certificates=self.tls_ca, require_client_auth=True
        )

    def check_node_certificate(self, node_id: str) -> None:
        """With mutual TLS, the node's certificate must name `node_id` as its common name (peers take
        the sender of averaging messages from it); ValueError naming --tls-cert otherwise."""
        certificate = self._certificate if self.mutual_tls else None
        if certificate is None:
            return
        names = certificate.subject.get_attributes_for_oid(x509.NameOID.COMMON_NAME)
        common_name = str(names[0].value) if names else ""
        if common_name != node_id:
            raise ValueError(
                f"--tls-cert: with --tls-ca a node's certificate must name its node id {node_id} as its "
                f"common name (CN), got {common_name!r}"
            )

    def channel_credentials(self) -> grpc.ChannelCredentials | None:
        if not self.tls:
            return None
        return grpc.ssl_channel_credentials(
            root_certificates=self.tls_ca, private_key=self.tls_key, certificate_chain=self.tls_cert
        )

    def call_metadata(self) -> list[tuple[str, str | bytes]]:
        """What every outgoing call carries: the token, if the swarm has one."""
        return [(TOKEN_HEADER, self.token)] if self.token else []

    @functools.cached_property
    def _certificate(self) -> x509.Certificate | None:
        """The node's certificate, parsed once and its private key checked (so bad files fail at
        start-up); None without both."""
        if self.tls_cert is None or self.tls_key is None:
            return None
        try:
            cert = x509.load_pem_x509_certificate(self.tls_cert)
        except ValueError as exc:
            raise ValueError(f"--tls-cert: not a PEM certificate: {exc}") from None
        _load_tls_key(self.tls_key)
        return cert

    def dht_namespace(self, run_id: str) -> str:
        """The run's name in DHT keys: with a token, one that only token holders can compute."""
        if not self.token:
            return run_id
        tag = hmac.new(self.token.encode(), run_id.encode(), hashlib.sha256).hexdigest()[:16]
        return f"{run_id}.{tag}"

    def dht_datagram_key(self) -> bytes | None:
        """The key that tags every DHT datagram of a token swarm (`swarmnode.net.dht`); None without a token.

        HMAC-SHA256 of a fixed label under the token: a run id cannot be that label (it has no '/'), so
        the key is none of the `dht_namespace` tags, and it reveals nothing about the token."""
        if not self.token:
            return None
        return hmac.new(self.token.encode(), b"swarmnode/dht-datagram-key/v1", hashlib.sha256).digest()


def certificate_request(node_id: str, key_path: Path, names: tuple[str, ...] = ()) -> bytes:
    """A PEM certificate signing request whose subject CN is `node_id` (what mutual TLS requires of a
    node's certificate: `check_node_certificate`), signed with the TLS key at `key_path`: an EC, RSA or
    Ed25519 PEM key there, or a new EC P-256 key written there (mode 0600). `names` (host names or IP
    addresses peers dial) become its subject alternative names. ValueError for a key file that is not
    an unencrypted PEM key of those types."""
    key = _tls_key(key_path)
    builder = x509.CertificateSigningRequestBuilder().subject_name(
        x509.Name([x509.NameAttribute(x509.NameOID.COMMON_NAME, node_id)])
    )
    if names:
        builder = builder.add_extension(x509.SubjectAlternativeName([_general_name(n) for n in names]), False)
    algorithm = None if isinstance(key, ed25519.Ed25519PrivateKey) else hashes.SHA256()
    return builder.sign(key, algorithm).public_bytes(serialization.Encoding.PEM)


def _tls_key(path: Path) -> TlsKey:
    if not path.exists():
        key = ec.generate_private_key(ec.SECP256R1())
        pem = key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
        with os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "wb") as f:
            f.write(pem)
        return key
    return _load_tls_key(path.read_bytes())


TlsKey = ec.EllipticCurvePrivateKey | rsa.RSAPrivateKey | ed25519.Ed25519PrivateKey
"""The TLS key types a node accepts."""


def _load_tls_key(pem: bytes) -> TlsKey:
    try:
        key = serialization.load_pem_private_key(pem, password=None)
    except (ValueError, TypeError, UnsupportedAlgorithm) as exc:
        raise ValueError(f"--tls-key: not an unencrypted PEM private key: {exc}") from None
    if not isinstance(key, TlsKey):
        raise ValueError("--tls-key: only EC, RSA and Ed25519 keys are supported")
    return key


def _general_name(name: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(name))
    except ValueError:
        return x509.DNSName(name)


def _read(path: Path | None, flag: str) -> bytes | None:
    if path is None:
        return None
    try:
        return path.read_bytes()
    except OSError as exc:
        raise ValueError(f"{flag}: cannot read {str(path)!r}: {exc.strerror}") from None


def authenticated_node_id(context: Any) -> str | None:
    """The node id the caller's TLS client certificate names (its common name, when it is a node id),
    or None: no mutual TLS, or a certificate of a person or script rather than a node. Only
    meaningful on a server that requires client certificates (`Security.mutual_tls`)."""
    try:
        names: list[bytes] = list(context.auth_context().get("x509_common_name") or ())
    except (AttributeError, RuntimeError):
        return None
    name = names[0].decode("ascii", "replace") if len(names) == 1 else ""
    return name if is_node_id_hex(name) else None


class _Credentials:
    """Adds the swarm token and the certificate proof to an outgoing call."""

    def __init__(self, security: Security) -> None:
        self._security = security

    def _with_credentials(self, details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        metadata = grpc.aio.Metadata(*(details.metadata or ()), *self._security.call_metadata())
        return grpc.aio.ClientCallDetails(
            details.method, details.timeout, metadata, details.credentials, details.wait_for_ready
        )


class _UnaryUnaryCredentials(_Credentials, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return await continuation(self._with_credentials(details), request)


class _UnaryStreamCredentials(_Credentials, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return await continuation(self._with_credentials(details), request)


class _StreamUnaryCredentials(_Credentials, grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(self, continuation: Any, details: Any, request_iterator: Any) -> Any:
        return await continuation(self._with_credentials(details), request_iterator)


class _StreamStreamCredentials(_Credentials, grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(self, continuation: Any, details: Any, request_iterator: Any) -> Any:
        return await continuation(self._with_credentials(details), request_iterator)


def credential_interceptors(security: Security) -> list[Any]:
    """The client interceptors that put `security`'s credentials on every call: one per call kind,
    since grpc.aio files an interceptor under the first kind it implements only (one that implements
    all four would see unary-unary calls alone: streams would go out without the token); none when
    there is nothing to add."""
    if not security.token:
        return []
    kinds = (
        _UnaryUnaryCredentials,
        _UnaryStreamCredentials,
        _StreamUnaryCredentials,
        _StreamStreamCredentials,
    )
    return [kind(security) for kind in kinds]


class ServerGuard(grpc.aio.ServerInterceptor):
    """Runs before every handler: a call without the swarm token ends UNAUTHENTICATED, and `on_reject`
    counts it (client certificates are checked earlier, in the handshake); a request message that does
    not decode ends INVALID_ARGUMENT (where gRPC itself would answer UNKNOWN)."""

    def __init__(self, security: Security, on_reject: Callable[[str], None] | None = None) -> None:
        self._token = security.token.encode() if security.token else None
        self._on_reject = on_reject

    async def intercept_service(self, continuation: Any, details: grpc.HandlerCallDetails) -> Any:
        handler = await continuation(details)
        if handler is None:
            return None
        admitted = self._admits(details)
        if not admitted and self._on_reject is not None:
            self._on_reject("unauthenticated")
        return _guarded(handler, admitted)

    def _admits(self, details: grpc.HandlerCallDetails) -> bool:
        metadata = dict(details.invocation_metadata or ())
        if self._token is None:
            return True
        given = metadata.get(TOKEN_HEADER)
        return isinstance(given, str) and hmac.compare_digest(given.encode(), self._token)


UNDECODABLE = object()
"""What a guarded handler gets for a request message that did not decode: a unary call ends
INVALID_ARGUMENT before the handler runs; a streaming handler reads it (`context.read()`) and must
refuse it itself, as the averaging reducer does."""

_KINDS = {
    "unary_unary": grpc.unary_unary_rpc_method_handler,
    "unary_stream": grpc.unary_stream_rpc_method_handler,
    "stream_unary": grpc.stream_unary_rpc_method_handler,
    "stream_stream": grpc.stream_stream_rpc_method_handler,
}


def _guarded(handler: Any, admitted: bool) -> Any:
    """The same kind of handler, behind the admission and decoding checks."""
    for kind, make in _KINDS.items():
        behaviour = getattr(handler, kind)
        if behaviour is not None:
            wrapped = _wrap(behaviour, admitted, kind.startswith("stream"), kind.endswith("stream"))
            return make(
                wrapped,
                request_deserializer=_lenient(handler.request_deserializer),
                response_serializer=handler.response_serializer,
            )
    return handler


def _lenient(deserializer: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
    if deserializer is None:
        return None

    def decode(data: bytes) -> Any:
        try:
            return deserializer(data)
        except Exception:  # noqa: BLE001 - any decoding failure is the caller's malformed message
            return UNDECODABLE

    return decode


async def _prepare(request: Any, context: Any, admitted: bool, streaming: bool) -> Any:
    if not admitted:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, _REFUSAL)
    if not streaming and request is UNDECODABLE:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "the request message does not decode")
    return request


def _wrap(
    behaviour: Callable[..., Any], admitted: bool, request_streaming: bool, response_streaming: bool
) -> Callable[..., Any]:
    if not response_streaming:

        async def unary(request: Any, context: Any) -> Any:
            return await behaviour(await _prepare(request, context, admitted, request_streaming), context)

        return unary

    async def streaming(request: Any, context: Any) -> None:
        # It writes a generator's responses itself (gRPC's reader/writer API), as a handler that writes
        # through the context does: a write into a call whose peer cancelled it fails (InternalError)
        # before gRPC has seen the cancellation, and gRPC logs a failure of its own write (after a
        # `yield`) as an ERROR with a traceback. A cancelled call is routine, so it ends as one (gRPC
        # logs that at debug); the generator is closed at once, so its `finally` frees what it holds.
        result = behaviour(await _prepare(request, context, admitted, request_streaming), context)
        try:
            if inspect.isasyncgen(result):
                async with contextlib.aclosing(result) as responses:
                    async for item in responses:
                        await context.write(item)
            else:
                await result
        except grpc.aio.InternalError:  # a batch (message, metadata, status) the ended call refused
            raise asyncio.CancelledError from None

    return streaming
