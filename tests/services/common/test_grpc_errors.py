"""What a client reads of a failed call to another service (services.common.grpc_errors): the
real texts gRPC produces for an unresolvable host, a closed port and a TLS handshake that fails
become a message naming only the code; the services' own texts pass. The coordinator's
spec_stats.fallback_reason comes from the same allowlist."""

from __future__ import annotations

import asyncio
import socket

import grpc
import pytest
import trustme
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.grpc_errors import client_message, from_rpc_error, status_error
from services.common.security import GrpcSecurity
from services.common.server import channel, make_server
from services.common.state import AsyncMemoryStateStore
from services.coordinator.api import FinishEvent, GenerateRequest
from services.coordinator.coordinator import Coordinator, CoordinatorConfig
from specd.errors import InvalidRequest
from specd.types import SamplingParams, SpecParams

UNRESOLVABLE = "no-such-host.invalid:50061"


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rpc_error(address: str, security: GrpcSecurity | None = None) -> grpc.aio.AioRpcError:
    """The error a real health check to address fails with."""
    async def run():
        async with channel(address, security) as ch:
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10)
            return e.value

    return asyncio.run(run())


def assert_generic(e: grpc.aio.AioRpcError, *secrets: str) -> None:
    message = str(from_rpc_error(e, "target"))
    assert message == f"target service: {e.code().name.lower()}", (message, e.details())
    assert client_message(e, "target") == message
    for secret in secrets:
        assert secret not in message


def test_an_unresolvable_host_name_is_not_passed_on():
    e = rpc_error(UNRESOLVABLE)
    assert "no-such-host" in e.details()  # what gRPC says, which names the host
    assert_generic(e, "no-such-host", "50061")


def test_a_closed_port_is_not_passed_on():
    port = closed_port()
    e = rpc_error(f"localhost:{port}")
    assert str(port) in e.details()
    assert_generic(e, str(port), "127.0.0.1", "localhost")


def test_a_failed_tls_handshake_is_not_passed_on(tmp_path):
    """A TLS client that does not trust the server's CA: gRPC's handshake text is withheld."""
    ca, other = trustme.CA(), trustme.CA()
    leaf = ca.issue_cert("localhost", "127.0.0.1")
    for name, blob in (("s.crt", leaf.cert_chain_pems[0]), ("s.key", leaf.private_key_pem),
                       ("other.crt", other.cert_pem)):
        blob.write_to_path(str(tmp_path / name))
    server_security = GrpcSecurity(tmp_path / "s.crt", tmp_path / "s.key")

    async def run():
        server, _ = make_server([], security=server_security)
        port = server_security.add_port(server, "127.0.0.1:0")
        await server.start()
        try:
            async with channel(f"127.0.0.1:{port}", GrpcSecurity(tls_ca=tmp_path / "other.crt")) as ch:
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10)
            return e.value, port
        finally:
            await server.stop(0)

    e, port = asyncio.run(run())
    assert_generic(e, str(port), "127.0.0.1", "handshake", "SSL", "CERTIFICATE")


def test_the_services_own_texts_pass():
    assert str(status_error(grpc.StatusCode.INVALID_ARGUMENT, "tokens: at most 64 draft tokens", "target")) == \
        "tokens: at most 64 draft tokens"
    assert isinstance(status_error(grpc.StatusCode.INVALID_ARGUMENT, "tokens: x", "target"), InvalidRequest)
    relayed = "target service: unavailable"
    assert str(status_error(grpc.StatusCode.UNAVAILABLE, relayed, "coordinator")) == \
        "coordinator service: unavailable: target service: unavailable"
    assert str(status_error(grpc.StatusCode.INTERNAL, "internal error: KeyError", "draft")) == \
        "draft service: internal: internal error: KeyError"
    # a text nobody in specd writes, even under a service code, where it names an address
    assert str(status_error(grpc.StatusCode.RESOURCE_EXHAUSTED, "pool at db-1.internal:5432", "target")) == \
        "target: "
    assert str(status_error(grpc.StatusCode.UNAVAILABLE, "target service: unavailable: DNS resolution failed "
                                                          "for target:50062", "coordinator")) == \
        "coordinator service: unavailable"


def test_fallback_reason_names_no_draft_address(target_service):
    """A draft service that cannot be resolved: the request is served by the target alone, and
    its spec_stats say why without the host name gRPC reported."""
    async def run():
        coord = Coordinator(CoordinatorConfig(target_service.address, UNRESOLVABLE, info_timeout_s=10,
                                              draft_cooldown_s=0.0),
                            AsyncMemoryStateStore())
        await coord.connect()
        try:
            async for ev in coord.generate(GenerateRequest(prompt="abc", sampling=SamplingParams(max_new_tokens=2),
                                                           spec=SpecParams("constant"))):
                if isinstance(ev, FinishEvent):
                    return ev.spec_stats
        finally:
            await coord.close()

    stats = asyncio.run(run())
    assert stats["fallback"] and stats["fallback_reason"] == "draft service: unavailable", stats
