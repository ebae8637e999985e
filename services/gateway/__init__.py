"""The OpenAI-compatible REST gateway: `create_app(backend)` builds the FastAPI app."""

from services.gateway.app import create_app

__all__ = ["create_app"]
