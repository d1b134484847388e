"""API keys managed in the store (issue 31): admin keys create, list, limit, rotate and revoke keys through /v1/keys
(403 for any other key); a revoked or rotated key is refused on its very next request, no restart; a key's own
limits hold over the deployment's; the store keeps no key, only its hash; BATCH_API_KEYS seeds the store, a key
that leaves it is refused once the API starts again, and none revoked or rotated ever comes back."""

from __future__ import annotations

import re

import openai
import pytest
from sqlalchemy import select, text

from batch_dagster.cli import main as cli
from batch_dagster.db import Database, keys, repo
from batch_dagster.db.models import ApiKey, FileRecord
from tests.helpers import KEY_A, KEY_B, rows, upload, wait_for

CHAT = "/v1/chat/completions"


def admin_key(service) -> str:
    with Database(service.config.database_url).session() as session:
        return keys.create(session, "ops", admin=True)[1]


def test_an_admin_manages_keys_and_a_normal_key_gets_a_403(start_service, tmp_path):
    service = start_service(worker=False)
    admin = service.http(admin_key(service))
    refused = service.http(KEY_A).post("/v1/keys", json={"name": "mallory", "admin": True})
    assert refused.status_code == 403 and refused.json()["error"]["code"] == "admin_key_required"
    assert service.http(KEY_A).get("/v1/keys").status_code == 403

    made = admin.post("/v1/keys", json={"name": "carol", "limits": {"max_active_batches": 1}}).json()
    assert made["key"].startswith(keys.PREFIX) and made["limits"]["max_active_batches"] == 1
    carol = service.client(made["key"])
    file_id = upload(carol, tmp_path / "c.jsonl", rows(2))
    carol.batches.create(input_file_id=file_id, endpoint=CHAT, completion_window="24h")
    with pytest.raises(openai.RateLimitError):  # her own limit, not the deployment's 100
        carol.batches.create(input_file_id=file_id, endpoint=CHAT, completion_window="24h")
    assert admin.post("/v1/keys/carol", json={"limits": {"max_active_batches": 0}}).json()["limits"] == {
        "max_active_batches": 0, "max_stored_bytes": None, "daily_budget": None, "max_priority": None}
    carol.batches.create(input_file_id=file_id, endpoint=CHAT, completion_window="24h")  # 0: no limit, at once

    names = [k["name"] for k in admin.get("/v1/keys").json()["data"]]
    assert {"ops", "carol"} <= set(names) and "key" not in admin.get("/v1/keys/carol").json()
    assert admin.post("/v1/keys", json={"name": "carol"}).status_code == 409
    assert admin.post("/v1/keys", json={"name": "bad name"}).status_code == 400
    # A limit is a number, never a boolean or a string read as one (the OpenAPI document says integer).
    for limits in ({"max_stored_bytes": False}, {"max_active_batches": "3"}, {"daily_budget": True}):
        assert admin.post("/v1/keys", json={"name": "dave", "limits": limits}).status_code == 400, limits
        assert admin.post("/v1/keys/carol", json={"limits": limits}).status_code == 400, limits
    assert admin.post("/v1/keys", json={"name": "dave", "admin": "yes"}).status_code == 400
    assert admin.get("/v1/keys/nobody").status_code == 404

    # Rotated: the old key is refused on its next request; the new one is the same owner, files and all.
    rotated = admin.post("/v1/keys/carol/rotate").json()
    with pytest.raises(openai.AuthenticationError):
        carol.files.list()
    assert [f.id for f in service.client(rotated["key"]).files.list()] == [file_id]
    # Revoked: refused on its next request, and listed as revoked only when asked.
    assert admin.post("/v1/keys/carol/revoke").json()["revoked_at"] is not None
    with pytest.raises(openai.AuthenticationError) as gone:
        service.client(rotated["key"]).files.list()
    assert "revoked" in gone.value.body["message"]
    assert "carol" not in [k["name"] for k in admin.get("/v1/keys").json()["data"]]
    assert "carol" in [k["name"] for k in admin.get("/v1/keys?include_revoked=true").json()["data"]]
    assert admin.post("/v1/keys/carol/rotate").status_code == 409

    # The store holds hashes, never a key.
    with Database(service.config.database_url).session() as session:
        stored = " ".join(str(v) for row in session.execute(text("SELECT * FROM api_keys")) for v in row)
    assert made["key"] not in stored and rotated["key"] not in stored and KEY_A not in stored


def test_env_keys_seed_the_store_and_one_that_leaves_is_refused_after_a_restart(start_service, tmp_path):
    first = start_service(worker=False, api_keys=(f"alice:{KEY_A}", KEY_B))
    file_id = upload(first.client(KEY_B), tmp_path / "b.jsonl", rows(2))
    with Database(first.config.database_url).session() as session:
        names = keys.labels(session)
    assert names[repo.owner_of_key(KEY_A)] == "alice"
    assert re.fullmatch(r"key-[0-9a-f]{12}", names[repo.owner_of_key(KEY_B)])  # a bare key: a random name
    again = start_service(worker=False, api_keys=(f"alice:{KEY_A}",))  # KEY_B left BATCH_API_KEYS
    with pytest.raises(openai.AuthenticationError):
        again.client(KEY_B).files.list()
    assert again.client(KEY_A).files.list().data == []
    # Back in the variable: still revoked (the store says so); its files stay its owner's.
    third = start_service(worker=False, api_keys=(KEY_A, KEY_B))
    with pytest.raises(openai.AuthenticationError):
        third.client(KEY_B).files.list()
    with Database(third.config.database_url).session() as session:
        assert [f.id for f in session.scalars(select(FileRecord).where(
            FileRecord.owner == repo.owner_of_key(KEY_B)))] == [file_id]


def test_a_key_revoked_or_rotated_in_the_store_stays_so_when_the_api_starts_again(start_service):
    """The store is the truth: BATCH_API_KEYS seeds keys it has never seen, and never brings back one that was
    revoked or rotated (with `batch-dagster keys` or /v1/keys), however often the API starts again."""
    env = (f"alice:{KEY_A}", f"bob:{KEY_B}")
    first = start_service(worker=False, api_keys=env)
    with Database(first.config.database_url).session() as session:
        keys.revoke(session, "alice")
        _, rotated = keys.rotate(session, "bob")
    again = start_service(worker=False, api_keys=env)  # the same variable, the next start
    for old in (KEY_A, KEY_B):
        with pytest.raises(openai.AuthenticationError):
            again.client(old).files.list()
    assert again.client(rotated).files.list().data == []
    # The rotated key is the store's now: its old entry leaving the variable revokes nothing.
    third = start_service(worker=False, api_keys=(f"alice:{KEY_A}",))
    assert third.client(rotated).files.list().data == []
    with Database(third.config.database_url).session() as session:
        assert keys.get(session, "bob").revoked_at is None and keys.get(session, "alice").revoked_at is not None


def test_a_rotation_an_earlier_version_undid_is_named_at_start(start_service, caplog):
    """A store an earlier version seeded again after a rotation (the old key live, rotated_at set): the API's log
    names the key to rotate again, and seeding leaves it as it is."""
    first = start_service(worker=False, api_keys=(f"bob:{KEY_B}",))
    with Database(first.config.database_url).session() as session:
        keys.rotate(session, "bob")
        row = keys.get(session, "bob")
        row.key_hash = row.owner  # what the earlier seeding wrote
        session.commit()
        assert keys.brought_back(session) == ["bob"]
    again = start_service(worker=False, api_keys=(f"bob:{KEY_B}",))
    assert "rotate it again (`batch-dagster keys rotate bob`)" in caplog.text
    assert again.client(KEY_B).files.list().data == []  # left live: refusing it is the operator's rotation


def test_unsetting_the_variable_leaves_the_store_its_keys(start_service):
    """The way from BATCH_API_KEYS to the store: once the API has started with the variable, its keys are in the
    store; unset, it seeds nothing and revokes nothing, and the keys are managed with `batch-dagster keys` alone."""
    first = start_service(worker=False, api_keys=(f"alice:{KEY_A}", KEY_B))
    assert first.client(KEY_A).files.list().data == []
    moved = start_service(worker=False, api_keys=())
    assert moved.client(KEY_A).files.list().data == [] and moved.client(KEY_B).files.list().data == []
    assert moved.http(None).get("/v1/files").status_code == 401  # keyed: no open API
    with Database(moved.config.database_url).session() as session:
        keys.revoke(session, "alice")
    with pytest.raises(openai.AuthenticationError):
        moved.client(KEY_A).files.list()


def test_a_store_that_had_keys_never_opens_up_again(start_service):
    """No BATCH_API_KEYS and no key in the store: loopback callers need none. Once the store has had a key, every
    request needs a live one, even after the last key is revoked."""
    service = start_service(worker=False, api_keys=())
    assert service.http(None).get("/v1/files").status_code == 200
    made = service.http(None).post("/v1/keys", json={"name": "first", "admin": True}).json()  # loopback: allowed
    assert service.http(None).get("/v1/files").status_code == 401
    admin = service.http(made["key"])
    assert admin.post("/v1/keys/first/revoke").status_code == 200
    assert service.http(None).get("/v1/files").status_code == 401
    assert admin.get("/v1/files").status_code == 401


def test_the_keys_command_manages_the_same_store(start_service, tmp_path, monkeypatch, capsys):
    service = start_service(worker=False)
    monkeypatch.setenv("BATCH_DATABASE_URL", service.config.database_url)
    with pytest.raises(SystemExit) as done:
        cli(["keys", "create", "dave", "--max-stored-bytes", "100"])
    assert done.value.code == 0
    key = capsys.readouterr().out.strip()
    assert service.client(key).files.list().data == []
    with pytest.raises(openai.RateLimitError):  # 100 bytes of files: his own limit
        upload(service.client(key), tmp_path / "d.jsonl", rows(5))
    with pytest.raises(SystemExit):
        cli(["keys", "revoke", "dave"])
    with pytest.raises(openai.AuthenticationError):
        service.client(key).files.list()
    with pytest.raises(SystemExit) as missing:
        cli(["keys", "rotate", "nobody"])
    assert missing.value.code == 1 and "no key is named 'nobody'" in capsys.readouterr().err
    with Database(service.config.database_url).session() as session:
        assert session.scalar(select(ApiKey.created_by).where(ApiKey.name == "dave")) == "cli"



def test_a_keys_own_priority_ceiling_and_daily_budget_hold_over_the_deployments(start_service, tmp_path):
    from batch_dagster.batchfile import contract as c
    from tests.api.test_estimate import estimate

    service = start_service(key_max_priority=10)  # and no deployment budget
    a = service.client(KEY_A)
    file_a = upload(a, tmp_path / "a.jsonl", rows(4, max_tokens=20))
    bound = estimate(a, file_a)["cost"]["max"]
    with Database(service.config.database_url).session() as session:
        _, low = keys.create(session, "low", limits=keys.Limits(max_priority=0, daily_budget=bound / 2))
    client = service.client(low)
    file_id = upload(client, tmp_path / "l.jsonl", rows(4, max_tokens=20))
    with pytest.raises(openai.BadRequestError) as refused:
        client.batches.create(input_file_id=file_id, endpoint=CHAT, completion_window="24h",
                              extra_body={"priority": 5})
    assert refused.value.body["code"] == "priority_not_allowed" and "above 0" in refused.value.body["message"]
    # Its own budget is half what the batch may cost: validation refuses it; KEY_A, with none, runs the same.
    failed = wait_for(client, client.batches.create(input_file_id=file_id, endpoint=CHAT,
                                                    completion_window="24h").id, {"failed", "completed"})
    assert [e.code for e in failed.errors.data] == [c.COST_LIMIT_EXCEEDED]
    done = wait_for(a, a.batches.create(input_file_id=file_a, endpoint=CHAT, completion_window="24h",
                                        extra_body={"priority": 5}).id, {"failed", "completed"})
    assert done.status == "completed"


def test_the_ui_names_a_keys_owner_as_the_store_does_and_drops_follow_a_rotated_intake_key(tmp_path):
    from batch_dagster.defs.resources import DatabaseResource

    url = f"sqlite:///{tmp_path / 'store.db'}"
    store = Database(url)
    store.upgrade()
    with store.session() as session:
        row, first = keys.create(session, "erin")
        _, rotated = keys.rotate(session, "erin")
    store.dispose()
    database = DatabaseResource(url=url)
    assert database.labels().label(row.owner) == "erin"  # the metrics' name, not a hash
    assert DatabaseResource(url=url, intake_api_key=rotated).intake_owner() == row.owner  # her rows, her new key
    assert database.intake_owner() == ""  # the store has keys and none was chosen for drops: none taken
    assert "BATCH_INTAKE_API_KEY" in (database.no_intake_owner() or "")


def test_a_limit_given_as_a_boolean_is_refused_not_read_as_zero(start_service):
    """JSON `false` is not a number: read as 0 it would mean "no limit". (The OpenAPI conformance test's negative data
    found it.)"""
    service = start_service(worker=False)
    admin = service.http(admin_key(service))
    for name in ("max_active_batches", "max_stored_bytes", "max_priority"):
        refused = admin.post("/v1/keys", json={"name": f"k-{name}", "limits": {name: False}})
        assert refused.status_code == 400 and name in refused.json()["error"]["param"], refused.json()
