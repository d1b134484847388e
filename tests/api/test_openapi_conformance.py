"""The OpenAPI document tells the truth: schemathesis generates requests from it against the live API (uvicorn
on loopback, a test key) and checks every answer against it (issue #13, defect 5).

Bounded: a few tens of examples per operation, about a minute in all.
"""

from __future__ import annotations

import pytest

from batch_dagster.db import Database, keys
from tests.helpers import KEY_A, rows, upload

# schemathesis and its checks are imported when the test runs, not at collection: about half a second of each pytest
# worker's, and one worker runs this test.


def checks() -> list:
    from schemathesis.checks import not_a_server_error
    from schemathesis.specs.openapi.checks import (
        content_type_conformance,
        ignored_auth,
        response_headers_conformance,
        response_schema_conformance,
        status_code_conformance,
        unsupported_method,
    )

    return [not_a_server_error, status_code_conformance, content_type_conformance, response_headers_conformance,
            response_schema_conformance, unsupported_method, ignored_auth]


@pytest.fixture
def api_schema(start_service, tmp_path):
    schemathesis = pytest.importorskip("schemathesis")
    service = start_service(worker=False)
    client = service.client()
    # Something to find: a file and a batch, so that not every generated id is a 404.
    file_id = upload(client, tmp_path / "in.jsonl", rows(2))
    client.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h")
    store = Database(service.config.database_url)
    with store.session() as session:  # the key endpoints are exercised with an admin key, the others with KEY_A
        _, admin = keys.create(session, "conformance-admin", admin=True)
    store.dispose()
    return schemathesis.openapi.from_url(f"{service.url}/openapi.json"), admin


def exercise(operation, mode, key: str) -> None:
    """One operation as its own hypothesis test, as schemathesis's pytest plugin runs them."""
    from hypothesis import HealthCheck, given, settings
    from schemathesis import GenerationMode
    from schemathesis.specs.openapi.checks import negative_data_rejection

    run = checks() if mode is GenerationMode.POSITIVE else [*checks(), negative_data_rejection]

    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(max_examples=15, deadline=None, derandomize=True, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
    def answers_match(case):
        case.call_and_validate(headers={"Authorization": f"Bearer {key}"}, checks=run)

    answers_match()


def test_every_answer_matches_the_document(api_schema):
    from hypothesis.errors import Unsatisfiable
    from schemathesis import GenerationMode

    schema, admin = api_schema
    operations = [result.ok() for result in schema.get_all_operations()]
    # files (5), batches (4), the retry, partial output and estimate extensions, webhook endpoints (4), event
    # types, keys (6), models (2: the interactive calls they name are OpenAI's own, forwarded, not in the document),
    # Anthropic's Message Batches (6)
    assert len(operations) == 31
    negated = 0
    for operation in operations:
        key = admin if operation.path.startswith("/v1/keys") else KEY_A
        # Requests the document allows, then requests it forbids (to be refused with a 4xx it lists).
        exercise(operation, GenerationMode.POSITIVE, key)
        try:
            exercise(operation, GenerationMode.NEGATIVE, key)
            negated += 1
        except Unsatisfiable:
            pass  # nothing to negate: e.g. a path's only parameter is any string
    assert negated >= 4
