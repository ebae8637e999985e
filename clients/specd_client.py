"""A small Python client for the specd coordinator's gRPC service (`specd.coordinator.v1`).

Synchronous:

    from clients.specd_client import CoordinatorClient

    with CoordinatorClient("127.0.0.1:50063") as client:
        print(client.info())
        for chunk in client.generate("The capital of France is", max_new_tokens=32, policy="heuristic"):
            print(chunk.text, end="", flush=True)
            if chunk.finish_reason:
                print("\\n", chunk.finish_reason, chunk.spec_stats["mean_accepted_tokens"])

Asynchronous (the same arguments):

    async with AsyncCoordinatorClient("127.0.0.1:50063") as client:
        async for chunk in client.generate(messages=[{"role": "user", "content": "Hi"}]):
            ...

Leaving a stream early cancels the request (and frees both services' KV caches): close the
iterator (`stream.close()` / `await stream.aclose()`) rather than waiting for the garbage
collector. Errors arrive as specd's typed errors (InvalidRequest naming the bad field,
Unavailable, Overloaded, ModelError), mapped from the gRPC status in one place.

TLS, mTLS and the shared token: pass `security=GrpcSecurity(tls_ca=..., tls_cert=..., tls_key=...,
auth_token=...)` (services.common.security); the default is plaintext without a token.

From a shell: `python -m clients.specd_client --address HOST:PORT "prompt"` streams the text
to stdout, then prints the request's spec_stats as JSON (TLS: --tls-ca, and for mTLS --tls-cert
and --tls-key; the token from SPECD_AUTH_TOKEN).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Self

import grpc

from services.common.grpc_errors import from_rpc_error
from services.common.security import GrpcSecurity
from services.common.server import channel_options
from services.coordinator.api import FinishEvent, GenerateRequest, ModelCard
from services.coordinator.convert import event_from_proto, request_to_proto
from services.proto.specd.common.v1 import common_pb2
from services.proto.specd.coordinator.v1 import coordinator_pb2, coordinator_pb2_grpc
from specd.errors import InvalidRequest, SpecdError
from specd.types import SamplingParams, SpecParams

SERVICE = "coordinator"


@dataclass(frozen=True)
class Chunk:
    """Newly verified tokens and their text; the last chunk of a stream carries no tokens but
    finish_reason ("stop" | "length"), the token counts and spec_stats."""

    text: str
    token_ids: tuple[int, ...]
    finish_reason: str | None = None
    spec_stats: dict | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None


def build_request(prompt: str | None = None, messages: Sequence[dict] | None = None, *,
                  prompt_ids: Sequence[int] | None = None, max_new_tokens: int = 128,
                  temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0, seed: int | None = None,
                  stop: Sequence[str] = (), policy: str = "", policy_params: dict | None = None,
                  max_draft_tokens: int | None = None, task_tag: str = "default", relaxed: bool = False,
                  overlap: bool | None = None, branches: int | None = None) -> coordinator_pb2.GenerateRequest:
    """The GenerateRequest message (policy "": the server's default; overlap and branches None:
    the servers' settings).
    Values are checked by the server, which names the bad field."""
    given = [name for name, v in (("prompt", prompt), ("messages", messages), ("prompt_ids", prompt_ids))
             if v is not None]
    if len(given) != 1:
        raise InvalidRequest("input", "give exactly one of prompt, messages or prompt_ids "
                                      f"(got {', '.join(given) or 'none'})")
    sampling = SamplingParams(temperature, top_k, top_p, seed, max_new_tokens, tuple(stop))
    spec = SpecParams(policy, max_draft_tokens, dict(policy_params or {}), task_tag, relaxed, branches)
    return request_to_proto(GenerateRequest(
        prompt=prompt, messages=tuple(dict(m) for m in messages) if messages is not None else None,
        prompt_ids=tuple(prompt_ids) if prompt_ids is not None else None,
        sampling=sampling, spec=spec, overlap=overlap))


def _chunk(msg: coordinator_pb2.GenerateResponse) -> Chunk:
    event = event_from_proto(msg)
    if isinstance(event, FinishEvent):
        return Chunk("", (), event.finish_reason, event.spec_stats, event.prompt_tokens,
                     event.completion_tokens)
    return Chunk(event.text, event.token_ids)


def _card(info: coordinator_pb2.CoordinatorInfo) -> ModelCard:
    return ModelCard(info.model, info.max_context, info.drafter or None)


class CoordinatorClient:
    """Blocking client over a sync gRPC channel; `generate` returns an iterator of Chunks."""

    def __init__(self, address: str, security: GrpcSecurity | None = None):
        self.address = address
        self.channel = (security or GrpcSecurity()).sync_channel(address, channel_options(address))
        self.stub = coordinator_pb2_grpc.CoordinatorServiceStub(self.channel)

    def info(self, timeout: float = 10) -> ModelCard:
        try:
            return _card(self.stub.Info(common_pb2.InfoRequest(), timeout=timeout))
        except grpc.RpcError as e:
            raise from_rpc_error(e, SERVICE) from None

    def generate(self, prompt: str | None = None, messages: Sequence[dict] | None = None, *,
                 max_new_tokens: int = 128, temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0,
                 seed: int | None = None, stop: Sequence[str] = (), policy: str = "",
                 policy_params: dict | None = None, overlap: bool | None = None, timeout: float = 600,
                 **more) -> Iterator[Chunk]:
        """Streams the answer (`more`: build_request's other options). The request is sent when
        iteration starts; closing the iterator early cancels it."""
        request = build_request(prompt, messages, max_new_tokens=max_new_tokens, temperature=temperature,
                                top_p=top_p, top_k=top_k, seed=seed, stop=stop, policy=policy,
                                policy_params=policy_params, overlap=overlap, **more)
        return self._stream(request, timeout)

    def _stream(self, request: coordinator_pb2.GenerateRequest, timeout: float) -> Iterator[Chunk]:
        call = self.stub.Generate(request, timeout=timeout)
        last = None
        try:
            for msg in call:
                chunk = _chunk(msg)
                if chunk.finish_reason:
                    last = chunk  # yielded once the call has ended OK: stopping at it cancels nothing
                else:
                    yield chunk
        except grpc.RpcError as e:
            raise from_rpc_error(e, SERVICE) from None
        finally:
            call.cancel()  # a no-op after a complete stream; frees the request when left early
        if last is not None:
            yield last

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class AsyncCoordinatorClient:
    """asyncio client over a grpc.aio channel, opened on first use (on the running loop)."""

    def __init__(self, address: str, security: GrpcSecurity | None = None):
        self.address, self.security = address, security or GrpcSecurity()
        self.channel: grpc.aio.Channel | None = None
        self._stub: coordinator_pb2_grpc.CoordinatorServiceStub | None = None

    @property
    def stub(self) -> coordinator_pb2_grpc.CoordinatorServiceStub:
        if self._stub is None:
            self.channel = self.security.aio_channel(self.address, channel_options(self.address))
            self._stub = coordinator_pb2_grpc.CoordinatorServiceStub(self.channel)
        return self._stub

    async def info(self, timeout: float = 10) -> ModelCard:
        try:
            return _card(await self.stub.Info(common_pb2.InfoRequest(), timeout=timeout))
        except grpc.aio.AioRpcError as e:
            raise from_rpc_error(e, SERVICE) from None

    async def generate(self, prompt: str | None = None, messages: Sequence[dict] | None = None, *,
                       max_new_tokens: int = 128, temperature: float = 0.0, top_p: float = 1.0,
                       top_k: int = 0, seed: int | None = None, stop: Sequence[str] = (), policy: str = "",
                       policy_params: dict | None = None, overlap: bool | None = None, timeout: float = 600,
                       **more) -> AsyncIterator[Chunk]:
        """Streams the answer (`more`: build_request's other options); `aclose()` on the
        iterator (or cancelling the task iterating it) cancels the request."""
        request = build_request(prompt, messages, max_new_tokens=max_new_tokens, temperature=temperature,
                                top_p=top_p, top_k=top_k, seed=seed, stop=stop, policy=policy,
                                policy_params=policy_params, overlap=overlap, **more)
        call = self.stub.Generate(request, timeout=timeout)
        last = None
        try:
            async for msg in call:
                chunk = _chunk(msg)
                if chunk.finish_reason:
                    last = chunk  # yielded once the call has ended OK: stopping at it cancels nothing
                else:
                    yield chunk
        except grpc.aio.AioRpcError as e:
            raise from_rpc_error(e, SERVICE) from None
        finally:
            call.cancel()
        if last is not None:
            yield last

    async def close(self) -> None:
        if self.channel is not None:
            await self.channel.close()
            self.channel = self._stub = None

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()


# -- command line -------------------------------------------------------------------------------

def main(argv: Sequence[str] | None = None) -> int:
    import os

    p = argparse.ArgumentParser(prog="python -m clients.specd_client",
                                description="Stream one answer from a specd coordinator service.")
    p.add_argument("prompt")
    p.add_argument("--address", default=os.environ.get("SPECD_COORDINATOR_ADDRESS", "127.0.0.1:50063"))
    p.add_argument("--chat", action="store_true", help="send the prompt as a user message (chat template)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--policy", default="",
                   help="stopping policy ('none': the target alone; default: the server's)")
    p.add_argument("--overlap", choices=["on", "off"], default=None,
                   help="PEARL overlap (default: the server's)")
    p.add_argument("--tls-ca", type=Path, help="CA bundle verifying the coordinator (turns TLS on)")
    p.add_argument("--tls-cert", type=Path, help="client certificate (mTLS), with --tls-key")
    p.add_argument("--tls-key", type=Path, help="private key of --tls-cert")
    p.add_argument("--tls-server-name", help="name checked in the coordinator's certificate")
    a = p.parse_args(argv)
    overlap = None if a.overlap is None else a.overlap == "on"
    source = {"messages": [{"role": "user", "content": a.prompt}]} if a.chat else {"prompt": a.prompt}
    stats: dict = {}
    try:
        security = GrpcSecurity(a.tls_cert, a.tls_key, a.tls_ca, tls_server_name=a.tls_server_name,
                                auth_token=os.environ.get("SPECD_AUTH_TOKEN") or None)
        with CoordinatorClient(a.address, security) as client:
            for chunk in client.generate(**source, max_new_tokens=a.max_new_tokens, temperature=a.temperature,
                                         top_p=a.top_p, top_k=a.top_k, seed=a.seed, stop=a.stop,
                                         policy=a.policy, overlap=overlap):
                sys.stdout.write(chunk.text)
                sys.stdout.flush()
                if chunk.finish_reason:
                    stats = chunk.spec_stats or {}
    except SpecdError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print()
    print(json.dumps(stats, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
