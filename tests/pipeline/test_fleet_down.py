"""A fleet whose servers are all down: the shard fails, the step retries (RetryPolicy), and when the retries run
out its requests become engine_error lines, with the batch still finishing."""

from __future__ import annotations

from batch_dagster.defs.runner import run_batch
from tests.helpers import chat_request, free_port, make_defs, read_jsonl, real_vllm, write_jsonl


def test_no_server_left_retries_the_step_then_ends_in_engine_error_lines(tmp_path, data_dir, instance):
    dead = f"http://127.0.0.1:{free_port()}"
    vllm = real_vllm(mode="server", server_urls=[dead], failover_s=0.5)
    rows = [chat_request(f"r{i}", f"q {i}") for i in range(3)]
    summary = run_batch(write_jsonl(tmp_path / "in.jsonl", rows), tmp_path / "out", show_progress=False,
                        defs=make_defs(data_dir, vllm, shard_size=2), instance=instance).to_dict()
    assert summary["status"] == "completed"
    assert summary["request_counts"] == {"total": 3, "completed": 0, "failed": 3}
    assert summary["engine"] == {"mode": "server", "url": dead, "start_s": 0.0}  # the servers it went to
    errors = read_jsonl(tmp_path / "out" / "errors.jsonl")
    assert sorted(e["custom_id"] for e in errors) == ["r0", "r1", "r2"]
    assert {e["response"]["body"]["error"]["code"] for e in errors} == {"engine_error"}
    message = errors[0]["response"]["body"]["error"]["message"]
    # Why, without the deployment's addresses: the server's URL is the operator's to read (in the run's log).
    assert "No server answered" in message and "<internal address> unreachable" in message, message
    assert "127.0.0.1" not in message and "http" not in message, message
    attempts = [e for e in instance.all_logs(summary["run_id"]) if e.step_key == "shard_results"
                and e.dagster_event and e.dagster_event.event_type_value == "STEP_UP_FOR_RETRY"]
    assert len(attempts) == 2  # the RetryPolicy's retries, then the last attempt writes the error lines
