"""One default per setting: the docs' text, Settings, the engine, the CLI and serve agree (the Dagster resources:
tests/pipeline/test_resource_defaults.py)."""

from __future__ import annotations

import argparse
import dataclasses
import re
from pathlib import Path

import pytest

from batch_dagster import settings
from batch_dagster.cli import build_parser
from batch_dagster.engine.server import ServerEngine
from batch_dagster.settings import POLICIES

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "batch_dagster"


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


def test_cli_and_serve_defaults_come_from_the_settings(empty_env, monkeypatch):
    args = build_parser(settings.Settings.from_env()).parse_args(["fleet", "some-model"])
    assert (args.replicas, args.port, args.policy, args.host) == (
        empty_env.fleet_replicas, empty_env.fleet_port, empty_env.fleet_policy, settings.LOOPBACK)
    commands = next(a for a in build_parser(settings.Settings.from_env())._actions if isinstance(a, argparse._SubParsersAction))
    assert next(a for a in commands.choices["fleet"]._actions if a.dest == "policy").choices == POLICIES
    assert build_parser(settings.Settings.from_env()).parse_args(["vllm-server", "m"]).port == settings.VLLM_SERVER_PORT
    monkeypatch.setenv("BATCH_FLEET_PORT", "9100")
    monkeypatch.setenv("BATCH_FLEET_POLICY", "round_robin")
    args = build_parser(settings.Settings.from_env()).parse_args(["fleet", "some-model"])
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


def test_the_sensor_loop_is_half_a_second_unless_set_and_never_below_a_tenth(empty_env, monkeypatch):
    assert empty_env.sensor_loop_s == 0.5
    monkeypatch.setenv("BATCH_SENSOR_LOOP_S", "5")
    assert settings.Settings.from_env().sensor_loop_s == 5
    for text in ("0", "0.05", "nan"):  # a loop that never sleeps
        monkeypatch.setenv("BATCH_SENSOR_LOOP_S", text)
        with pytest.raises(ValueError, match=f"BATCH_SENSOR_LOOP_S='{text}': must be 0.1 seconds or more"):
            settings.Settings.from_env()


def test_one_place_opens_the_storage():
    openers = [str(p.relative_to(REPO)) for p in PACKAGE.rglob("*.py")
               if "open_storage(" in p.read_text(encoding="utf-8") and p.parent.name != "storage"]
    assert openers == ["batch_dagster/settings.py"]


def test_server_engine_defaults_are_the_settings(empty_env):
    assert ServerEngine([]).max_concurrency == empty_env.vllm_max_concurrency


def test_derived_defaults(empty_env, monkeypatch, tmp_path):
    assert empty_env.storage_url == str(empty_env.data_dir)
    assert empty_env.scratch_dir == empty_env.data_dir / "scratch"
    monkeypatch.setenv("BATCH_INBOX_DIR", str(tmp_path / "drops" / "in"))
    monkeypatch.setenv("BATCH_MAX_ENQUEUED_TOKENS", "0")
    s = settings.Settings.from_env()
    assert s.outbox_dir == tmp_path / "drops" / "outbox" and s.max_enqueued_tokens is None


def test_api_keys_may_have_names_and_no_key_is_picked_to_own_dropped_files(empty_env, monkeypatch):
    monkeypatch.setenv("BATCH_API_KEYS", "acme:sk-a, sk-b ,ops.team_1:sk:c")
    s = settings.Settings.from_env()
    assert [settings.split_key(e) for e in s.api_keys] == [("acme", "sk-a"), (None, "sk-b"), ("ops.team_1", "sk:c")]
    assert s.intake_api_key == ""  # the operator names it: never the first key, silently
    for bad, why in (("sk bad:secret", "key name"), ("a:sk-a,b:sk-a", "repeated"), ("a:sk-a,a:sk-b", "repeated"),
                     ("a:", "empty key")):
        monkeypatch.setenv("BATCH_API_KEYS", bad)
        with pytest.raises(ValueError, match=f"BATCH_API_KEYS: entry .*{why}") as refused:
            settings.Settings.from_env()
        assert "sk" not in str(refused.value).replace("BATCH_API_KEYS", "")  # no part of a key in the message
