"""The Dagster resources' defaults are the settings' (one default per setting), and a set variable reaches a
resource as a `dg.EnvVar`, so the Dagster UI names it."""

from __future__ import annotations

from pathlib import Path

import dagster as dg

from batch_dagster import settings
from batch_dagster.defs.resources import (
    DatabaseResource,
    Intake,
    PipelineConfig,
    StorageResource,
    VLLMResource,
)
from batch_dagster.defs.resources.from_env import resources_from_env
from batch_dagster.defs.retention import Retention
from batch_dagster.defs.webhooks import WebhookConfig
from batch_dagster.engine.server import ServerEngine


def test_resource_defaults_are_the_settings_defaults(empty_env):
    s = empty_env
    pipeline = PipelineConfig()
    assert (pipeline.shard_size, pipeline.limits, Path(pipeline.prices_file), pipeline.max_enqueued_tokens) == (
        s.shard_size, s.limits, s.prices_file, s.max_enqueued_tokens)
    vllm = VLLMResource(models_file="m.toml", model_cache_dir="models")
    assert (vllm.mode, tuple(vllm.server_urls), vllm.server_api_key, vllm.max_concurrency, vllm.fleet_urls) == (
        s.engine_mode, s.vllm_server_urls, s.vllm_api_key, s.vllm_max_concurrency, s.fleet_urls)
    assert (vllm.request_timeout_s, vllm.failover_s) == (ServerEngine([]).timeout_s, ServerEngine([]).failover_s)
    intake = Intake(inbox_dir="in", outbox_dir="out")
    assert (intake.s3_bucket, intake.s3_prefix, intake.s3_output_prefix, intake.completion_windows) == (
        s.s3_bucket, s.s3_prefix, s.s3_output_prefix, list(s.completion_windows))
    webhooks = WebhookConfig()
    assert (tuple(webhooks.urls), webhooks.secret) == (s.webhook_urls, s.webhook_secret)


def test_resources_from_an_empty_environment_hold_the_settings(empty_env):
    resources = resources_from_env(settings.Settings.from_env())
    assert resources["pipeline"].shard_size == empty_env.shard_size
    assert resources["intake"].inbox_dir == str(empty_env.inbox_dir)
    assert resources["vllm"].fleet_urls == empty_env.fleet_urls == {}


def test_a_set_variable_reaches_the_resource_as_an_env_var(empty_env, monkeypatch):
    """So the Dagster UI names the variable (and never shows the webhook secret's value)."""
    monkeypatch.setenv("BATCH_SHARD_SIZE", "7")
    monkeypatch.setenv("BATCH_WEBHOOK_SECRET", "whsec_" + "A" * 24)
    resources = resources_from_env(settings.Settings.from_env())
    shard_size, secret = resources["pipeline"].shard_size, resources["webhooks"].secret
    assert type(shard_size).__name__ == "IntEnvVar" and shard_size.name == "BATCH_SHARD_SIZE"  # an int subclass
    assert isinstance(secret, dg.EnvVar) and secret == dg.EnvVar("BATCH_WEBHOOK_SECRET")


def test_the_storage_resource_opens_what_the_settings_open(tmp_path):
    assert StorageResource(data_dir=str(tmp_path)).open().root == settings.open_batch_storage(tmp_path).root


RESOURCES = (PipelineConfig, VLLMResource, Intake, StorageResource, WebhookConfig, DatabaseResource, Retention)


def _variables(cls) -> dict[str, str]:
    """The resource's fields that hold a setting, and the variable each names."""
    return {name: info.json_schema_extra["variable"] for name, info in cls.model_fields.items()
            if isinstance(info.json_schema_extra, dict) and "variable" in info.json_schema_extra}


def test_a_resource_field_of_a_setting_is_described_by_its_declaration():
    named = {variable for cls in RESOURCES for variable in _variables(cls).values()}
    assert {"BATCH_SHARD_SIZE", "BATCH_DATABASE_URL", "BATCH_WEBHOOK_SECRET", "BATCH_INBOX_DIR"} <= named
    for cls in RESOURCES:
        for name, variable in _variables(cls).items():
            assert cls.model_fields[name].description == settings.declared(variable).meaning, (cls, name)


def test_every_set_variable_whose_text_is_its_value_reaches_its_fields_as_an_env_var(empty_env, monkeypatch):
    values = {"BATCH_ENGINE_MODE": "server", "BATCH_API_KEYS": "sk-a", "BATCH_WEBHOOK_SECRET": "whsec_" + "A" * 24}
    for variable in settings.VARIABLES:
        if variable.text_is_value and variable.name != "BATCH_REPORT_START":
            monkeypatch.setenv(variable.name, values.get(variable.name, "7" if variable.parse is not str else "x"))
    resources = resources_from_env(settings.Settings.from_env())
    for key, resource in resources.items():
        for name, variable in _variables(type(resource)).items():
            value, annotation = getattr(resource, name), type(resource).model_fields[name].annotation
            if settings.declared(variable).text_is_value and annotation in (str, str | None, int, int | None):
                assert getattr(value, "env_var_name", None) == variable, (key, name)
