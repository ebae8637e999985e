"""Real `specd serve` processes on checkpoints of other families (tiny directories built from
transformers' config classes): a Qwen2 target and its Qwen2 hf draft start on specd's runtime,
with the KV pool their settings ask for, and say so; a model the runtime cannot serve exactly
is refused at start with a message that names what it lacks."""

from __future__ import annotations

import urllib.request

import pytest
from grpc_health.v1 import health_pb2

from services.cli import free_port
from specd.runtime.tiny import char_tokenizer, perturbed, save_tiny, tiny_family
from tests.services.common.test_drain import serve, status, wait

pytestmark = pytest.mark.external  # real `specd serve` processes


@pytest.fixture(scope="module")
def qwen2_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen2")
    model = tiny_family("qwen2", vocab_size=len(char_tokenizer()))
    return save_tiny(root / "target", model=model), save_tiny(root / "draft", model=perturbed(model, 0.01, seed=1))


def test_a_qwen2_target_and_draft_serve_on_the_runtime_with_their_pools(qwen2_dirs, tmp_path):
    target_dir, draft_dir = qwen2_dirs
    tport, dport, metrics = free_port(), free_port(), free_port()
    logs = [tmp_path / "target.log", tmp_path / "draft.log"]
    target = serve("target", logs[0], "--port", str(tport), "--model", str(target_dir), "--threads", "1",
                   "--kv-slots", "3", "--kv-max-len", "256", "--metrics-port", str(metrics))
    draft = serve("draft", logs[1], "--port", str(dport), "--drafter", "hf", "--draft-model", str(draft_dir),
                  "--target-model", str(target_dir), "--threads", "1", "--kv-slots", "2", "--kv-max-len", "256")
    procs = [target, draft]
    try:
        for port in (tport, dport):
            wait(lambda: status(f"127.0.0.1:{port}") == health_pb2.HealthCheckResponse.SERVING, 120,
                 f"service on {port} SERVING", procs, logs)
        scraped = urllib.request.urlopen(f"http://127.0.0.1:{metrics}/metrics", timeout=5).read().decode()
        slots = [line for line in scraped.splitlines() if line.startswith("specd_target_kv_slots{")]
        assert slots and float(slots[0].split()[-1]) == 3
        assert "(qwen2) on specd's runtime: KV pool of 3 slots" in logs[0].read_text()
        assert "(qwen2) on specd's runtime: KV pool of 2 slots" in logs[1].read_text()
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(30)


def test_a_model_the_runtime_cannot_serve_is_refused_at_start_naming_it(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(vocab_size=len(char_tokenizer()), n_embd=64, n_layer=1, n_head=4))
    gpt2 = save_tiny(tmp_path / "gpt2", model=model)
    log = tmp_path / "target.log"
    target = serve("target", log, "--port", str(free_port()), "--model", str(gpt2), "--threads", "1")
    assert target.wait(120) != 0
    text = log.read_text()
    assert "model type 'gpt2'" in text and "cannot serve" in text, text[-2000:]


def test_a_tensor_parallel_qwen2_target_serves_greedy_output_and_drains(qwen2_dirs, tmp_path):
    """`--tensor-parallel 2` on the CPU (gloo): two ranks, each with its share of every layer and
    the same slots; greedy output through a coordinator equals transformers' generate, and a
    SIGTERM (which torchrun sends every rank) drains rank 0 while rank 1 waits for its stop."""
    import signal

    from services.coordinator.api import GenerateRequest
    from specd.runtime import load_model
    from specd.types import SamplingParams, SpecParams
    from tests.services.coordinator.test_coordinator import generate
    from tests.specd.runtime.test_families import greedy_reference

    target_dir, _ = qwen2_dirs
    port = free_port()
    log = tmp_path / "target.log"
    target = serve("target", log, "--port", str(port), "--model", str(target_dir), "--tensor-parallel", "2",
                   "--device", "cpu", "--threads", "1", "--kv-slots", "2", "--kv-max-len", "256",
                   "--drafter", "ngram")
    try:
        wait(lambda: status(f"127.0.0.1:{port}") == health_pb2.HealthCheckResponse.SERVING, 180,
             "tensor-parallel target SERVING", [target], [log])
        reference = load_model(str(target_dir))
        prompt = "the cat sat, the cat sat, the"
        want = greedy_reference(reference.model, "qwen2", reference.encode_prompt(prompt, chat=False), 30)
        request = GenerateRequest(prompt=prompt, sampling=SamplingParams(max_new_tokens=30),
                                  spec=SpecParams("constant"))
        ids, finish = generate(f"127.0.0.1:{port}", None, request)
        assert ids == want[:len(ids)] and finish.spec_stats["drafted"] > 0
        target.send_signal(signal.SIGTERM)  # torchrun forwards it to both ranks, then exits reporting it
        target.wait(60)
        text = log.read_text()
        assert "draining" in text and "Connection closed" not in text and "ChildFailedError" not in text, text[-3000:]
    finally:
        if target.poll() is None:
            target.kill()
