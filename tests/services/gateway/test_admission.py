"""The gateway's admission between API keys: a default cap per key and a fair share of the last
slots, so that one key cannot fill a gateway against the others (docs/deploy.md, "Security")."""

from __future__ import annotations

import httpx
import pytest

from services.gateway import create_app
from services.gateway.app import Admission
from services.gateway.errors import RateLimited
from services.gateway.metrics import key_label
from specd.errors import Overloaded

CHAT = "/v1/chat/completions"
HI = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "temperature": 0}


def test_a_key_without_a_limit_of_its_own_is_capped_and_others_are_not():
    a = Admission(limit=10, per_key=2, reserve=0)
    held = [a.enter("one"), a.enter("one")]
    with pytest.raises(RateLimited) as e:
        a.enter("one")
    assert e.value.kind == "concurrent" and e.value.headers["Retry-After"]
    a.enter("two")
    a.enter("one", own_limit=5)  # a key with a limit of its own: the limiter enforces that one
    held[0]()
    held[0]()  # a release is counted once: "one" still holds 2
    with pytest.raises(RateLimited):
        a.enter("one")
    held[1]()
    a.enter("one")
    assert a.in_flight == 3 and a.by_key == {"one": 2, "two": 1}


def test_the_last_slots_go_to_keys_under_their_fair_share():
    a = Admission(limit=8, per_key=0, reserve=0.25)  # the last 2 of 8 slots are reserved
    hog = [a.enter("hog") for _ in range(6)]  # alone, one key takes all but the reserve
    with pytest.raises(RateLimited):
        a.enter("hog")  # 6 >= ceil(8 / 2): over a share that leaves room for one more key
    a.enter("new")  # 0 < ceil(8 / 2)
    a.enter("third")  # 0 < ceil(8 / 3)
    with pytest.raises(Overloaded):  # the gateway is full: 503 for everyone
        a.enter("fourth")
    for release in hog[:3]:
        release()
    a.enter("hog")  # 3 free, above the reserve again
    anonymous = Admission(limit=2, per_key=1, reserve=0.5)  # without keys: one shared count, no shares
    anonymous.enter()
    anonymous.enter()
    with pytest.raises(Overloaded):
        anonymous.enter()


def test_over_http_a_capped_key_gets_429_while_another_key_is_served(serve, local_backend):
    app = create_app(local_backend, api_keys=frozenset({"sk-one", "sk-two"}), max_concurrent_requests=8,
                     max_concurrent_per_key=2)
    url = serve(app)
    admission = app.state.gateway.admission

    def chat(key: str) -> httpx.Response:
        return httpx.post(url + CHAT, json=HI, headers={"Authorization": f"Bearer {key}"}, timeout=30)

    held = [admission.enter("key-1"), admission.enter("key-1")]  # two of sk-one's generations in flight
    try:
        r = chat("sk-one")
        assert r.status_code == 429 and r.headers["Retry-After"] == "1", r.text
        assert r.json()["error"]["code"] == "rate_limit_exceeded" and "its limit of 2" in r.text, r.text
        assert chat("sk-two").status_code == 200
    finally:
        for release in held:
            release()
    assert chat("sk-one").status_code == 200
    assert admission.in_flight == 0 and admission.by_key == {}


class Recording:
    """The real in-process backend, keeping the requests the gateway sent it."""

    def __init__(self, backend):
        self.backend, self.requests = backend, []

    def __getattr__(self, name):
        return getattr(self.backend, name)

    def generate(self, request):
        self.requests.append(request)
        return self.backend.generate(request)


def test_each_keys_requests_name_their_tenant_and_open_ones_name_none(serve, local_backend):
    keyed = Recording(local_backend)
    url = serve(create_app(keyed, api_keys=frozenset({"sk-one", "sk-two"})))
    for key in ("sk-one", "sk-two"):
        r = httpx.post(url + CHAT, json=HI, headers={"Authorization": f"Bearer {key}"}, timeout=30)
        assert r.status_code == 200, r.text
    assert [r.tenant for r in keyed.requests] == [key_label("key-1"), key_label("key-2")]
    assert "sk-one" not in keyed.requests[0].tenant
    open_ = Recording(local_backend)
    r = httpx.post(serve(create_app(open_)) + CHAT, json=HI, timeout=30)
    assert r.status_code == 200 and open_.requests[0].tenant == ""
