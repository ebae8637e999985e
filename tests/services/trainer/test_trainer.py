"""`specd serve trainer`'s loop against a real Redis: it turns replay records into updates,
publishes the adapter draft services swap in, and resumes from its checkpoint."""

from __future__ import annotations

import asyncio

import torch

from services.common.replay import RedisDVI
from services.trainer.main import TrainerLoop
from specd.dvi import DVITrainer, Record, TrainerConfig, top_logprobs

H, V = 16, 40


def _records(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    lp, ids = top_logprobs(torch.randn(n, V, generator=g), 8)
    return [Record(torch.randn(H, generator=g), int(ids[i, 1]), 0.0, ids[i], lp[i]) for i in range(n)]


def _loop(redis_url, checkpoint=None, **kw):
    W = torch.randn(V, H, generator=torch.Generator().manual_seed(1))
    trainer = DVITrainer(W, None, V, TrainerConfig(batch_size=4, kl_steps=1))
    return TrainerLoop(trainer, RedisDVI(redis_url, "tiny:early-exit-1"), kw.get("upr", 1.0),
                       kw.get("publish_every", 2), checkpoint)


def test_trainer_updates_from_a_tiny_stream_and_publishes(redis_url, tmp_path):
    async def run():
        loop = _loop(redis_url, tmp_path / "ckpt.pt", upr=0.5, publish_every=2)
        producer = RedisDVI(redis_url, "tiny:early-exit-1")
        try:
            assert await loop.run_once(block_ms=10) == 0  # an empty stream: nothing to learn
            await producer.add(_records(5))
            made = await loop.run_once(block_ms=10)
            assert made == 2 and loop.trainer.steps == 2 and loop.trainer.seen == 5
            published = await producer.fetch()
            assert published.version == 2 and torch.count_nonzero(published.B) > 0  # learned something
            assert (tmp_path / "ckpt.pt").is_file()
            # A restarted trainer resumes after what it read, with the same weights.
            again = _loop(redis_url, tmp_path / "ckpt.pt", upr=0.5, publish_every=2)
            assert again.trainer.steps == 2 and again.after == loop.after
            assert torch.allclose(again.trainer.lora.B, loop.trainer.lora.B)
            await producer.add(_records(2, seed=3))
            assert await again.run_once(block_ms=10) == 1 and again.trainer.seen == 7
            await again.dvi.close()
        finally:
            await loop.dvi.close()
            await producer.close()

    asyncio.run(run())


def test_trainer_settings_build_a_loop_for_the_drafter_the_draft_service_names(tiny_dirs, redis_url):
    from services.common.settings import TrainerSettings
    from services.trainer.main import build_loop
    from specd.drafters.early_exit import EarlyExitDrafter
    from specd.runtime import load_model

    s = TrainerSettings(target_model=str(tiny_dirs[0]), device="cpu", draft_layers=1, redis_url=redis_url)
    loop = build_loop(s)
    drafter = EarlyExitDrafter(load_model(str(tiny_dirs[0]), "cpu"), layers=1)
    try:  # the same keys as the draft service's RedisDVI(url, drafter.name)
        assert loop.dvi.stream_key == RedisDVI(redis_url, drafter.name).stream_key
        assert loop.trainer.W.shape == drafter.head_weight.shape
    finally:
        asyncio.run(loop.dvi.close())
