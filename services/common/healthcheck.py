"""A probe for container health checks: exit status 0 when a service is healthy, 1 when not.

    python -m services.common.healthcheck grpc HOST:PORT   # standard gRPC health check answers SERVING
    python -m services.common.healthcheck http URL         # GET URL answers 200

Under TLS or mTLS the gRPC probe needs the service's certificates: `--tls-from target` takes them
from the same SPECD_TARGET_TLS_* variables the service reads (a probe beside the service), or
give them with --tls-cert, --tls-key, --tls-ca; --tls-server-name names the certificate's host
when the probe dials 127.0.0.1. The health check is exempt from the token (SPECD_AUTH_TOKEN).
"""

from __future__ import annotations

import argparse
import asyncio
import sys

from specd.errors import SpecdError

TIMEOUT_S = 3.0


def grpc_healthy(address: str, timeout_s: float = TIMEOUT_S, security=None, service: str = "") -> bool:
    """True when the gRPC service at address answers SERVING for `service` ("": ready for
    requests; "liveness": the process runs); security: a services.common.security.GrpcSecurity
    (default: plaintext)."""
    from services.common.server import check_health

    try:
        return asyncio.run(check_health(address, timeout_s, security, service))
    except Exception:  # noqa: BLE001 - a probe reports any failure as unhealthy
        return False


def http_healthy(url: str, timeout_s: float = TIMEOUT_S) -> bool:
    """True when GET url answers 200."""
    import httpx

    try:
        return httpx.get(url, timeout=timeout_s).status_code == 200
    except httpx.HTTPError:
        return False


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m services.common.healthcheck", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="mode", required=True)
    grpc_probe = sub.add_parser("grpc", help="standard gRPC health check")
    grpc_probe.add_argument("address", help="HOST:PORT")
    grpc_probe.add_argument("--service", default="", help="health service name: '' (default) is SERVING "
                                                          "while the service can serve requests, 'liveness' "
                                                          "while the process runs (for liveness probes)")
    grpc_probe.add_argument("--tls-from", choices=["draft", "target", "coordinator"],
                            help="take TLS settings from this service's SPECD_<SERVICE>_TLS_* variables")
    for flag, what in (("--tls-cert", "client certificate (PEM; mTLS)"), ("--tls-key", "its private key"),
                       ("--tls-ca", "CA bundle verifying the server"),
                       ("--tls-server-name", "name checked in the server certificate")):
        grpc_probe.add_argument(flag, help=what)
    sub.add_parser("http", help="HTTP GET answering 200").add_argument(
        "url", help="e.g. http://127.0.0.1:8000/health")
    args = parser.parse_args(argv)
    try:
        if args.mode == "grpc":
            ok = grpc_healthy(args.address, security=_security(args), service=args.service)
        else:
            ok = http_healthy(args.url)
    except SpecdError as e:  # settings that do not fit together
        print(f"unhealthy: {e}", file=sys.stderr)
        return 1
    if not ok:
        print(f"unhealthy: {args.mode} {getattr(args, 'address', None) or args.url}", file=sys.stderr)
    return 0 if ok else 1


def _security(args: argparse.Namespace):
    """The probe's GrpcSecurity: the service's settings (--tls-from), overridden by the flags."""
    import dataclasses
    from pathlib import Path

    from services.common.security import GrpcSecurity

    base = GrpcSecurity.from_env(args.tls_from) if args.tls_from else GrpcSecurity()
    given = {name: getattr(args, name) for name in ("tls_cert", "tls_key", "tls_ca", "tls_server_name")
             if getattr(args, name)}
    given = {k: (v if k == "tls_server_name" else Path(v)) for k, v in given.items()}
    # a probe only calls the health check: it sends no token and needs no --insecure
    return dataclasses.replace(base, **given, auth_token=None, insecure=False, tls_client_auth=False)


if __name__ == "__main__":
    sys.exit(main())
