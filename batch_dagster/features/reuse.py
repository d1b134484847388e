"""Answers kept for reuse: a deterministic request asked again of the same model, by the same owner, gets the answer
it got before, as if answered now.

An answer is found by a content hash of its scope (its owner's, or the one the operator's shared owners share:
features/scope.py), the model's identity (its name, its weights' revision, the dtype and the engine settings that
change numerics) and the request's body (its images by their content's hash). Only deterministic requests are kept (an
embedding, or temperature 0, or a seed). The store lives in the batch storage beside the batch folders, bounded in
bytes: the answers written first go first.

    answers/entries/<kk>/<key>.json                 one answer: its response body
    answers/ledger/<written_ns>-<bytes>-<id>.json   the keys one commit wrote (eviction reads its bytes from the name)
"""

from __future__ import annotations

import hashlib
import re
import time
import uuid
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import orjson

from batch_dagster.batchfile import contract as c
from batch_dagster.batchfile.folder import ANSWERS
from batch_dagster.batchfile.storage import Storage
from batch_dagster.features.shards import Line, Request, Run, Shard, ShardFeature

# Engine arguments that change the numbers a model computes (beside its dtype); the others (cache sizes,
# parallelism) change only how fast.
NUMERIC_ENGINE_ARGS = ("quantization", "kv_cache_dtype", "revision", "tokenizer_revision", "hf_overrides")
DEFAULT_MAX_BYTES = 1 << 30
_READERS = 16  # answers looked up at once (an object store answers each in its own round trip)


def deterministic(endpoint: str, body: Mapping[str, Any]) -> bool:
    """Whether a request always gets the same answer: an embedding, or sampling at temperature 0, or seeded."""
    return endpoint == c.EMBEDDINGS or body.get("temperature") == 0 or body.get("seed") is not None


def model_identity(record: Mapping[str, Any]) -> dict[str, Any]:
    """What of a batch's engine record (its model, revision, dtype and settings) decides the answers' numbers."""
    args = (record.get("engine_settings") or {}).get("engine_args") or {}
    return {"model": record.get("model"), "revision": record.get("revision"), "dtype": record.get("dtype"),
            **{k: args[k] for k in NUMERIC_ENGINE_ARGS if k in args}}


def answer_key(scope: str, identity: Mapping[str, Any], endpoint: str, body: Mapping[str, Any]) -> str | None:
    """The content hash an answer is kept under, within `scope`; None for a request that is not deterministic."""
    if not deterministic(endpoint, body):
        return None
    data = orjson.dumps({"scope": scope, "identity": identity, "endpoint": endpoint, "body": body},
                        option=orjson.OPT_SORT_KEYS | orjson.OPT_NON_STR_KEYS)
    return hashlib.sha256(data).hexdigest()


_ID_HEAD = re.compile(r"^(.*[-_])")  # what an id keeps of itself renewed: up to its last '-' or '_' (`chatcmpl-`)
_TIMES = ("created", "created_at")


def _new_id(old: Any) -> Any:
    if not isinstance(old, str):
        return old
    head = _ID_HEAD.match(old)
    return (head.group(1) if head else "") + uuid.uuid4().hex


def renewed(body: Mapping[str, Any]) -> dict[str, Any]:
    """A kept answer as if answered now: new ids wherever the engine makes random ones (the answer's, its tool
    calls', a response's output items' and their call ids), its creation time now, and no measurements of the call
    that computed it (`metrics`). Nothing in it tells when, or for whom, it was first computed; `system_fingerprint`
    stays, as it names the engine's version and settings, the same for every call."""
    out: dict[str, Any] = orjson.loads(orjson.dumps(body))  # a copy of its own: one kept answer may serve many lines
    now = int(time.time())
    out.pop("metrics", None)
    if "id" in out:
        out["id"] = _new_id(out["id"])
    for name in _TIMES:
        if isinstance(out.get(name), (int, float)):
            out[name] = now
    for choice in out.get("choices") or []:
        message = choice.get("message") if isinstance(choice, dict) else None
        for call in (message.get("tool_calls") or []) if isinstance(message, dict) else []:
            if isinstance(call, dict) and "id" in call:
                call["id"] = _new_id(call["id"])
    output = out.get("output")
    for item in output if isinstance(output, list) else []:
        if isinstance(item, dict):
            for name in ("id", "call_id"):
                if name in item:
                    item[name] = _new_id(item[name])
    return out


def _entry(key: str) -> str:
    return f"{ANSWERS}/entries/{key[:2]}/{key}.json"


LEDGER = f"{ANSWERS}/ledger"


@dataclass(frozen=True)
class Ledger:
    """One commit's list of the answers it wrote, named so that listing the ledgers tells their order and bytes."""

    key: str
    written_ns: int
    bytes: int

    @classmethod
    def parse(cls, key: str) -> Ledger | None:
        parts = key.rsplit("/", 1)[-1].removesuffix(".json").split("-")
        if len(parts) != 3 or not parts[0].isdigit() or not parts[1].isdigit():
            return None
        return cls(key, int(parts[0]), int(parts[1]))


class AnswerStore:
    """The answers of `storage`, at most `max_bytes` of them."""

    def __init__(self, storage: Storage, max_bytes: int = DEFAULT_MAX_BYTES):
        self.storage, self.max_bytes = storage, max_bytes

    def get(self, keys: Iterable[str]) -> dict[str, dict[str, Any]]:
        """The kept answers (response bodies) of those of `keys` that have one."""
        wanted = list(dict.fromkeys(keys))
        if not wanted:
            return {}
        with ThreadPoolExecutor(min(_READERS, len(wanted))) as pool:
            found = pool.map(lambda k: self.storage.read_bytes(_entry(k)), wanted)
            return {k: orjson.loads(data) for k, data in zip(wanted, found, strict=True) if data is not None}

    def put(self, answers: Mapping[str, dict[str, Any]]) -> None:
        """Keep `answers` (response bodies by key), then let the oldest go until the store fits its bound.

        The entries are written before their ledger: an entry a crash left without one is found by a later run
        (and its ledger written then), never counted twice by eviction."""
        if not answers:
            return
        written, total = [], 0
        for key, body in answers.items():
            data = orjson.dumps(body)
            if len(data) > self.max_bytes:  # one answer larger than the store: never kept
                continue
            self.storage.write_bytes(_entry(key), data)
            written.append([key, len(data)])
            total += len(data)
        if written:
            name = f"{time.time_ns()}-{total}-{uuid.uuid4().hex[:12]}.json"
            self.storage.write_bytes(f"{LEDGER}/{name}", orjson.dumps({"entries": written}))
        self.evict()

    def ledgers(self) -> list[Ledger]:
        """The ledgers, oldest first."""
        found = [ledger for key in self.storage.list(LEDGER) if (ledger := Ledger.parse(key)) is not None]
        return sorted(found, key=lambda ledger: (ledger.written_ns, ledger.key))

    def size(self) -> int:
        return sum(ledger.bytes for ledger in self.ledgers())

    def evict(self) -> int:
        """Delete the oldest commits' answers until the store holds at most max_bytes; the bytes freed.

        An answer written again by a later commit is in both ledgers: the older one's eviction deletes it, and the
        later lookup misses it and computes it again, which is safe (and counts its bytes a little high, never low).
        """
        ledgers = self.ledgers()
        total, freed = sum(ledger.bytes for ledger in ledgers), 0
        for ledger in ledgers:
            if total - freed <= self.max_bytes:
                break
            data = self.storage.read_bytes(ledger.key)
            for key, _ in (orjson.loads(data)["entries"] if data else []):
                self.storage.delete(_entry(key))
            self.storage.delete(ledger.key)
            freed += ledger.bytes
        return freed


@dataclass
class Reuse:
    """The answers a shard can take from the store, the requests it runs, and the keys their answers are kept under.
    A deterministic request asked more than once in the shard runs once: its twins take its line."""

    lines: list[dict[str, Any]]  # the reused requests' output lines (marked `reused`)
    to_run: list[tuple[str, dict[str, Any]]]  # the requests the engine still runs, each deterministic one once
    keys: dict[str, str]  # custom_id -> key, for the deterministic requests it runs
    twins: dict[str, str] = field(default_factory=dict)  # custom_id -> that of the same request, which runs

    def twin_lines(self, ran: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
        """The twins' lines, from those of the requests that ran: the same answer or the same error, each under its
        own custom_id and ids, marked `reused` (computed once: an answer is billed once)."""
        by_id = {line.get("custom_id"): line for line in ran}
        lines = []
        for cid, first in self.twins.items():
            line = by_id[first]
            if c.is_success(line):
                lines.append(c.reused_line(cid, renewed(line["response"]["body"])))
                continue
            response = line.get("response")
            lines.append({**line, "id": c.new_id("batch_req_"), "custom_id": cid, c.REUSED: True,
                          "response": None if response is None else {**response, "request_id": c.new_id("req_")}})
        return lines


def look_up(store: AnswerStore, scope: str, identity: Mapping[str, Any], endpoint: str,
            requests: Sequence[tuple[str, dict[str, Any]]]) -> Reuse:
    """Split a shard's requests into those answered from the store (within `scope`), those to run and their twins."""
    keys = {cid: key for cid, body in requests if (key := answer_key(scope, identity, endpoint, body)) is not None}
    found = store.get(keys.values())
    lines = [c.reused_line(cid, renewed(found[keys[cid]])) for cid, _ in requests if keys.get(cid) in found]
    runs: dict[str, str] = {}  # key -> the custom_id that runs it
    to_run, twins = [], {}
    for cid, body in requests:
        key = keys.get(cid)
        if key in found:
            continue
        if key in runs:
            twins[cid] = runs[key]
        else:
            if key is not None:
                runs[key] = cid
            to_run.append((cid, body))
    return Reuse(lines, to_run, {cid: key for key, cid in runs.items()}, twins)


def keep(store: AnswerStore, reuse: Reuse, lines: Iterable[dict[str, Any]]) -> int:
    """Keep the answers of the requests `reuse` ran (the successful ones); how many."""
    answers = {reuse.keys[line["custom_id"]]: line["response"]["body"] for line in lines
               if line.get("custom_id") in reuse.keys and c.is_success(line)}
    store.put(answers)
    return len(answers)


class AnswerReuse(ShardFeature):
    """A shard's deterministic requests answered from the answer store where it holds them (within the batch's
    scope), the same request twice in a shard run once, and the answers run kept for the next batch."""

    def __init__(self, store: AnswerStore, scope: str, identity: Mapping[str, Any], endpoint: str):
        self.store, self.scope, self.identity, self.endpoint = store, scope, identity, endpoint

    def run(self, shard: Shard, requests: list[Request], then: Run) -> list[Line]:
        found = look_up(self.store, self.scope, self.identity, self.endpoint, requests)
        if found.lines:
            shard.progress(len(found.lines))
        lines = then(found.to_run)
        keep(self.store, found, lines)  # before the commit: a retry finds them even if this process dies now
        twins = found.twin_lines(lines)  # the same request again in the shard: the same answer
        if twins:
            shard.progress(len(twins))
        return lines + found.lines + twins
