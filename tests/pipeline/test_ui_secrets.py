"""No secret is readable in the Dagster UI or in run tags (issue #18): the resources' credentials are `dg.EnvVar`s,
so the UI's resources page names the variables; owners show as the key's name or a keyed hash, never a prefix of
the key's plain SHA-256 (which anyone reading the UI could test guesses of the key against)."""

from __future__ import annotations

import hashlib

import dagster as dg
from dagster._core.remote_representation.external_data import RepositorySnap  # what the UI is sent (Dagster 1.13)

from batch_dagster.db import repo
from batch_dagster.definitions import defs as project_defs
from batch_dagster.defs.run_tags import OwnerLabels, run_tags
from batch_dagster.settings import split_key

PASSWORD, VLLM_KEY, KEY_ALICE, KEY_BARE = "pg-Pa55word", "vk-engine-secret", "sk-alice-secret", "sk-bare-secret"
SECRETS = {
    "BATCH_DATABASE_URL": f"postgresql+psycopg://batch:{PASSWORD}@db.internal/batch",
    "BATCH_VLLM_API_KEY": VLLM_KEY,
    "BATCH_API_KEYS": f"alice:{KEY_ALICE},{KEY_BARE}",
    "BATCH_INTAKE_API_KEY": KEY_BARE,
    "BATCH_WEBHOOK_SECRET": "whsec_" + "B" * 24,
}


def hash_prefixes(key: str) -> list[str]:
    digest = hashlib.sha256(key.encode()).hexdigest()
    return [digest[:8], digest[-8:]]


def test_the_ui_is_sent_the_variables_names_not_the_secrets(empty_env, monkeypatch):
    for name, value in SECRETS.items():
        monkeypatch.setenv(name, value)
    # The project's definitions (batch_dagster/defs/definitions.py), built in this environment.
    defs = project_defs()
    snap = RepositorySnap.from_def(defs.get_repository_def())
    shown = dg.serialize_value(snap)
    for secret in (PASSWORD, VLLM_KEY, KEY_ALICE, KEY_BARE, SECRETS["BATCH_WEBHOOK_SECRET"],
                   *hash_prefixes(KEY_ALICE), *hash_prefixes(KEY_BARE)):
        assert secret not in shown, secret
    configured = {(r.name, field): value for r in snap.resources or [] for field, value in r.configured_values.items()}
    env = {key: value.name for key, value in configured.items() if not isinstance(value, str)}
    assert [key for key, name in env.items() if name == "BATCH_DATABASE_URL"] == [("database", "url")]  # one holder
    assert (env[("vllm", "server_api_key")], env[("database", "api_keys")], env[("database", "intake_api_key")]) == (
        "BATCH_VLLM_API_KEY", "BATCH_API_KEYS", "BATCH_INTAKE_API_KEY")


def test_an_owner_shows_as_its_keys_name_else_a_keyed_hash():
    entries = [split_key(e) for e in (f"alice:{KEY_ALICE}", KEY_BARE)]
    labels = OwnerLabels.of(entries)
    alice, bare = repo.owner_of_key(KEY_ALICE), repo.owner_of_key(KEY_BARE)
    assert labels.label(alice) == "alice" and labels.label(repo.ANONYMOUS) == repo.ANONYMOUS
    shown = labels.label(bare)
    assert shown.startswith("key-") and len(shown) == 16 and shown[4:] not in bare  # no part of the plain hash
    assert labels.label(bare) == OwnerLabels.of(list(reversed(entries))).label(bare)  # stable across processes
    # Keyed by the server's keys: someone holding one key cannot compute another's label from its hash.
    assert OwnerLabels.of([(None, KEY_BARE)]).label(bare) != shown
    tags = run_tags("batch_x", way_in="api", filename="in.jsonl", owner=bare, model=None, labels=labels,
                    vllm=type("Queue", (), {"queue_tags": lambda self, model: {}})())
    assert tags["owner"] == shown and not any(p in str(tags) for p in hash_prefixes(KEY_BARE))
