"""serve refuses to listen beyond loopback without API keys (serving for real is in tests/system/test_serve.py)."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace

import pytest

from batch_dagster.api.bind import UnsafeBind, check_bind, is_loopback
from batch_dagster.settings import Settings
from tests.helpers import REPO, database_url, serve_env


def test_without_keys_only_loopback_is_allowed(tmp_path):
    config = replace(Settings.from_env(), api_keys=(), database_url=database_url(tmp_path))
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("example.com")
    check_bind("127.0.0.1", config)
    with pytest.raises(UnsafeBind):
        check_bind("0.0.0.0", config)
    check_bind("0.0.0.0", replace(config, api_keys=("k",)))

    refused = subprocess.run([sys.executable, "-m", "batch_dagster.serve", "--host", "0.0.0.0"], cwd=REPO,
                             env=serve_env(tmp_path), capture_output=True, text=True, timeout=60)
    assert refused.returncode == 2 and "refusing to listen on 0.0.0.0" in refused.stderr
    assert "starting" not in refused.stderr
