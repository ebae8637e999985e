"""`specd serve gateway`: the OpenAI-compatible REST gateway (FastAPI under uvicorn).

It reaches a coordinator gRPC service when `coordinator_address` is set; otherwise it runs
the coordinator in-process over the draft and target services (one hop fewer)."""

from __future__ import annotations

from services.common.settings import GatewaySettings


async def build_backend(s: GatewaySettings, registry=None):
    """The backend the routes call; an in-process coordinator puts its series on registry."""
    if s.coordinator_address:
        from services.coordinator.remote import RemoteBackend

        backend = RemoteBackend(s.coordinator_address, s.request_timeout_s)
    else:
        from services.common.state import build_state_store
        from services.coordinator.coordinator import Coordinator, CoordinatorConfig

        cfg = CoordinatorConfig(s.target_address, s.draft_address or None, s.overlap, s.request_timeout_s)
        backend = Coordinator(cfg, build_state_store(s.redis_url), registry)
    await backend.connect()
    return backend


async def serve(s: GatewaySettings) -> None:
    import uvicorn

    from services.common.metrics import new_registry
    from services.gateway.app import create_app

    registry = new_registry()
    backend = await build_backend(s, registry)
    keys = frozenset(k.strip() for k in s.api_keys.split(",") if k.strip())
    app = create_app(backend, max_tokens_limit=s.max_tokens_limit, default_policy=s.default_policy, api_keys=keys,
                     registry=registry, max_concurrent_requests=s.max_concurrent_requests)
    config = uvicorn.Config(app, host=s.host, port=s.port, log_level=s.log_level, lifespan="off")
    server = uvicorn.Server(config)
    print(f"specd gateway listening on http://{s.host}:{s.port}", flush=True)
    try:
        await server.serve()
    finally:
        await backend.close()
