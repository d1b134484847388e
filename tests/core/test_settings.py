"""One default per setting: the docs' text, Settings, the resources, the API, the CLI and serve all agree."""

from __future__ import annotations

import argparse
import dataclasses
import re
from pathlib import Path

import pytest

from batch_dagster import settings
from batch_dagster.cli import build_parser
from batch_dagster.defs.resources import Intake, PipelineConfig, StorageResource, VLLMResource
from batch_dagster.defs.resources.from_env import resources_from_env
from batch_dagster.defs.resources.webhooks import WebhookConfig
from batch_dagster.engine.server import ServerEngine
from batch_dagster.serve.fleet import POLICIES
from tests.helpers import REPO

PACKAGE = REPO / "batch_dagster"


@pytest.fixture
def empty_env(monkeypatch) -> settings.Settings:
    """The settings of an empty environment, read in the repository (where the docs' relative paths start)."""
    for variable in settings.VARIABLES:
        monkeypatch.delenv(variable.name, raising=False)
    monkeypatch.chdir(REPO)
    return settings.Settings.from_env()


def _same(value):
    return value.resolve() if isinstance(value, Path) else value


def test_every_variable_is_one_settings_field_and_every_field_one_variable():
    fields = [f.name for f in dataclasses.fields(settings.Settings)]
    assert sorted(v.field for v in settings.VARIABLES) == sorted(fields)


def test_every_documented_default_reads_as_the_settings_value(empty_env, monkeypatch):
    """Setting a variable to the default the docs show changes nothing: the docs' text is the default."""
    values = {v.name: getattr(empty_env, v.field) for v in settings.VARIABLES}
    for variable in settings.VARIABLES:
        text = variable.text()
        if variable.derive is not None and text.startswith("the "):  # described, not spelled: derived in read()
            continue
        if not text:  # unset: set to "" is unset too
            continue
        monkeypatch.setenv(variable.name, re.sub(r"\$(BATCH_\w+)", lambda m: str(values[m[1]]), text))
        got = getattr(settings.Settings.from_env(), variable.field)
        assert _same(got) == _same(values[variable.name]), variable.name
        monkeypatch.delenv(variable.name)


def test_typed_defaults_are_the_settings_of_an_empty_environment(empty_env):
    for variable in settings.VARIABLES:
        if variable.derive is None and not (isinstance(variable.default, str) and "$" in variable.default):
            assert settings.default(variable.name) == getattr(empty_env, variable.field), variable.name
    with pytest.raises(ValueError, match="derived"):
        settings.default("BATCH_MODEL_CACHE")


def test_resource_defaults_are_the_settings_defaults(empty_env):
    s = empty_env
    pipeline = PipelineConfig()
    assert (pipeline.shard_size, pipeline.limits, Path(pipeline.prices_file), pipeline.max_enqueued_tokens) == (
        s.shard_size, s.limits, s.prices_file, s.max_enqueued_tokens)
    vllm = VLLMResource(models_file="m.toml", model_cache_dir="models")
    assert (vllm.mode, tuple(vllm.server_urls), vllm.server_api_key, vllm.max_concurrency, vllm.fleet_url) == (
        s.engine_mode, s.vllm_server_urls, s.vllm_api_key, s.vllm_max_concurrency, s.fleet_url)
    assert ServerEngine([]).max_concurrency == s.vllm_max_concurrency
    assert (vllm.request_timeout_s, vllm.failover_s) == (ServerEngine([]).timeout_s, ServerEngine([]).failover_s)
    intake = Intake(inbox_dir="in", outbox_dir="out")
    assert (intake.s3_bucket, intake.s3_prefix, intake.s3_output_prefix, intake.completion_window_s) == (
        s.s3_bucket, s.s3_prefix, s.s3_output_prefix, s.completion_window_s)
    webhooks = WebhookConfig()
    assert (tuple(webhooks.urls), webhooks.secret) == (s.webhook_urls, s.webhook_secret)


def test_resources_from_an_empty_environment_hold_the_settings(empty_env):
    resources = resources_from_env()
    assert resources["pipeline"].shard_size == empty_env.shard_size
    assert resources["intake"].inbox_dir == str(empty_env.inbox_dir)
    assert resources["vllm"].fleet_model == empty_env.served_fleet_model()


def test_a_set_variable_reaches_the_resource_as_an_env_var(empty_env, monkeypatch):
    """So the Dagster UI names the variable (and never shows the webhook secret's value)."""
    import dagster as dg

    monkeypatch.setenv("BATCH_SHARD_SIZE", "7")
    monkeypatch.setenv("BATCH_WEBHOOK_SECRET", "whsec_" + "A" * 24)
    resources = resources_from_env()
    shard_size, secret = resources["pipeline"].shard_size, resources["webhooks"].secret
    assert type(shard_size).__name__ == "IntEnvVar" and shard_size.name == "BATCH_SHARD_SIZE"  # an int subclass
    assert isinstance(secret, dg.EnvVar) and secret == dg.EnvVar("BATCH_WEBHOOK_SECRET")


def test_cli_and_serve_defaults_come_from_the_settings(empty_env, monkeypatch):
    args = build_parser().parse_args(["fleet", "some-model"])
    assert (args.replicas, args.port, args.policy, args.host) == (
        empty_env.fleet_replicas, empty_env.fleet_port, empty_env.fleet_policy, settings.LOOPBACK)
    commands = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    assert next(a for a in commands.choices["fleet"]._actions if a.dest == "policy").choices == POLICIES
    assert build_parser().parse_args(["vllm-server", "m"]).port == settings.VLLM_SERVER_PORT
    monkeypatch.setenv("BATCH_FLEET_PORT", "9100")
    monkeypatch.setenv("BATCH_FLEET_POLICY", "round_robin")
    args = build_parser().parse_args(["fleet", "some-model"])
    assert (args.port, args.policy) == (9100, "round_robin")

    from batch_dagster.serve.__main__ import build_parser as serve_parser

    args = serve_parser(empty_env).parse_args([])
    assert (args.host, args.port) == (empty_env.api_host, empty_env.api_port)


def test_the_fleet_policy_is_checked_against_the_routers_policies(empty_env, monkeypatch):
    assert empty_env.fleet_policy in POLICIES
    monkeypatch.setenv("BATCH_FLEET_POLICY", "fastest")
    with pytest.raises(ValueError, match=r"BATCH_FLEET_POLICY='fastest'.*cache_aware"):
        settings.Settings.from_env()


def test_a_bad_number_names_its_variable(empty_env, monkeypatch):
    monkeypatch.setenv("BATCH_SHARD_SIZE", "many")
    with pytest.raises(ValueError, match="BATCH_SHARD_SIZE='many'"):
        settings.Settings.from_env()


def test_one_place_opens_the_storage(tmp_path):
    openers = [str(p.relative_to(REPO)) for p in PACKAGE.rglob("*.py")
               if "open_storage(" in p.read_text(encoding="utf-8") and p.parent.name != "storage"]
    assert openers == ["batch_dagster/settings.py"]
    assert StorageResource(data_dir=str(tmp_path)).storage().root == settings.open_store(tmp_path).root


def test_derived_defaults(empty_env, monkeypatch, tmp_path):
    assert empty_env.storage_url == str(empty_env.data_dir)
    assert empty_env.scratch_dir == empty_env.data_dir / "scratch"
    monkeypatch.setenv("BATCH_INBOX_DIR", str(tmp_path / "drops" / "in"))
    monkeypatch.setenv("BATCH_MAX_ENQUEUED_TOKENS", "0")
    s = settings.Settings.from_env()
    assert s.outbox_dir == tmp_path / "drops" / "outbox" and s.max_enqueued_tokens is None
