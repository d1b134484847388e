"""The files the API serves split into their lines with str.splitlines(), as clients read them (tests/helpers.py's
file_lines does; so does inspect_ai): output, error, partial output, a retry's input and the merged results, with
custom_ids that carry every character splitlines() breaks at (the service echoes them in every line)."""

from __future__ import annotations

import json

import openai

from tests.helpers import FakeEngine, chat_request, file_lines, upload, wait_for

BREAKS = "\u2028\u2029\u0085\x0b\x0c\x1c\x1d\x1e"
CHAT = "/v1/chat/completions"


def test_every_file_the_api_serves_splits_into_its_lines(start_service, tmp_path):
    ids = [f"r{i}{BREAKS}" for i in range(3)]
    engine = FakeEngine(fail_once={ids[1]})
    client = start_service(shard_size=2, engine=engine).client()
    requests = [chat_request(cid, f"question {i}", max_tokens=8) for i, cid in enumerate(ids)]
    requests.append(chat_request(f"bad{BREAKS}", "hi", temperature=-1))
    parent = client.batches.create(input_file_id=upload(client, tmp_path / "in.jsonl", requests), endpoint=CHAT,
                                   completion_window="24h")
    parent = wait_for(client, parent.id, "completed")
    out, err = file_lines(client, parent.output_file_id), file_lines(client, parent.error_file_id)
    assert sorted(x["custom_id"] for x in out) == [ids[0], ids[2]]
    assert sorted(x["custom_id"] for x in err) == [f"bad{BREAKS}", ids[1]]
    assert out[0]["response"]["body"]["choices"][0]["message"]["content"].startswith("echo: question")
    raw = client.files.content(parent.output_file_id).content
    assert "\u2028".encode() not in raw and b"\\u2028" in raw  # escaped, not dropped
    partial = client.get(f"/batches/{parent.id}/partial_output", cast_to=str)
    partial = partial if isinstance(partial, str) else partial.text
    assert sorted(json.loads(x)["custom_id"] for x in partial.splitlines()) == [ids[0], ids[2]]

    child = wait_for(client, client.post(f"/batches/{parent.id}/retry", cast_to=openai.types.Batch).id, "completed")
    assert [x["custom_id"] for x in file_lines(client, child.input_file_id)] == [ids[1]]
    merged = file_lines(client, child.output_file_id, merged=True)
    assert sorted(x["custom_id"] for x in merged) == ids
