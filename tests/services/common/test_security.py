"""TLS, mTLS and the shared token on real gRPC links (services.common.security): certificates
made here with trustme, a real target service requiring client certificates and a token, a
draft and a coordinator service secured the same way, all on loopback. A client without a
certificate, with one from another CA, in plaintext, or without the right token is refused;
the secured path through a coordinator answers token for token as the target alone; the
health check stays open to a probe without the token; a non-loopback plaintext bind refuses
to start; reflection answers only when asked."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path

import grpc
import pytest
import trustme
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from clients.specd_client import CoordinatorClient
from services.common.healthcheck import main as healthcheck
from services.common.security import GrpcSecurity, SecurityError, address_host, address_hosts, is_loopback
from services.common.server import channel, check_health
from services.common.settings import CoordinatorSettings, DraftSettings, GatewaySettings, TargetSettings
from services.common.state import AsyncMemoryStateStore
from services.coordinator.api import FinishEvent, GenerateRequest
from services.coordinator.coordinator import Coordinator, CoordinatorConfig
from services.coordinator.main import start as start_coordinator
from services.draft.main import start as start_draft
from services.draft.servicer import DraftServicer
from services.proto.specd.common.v1 import common_pb2
from services.proto.specd.target.v1 import target_pb2_grpc
from services.target.main import start as start_target
from services.target.servicer import SERVICE_NAME as TARGET_SERVICE
from services.target.servicer import TargetServicer
from specd.drafters import build_drafter
from specd.engine import SpeculativeEngine
from specd.types import SamplingParams, SpecParams
from tests.services.conftest import Service

TOKEN = "s3cret-token"
PROMPT = "abcabc abc xyz abc"
N = 16


@dataclasses.dataclass(frozen=True)
class Pki:
    ca: Path
    cert: Path  # for "localhost" and 127.0.0.1: the services' certificate, also their client certificate
    key: Path
    client_cert: Path  # another certificate of the same CA
    client_key: Path
    other_ca: Path  # an unrelated CA, and a client certificate it signed
    other_cert: Path
    other_key: Path


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Pki:
    d = tmp_path_factory.mktemp("pki")
    ca, other = trustme.CA(), trustme.CA()
    files = {}

    def write(name: str, blob) -> Path:
        files[name] = d / name
        blob.write_to_path(str(files[name]))
        return files[name]

    write("ca.crt", ca.cert_pem)
    write("other-ca.crt", other.cert_pem)
    for prefix, issuer, names in (("server", ca, ("localhost", "127.0.0.1")), ("client", ca, ("client",)),
                                  ("other", other, ("client",))):
        leaf = issuer.issue_cert(*names)
        write(f"{prefix}.crt", leaf.cert_chain_pems[0])
        write(f"{prefix}.key", leaf.private_key_pem)
    return Pki(files["ca.crt"], files["server.crt"], files["server.key"], files["client.crt"], files["client.key"],
               files["other-ca.crt"], files["other.crt"], files["other.key"])


def mtls(pki: Pki, **more) -> dict:
    """Security settings of a service requiring client certificates."""
    return dict(tls_cert=pki.cert, tls_key=pki.key, tls_ca=pki.ca, tls_client_auth=True, **more)


def client(pki: Pki, cert: str = "client", ca: Path | None = None, token: str | None = TOKEN) -> GrpcSecurity:
    pair = {"client": (pki.client_cert, pki.client_key), "other": (pki.other_cert, pki.other_key),
            "none": (None, None)}[cert]
    return GrpcSecurity(*pair, tls_ca=ca or pki.ca, auth_token=token)


@pytest.fixture(scope="module")
def secure_target(service_loop, chat_pair, pki):
    """The target requiring a client certificate of the CA and the token."""
    servicer = TargetServicer(chat_pair[0])
    server, port = service_loop.run(start_target(TargetSettings(port=0, **mtls(pki), auth_token=TOKEN), servicer))
    yield Service(f"127.0.0.1:{port}", servicer, server, service_loop)
    service_loop.run(server.stop(0))
    servicer.close()


@pytest.fixture(scope="module")
def token_target(service_loop, chat_pair):
    """The target in plaintext on loopback, requiring the token, with reflection on."""
    servicer = TargetServicer(chat_pair[0])
    server, port = service_loop.run(start_target(TargetSettings(port=0, auth_token=TOKEN, reflection=True),
                                                 servicer))
    yield Service(f"127.0.0.1:{port}", servicer, server, service_loop)
    service_loop.run(server.stop(0))
    servicer.close()


@pytest.fixture(scope="module")
def secure_draft(service_loop, chat_pair, pki):
    _, draft = chat_pair
    servicer = DraftServicer(build_drafter("hf", draft, draft), draft)
    server, port = service_loop.run(start_draft(DraftSettings(port=0, **mtls(pki), auth_token=TOKEN), servicer))
    yield Service(f"127.0.0.1:{port}", servicer, server, service_loop)
    service_loop.run(server.stop(0))
    servicer.close()


def info(address: str, security: GrpcSecurity | None) -> str:
    """The target's model name over a fresh channel (raises grpc.aio.AioRpcError when refused)."""
    async def run():
        async with channel(address, security) as ch:
            reply = await target_pb2_grpc.TargetServiceStub(ch).Info(common_pb2.InfoRequest(), timeout=5)
            return reply.model.name

    return asyncio.run(run())


def refused_with(address: str, security: GrpcSecurity | None) -> grpc.StatusCode:
    with pytest.raises(grpc.aio.AioRpcError) as e:
        info(address, security)
    return e.value.code()


def reference(target, n: int = N) -> list[int]:
    ids = target.encode_prompt(PROMPT, chat=False)
    return SpeculativeEngine(target).generate(ids, SamplingParams(max_new_tokens=n), SpecParams("none")).token_ids


def coordinator_ids(target_address: str, draft_address: str | None, security: GrpcSecurity,
                    policy: str = "constant") -> list[int]:
    async def run():
        coord = Coordinator(CoordinatorConfig(target_address, draft_address, security=security),
                            AsyncMemoryStateStore())
        await coord.connect()
        ids = []
        try:
            async for ev in coord.generate(GenerateRequest(prompt=PROMPT, sampling=SamplingParams(max_new_tokens=N),
                                                           spec=SpecParams(policy))):
                if not isinstance(ev, FinishEvent):
                    ids += ev.token_ids
        finally:
            await coord.close()
        return ids

    return asyncio.run(run())


# -- mTLS ----------------------------------------------------------------------------------------

def test_a_client_with_the_cas_certificate_and_the_token_is_served(secure_target, chat_pair, pki):
    assert info(secure_target.address, client(pki)) == chat_pair[0].name


@pytest.mark.parametrize("who", ["no client certificate", "a certificate of another CA", "plaintext"])
def test_mtls_refuses_clients_without_a_certificate_of_its_ca(secure_target, pki, who):
    security = {"no client certificate": client(pki, "none"), "a certificate of another CA": client(pki, "other"),
                "plaintext": GrpcSecurity(auth_token=TOKEN)}[who]
    assert refused_with(secure_target.address, security) == grpc.StatusCode.UNAVAILABLE


def test_a_client_refuses_a_server_its_ca_did_not_sign(secure_target, pki):
    assert refused_with(secure_target.address, client(pki, ca=pki.other_ca)) == grpc.StatusCode.UNAVAILABLE


def test_the_server_name_override_checks_another_name(secure_target, pki):
    """The certificate names localhost: dialing 127.0.0.1 while expecting 'target' is refused."""
    wrong = dataclasses.replace(client(pki), tls_server_name="target")
    assert refused_with(secure_target.address, wrong) == grpc.StatusCode.UNAVAILABLE
    right = dataclasses.replace(client(pki), tls_server_name="localhost")
    assert info(secure_target.address, right)


# -- the token -----------------------------------------------------------------------------------

@pytest.mark.parametrize("transport", ["mtls", "plaintext"])
def test_a_missing_or_wrong_token_is_unauthenticated(secure_target, token_target, chat_pair, pki, transport):
    address = secure_target.address if transport == "mtls" else token_target.address
    base = client(pki) if transport == "mtls" else GrpcSecurity(auth_token=TOKEN)
    for token in (None, "wrong-token", TOKEN + "x"):
        assert refused_with(address, dataclasses.replace(base, auth_token=token)) == \
            grpc.StatusCode.UNAUTHENTICATED, token
    assert info(address, base) == chat_pair[0].name


def test_the_health_check_needs_no_token(secure_target, token_target, pki):
    assert asyncio.run(check_health(token_target.address))
    assert asyncio.run(check_health(secure_target.address, security=client(pki, token=None)))
    assert not asyncio.run(check_health(secure_target.address, security=client(pki, "none", token=None)))


def test_health_watch_needs_the_token(token_target):
    """Watch is a stream that holds the server: without the token it is refused (it was open)."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from services.common.server import channel

    async def watch(security) -> grpc.StatusCode:
        async with channel(token_target.address, security=security) as ch:
            call = health_pb2_grpc.HealthStub(ch).Watch(health_pb2.HealthCheckRequest(), timeout=10)
            try:
                await call.read()
            except grpc.aio.AioRpcError as e:
                return e.code()
            call.cancel()
            return grpc.StatusCode.OK

    assert asyncio.run(watch(None)) == grpc.StatusCode.UNAUTHENTICATED
    assert asyncio.run(watch(GrpcSecurity(auth_token=TOKEN))) == grpc.StatusCode.OK


# -- the secured path through a coordinator ------------------------------------------------------

def test_secured_coordinator_answers_as_the_target_alone(secure_target, secure_draft, chat_pair, pki):
    """Client cert and token on both of the coordinator's channels (the services' own
    certificate serves as its client certificate, as one process's settings do)."""
    own = GrpcSecurity(pki.cert, pki.key, pki.ca, auth_token=TOKEN)
    assert coordinator_ids(secure_target.address, secure_draft.address, own) == reference(chat_pair[0])


def test_token_over_plaintext_through_a_coordinator(token_target, chat_pair):
    """The token rides on client interceptors, streaming sessions included."""
    ids = coordinator_ids(token_target.address, None, GrpcSecurity(auth_token=TOKEN), policy="none")
    assert ids == reference(chat_pair[0])


def test_coordinator_service_under_mtls_with_the_python_client(service_loop, secure_target, secure_draft,
                                                               chat_pair, pki):
    """client (mTLS, token) -> coordinator service (mTLS, token) -> draft and target (mTLS, token)."""
    settings = CoordinatorSettings(port=0, target_address=secure_target.address,
                                   draft_address=secure_draft.address, **mtls(pki), auth_token=TOKEN)

    async def up():
        coordinator = Coordinator(CoordinatorConfig(settings.target_address, settings.draft_address,
                                                    security=GrpcSecurity.from_settings(settings)),
                                  AsyncMemoryStateStore())
        server, port = await start_coordinator(settings, coordinator)
        return coordinator, server, port

    coordinator, server, port = service_loop.run(up())
    try:
        address = f"127.0.0.1:{port}"
        with CoordinatorClient(address, client(pki)) as c:
            ids = [t for chunk in c.generate(PROMPT, max_new_tokens=N, policy="constant") for t in chunk.token_ids]
        assert ids == reference(chat_pair[0])
        with CoordinatorClient(address, client(pki, token="wrong")) as c, pytest.raises(Exception, match="unauth"):
            c.info()
    finally:
        service_loop.run(server.stop(0))
        service_loop.run(coordinator.close())


# -- the probe -----------------------------------------------------------------------------------

def test_healthcheck_probe_under_mtls(secure_target, pki, monkeypatch):
    address = secure_target.address
    assert healthcheck(["grpc", address]) == 1  # plaintext against TLS
    assert healthcheck(["grpc", address, "--tls-ca", str(pki.ca)]) == 1  # no client certificate
    assert healthcheck(["grpc", address, "--tls-ca", str(pki.ca), "--tls-cert", str(pki.cert),
                        "--tls-key", str(pki.key)]) == 0
    # beside the service: its own variables, token and all (the health check ignores the token)
    for name, value in {"SPECD_TARGET_TLS_CERT": pki.cert, "SPECD_TARGET_TLS_KEY": pki.key,
                        "SPECD_TARGET_TLS_CA": pki.ca, "SPECD_TARGET_TLS_CLIENT_AUTH": "true",
                        "SPECD_AUTH_TOKEN": TOKEN}.items():
        monkeypatch.setenv(name, str(value))
    assert healthcheck(["grpc", address, "--tls-from", "target", "--tls-server-name", "localhost"]) == 0
    assert healthcheck(["grpc", address, "--tls-from", "target", "--tls-server-name", "target"]) == 1


# -- reflection ----------------------------------------------------------------------------------

def test_reflection_only_when_asked(secure_target, token_target, pki):
    with GrpcSecurity(auth_token=TOKEN).sync_channel(token_target.address) as ch:
        assert TARGET_SERVICE in ProtoReflectionDescriptorDatabase(ch).get_services()
    with client(pki).sync_channel(secure_target.address) as ch, pytest.raises(grpc.RpcError) as e:
        ProtoReflectionDescriptorDatabase(ch).get_services()
    assert e.value.code() == grpc.StatusCode.UNIMPLEMENTED
    assert TargetSettings().reflection is False and CoordinatorSettings().reflection is False


# -- start-up checks -----------------------------------------------------------------------------

def own_address() -> str:
    """An address of this machine that is not loopback (its hostname's, else 0.0.0.0)."""
    import socket

    try:
        ip = socket.gethostbyname(socket.gethostname())
    except OSError:
        return "0.0.0.0"
    return "0.0.0.0" if ip.startswith("127.") else ip


def test_a_token_alone_does_not_allow_plaintext_off_loopback(service_loop, chat_pair):
    """The token crosses a plaintext link in the clear: a bind (a real `start`) or a dial off
    loopback with a token but neither TLS nor insecure is refused, naming insecure."""
    host = own_address()
    servicer = TargetServicer(chat_pair[0])
    try:
        for bind in (host, "0.0.0.0"):
            with pytest.raises(SecurityError, match=r"sent in the clear.*--insecure \(SPECD_TARGET_INSECURE\)"):
                service_loop.run(start_target(TargetSettings(host=bind, port=0, auth_token=TOKEN), servicer))
    finally:
        servicer.close()
    with pytest.raises(SecurityError, match="insecure"):
        GrpcSecurity(auth_token=TOKEN).check_dial(f"{host}:50062")
    with pytest.raises(SecurityError, match="insecure"):
        GrpcSecurity(auth_token=TOKEN).check_dial("target:50062")
    GrpcSecurity(auth_token=TOKEN, insecure=True).check_dial("target:50062")


def test_a_non_loopback_plaintext_bind_refuses_to_start(service_loop, chat_pair):
    servicer = TargetServicer(chat_pair[0])
    try:
        for host in ("0.0.0.0", "10.1.2.3", "target"):
            with pytest.raises(SecurityError, match=r"--insecure \(SPECD_TARGET_INSECURE\)"):
                service_loop.run(start_target(TargetSettings(host=host, port=0), servicer))
    finally:
        servicer.close()


def test_plaintext_is_allowed_on_loopback_or_when_chosen(caplog):
    for host in ("127.0.0.1", "::1", "localhost", "127.0.0.2"):
        GrpcSecurity().check_listen(host)
    assert "plaintext" in caplog.text
    GrpcSecurity(insecure=True).check_listen("0.0.0.0")
    GrpcSecurity(auth_token=TOKEN, insecure=True).check_listen("0.0.0.0")
    GrpcSecurity(auth_token=TOKEN).check_listen("127.0.0.1")
    GrpcSecurity(insecure=True).check_dial("target:50062", "")
    with pytest.raises(SecurityError, match="refusing to dial target"):
        GrpcSecurity().check_dial("127.0.0.1:1", "target:50062")


def test_settings_that_do_not_fit_together_are_refused(pki, tmp_path):
    def security(**fields):
        return GrpcSecurity.from_settings(TargetSettings(**fields))

    with pytest.raises(SecurityError, match=r"--tls-cert \(SPECD_TARGET_TLS_CERT\) is set without --tls-key"):
        security(tls_cert=pki.cert)
    with pytest.raises(SecurityError, match="--tls-key .* without --tls-cert"):
        security(tls_key=pki.key)
    with pytest.raises(SecurityError, match=r"--tls-client-auth .* needs --tls-ca \(SPECD_TARGET_TLS_CA\)"):
        security(tls_cert=pki.cert, tls_key=pki.key, tls_client_auth=True)
    with pytest.raises(SecurityError, match="no such file"):
        security(tls_cert=tmp_path / "missing.crt", tls_key=pki.key)
    with pytest.raises(SecurityError, match="choose one"):
        security(tls_ca=pki.ca, insecure=True)
    with pytest.raises(SecurityError, match="a TLS server needs --tls-cert"):
        security(tls_ca=pki.ca).check_listen("127.0.0.1")


def test_settings_read_the_service_variables_and_the_shared_token(pki, monkeypatch):
    monkeypatch.setenv("SPECD_TARGET_TLS_CERT", str(pki.cert))
    monkeypatch.setenv("SPECD_TARGET_TLS_KEY", str(pki.key))
    monkeypatch.setenv("SPECD_AUTH_TOKEN", TOKEN)
    s = TargetSettings()
    assert (s.tls_cert, s.tls_key, s.auth_token.get_secret_value()) == (pki.cert, pki.key, TOKEN)
    assert TOKEN not in repr(s) and TOKEN not in repr(GrpcSecurity.from_settings(s))
    assert GatewaySettings().auth_token.get_secret_value() == TOKEN and GatewaySettings().tls_cert is None
    assert DraftSettings().tls_cert is None  # another service's prefix


def test_loopback_and_address_hosts():
    assert [is_loopback(h) for h in ("127.0.0.1", "::1", "[::1]", "localhost", "0.0.0.0", "target")] == \
        [True, True, True, True, False, False]
    assert [address_host(a) for a in ("target:50062", "[::1]:1", "dns:///coordinator:50063", "unix:/s")] == \
        ["target", "::1", "coordinator", None]
    assert address_hosts("ipv4:127.0.0.1:1,10.0.0.5:2") == ["127.0.0.1", "10.0.0.5"]
    assert address_hosts("ipv6:[::1]:1,[fd00::5]:2") == ["::1", "fd00::5"]
    assert address_hosts("unix:/s") == [] and address_hosts("target:50062") == ["target"]


def test_every_address_of_a_list_is_checked_before_dialing_in_plaintext():
    GrpcSecurity().check_dial("ipv4:127.0.0.1:1,127.0.0.1:2")
    with pytest.raises(SecurityError, match="10.0.0.5"):  # not only the first of the list
        GrpcSecurity().check_dial("ipv4:127.0.0.1:1,10.0.0.5:2")
