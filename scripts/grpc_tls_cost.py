"""What TLS, mutual TLS and the shared token cost one gRPC round trip on this machine, the
question behind turning them on for the draft/target links (docs/deploy.md, "Security").

One grpc.aio echo server per configuration (plaintext, token, TLS, mTLS, mTLS + token) on loopback,
built with the same GrpcSecurity the services use, answers unary calls that carry a payload
of a verification's size: a greedy window (~200 B), one dense float32 draft distribution of
the embedded vocabulary (~200 KB) and a window of five (~1 MB). Configurations are measured
in interleaved blocks, so that drift on a shared machine falls on all of them alike; the
median round trip of each is printed, and the extra time over plaintext.

    python scripts/grpc_tls_cost.py [--calls 300]       # needs trustme (the test extra)
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from services.common.security import GrpcSecurity  # noqa: E402
from services.common.server import CHANNEL_OPTIONS, make_server  # noqa: E402

PAYLOADS = {"window (200 B)": 200, "one dense q (200 KB)": 49152 * 4, "five dense q (1 MB)": 5 * 49152 * 4}
METHOD = "/bench.Echo/Call"


def _pki(tmp: Path) -> dict[str, Path]:
    import trustme

    ca = trustme.CA()
    server = ca.issue_cert("localhost", "127.0.0.1")
    client = ca.issue_cert("client")
    paths = {"ca": tmp / "ca.pem", "cert": tmp / "server.pem", "key": tmp / "server.key",
             "client_cert": tmp / "client.pem", "client_key": tmp / "client.key"}
    ca.cert_pem.write_to_path(paths["ca"])
    server.cert_chain_pems[0].write_to_path(paths["cert"])
    server.private_key_pem.write_to_path(paths["key"])
    client.cert_chain_pems[0].write_to_path(paths["client_cert"])
    client.private_key_pem.write_to_path(paths["client_key"])
    return paths


def _configs(p: dict[str, Path]) -> dict[str, tuple[GrpcSecurity, GrpcSecurity]]:
    """name -> (server security, client security)."""
    return {
        "plaintext": (GrpcSecurity(insecure=True), GrpcSecurity(insecure=True)),
        "token": (GrpcSecurity(auth_token="t" * 32), GrpcSecurity(auth_token="t" * 32)),
        "TLS": (GrpcSecurity(p["cert"], p["key"]), GrpcSecurity(tls_ca=p["ca"])),
        "mTLS": (GrpcSecurity(p["cert"], p["key"], p["ca"], tls_client_auth=True),
                 GrpcSecurity(p["client_cert"], p["client_key"], p["ca"])),
        "mTLS + token": (GrpcSecurity(p["cert"], p["key"], p["ca"], tls_client_auth=True, auth_token="t" * 32),
                         GrpcSecurity(p["client_cert"], p["client_key"], p["ca"], auth_token="t" * 32)),
    }


async def _echo(request: bytes, context) -> bytes:
    return request[:64]  # a verification's answer is small


class _Echo(grpc.GenericRpcHandler):
    def service(self, details):
        if details.method == METHOD:
            return grpc.unary_unary_rpc_method_handler(_echo)
        return None


async def main(calls: int, block: int = 20) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        configs = _configs(_pki(Path(tmp)))
        servers, stubs = [], {}
        for name, (server_sec, client_sec) in configs.items():
            server, _ = make_server([], security=server_sec)
            server.add_generic_rpc_handlers((_Echo(),))
            port = server_sec.add_port(server, "127.0.0.1:0")
            await server.start()
            servers.append(server)
            channel = client_sec.aio_channel(f"localhost:{port}", CHANNEL_OPTIONS)
            stubs[name] = channel.unary_unary(METHOD)
            await stubs[name](b"warm-up", timeout=10)
        print(f"{calls} calls per cell, interleaved in blocks of {block}; median round trip (ms)")
        print("| payload | " + " | ".join(configs) + " |")
        print("|---|" + "---|" * len(configs))
        for label, size in PAYLOADS.items():
            payload = bytes(size)
            times: dict[str, list[float]] = {name: [] for name in configs}
            for _ in range(calls // block):
                for name, stub in stubs.items():
                    for _ in range(block):
                        t = time.perf_counter()
                        await stub(payload, timeout=10)
                        times[name].append(time.perf_counter() - t)
            base = statistics.median(times["plaintext"])
            cells = []
            for name in configs:
                m = statistics.median(times[name])
                cells.append(f"{m * 1e3:.3f}" + ("" if name == "plaintext" else f" (+{(m - base) * 1e3:.3f})"))
            print(f"| {label} | " + " | ".join(cells) + " |")
        for server in servers:
            await server.stop(0)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=300)
    asyncio.run(main(parser.parse_args().calls))
