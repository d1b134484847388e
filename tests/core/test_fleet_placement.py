"""Where a fleet's replicas run: on a GPU host, GPUs of their own (the model's tensor parallel size each), none
shared; on a CPU, a core each. What `make serve` and `batch-dagster fleet` start, without starting it."""

from __future__ import annotations

import contextlib
import os
import re
import socket
import subprocess
import sys
from collections.abc import Iterator

import pytest

from batch_dagster.engine.hardware import visible_gpus
from batch_dagster.serve.fleet import (
    Fleet,
    ephemeral_ports,
    free_port_block,
    model_fleet,
    place_replicas,
    taken_ports,
)
from batch_dagster.settings import Settings

REGISTRY = """
[models.big]
source = "/models/big"
dtype = "bfloat16"
tensor_parallel_size = 2

[models.small]
source = "/models/small"
dtype = "bfloat16"
"""


def fleet(replicas: int, gpus: list[str], per_replica: int = 1) -> Fleet:
    return Fleet("m", replicas, 0, lambda port: ["vllm", "serve", "--port", str(port)], "cache_aware", "127.0.0.1",
                 gpus=gpus, gpus_per_replica=per_replica)


def test_on_a_cpu_each_replica_is_pinned_to_a_core_of_its_own():
    assert [p.core for p in place_replicas(2, [0, 1], [])] == [0, 1]
    assert [p.core for p in place_replicas(3, [4, 5], [])] == [4, 5, 4]  # more replicas than cores: round robin
    f = fleet(2, [])
    for (command, env), place in zip(f.server_commands(), f.placements, strict=True):
        assert command == ["taskset", "-c", str(place.core), "vllm", "serve", "--port", command[-1]]
        assert env["VLLM_CPU_OMP_THREADS_BIND"] == str(place.core)
        assert env.get("CUDA_VISIBLE_DEVICES") == os.environ.get("CUDA_VISIBLE_DEVICES")  # left as it was


def test_on_a_gpu_host_each_replica_gets_its_own_gpus_and_no_core_pinning():
    f = fleet(2, ["0", "1", "2", "3"], per_replica=2)
    commands = f.server_commands()
    assert [env["CUDA_VISIBLE_DEVICES"] for _, env in commands] == ["0,1", "2,3"]
    assert all(command[0] == "vllm" and "VLLM_CPU_OMP_THREADS_BIND" not in env for command, env in commands)
    assert f.spare_gpus == [] and fleet(1, ["0", "1", "2"], per_replica=2).spare_gpus == ["2"]
    assert fleet(2, []).spare_gpus is None  # a CPU host: nothing to say of GPUs
    # One GPU each, the GPUs named as CUDA_VISIBLE_DEVICES names them (indices or UUIDs).
    assert [p.gpus for p in place_replicas(2, [0], ["GPU-a", "GPU-b", "GPU-c"])] == [("GPU-a",), ("GPU-b",)]


def test_replicas_the_gpus_do_not_go_round_are_refused_with_the_count():
    with pytest.raises(ValueError, match=r"3 replica\(s\) of 2 GPU\(s\) each need 6 GPUs; this host shows 4"):
        place_replicas(3, [0, 1], ["0", "1", "2", "3"], 2)


def test_the_gpus_are_those_cuda_visible_devices_shows(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3, 5")
    assert visible_gpus() == ["3", "5"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # set and empty: no GPU
    assert visible_gpus() == []


def test_a_models_fleet_takes_its_tensor_parallel_size_from_the_registry(tmp_path, monkeypatch):
    (tmp_path / "models.toml").write_text(REGISTRY)
    monkeypatch.setenv("BATCH_MODELS_FILE", str(tmp_path / "models.toml"))
    monkeypatch.setenv("BATCH_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3")
    settings = Settings.from_env()
    big = model_fleet(settings, "big", 2, 0, "cache_aware", "127.0.0.1")
    assert [env["CUDA_VISIBLE_DEVICES"] for _, env in big.server_commands()] == ["0,1", "2,3"]
    command = big.server_commands()[1][0]
    assert command[command.index("--tensor-parallel-size") + 1] == "2"
    assert command[command.index("--port") + 1] == str(big.port + 2)
    small = model_fleet(settings, "small", 4, 0, "cache_aware", "127.0.0.1")
    assert [env["CUDA_VISIBLE_DEVICES"] for _, env in small.server_commands()] == ["0", "1", "2", "3"]
    with pytest.raises(ValueError, match="need 6 GPUs"):
        model_fleet(settings, "big", 3, 0, "cache_aware", "127.0.0.1")


@contextlib.contextmanager
def listening() -> Iterator[int]:
    """A port another process's server holds."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        yield held.getsockname()[1]


def test_a_fleet_with_a_port_taken_starts_nothing_and_names_the_port(tmp_path):
    with listening() as taken:
        f = Fleet("m", 2, taken - 2, lambda port: [sys.executable, "-c", "import time; time.sleep(60)"],
                  "cache_aware", "127.0.0.1", log_dir=tmp_path, gpus=[])  # its second replica's port is taken
        # Another process (a test beside this one) may hold a second port of the block by chance: the message
        # names every port taken, this one among them.
        with pytest.raises(RuntimeError, match=rf"port (\d+, )*{taken}(, \d+)* on 127.0.0.1 is in use: .* ports "
                                               rf"{taken - 2} to {taken + 1}"):
            f.start(timeout_s=5)
        assert f.children.procs == {}
        assert taken in taken_ports("127.0.0.1", [taken - 2, taken, taken + 1])


def test_batch_dagster_fleet_on_a_taken_port_says_so_without_a_traceback(tmp_path):
    (tmp_path / "models.toml").write_text(REGISTRY)
    env = {**os.environ, "BATCH_MODELS_FILE": str(tmp_path / "models.toml"), "BATCH_DATA_DIR": str(tmp_path / "data")}
    with listening() as taken:
        done = subprocess.run([sys.executable, "-m", "batch_dagster.cli", "fleet", "small", "--replicas", "1",
                               "--port", str(taken - 1)], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stderr
    # The message names every taken port of the block: another of them may be some other process's by chance.
    named = re.search(r"batch-dagster: error: ports? ([\d, ]+) on 127\.0\.0\.1 (is|are) in use", done.stderr)
    assert named and str(taken) in named.group(1).split(", "), done.stderr
    assert "Traceback" not in done.stderr


def test_a_free_block_is_outside_the_ports_outgoing_connections_take():
    # A replica binds its port seconds after the block is chosen: meanwhile any connection of the machine could take
    # a port of the system's ephemeral range as its own end.
    low, high = ephemeral_ports()
    blocks = {free_port_block(4, "127.0.0.1") for _ in range(20)}
    assert len(blocks) > 1  # at random: two fleets started at once get different blocks
    for base in blocks:
        assert base + 3 < low or base > high, (base, low, high)
        assert taken_ports("127.0.0.1", range(base, base + 4), reuse=False) == []
