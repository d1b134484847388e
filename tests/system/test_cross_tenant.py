"""Two keys on one service on a real PostgreSQL 15, key B trying every surface for key A's data: files, batches
(retrieve, cancel, retry, partial output, lists with filters and cursors), output and error files, webhook endpoints
and their deliveries, estimates, the answer store (`reuse`), the prefix cache (`cached_tokens`, on the session's vLLM
server, whose cache both keys' lines reach), the metrics, usage, the limits and the estimate lane. Every response B
gets goes through the official openai SDK or an HTTP client that keeps its bytes, and no byte of A's (ids,
custom_ids, prompt, metadata, key, key name, owner hash, webhook URL and secret, answer ids) may be among them; a 404
for A's object is the 404 for an id that never existed, byte for byte, so B cannot even learn that A's exists.

Each check has its positive control beside it: what crossing would look like within one key (B's own repeat is
reused and cached; the operator's listener does name both keys), so a check that cannot fail is seen to."""

from __future__ import annotations

import hashlib
import json
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import openai
import pytest
from openai import DefaultHttpxClient, OpenAI

from batch_dagster.batchfile import contract as c
from batch_dagster.defs.resources import DatabaseResource
from batch_dagster.defs.webhooks import WebhookConfig, webhook_sensor
from tests.api.conftest import serving
from tests.api.test_tenancy_limits import port_of, upload_head
from tests.helpers import (
    MODEL_CACHE,
    Receiver,
    Service,
    chat_request,
    new_database,
    real_vllm,
    rows,
    tls,
    upload,
    wait_for,
)

CHAT = c.CHAT
# Fresh keys: the session's vLLM server is shared with other tests, and its prefix cache with it.
RUN = uuid.uuid4().hex[:10]
KEY_A, KEY_B = f"sk-alice-{uuid.uuid4().hex}", f"sk-bob-{uuid.uuid4().hex}"
NAME_A, NAME_B = f"alice-{RUN}", f"bob-{RUN}"
# About a thousand prompt tokens (many of the prefix cache's blocks), the same words for both keys.
LONG = "Summarize the following notes. " + " ".join(f"note{i} says item{i * 7 % 13}" for i in range(150))
SHARED = {"temperature": 0, "max_tokens": 4}  # deterministic: an answer the store may keep
ALL_TYPES = ["batch.completed", "batch.failed", "batch.expired", "batch.cancelled", "batch.deadline_at_risk"]


class Recorder:
    """Every response a client got, as bytes (its status, headers and body), for the byte checks."""

    def __init__(self) -> None:
        self.seen: list[bytes] = []
        self.lock = threading.Lock()

    def __call__(self, response: httpx.Response) -> None:
        response.read()
        head = f"{response.status_code}\n{response.headers}\n"
        with self.lock:
            self.seen.append(head.encode() + response.content)


@dataclass
class World:
    service: Service
    tmp: Path
    a: OpenAI
    b: OpenAI  # every response recorded in `recorder`
    b_http: httpx.Client  # the same key, raw HTTP, recorded too
    recorder: Recorder
    a_secrets: dict[str, str] = field(default_factory=dict)  # what of A's B must never read, by name
    a_batch: openai.types.Batch | None = None
    a_lines: dict[str, dict] = field(default_factory=dict)
    b_first: openai.types.Batch | None = None
    b_first_lines: dict[str, dict] = field(default_factory=dict)
    b_again: openai.types.Batch | None = None
    b_again_lines: dict[str, dict] = field(default_factory=dict)
    b_endpoint: str = ""
    receivers: dict[str, Receiver] = field(default_factory=dict)

    def b_got_nothing_of_a(self, since: int = 0) -> None:
        """No response B got (from the `since`th on) holds any of A's secrets."""
        for body in self.recorder.seen[since:]:
            for name, secret in self.a_secrets.items():
                assert secret.encode() not in body, f"A's {name} ({secret!r}) reached B: {body[:600]!r}"


def lines_of(client: OpenAI, file_id: str | None) -> dict[str, dict]:
    if file_id is None:
        return {}
    return {x["custom_id"]: x for x in map(json.loads, client.files.content(file_id).text.splitlines())}


def run(client: OpenAI, path: Path, lines: list[dict], **create) -> openai.types.Batch:
    batch = client.batches.create(input_file_id=upload(client, path, lines), endpoint=CHAT, completion_window="24h",
                                  **create)
    return wait_for(client, batch.id, {"completed", "failed", "cancelled", "expired"}, timeout_s=240)


def deliver(service: Service) -> None:
    """The webhook sensor's ticks, as the daemon's (the owners' own endpoints only, on loopback by the allow list)."""
    config = WebhookConfig(urls=[], secret="", timeout_s=5.0, max_attempts=3, first_backoff_s=0, allow=["127.0.0.1"])
    context = dg_context(service, config)
    for _ in range(2):
        webhook_sensor(context)


def dg_context(service: Service, config: WebhookConfig):
    import dagster as dg

    return dg.build_sensor_context(instance=service.instance, resources={
        "database": DatabaseResource(url=service.config.database_url), "webhooks": config})


def sdk(service: Service, key: str, recorder: Recorder | None = None) -> OpenAI:
    hooks = {"response": [recorder]} if recorder else {}
    return OpenAI(base_url=f"{service.url}/v1", api_key=key, max_retries=0, timeout=60,
                  http_client=DefaultHttpxClient(verify=tls(), event_hooks=hooks))


@pytest.fixture(scope="module")
def world(postgres_server, vllm_server, tmp_path_factory) -> Iterator[World]:
    """A's batch, endpoint and estimate, then B's two batches asking A's very request, on one service whose store is
    a new database of the session's PostgreSQL and whose engine is the session's vLLM server."""
    tmp = tmp_path_factory.mktemp("cross-tenant")
    with pytest.MonkeyPatch.context() as env:
        env.setenv("BATCH_TEST_DATABASE_URL", new_database(postgres_server))
        env.setenv("BATCH_MODEL_CACHE", str(MODEL_CACHE))  # the API's count worker: the models prepared once
        with serving(tmp, env) as start:
            service = start(api_keys=(f"{NAME_A}:{KEY_A}", f"{NAME_B}:{KEY_B}"), shard_size=4,
                            vllm=real_vllm(mode="server", server_urls=[vllm_server]), webhook_allow=("127.0.0.1",))
            recorder = Recorder()
            b_http = httpx.Client(base_url=service.url, headers={"Authorization": f"Bearer {KEY_B}"}, timeout=60,
                                  verify=tls(), event_hooks={"response": [recorder]})
            world = World(service, tmp, sdk(service, KEY_A), sdk(service, KEY_B, recorder), b_http, recorder)
            try:
                build(world)
                yield world
            finally:
                b_http.close()
                for r in world.receivers.values():
                    r.close()


def build(w: World) -> None:
    a, b, secrets = w.a, w.b, w.a_secrets
    # A's batch: the long deterministic request (B will ask it too, word for word), a private question, and a line
    # too long for the model (its error file's line).
    private = f"What does the private codeword {uuid.uuid4().hex} of alice mean?"
    a_rows = [chat_request(f"a-long-{RUN}", LONG, **SHARED),
              chat_request(f"a-private-{RUN}", private, **SHARED),
              chat_request(f"a-too-long-{RUN}", "word " * 2500 + f"alice-tail-{RUN}", max_tokens=16)]
    w.receivers["a"], w.receivers["b"] = Receiver(), Receiver()
    endpoint_a = a.webhooks.create(name="alice", url=w.receivers["a"].url, event_types=ALL_TYPES)
    w.b_endpoint = b.webhooks.create(name="bob", url=w.receivers["b"].url, event_types=ALL_TYPES).id
    w.a_batch = run(a, w.tmp / "a.jsonl", a_rows, metadata={"project": f"alice-project-{RUN}"},
                    extra_body={"reuse": True})
    assert w.a_batch.status == "completed", w.a_batch
    assert w.a_batch.output_file_id and w.a_batch.error_file_id, w.a_batch
    w.a_lines = lines_of(a, w.a_batch.output_file_id) | lines_of(a, w.a_batch.error_file_id)
    assert set(w.a_lines) == {r["custom_id"] for r in a_rows}
    # A's own estimate of its file (the count kept by file, on the estimate lane).
    estimate = a.post("/batches/estimate", cast_to=object, body={"input_file_id": w.a_batch.input_file_id,
                                                                "endpoint": CHAT, "completion_window": "24h"})
    assert estimate["total_requests"] == 3 and estimate["input_tokens"] > 600, estimate  # type: ignore[index]

    secrets.update({
        "key": KEY_A, "key name": NAME_A, "owner": hashlib.sha256(KEY_A.encode()).hexdigest(),
        "input file": w.a_batch.input_file_id, "output file": w.a_batch.output_file_id,
        "error file": w.a_batch.error_file_id, "batch": w.a_batch.id, "metadata": f"alice-project-{RUN}",
        "private prompt": private, "long line's custom_id": f"a-long-{RUN}", "tail of the too-long prompt":
        f"alice-tail-{RUN}", "webhook endpoint": endpoint_a.id, "webhook url": w.receivers["a"].url,
        "webhook secret": endpoint_a.signing_secret.removeprefix("whsec_"),
    })
    for cid, line in w.a_lines.items():
        secrets[f"custom_id {cid}"] = cid
        body = (line.get("response") or {}).get("body") or {}
        if body.get("id"):
            secrets[f"answer id of {cid}"] = body["id"]

    # B sends A's long prompt in a request of its own (not A's body: the answer store has nothing to say), then, in
    # its second batch, A's long request word for word (another custom_id: the store keys the body) asking reuse,
    # beside its own first request again (reused: B's own answer) and one more of the same prompt (its prefix
    # cached: B's own).
    w.b_first = run(b, w.tmp / "b1.jsonl", [chat_request("b-prefix", LONG, temperature=0, max_tokens=3)],
                    extra_body={"reuse": True})
    w.b_first_lines = lines_of(b, w.b_first.output_file_id)
    w.b_again = run(b, w.tmp / "b2.jsonl", [chat_request("b-long", LONG, **SHARED),
                                            chat_request("b-prefix", LONG, temperature=0, max_tokens=3),
                                            chat_request("b-long-5", LONG, temperature=0, max_tokens=5)],
                    extra_body={"reuse": True})
    w.b_again_lines = lines_of(b, w.b_again.output_file_id)
    deliver(w.service)


@pytest.mark.engine
def test_an_answer_a_computed_is_computed_again_for_b(world):
    """The answer store is A's: B asking A's exact deterministic request with `reuse` gets it computed and billed,
    with an id and a time of its own; B's own earlier request, asked again beside it, is reused (so the store would
    have said so)."""
    a_body = world.a_lines[f"a-long-{RUN}"]["response"]["body"]
    assert world.b_again.status == "completed", world.b_again
    line = world.b_again_lines["b-long"]
    assert not line.get("reused"), line
    body = line["response"]["body"]
    assert body["usage"]["prompt_tokens"] > 600 and body["usage"]["completion_tokens"] > 0
    assert body["id"] != a_body["id"]
    assert body["created"] >= world.b_again.created_at > a_body["created"]
    # The control: B's own answer, asked again, is reused and costs nothing; the other two lines ran, billed.
    own = world.b_again_lines["b-prefix"]
    assert own.get("reused") is True, own
    assert own["response"]["body"]["id"] != world.b_first_lines["b-prefix"]["response"]["body"]["id"]
    ran = [world.b_again_lines[c]["response"]["body"]["usage"]["total_tokens"] for c in ("b-long", "b-long-5")]
    assert world.b_again.usage.total_tokens == sum(ran)
    world.b_got_nothing_of_a()


@pytest.mark.engine
def test_as_prompt_prefix_is_no_cache_hit_for_b(world):
    """The prefix cache is kept per owner: B's first sending of the prompt A sent just before reports no cached
    tokens (nor their lower price); B's next one, a prefix of its own, does."""
    first = world.b_first_lines["b-prefix"]["response"]["body"]["usage"]
    assert first["prompt_tokens"] > 600 and first["prompt_tokens_details"]["cached_tokens"] == 0, first
    own = world.b_again_lines["b-long-5"]["response"]["body"]["usage"]
    assert own["prompt_tokens"] == first["prompt_tokens"] and own["prompt_tokens_details"]["cached_tokens"] > 500, own


def not_found_table(ids: dict[str, str]) -> list[tuple[str, str, dict | None]]:
    """Every route that takes an object's id, with `ids`' objects."""
    create = {"input_file_id": ids["input"], "endpoint": CHAT, "completion_window": "24h"}
    return [
        ("GET", f"/v1/files/{ids['output']}", None),
        ("GET", f"/v1/files/{ids['output']}/content", None),
        ("GET", f"/v1/files/{ids['output']}/content?merged=true", None),
        ("GET", f"/v1/files/{ids['error']}", None),
        ("GET", f"/v1/files/{ids['error']}/content", None),
        ("GET", f"/v1/files/{ids['input']}/content", None),
        ("GET", f"/v1/files?after={ids['input']}", None),
        ("GET", f"/v1/files?after={ids['output']}&purpose=batch_output", None),
        ("GET", f"/v1/files?after={ids['output']}&order=asc", None),
        ("POST", "/v1/batches", create),
        ("POST", "/v1/batches/estimate", create),
        ("GET", f"/v1/batches/{ids['batch']}", None),
        ("GET", f"/v1/batches/{ids['batch']}/partial_output", None),
        ("POST", f"/v1/batches/{ids['batch']}/cancel", None),
        ("POST", f"/v1/batches/{ids['batch']}/retry", None),
        ("POST", f"/v1/batches/{ids['batch']}/retry", {"only": ["invalid_structured"]}),
        ("GET", f"/v1/batches?after={ids['batch']}", None),
        ("GET", f"/v1/batches?after={ids['batch']}&status=completed&limit=5", None),
        ("GET", f"/v1/webhook_endpoints/{ids['endpoint']}", None),
        ("GET", f"/v1/webhook_endpoints?after={ids['endpoint']}", None),
        ("DELETE", f"/v1/webhook_endpoints/{ids['endpoint']}", None),
        ("DELETE", f"/v1/files/{ids['output']}", None),
        ("DELETE", f"/v1/files/{ids['error']}", None),
        ("DELETE", f"/v1/files/{ids['input']}", None),
        ("GET", f"/v1/keys/{ids['key name']}", None),  # the admin's routes: a 403 whatever the name
        ("POST", f"/v1/keys/{ids['key name']}/revoke", None),
        ("POST", f"/v1/keys/{ids['key name']}/rotate", None),
    ]


@pytest.mark.engine
def test_bs_404_for_as_object_is_the_404_for_none(world):
    """Each of A's ids, on every route that takes one, answers B exactly as an id that never existed does (status,
    headers but the date and length, body with the id masked): no existence oracle, and none of A's objects changes."""
    s = world.a_secrets
    theirs = {"input": s["input file"], "output": s["output file"], "error": s["error file"], "batch": s["batch"],
              "endpoint": s["webhook endpoint"], "key name": s["key name"]}
    absent = {"key name": f"carol-{RUN}", "input": f"file-{uuid.uuid4().hex}", "output": f"file-{uuid.uuid4().hex}",
              "error": f"file-{uuid.uuid4().hex}", "batch": f"batch_{uuid.uuid4().hex}",
              "endpoint": f"we_{uuid.uuid4().hex}"}

    def answers(ids: dict[str, str]) -> list[tuple[int, str, str]]:
        out = []
        # Not recorded: these answers name the id B sent (A's, here), masked below, and are checked masked.
        with httpx.Client(base_url=world.service.url, headers={"Authorization": f"Bearer {KEY_B}"}, timeout=60,
                          verify=tls()) as http:
            for method, url, body in not_found_table(ids):
                response = http.request(method, url, json=body)
                headers = {k: v for k, v in response.headers.items() if k not in ("date", "content-length")}
                text = f"{method} {url} {headers} {response.text}"
                for name, object_id in ids.items():
                    text = text.replace(object_id, f"<{name}>")
                out.append((response.status_code, response.json()["error"]["code"], text))
        return out

    foreign, never = answers(theirs), answers(absent)
    assert [status for status, _, _ in foreign] == [404] * (len(foreign) - 3) + [403] * 3, foreign
    assert foreign == never
    for _, _, text in foreign:
        for name, secret in s.items():
            assert secret not in text, f"A's {name} reached B: {text}"
    # B's requests changed nothing of A's: every object is there as it was.
    a = world.a
    assert a.batches.retrieve(s["batch"]).status == "completed"
    assert len(lines_of(a, s["output file"])) == 2 and len(lines_of(a, s["error file"])) == 1
    assert a.files.retrieve(s["input file"]).id == s["input file"]
    assert a.webhooks.retrieve(s["webhook endpoint"]).url == s["webhook url"]
    assert world.a.files.list(limit=1).data  # A's key still works: not revoked, not rotated
    assert world.b_http.get("/v1/keys").status_code == 403


@pytest.mark.engine
def test_bs_lists_and_filters_show_bs_own_only(world):
    """Every list B can ask, every filter and every page of it, names B's own objects only, and A's metadata value
    as a filter finds nothing."""
    b = world.b
    own_batches = {world.b_first.id, world.b_again.id}
    own_files = {f for batch in (world.b_first, world.b_again)
                 for f in (batch.input_file_id, batch.output_file_id, batch.error_file_id) if f}
    assert [x.id for x in b.batches.list(limit=1)] and {x.id for x in b.batches.list(limit=1)} == own_batches
    assert {x.id for x in b.batches.list(limit=100)} == own_batches
    for query in ({"status": "completed"}, {"created_after": 0}, {"created_before": int(time.time()) + 10},
                  {"metadata[project]": world.a_secrets["metadata"]}, {"status": "failed"}):
        listed = world.b_http.get("/v1/batches", params=query).json()
        assert {x["id"] for x in listed["data"]} <= own_batches, (query, listed)
        if "metadata[project]" in query or query.get("status") == "failed":
            assert listed["data"] == [] and listed["has_more"] is False
    assert {f.id for f in b.files.list(limit=1)} == own_files  # the SDK pages through with `after`
    for purpose in ("batch", "batch_output"):
        assert {f.id for f in b.files.list(purpose=purpose)} <= own_files
    assert [e.id for e in b.webhooks.list()] == [world.b_endpoint]
    # The control: A's lists do name A's objects.
    assert world.a_secrets["batch"] in {x.id for x in world.a.batches.list()}
    world.b_got_nothing_of_a()


@pytest.mark.engine
def test_webhook_events_reach_their_owners_endpoint_only(world):
    """Each key's endpoint gets its own batches' events, signed with its own secret; none of A's reaches B's."""
    def batches(receiver: Receiver) -> set[str]:
        return {e["data"]["id"] for e in receiver.events()}

    assert batches(world.receivers["a"]) == {world.a_secrets["batch"]}
    assert batches(world.receivers["b"]) == {world.b_first.id, world.b_again.id}
    for headers, body, _ in world.receivers["b"].posts:
        posted = (json.dumps(headers) + body.decode()).encode()
        for name, secret in world.a_secrets.items():
            assert secret.encode() not in posted, f"A's {name} reached B's endpoint"


@pytest.mark.engine
def test_metrics_are_not_on_the_tenant_listener(world):
    """The metrics name every key: the tenants' listener serves none of them, to B's key or to no key; the
    operator's listener (the control) does name both keys."""
    since = len(world.recorder.seen)
    for path in ("/metrics", "/metrics/", "/v1/metrics", "/metrics?name[]=batch_dagster_batches_total"):
        assert world.b_http.get(path).status_code == 404, path
        with httpx.Client(base_url=world.service.url, timeout=10, verify=tls(),
                          event_hooks={"response": [world.recorder]}) as anonymous:
            assert anonymous.get(path).status_code in (401, 404), path
    world.b_got_nothing_of_a(since)
    scraped = httpx.get(world.service.metrics_url, timeout=30).text
    assert f'key="{NAME_A}"' in scraped and f'key="{NAME_B}"' in scraped


@pytest.mark.engine
def test_bs_usage_is_bs_own(world):
    """B's batches bill B's lines only: the usage of each is the sum of its own output lines' (the reused line at
    zero), never anything of A's batch, which ran the same request first."""
    for batch, lines in ((world.b_first, world.b_first_lines), (world.b_again, world.b_again_lines)):
        billed = [x["response"]["body"]["usage"] for x in lines.values() if not x.get("reused")]
        assert batch.usage.input_tokens == sum(u["prompt_tokens"] for u in billed)
        assert batch.usage.output_tokens == sum(u["completion_tokens"] for u in billed)
    a_usage = world.a.batches.retrieve(world.a_secrets["batch"]).usage
    assert a_usage.input_tokens > world.b_first.usage.input_tokens > 0  # A's two answered lines, B's one
    world.b_got_nothing_of_a()


@pytest.mark.engine
def test_as_estimates_never_hold_bs(world):
    """A's flood of estimates (each a file to count) fills A's turn on the estimate lane, never B's: B's estimate is
    answered while A's still wait, and A's past its bound are A's 429s, not B's."""
    a_files = [upload(world.a, world.tmp / f"a-est-{i}.jsonl", [chat_request(f"a{i}-{j}", f"question {j} about item {j * 7}") for j in range(1500)]) for i in range(4)]
    b_file = upload(world.b, world.tmp / "b-est.jsonl", rows(3, prefix="b"))
    done: dict[str, float] = {}
    statuses: dict[str, int] = {}

    def estimate(client: OpenAI | None, http: httpx.Client | None, name: str, file_id: str) -> None:
        body = {"input_file_id": file_id, "endpoint": CHAT, "completion_window": "24h"}
        if http is None:
            with httpx.Client(base_url=world.service.url, headers={"Authorization": f"Bearer {KEY_A}"}, timeout=300,
                              verify=tls()) as own:
                statuses[name] = own.post("/v1/batches/estimate", json=body).status_code
        else:
            statuses[name] = http.post("/v1/batches/estimate", json=body).status_code
        done[name] = time.monotonic()

    threads = [threading.Thread(target=estimate, args=(None, None, f"a{i}", f)) for i, f in enumerate(a_files)]
    for t in threads:
        t.start()
    time.sleep(0.5)  # A's four are in the lane: one counting, three waiting for A's turn
    estimate(None, world.b_http, "b", b_file)
    for t in threads:
        t.join(300)
    assert statuses["b"] == 200 and all(statuses[f"a{i}"] == 200 for i in range(4)), statuses
    assert done["b"] < max(done[f"a{i}"] for i in range(4)), done  # B did not wait behind A's queue
    world.b_got_nothing_of_a()


def test_as_limits_never_reduce_bs_room(postgres_server, tmp_path):
    """A at each of its limits (batches in flight, one of them being cancelled; uploads at once; stored bytes)
    leaves B the whole of its own: B gets as much as A got, to the batch and the upload, then the same 429s, with
    nothing of A's in them."""
    import socket

    with pytest.MonkeyPatch.context() as env:
        env.setenv("BATCH_TEST_DATABASE_URL", new_database(postgres_server))
        with serving(tmp_path, env) as start:
            service = start(api_keys=(f"{NAME_A}:{KEY_A}", f"{NAME_B}:{KEY_B}"), worker=False,
                            key_max_active_batches=2, key_max_stored_bytes=40_000, key_max_uploads=1,
                            webhook_allow=("127.0.0.1",))
            recorder = Recorder()
            keys = {"a": KEY_A, "b": KEY_B}
            clients = {"a": sdk(service, KEY_A), "b": sdk(service, KEY_B, recorder)}
            a_batches: list[str] = []

            def refused(call) -> str:
                with pytest.raises(openai.RateLimitError) as caught:
                    call()
                return caught.value.body["code"]  # type: ignore[index]

            def new_file(who: str) -> str:
                while True:  # a closed upload's slot comes back once the server has seen it go
                    try:
                        return upload(clients[who], tmp_path / f"{who}.jsonl", rows(20))
                    except openai.RateLimitError as e:
                        if e.body["code"] != "too_many_uploads":  # type: ignore[index]
                            raise
                        time.sleep(0.05)

            def create(who: str, file_id: str):
                return clients[who].batches.create(input_file_id=file_id, endpoint=CHAT, completion_window="24h")

            codes: dict[str, list[str]] = {"a": [], "b": []}
            first = {who: new_file(who) for who in "ab"}
            for who in "ab":  # A first: A's two batches in flight, then B's two
                made = [create(who, first[who]) for _ in range(2)]
                clients[who].batches.cancel(made[0].id)  # being cancelled: still in flight (no worker ends it)
                a_batches += [m.id for m in made] if who == "a" else []
                codes[who].append(refused(lambda who=who: create(who, first[who])))
            held = []
            try:
                for who in "ab":  # A's upload held open while B uploads, then B's beside it
                    head, _ = upload_head(service, 1000, key=keys[who], expect=True)
                    sock = socket.create_connection(("127.0.0.1", port_of(service)), timeout=5)
                    held.append(sock)
                    sock.sendall(head)
                    assert sock.recv(100).startswith(b"HTTP/1.1 100 Continue"), who
                    codes[who].append(refused(lambda who=who: upload(clients[who], tmp_path / "x.jsonl", rows(1))))
            finally:
                for sock in held:
                    sock.close()
            uploads = {"a": 0, "b": 0}
            for who in "ab":  # A's stored bytes up to its limit, then B's
                while True:
                    try:
                        new_file(who)
                        uploads[who] += 1
                    except openai.RateLimitError as e:
                        codes[who].append(e.body["code"])  # type: ignore[index]
                        break
            endpoints = {"a": [], "b": []}
            for who in "ab":  # A's webhook endpoints up to the most a key may have, then B's
                while True:
                    try:
                        endpoints[who].append(clients[who].webhooks.create(
                            name=who, url=f"http://127.0.0.1:9/{who}-{len(endpoints[who])}",
                            event_types=["batch.completed"]).id)
                    except openai.BadRequestError as e:
                        codes[who].append(e.body["code"])  # type: ignore[index]
                        break
            assert codes["a"] == codes["b"] == ["batch_limit_exceeded", "too_many_uploads", "storage_limit_exceeded",
                                                "too_many_webhook_endpoints"]
            assert len(endpoints["a"]) == len(endpoints["b"]) > 1, endpoints
            assert uploads["a"] == uploads["b"] > 3, uploads
            a_files = {f.id for f in clients["a"].files.list()}
            assert len(a_files) == uploads["a"] + 1 and not a_files & {f.id for f in clients["b"].files.list()}
            secrets = {"key": KEY_A, "key name": NAME_A, "owner": hashlib.sha256(KEY_A.encode()).hexdigest(),
                       **{f"file {f}": f for f in a_files}, **{f"batch {x}": x for x in a_batches},
                       **{f"endpoint {x}": x for x in endpoints["a"]}}
            assert len(recorder.seen) > 10
            for body in recorder.seen:
                for name, secret in secrets.items():
                    assert secret.encode() not in body, f"A's {name} reached B: {body[:400]!r}"
            for client in clients.values():
                client.close()


@pytest.mark.engine
def test_no_response_b_got_held_anything_of_as(world):
    """The whole of what B read in this module, once more: none of A's secrets, in any byte."""
    assert len(world.recorder.seen) > 50
    world.b_got_nothing_of_a()
