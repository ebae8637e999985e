"""Training the early-exit adapter by distillation: it learns, the file configures the
drafter, a reduced draft vocabulary stays lossless, a checkpoint resumes."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from specd.drafters import EarlyExitDrafter, FeatureDrafter
from specd.drafters.early_exit import ResidualAdapter, read_adapter_meta
from specd.engine import SpeculativeEngine
from specd.errors import InvalidRequest, ModelError
from specd.runtime.tiny import loaded, tiny_llama
from specd.training.corpus import Answered
from specd.training.early_exit import choose_vocab, coverage, evaluate, train_early_exit
from specd.types import SamplingParams, SpecParams


@pytest.fixture(scope="module")
def corpus(tiny_target, tmp_path_factory):
    work = tmp_path_factory.mktemp("corpus")
    # No tokenizer on the shared tiny target: answer id prompts through the same generator.
    from specd.training.corpus import batched_generate, write_shard

    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 128, (int(n),), generator=g).tolist() for n in torch.randint(4, 12, (48,), generator=g)]
    seqs = []
    for start in range(0, len(prompts), 16):
        chunk = prompts[start:start + 16]
        for temperature in (0.0, 1.0):
            answers = batched_generate(tiny_target, chunk, temperature, 24, start)
            seqs += [Answered(p + a, len(p)) for p, a in zip(chunk, answers) if a]
    write_shard(work / "shard-00000.safetensors", seqs, 0.0)
    return seqs


def test_choose_vocab_keeps_the_most_frequent_answer_tokens_and_eos():
    seqs = [Answered([9, 9, 1, 1, 1, 2, 2, 3], 2), Answered([9, 1, 5], 1)]
    ids = choose_vocab(seqs, 3, 10, always=[7])
    assert ids.tolist() == [1, 2, 7]  # prompt tokens (9) do not count; 7 is always kept
    assert coverage(seqs, ids) == pytest.approx(6 / 8)
    assert choose_vocab(seqs, 6, 10).tolist() == [0, 1, 2, 3, 4, 5]  # filled to size


@pytest.mark.parametrize("adapter", ["mlp", "layer"])
def test_training_lowers_the_held_out_loss_and_the_file_restores_the_drafter(tiny_target, corpus, tmp_path, adapter):
    out = tmp_path / "a.safetensors"
    report = train_early_exit(tiny_target, corpus, out, layers=1, adapter=adapter, rank=32, draft_vocab=96,
                              epochs=4, lr=3e-3, batch_tokens=512, holdout=0.2, seed=1)
    before, after = report["before"]["corpus-holdout"], report["after"]["corpus-holdout"]
    assert after["loss"] < before["loss"]
    meta = read_adapter_meta(out)
    assert (meta["layers"], meta["adapter"], meta["rank"]) == ("1", adapter, "32")
    assert meta["train"]["after"] == report["after"]
    # Layers, kind and rank come from the file, whatever the caller asks for.
    drafter = EarlyExitDrafter(tiny_target, 3, adapter_path=out)
    assert (drafter.layers, drafter.adapter_kind, drafter.vocab_ids.numel()) == (1, adapter, 96)
    assert evaluate(tiny_target, drafter, corpus[:8])["loss"] == pytest.approx(
        evaluate(tiny_target, drafter, corpus[:8])["loss"])
    logits, _ = drafter.open().kv.extend(corpus[0].ids, 1)
    outside = torch.ones(tiny_target.vocab_size, dtype=torch.bool)
    outside[drafter.vocab_ids] = False
    assert torch.isinf(logits[0, outside]).all() and torch.isfinite(logits[0, ~outside]).all()


def test_a_reduced_vocabulary_drafter_is_lossless(tiny_target, corpus, tmp_path, hf_greedy):
    out = tmp_path / "v.safetensors"
    train_early_exit(tiny_target, corpus, out, layers=2, adapter="layer", draft_vocab=40, epochs=1,
                     batch_tokens=512, holdout=0.0)
    engine = SpeculativeEngine(tiny_target, EarlyExitDrafter(tiny_target, adapter_path=out))
    for s in corpus[:3]:
        prompt = s.ids[:s.prompt_len]
        for policy in ("constant", "cost-aware"):
            out_ids = engine.generate(prompt, SamplingParams(max_new_tokens=20), SpecParams(policy)).token_ids
            assert out_ids == hf_greedy(tiny_target.model, prompt, 20)
    sampled = engine.generate(corpus[0].ids[:corpus[0].prompt_len],
                              SamplingParams(temperature=1.0, seed=3, max_new_tokens=20), SpecParams("constant"))
    assert len(sampled.token_ids) == 20


def test_a_checkpoint_resumes_the_same_run(tiny_target, corpus, tmp_path):
    ckpt = tmp_path / "ckpt.pt"
    args = {"layers": 1, "adapter": "mlp", "rank": 16, "epochs": 2, "batch_tokens": 512, "holdout": 0.1,
            "checkpoint": ckpt}
    train_early_exit(tiny_target, corpus, tmp_path / "a.safetensors", **args)
    assert torch.load(ckpt, weights_only=False)["epoch"] == 2
    train_early_exit(tiny_target, corpus, tmp_path / "b.safetensors", **args)  # nothing left to train
    a = EarlyExitDrafter(tiny_target, adapter_path=tmp_path / "a.safetensors").adapter.state_dict()
    b = EarlyExitDrafter(tiny_target, adapter_path=tmp_path / "b.safetensors").adapter.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_adapter_files_are_checked(tiny_target, tmp_path):
    other = loaded(tiny_llama(5, layers=4), "other-target")
    path = tmp_path / "other.safetensors"
    EarlyExitDrafter(other, 2).save_adapter(path)
    with pytest.raises(ModelError, match="trained for target other-target"):
        EarlyExitDrafter(tiny_target, adapter_path=path)
    with pytest.raises(ModelError, match="not found"):
        EarlyExitDrafter(tiny_target, adapter_path=tmp_path / "missing.safetensors")
    (tmp_path / "junk.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ModelError, match="not a safetensors file"):
        EarlyExitDrafter(tiny_target, adapter_path=tmp_path / "junk.safetensors")
    feature = tmp_path / "feature.safetensors"
    FeatureDrafter(tiny_target).save(feature)
    with pytest.raises(ModelError, match="not an early-exit adapter"):
        EarlyExitDrafter(tiny_target, adapter_path=feature)
    # A file from before adapters carried metadata: the rank-64 mlp's keys, unprefixed.
    legacy = tmp_path / "legacy.safetensors"
    save_file({k: v.contiguous() for k, v in ResidualAdapter(64, 64).state_dict().items()}, str(legacy))
    assert EarlyExitDrafter(tiny_target, 2, adapter_path=legacy).adapter_name == "legacy"


def test_the_feature_head_learns_and_drafts_losslessly(tiny_target, corpus, tmp_path, hf_greedy):
    from specd.training.feature import train_feature

    out = tmp_path / "feature.safetensors"
    report = train_feature(tiny_target, corpus, out, draft_vocab=96, epochs=4, lr=3e-3, batch_tokens=512,
                           holdout=0.2, seed=1)
    assert report["kind"] == "feature"
    assert report["after"]["corpus-holdout"]["loss"] < report["before"]["corpus-holdout"]["loss"]
    drafter = FeatureDrafter(tiny_target, out)
    assert drafter.vocab_ids.numel() == 96 and read_adapter_meta(out)["train"]["after"] == report["after"]
    engine = SpeculativeEngine(tiny_target, drafter)
    for s in corpus[:3]:
        prompt = s.ids[:s.prompt_len]
        got = engine.generate(prompt, SamplingParams(max_new_tokens=20), SpecParams("constant"))
        assert got.token_ids == hf_greedy(tiny_target.model, prompt, 20) and got.stats.drafted > 0


def test_the_unrolled_feature_step_adds_deeper_rows_and_keeps_the_first(tiny_target, corpus):
    from specd.training.early_exit import _pack
    from specd.training.feature import feature_step

    drafter = FeatureDrafter(tiny_target)
    ids, attn, pred = _pack(corpus[:4], 64, 0, tiny_target.device)
    with torch.no_grad():
        p1, q1, _, d1 = feature_step(tiny_target, drafter, ids, attn, pred)
        p3, q3, loss3, d3 = feature_step(tiny_target, drafter, ids, attn, pred, depth=3)
    assert (d1 == 1).all() and d3.unique().tolist() == [1, 2, 3]
    assert torch.equal(p3[d3 == 1], p1) and torch.allclose(q3[d3 == 1], q1, atol=1e-5)
    # A depth-d row needs d - 1 head positions before it; answers start after a prompt of >= 4 tokens.
    rows = pred[:, 1:]
    assert (d3 == 2).sum() == rows[:, 1:].sum() and (d3 == 3).sum() == rows[:, 2:].sum()
    assert torch.isfinite(loss3)


def test_unrolled_training_fits_the_deeper_tokens(tiny_target, corpus, tmp_path):
    """Trained on its own stand-ins, the head's third token past a verified prefix fits its
    training answers better than when trained on the target's features alone. (The tiny target
    is random, so nothing generalises to held-out text; the fit shows the deeper rows are in the
    objective: on the H100 the teacher-forced head drafted later tokens far worse than its first.)"""
    from specd.training.feature import train_feature

    common = {"draft_vocab": 96, "epochs": 4, "lr": 3e-3, "batch_tokens": 512, "holdout": 0.0, "seed": 1,
              "eval_seqs": {"train": corpus}}
    plain = train_feature(tiny_target, corpus, tmp_path / "a.safetensors", **common)
    unrolled = train_feature(tiny_target, corpus, tmp_path / "b.safetensors", unroll=3, **common)
    deep = {r["unroll"]: r["after"]["train"]["by_depth"]["3"]["loss"] for r in (plain, unrolled)}
    assert deep[3] < deep[1]
    assert set(plain["before"]["train"]["by_depth"]) == {"1", "2", "3"}
    with pytest.raises(InvalidRequest, match="unroll"):
        train_feature(tiny_target, corpus, tmp_path / "c.safetensors", unroll=0)
