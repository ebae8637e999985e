"""How a process secures its gRPC links: TLS, mutual TLS and a shared bearer token, one set of
settings (services.common.settings.SecurityFields) for its server side and its client side.

- TLS: tls_cert and tls_key are this process's certificate: the server's certificate, and the
  client certificate it presents when it calls another service. tls_ca verifies peers: the
  servers it calls (the system roots when unset) and, with tls_client_auth, its callers.
- Token: auth_token is sent on every call as `authorization: Bearer <token>` and, on a server,
  required of every call but the standard health check (`grpc.health.v1.Health/Check`), which
  stays open so that probes need no secret; it reveals only SERVING or NOT_SERVING. Its stream,
  Health.Watch, needs the token like any call that holds the server. Under mTLS the
  health check still needs a client certificate, as every call does.
- Plaintext: allowed on loopback (with one warning line, as Redis' protected mode does) or when
  chosen with `insecure`; a server listening on, or a process dialing, another address with
  neither TLS nor `insecure` refuses to start. A token does not count: over plaintext it
  travels in the clear, for anyone on the path to read and replay.
"""

from __future__ import annotations

import collections
import hmac
import ipaddress
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from specd.errors import SpecdError

log = logging.getLogger(__name__)

AUTH_METADATA = "authorization"
# The health check a probe makes carries no token; Health.Watch (a stream that lasts) needs one.
EXEMPT_METHOD = "/grpc.health.v1.Health/Check"
LOOPBACK_NAMES = {"localhost"}
# Channels this process has opened (aio_channel, sync_channel): each is a resolution, a
# handshake and, with TLS, the PEM files read again; tests count them.
channels_opened = 0


class SecurityError(SpecdError):
    """Security settings that do not fit together, or would expose a service in plaintext."""


def is_loopback(host: str) -> bool:
    """True for localhost and loopback IP addresses (127.0.0.0/8, ::1)."""
    host = host.strip("[]")
    if host.lower() in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def address_hosts(address: str) -> list[str]:
    """The hosts of a gRPC target, every one of a list ("ipv4:a:p,b:p"); [] for a Unix socket."""
    if address.startswith(("ipv4:", "ipv6:")):
        scheme, rest = address.split(":", 1)
        return [h for part in rest.split(",") if (h := address_host(f"{scheme}:{part}")) is not None]
    host = address_host(address)
    return [host] if host is not None else []


def address_host(address: str) -> str | None:
    """The host of a gRPC target ("host:port", "[v6]:port", "dns:///host:port", "ipv4:a:p,b:p");
    None for a Unix socket (local by nature)."""
    if address.startswith(("unix:", "unix-abstract:")):
        return None
    if address.startswith(("dns:", "ipv4:", "ipv6:")):
        address = address.split(":", 1)[1].rsplit("/", 1)[-1].split(",")[0]
    if address.startswith("["):
        return address[1:address.index("]")] if "]" in address else address[1:]
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or ":" in host:  # no port, or an unbracketed IPv6 address
        return address
    return host


@dataclass(frozen=True)
class GrpcSecurity:
    """One process's gRPC security; GrpcSecurity() is plaintext without a token."""

    tls_cert: Path | None = None
    tls_key: Path | None = None
    tls_ca: Path | None = None
    tls_client_auth: bool = False
    tls_server_name: str | None = None
    auth_token: str | None = field(default=None, repr=False)
    insecure: bool = False
    env_prefix: str = field(default="SPECD_<SERVICE>_", repr=False, compare=False)  # for messages

    def __post_init__(self):
        if (self.tls_cert is None) != (self.tls_key is None):
            given, missing = ("tls_cert", "tls_key") if self.tls_key is None else ("tls_key", "tls_cert")
            raise SecurityError(f"{self._flag(given)} is set without {self._flag(missing)}: a certificate "
                                f"needs its private key")
        if self.tls_client_auth and self.tls_ca is None:
            raise SecurityError(f"{self._flag('tls_client_auth')} needs {self._flag('tls_ca')}, the CA that "
                                f"signs client certificates")
        if self.tls_client_auth and self.tls_cert is None:
            raise SecurityError(f"{self._flag('tls_client_auth')} needs TLS: set {self._flag('tls_cert')} "
                                f"and {self._flag('tls_key')}")
        if self.insecure and self.tls:
            raise SecurityError(f"{self._flag('insecure')} asks for plaintext, but TLS is configured "
                                f"({self._flag('tls_cert')}/{self._flag('tls_ca')}); choose one")
        if self.tls_server_name and not self.tls:
            raise SecurityError(f"{self._flag('tls_server_name')} needs TLS ({self._flag('tls_ca')})")
        for name in ("tls_cert", "tls_key", "tls_ca"):
            path = getattr(self, name)
            if path is not None and not Path(path).is_file():
                raise SecurityError(f"{self._flag(name)}: no such file: {path}")
        if self.auth_token is not None and not self.auth_token.strip():
            raise SecurityError(f"{self._flag('auth_token')} is empty")

    @classmethod
    def from_settings(cls, s) -> GrpcSecurity:
        """From a settings object with SecurityFields (its env_prefix names the variables in errors)."""
        token = s.auth_token.get_secret_value() if s.auth_token is not None else None
        return cls(s.tls_cert, s.tls_key, s.tls_ca, s.tls_client_auth, s.tls_server_name, token, s.insecure,
                   s.model_config.get("env_prefix", "SPECD_<SERVICE>_"))

    @classmethod
    def from_env(cls, service: str) -> GrpcSecurity:
        """The security of `specd serve <service>` as its SPECD_<SERVICE>_* and SPECD_AUTH_TOKEN
        environment variables set it (for probes running beside the service)."""
        from pydantic_settings import SettingsConfigDict

        from services.common.settings import SecurityFields

        settings = type("ProbeSecurity", (SecurityFields,),
                        {"model_config": SettingsConfigDict(env_prefix=f"SPECD_{service.upper()}_")})
        return cls.from_settings(settings())

    def _flag(self, name: str) -> str:
        env = "SPECD_AUTH_TOKEN" if name == "auth_token" else f"{self.env_prefix}{name.upper()}"
        return f"--{name.replace('_', '-')} ({env})"

    @property
    def tls(self) -> bool:
        """Whether this process speaks TLS (it has a certificate, or a CA to check servers with)."""
        return self.tls_cert is not None or self.tls_ca is not None

    # -- start-up checks ------------------------------------------------------------------------
    def check_listen(self, host: str, quiet: bool = False) -> None:
        """Refuse (SecurityError) to serve plaintext on a non-loopback host unless insecure is set,
        token or not; on loopback, say once (unless quiet) that the link is plaintext."""
        if self.tls and self.tls_cert is None:
            raise SecurityError(f"a TLS server needs {self._flag('tls_cert')} and {self._flag('tls_key')} "
                                f"(only {self._flag('tls_ca')} is set)")
        self._check_plaintext(host, "listen on", quiet)

    def check_dial(self, *addresses: str) -> None:
        """Refuse (SecurityError) to call a non-loopback address in plaintext unless insecure is
        set, token or not ('' addresses, unset, are skipped; every address of a list is checked)."""
        for address in addresses:
            for host in address_hosts(address) if address else []:
                self._check_plaintext(host, "dial", quiet=True)

    def _check_plaintext(self, host: str, verb: str, quiet: bool = False) -> None:
        """A token is no protection here: without TLS it crosses the network in the clear."""
        if self.tls or self.insecure:
            return
        if not is_loopback(host):
            token = " (a token alone is sent in the clear)" if self.auth_token else ""
            raise SecurityError(
                f"refusing to {verb} {host} with plaintext gRPC{token}: set {self._flag('tls_cert')}, "
                f"{self._flag('tls_key')} and {self._flag('tls_ca')} (mTLS: with "
                f"{self._flag('tls_client_auth')} true), or choose plaintext with {self._flag('insecure')} true")
        if not quiet and not self.auth_token:
            log.warning("gRPC on %s is plaintext without a token (loopback only; --insecure true silences "
                        "this)", host)

    # -- server side ----------------------------------------------------------------------------
    def server_credentials(self) -> grpc.ServerCredentials | None:
        """TLS credentials of a server (requiring client certificates with tls_client_auth), or None
        for plaintext."""
        if self.tls_cert is None:
            return None
        ca = _read(self.tls_ca) if self.tls_client_auth else None
        return grpc.ssl_server_credentials([(_read(self.tls_key), _read(self.tls_cert))],
                                           root_certificates=ca, require_client_auth=self.tls_client_auth)

    def server_interceptors(self) -> list[grpc.aio.ServerInterceptor]:
        return [TokenInterceptor(self.auth_token)] if self.auth_token else []

    def add_port(self, server: grpc.aio.Server, address: str) -> int:
        """Bind address on server, with TLS when configured; returns the bound port."""
        creds = self.server_credentials()
        return server.add_secure_port(address, creds) if creds else server.add_insecure_port(address)

    # -- client side ----------------------------------------------------------------------------
    def channel_credentials(self) -> grpc.ChannelCredentials | None:
        """TLS credentials of a client, or None for plaintext. The token is not among them: client
        interceptors add it to every call, over TLS or not (call credentials would run a Python
        plugin on a thread of its own for every call; scripts/grpc_tls_cost.py measures both)."""
        if not self.tls:
            return None
        return grpc.ssl_channel_credentials(
            root_certificates=_read(self.tls_ca) if self.tls_ca else None,
            private_key=_read(self.tls_key) if self.tls_key else None,
            certificate_chain=_read(self.tls_cert) if self.tls_cert else None)

    def channel_options(self, options: Sequence[tuple[str, object]] = ()) -> list[tuple[str, object]]:
        extra = [("grpc.ssl_target_name_override", self.tls_server_name)] if self.tls_server_name else []
        return [*options, *extra]

    def aio_channel(self, address: str, options: Sequence[tuple[str, object]] = ()) -> grpc.aio.Channel:
        """A grpc.aio channel to address (open it on the loop that will use it)."""
        global channels_opened
        channels_opened += 1
        creds, opts = self.channel_credentials(), self.channel_options(options)
        interceptors = _aio_token_interceptors(self.auth_token) if self.auth_token else None
        if creds is not None:
            return grpc.aio.secure_channel(address, creds, options=opts, interceptors=interceptors)
        return grpc.aio.insecure_channel(address, options=opts, interceptors=interceptors)

    def sync_channel(self, address: str, options: Sequence[tuple[str, object]] = ()) -> grpc.Channel:
        """A blocking grpc channel to address."""
        global channels_opened
        channels_opened += 1
        creds, opts = self.channel_credentials(), self.channel_options(options)
        ch = grpc.secure_channel(address, creds, options=opts) if creds else grpc.insecure_channel(address, options=opts)
        return grpc.intercept_channel(ch, _SyncTokenInterceptor(self.auth_token)) if self.auth_token else ch


def _read(path: Path) -> bytes:
    return Path(path).read_bytes()


def _bearer(token: str) -> str:
    return f"Bearer {token}"


# -- the token, server side ---------------------------------------------------------------------

class TokenInterceptor(grpc.aio.ServerInterceptor):
    """Refuses every call but the health check whose `authorization` metadata is not
    `Bearer <token>`, with UNAUTHENTICATED (compared in constant time)."""

    def __init__(self, token: str):
        self.expected = _bearer(token).encode()

    async def intercept_service(self, continuation: Callable[..., Awaitable[grpc.RpcMethodHandler]],
                                details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None or details.method == EXEMPT_METHOD or self._authorized(details):
            return handler
        return _refusal(handler)

    def _authorized(self, details: grpc.HandlerCallDetails) -> bool:
        given = [v for k, v in details.invocation_metadata or () if k == AUTH_METADATA]
        value = given[0] if len(given) == 1 else ""
        value = value.encode() if isinstance(value, str) else bytes(value)
        return hmac.compare_digest(value, self.expected)


_REFUSED = "missing or wrong bearer token (authorization metadata)"


async def _refuse_unary(request, context: grpc.aio.ServicerContext):
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, _REFUSED)


async def _refuse_streaming(request, context: grpc.aio.ServicerContext):
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, _REFUSED)
    yield  # pragma: no cover - makes this an async generator, as streaming handlers are


def _refusal(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A handler of the same kind as handler that refuses the call."""
    args = (handler.request_deserializer, handler.response_serializer)
    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(_refuse_unary, *args)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(_refuse_streaming, *args)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(_refuse_unary, *args)
    return grpc.stream_stream_rpc_method_handler(_refuse_streaming, *args)


# -- the token, client side ---------------------------------------------------------------------

def _with_token(details, token: str):
    metadata = grpc.aio.Metadata(*(details.metadata or ()), (AUTH_METADATA, _bearer(token)))
    return grpc.aio.ClientCallDetails(details.method, details.timeout, metadata, details.credentials,
                                      details.wait_for_ready)


class _AioToken:
    def __init__(self, token: str):
        self.token = token


class _AioUnaryUnary(_AioToken, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation, details, request):
        return await continuation(_with_token(details, self.token), request)


class _AioUnaryStream(_AioToken, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation, details, request):
        return await continuation(_with_token(details, self.token), request)


class _AioStreamUnary(_AioToken, grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(self, continuation, details, request_iterator):
        return await continuation(_with_token(details, self.token), request_iterator)


class _AioStreamStream(_AioToken, grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(self, continuation, details, request_iterator):
        return await continuation(_with_token(details, self.token), request_iterator)


def _aio_token_interceptors(token: str) -> list:
    """The token on a grpc.aio channel (one interceptor per call kind: grpc.aio files each under
    one kind only)."""
    return [cls(token) for cls in (_AioUnaryUnary, _AioUnaryStream, _AioStreamUnary, _AioStreamStream)]


class _SyncDetails(collections.namedtuple("_SyncDetails", ("method", "timeout", "metadata", "credentials",
                                                           "wait_for_ready", "compression")),
                   grpc.ClientCallDetails):
    pass


class _SyncTokenInterceptor(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                            grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    """The token on a blocking channel."""

    def __init__(self, token: str):
        self.pair = (AUTH_METADATA, _bearer(token))

    def _details(self, d):
        return _SyncDetails(d.method, d.timeout, [*(d.metadata or ()), self.pair], d.credentials,
                            getattr(d, "wait_for_ready", None), getattr(d, "compression", None))

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation, details, request):
        return continuation(self._details(details), request)

    def intercept_stream_unary(self, continuation, details, request_iterator):
        return continuation(self._details(details), request_iterator)

    def intercept_stream_stream(self, continuation, details, request_iterator):
        return continuation(self._details(details), request_iterator)
