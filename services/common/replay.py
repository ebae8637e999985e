"""DVI in Redis (docs/engine.md): the replay stream draft services log judged draft positions
to, and the adapter versions the trainer publishes and draft services hot-swap.

Keys, per drafter (its name, which names its weights):
  {namespace}:dvi:{drafter}:replay    a Stream; one entry per record (specd.dvi.Record.encode),
                                      trimmed to about `maxlen` entries
  {namespace}:dvi:{drafter}:adapter   a Hash: version, weights (HeadLoRA safetensors bytes)
"""

from __future__ import annotations

import redis.asyncio as aioredis

from specd.dvi import HeadLoRA, Record


class RedisDVI:
    def __init__(self, url: str, drafter: str, namespace: str = "specd", maxlen: int = 200_000):
        self.redis = aioredis.Redis.from_url(url, socket_timeout=5, socket_connect_timeout=5)
        base = f"{namespace}:dvi:{drafter}"
        self.stream_key, self.adapter_key = f"{base}:replay", f"{base}:adapter"
        self.maxlen = maxlen

    async def add(self, records: list[Record]) -> None:
        async with self.redis.pipeline(transaction=False) as pipe:
            for r in records:
                pipe.xadd(self.stream_key, r.encode(), maxlen=self.maxlen, approximate=True)
            await pipe.execute()

    async def read(self, after: str, count: int, block_ms: int | None = None) -> list[tuple[str, Record]]:
        """Up to count records after stream id `after` ("0": from the oldest kept), waiting up
        to block_ms for the first; a malformed entry is skipped (its id still advances)."""
        reply = await self.redis.xread({self.stream_key: after}, count=count, block=block_ms)
        out = []
        for _, entries in reply or ():
            for entry_id, fields in entries:
                try:
                    rec = Record.decode(fields)
                except ValueError:
                    rec = None
                out.append((entry_id.decode() if isinstance(entry_id, bytes) else entry_id, rec))
        return out

    async def publish(self, lora: HeadLoRA) -> None:
        await self.redis.hset(self.adapter_key, mapping={"version": lora.version, "weights": lora.to_bytes()})

    async def version(self) -> int:
        v = await self.redis.hget(self.adapter_key, "version")
        return int(v) if v is not None else 0

    async def fetch(self) -> HeadLoRA | None:
        weights = await self.redis.hget(self.adapter_key, "weights")
        return HeadLoRA.from_bytes(weights) if weights is not None else None

    async def close(self) -> None:
        await self.redis.aclose()
