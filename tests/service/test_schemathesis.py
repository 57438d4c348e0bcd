"""schemathesis against the published OpenAPI spec, in-process: every route, with an operator, a tenant, a
producer and an invalid token; no 5xx, and every response conforms to its schema."""

from __future__ import annotations

import json

import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from kvtrail.service.app import create_app
from tests.service.access_fixtures import served_fixture  # noqa: F401

ROLES = ("operator", "tenant:mallory", "producer")
CHECKS = (not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance)


@schemathesis.serializer("application/x-ndjson", "application/vnd.apache.arrow.stream")
def _raw_body(ctx, value) -> bytes:
    """Ingest bodies as generated: bytes as they are, anything else as JSON text (mostly invalid events)."""
    if isinstance(value, bytes):
        return value
    return (value if isinstance(value, str) else json.dumps(value)).encode()


def test_the_api_keeps_to_its_schema(served):
    schema = schemathesis.openapi.from_asgi("/openapi.json", create_app(served.state))
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {"/v1/affected", "/v1/reports", "/v1/events", "/v1/audit/verify", "/v1/tokens"} <= {
        op.path for op in operations
    }
    for operation in operations:
        # a report takes seconds: a successful one is test_queries' job, here only the refusals
        roles = ("tenant:mallory", "producer") if operation.path == "/v1/reports" else ROLES
        _check(operation, [served.tokens[r] for r in roles] + ["kvt_000000000000_invalid"])


def _check(operation, secrets: list[str]) -> None:
    @given(case=operation.as_strategy())
    @settings(max_examples=8, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    def check(case):
        for secret in secrets:
            case.call_and_validate(headers={"Authorization": f"Bearer {secret}"}, checks=CHECKS)

    check()
