"""The official `openai` SDK against the real gateway: it parses our responses and chunks,
sends `speculative` through extra_body, sees `spec_stats` beside `usage`, and turns our
errors into its typed exceptions."""

from __future__ import annotations

import openai
import pytest

MESSAGES = [{"role": "user", "content": "Hi"}]
SPEC = {"speculative": {"policy": "heuristic"}}


@pytest.fixture
def client(gateway_url):
    with openai.OpenAI(base_url=gateway_url + "/v1", api_key="unused", max_retries=0, timeout=30) as c:
        yield c


def _stats(obj) -> dict:
    return obj.model_extra["spec_stats"]


def test_chat(client):
    out = client.chat.completions.create(model="tiny", messages=MESSAGES, temperature=0, max_tokens=20,
                                         extra_body=SPEC)
    assert out.choices[0].message.role == "assistant" and out.choices[0].message.content
    assert out.usage.completion_tokens <= 20
    stats = _stats(out)
    assert stats["policy"] == "heuristic" and stats["verifications"] >= 1


def test_chat_stream_with_usage(client):
    plain = client.chat.completions.create(model="tiny", messages=MESSAGES, temperature=0, max_tokens=20)
    chunks = list(client.chat.completions.create(
        model="tiny", messages=MESSAGES, temperature=0, max_tokens=20, stream=True,
        stream_options={"include_usage": True}, extra_body=SPEC))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == plain.choices[0].message.content
    final = next(c for c in chunks if c.choices and c.choices[0].finish_reason)
    assert final.choices[0].finish_reason == plain.choices[0].finish_reason
    assert _stats(final)["policy"] == "heuristic"
    assert chunks[-1].choices == [] and chunks[-1].usage == plain.usage


def test_the_sdk_reads_logprobs_and_sends_penalties(client):
    kw = dict(model="tiny", messages=MESSAGES, temperature=0, max_tokens=16, logprobs=True, top_logprobs=2,
              presence_penalty=0.5, frequency_penalty=0.2, logit_bias={"5": -100}, extra_body=SPEC)
    out = client.chat.completions.create(**kw)
    content = out.choices[0].logprobs.content
    assert content and all(t.logprob <= 0 and len(t.top_logprobs) == 2 for t in content)
    chunks = list(client.chat.completions.create(**kw, stream=True))
    streamed = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert [t.token for t in streamed] == [t.token for t in content]
    done = client.completions.create(model="tiny", prompt="Hi", temperature=0, max_tokens=8, logprobs=2)
    assert len(done.choices[0].logprobs.tokens) == len(done.choices[0].logprobs.token_logprobs) > 0


def test_the_sdk_reads_n_choices_and_structured_output(client):
    out = client.chat.completions.create(model="tiny", messages=MESSAGES, temperature=0.8, seed=1, n=2, max_tokens=8,
                                         response_format={"type": "json_object"})
    assert [c.index for c in out.choices] == [0, 1]
    assert all(c.message.content.startswith("{") for c in out.choices)
    assert out.usage.completion_tokens == sum(s["new_tokens"] for s in _stats(out)["per_choice"])


def test_completions(client):
    out = client.completions.create(model="tiny", prompt="Hi", temperature=0, max_tokens=16)
    chunks = list(client.completions.create(model="tiny", prompt="Hi", temperature=0, max_tokens=16,
                                            stream=True))
    assert "".join(c.choices[0].text for c in chunks) == out.choices[0].text
    assert _stats(chunks[-1])["new_tokens"] == out.usage.completion_tokens == _stats(out)["new_tokens"]


def test_models(client):
    (model,) = client.models.list().data
    assert model.object == "model" and model.model_extra["max_model_len"] == 512


def test_errors_become_sdk_exceptions(client):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="tiny", messages=MESSAGES,
                                       extra_body={"speculative": {"policy": "x"}})
    assert err.value.param == "speculative.policy"
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="tiny", messages=MESSAGES, temperature=3, stream=True)
    assert err.value.param == "temperature"
