"""A key's own webhook endpoint reaches public addresses only (no SSRF): refused at create (a 400 naming `url`)
and again at delivery, which connects to the address it checked and follows no redirect; the operator's
allow-list (BATCH_WEBHOOK_ALLOW) opens internal receivers on purpose, and the global endpoints stay trusted."""

from __future__ import annotations

import base64
import threading

import pytest

from batch_dagster.api.context import LOOKUPS_QUEUED_PER_KEY
from batch_dagster.defs.webhooks import WebhookConfig
from batch_dagster.features import egress
from tests.helpers import KEY_A, KEY_B, Flood, Receiver

SECRET = "whsec_" + base64.b64encode(b"an endpoint's secret, 32 bytes ok").decode()
NAMES: dict[str, list[str]] = {"example.com": ["93.184.216.34"], "metadata.example": ["169.254.169.254"],
                               "mixed.example": ["93.184.216.34", "10.1.2.3"], "hooks.example": ["93.184.216.34"]}


@pytest.fixture(autouse=True)
def resolver(monkeypatch):
    """DNS as these tests say (none of them depends on the network's)."""
    monkeypatch.setattr(egress, "resolve", lambda host, port: NAMES[host])
    return NAMES


@pytest.fixture
def receiver():
    r = Receiver()
    yield r
    r.close()


REFUSED = ["http://127.0.0.1/h", "http://localhost.:80/", "http://[::1]:8080/h", "http://169.254.169.254/latest/",
           "https://metadata.example/", "http://mixed.example/", "http://10.0.0.1/", "http://192.168.0.1/",
           "http://[fc00::1]/", "http://[fe80::1]/", "http://[::ffff:127.0.0.1]/", "http://0.0.0.0:8000/",
           "http://[::]/", "http://224.0.0.1/", "http://2130706433/", "http://0x7f.1/", "http://0177.0.0.1/",
           "http://127.1/"]


@pytest.mark.parametrize("url", REFUSED)
def test_an_endpoint_at_an_internal_address_is_refused_at_create(shared_service, resolver, url):
    resolver["localhost"] = ["127.0.0.1"]
    service = shared_service()
    with service.http(KEY_A) as http:
        response = http.post("/v1/webhook_endpoints", json={"url": url})
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert error["param"] == "url" and error["type"] == "invalid_request_error" and error["code"] == "invalid_url"
        # (httpx itself cannot parse 0177.0.0.1; every other form is refused for its address.)
        assert ("BATCH_WEBHOOK_ALLOW" in error["message"] or "0177" in url) and len(error["message"]) < 300, error
        assert http.get("/v1/webhook_endpoints").json()["data"] == []


def test_the_allow_list_opens_internal_hosts_and_public_ones_pass(start_service):
    service = start_service(worker=False, webhook_allow=("127.0.0.1", "10.0.0.0/8", "metadata.example"))
    with service.http(KEY_A) as http:
        for url in ("http://127.0.0.1:9/h", "http://10.2.3.4/h", "https://metadata.example/h", "https://example.com/",
                    "http://93.184.216.34:8080/h"):
            assert http.post("/v1/webhook_endpoints", json={"url": url}).status_code == 200, url
        assert http.post("/v1/webhook_endpoints", json={"url": "http://127.0.0.2/"}).status_code == 400


def post_to(url: str, allow: list[str], secret: str | None = SECRET) -> str | None:
    config = WebhookConfig(secret=SECRET, timeout_s=2.0, allow=allow)
    return config.send_all([(url, secret, "evt_1", b'{"id": "evt_1"}')])[0]


def test_delivery_checks_again_and_connects_to_the_address_it_checked(receiver, resolver):
    port = receiver.url.split(":")[2].split("/")[0]
    # Created when the name was public, now at loopback (DNS rebinding, or a changed record): refused.
    resolver["hooks.example"] = ["127.0.0.1"]
    error = post_to(f"http://hooks.example:{port}/hook", allow=[])
    assert error is not None and "not at a public address" in error and receiver.posts == []
    assert "not at a public address" in (post_to(receiver.url, allow=[]) or "") and receiver.posts == []
    # Allowed on purpose: the post goes to the address checked, naming the host it was sent for.
    assert post_to(f"http://hooks.example:{port}/hook", allow=["127.0.0.1"]) is None
    assert receiver.posts[-1][0]["host"] == f"hooks.example:{port}"
    # The operator's own global endpoints (no endpoint secret) are trusted, as BATCH_WEBHOOK_URLS always were.
    assert post_to(receiver.url, allow=[], secret=None) is None and len(receiver.posts) == 2


def test_delivery_follows_no_redirect():
    to_metadata = Receiver(307)
    try:
        error = post_to(to_metadata.url, allow=["127.0.0.1"])
        assert error is not None and error.startswith("HTTP 307") and len(to_metadata.posts) == 1
    finally:
        to_metadata.close()


def test_the_refusal_names_no_internal_address(shared_service):
    """A name that resolves inside is refused without saying where it resolves (a tenant learns nothing of the
    internal network's names)."""
    with shared_service().http(KEY_A) as http:
        for url in ("https://metadata.example/", "http://mixed.example/"):
            message = http.post("/v1/webhook_endpoints", json={"url": url}).json()["error"]["message"]
            assert "169.254" not in message and "10.1.2.3" not in message and "not at a public address" in message


def test_slow_lookups_of_one_key_leave_the_api_serving_everyone(start_service, resolver, monkeypatch):
    """45 creates of one key whose host's lookup hangs until released: past the key's bound they answer 429 at
    once, another key is served (its own create too) while the rest wait, and those end once the lookup answers."""
    release, lookups = threading.Event(), []

    def resolve(host, port):
        lookups.append(host)
        if host == "slow.example":
            release.wait(60)
        return NAMES[host]

    monkeypatch.setattr(egress, "resolve", resolve)
    resolver["slow.example"] = ["93.184.216.34"]
    service = start_service(worker=False)
    flood = Flood(service, "/v1/webhook_endpoints", {"url": "https://slow.example/h"}, 45)
    flood.wait_answered(45 - LOOKUPS_QUEUED_PER_KEY)
    assert set(flood.statuses) == {429} and flood.held() == LOOKUPS_QUEUED_PER_KEY
    with service.http(KEY_B) as other:
        assert other.get("/v1/batches", timeout=10).status_code == 200
        assert other.post("/v1/webhook_endpoints", json={"url": "https://example.com/h"}, timeout=10).status_code == 200
    assert not release.is_set() and flood.held() == LOOKUPS_QUEUED_PER_KEY
    release.set()
    statuses = flood.join()
    assert statuses.count(200) == LOOKUPS_QUEUED_PER_KEY and statuses.count(429) == 45 - LOOKUPS_QUEUED_PER_KEY
