"""Schemathesis over the OpenAPI schema: no input may produce a 5xx (SPEC §3.3).

Cases come from each operation's hypothesis strategy (schemathesis's pytest plugin does not
load under pytest 9, so the operations are driven directly)."""

import pytest

schemathesis = pytest.importorskip("schemathesis")

from hypothesis import HealthCheck, given, settings  # noqa: E402

from service.api import Backend, create_app  # noqa: E402
from tests.test_api import TOKEN, server  # noqa: E402, F401  (the real batch server fixture)

pytestmark = pytest.mark.slow


def test_no_input_gives_a_5xx(server, monkeypatch):  # noqa: F811
    monkeypatch.setenv("TOKENMILL_API_TOKEN", TOKEN)
    schema = schemathesis.openapi.from_asgi("/openapi.json", create_app(Backend(server)))
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.path for op in operations} >= {"/v1/mixture", "/v1/state", "/v1/pause", "/metrics"}
    calls = []
    for op in operations:

        @given(case=op.as_strategy())
        @settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck))
        def check(case):
            for headers in ({}, {"Authorization": f"Bearer {TOKEN}"}):
                response = case.call(headers=headers)
                calls.append(response.status_code)
                assert response.status_code < 500, (
                    case.method,
                    case.path,
                    case.body,
                    response.text,
                )

        check()
    assert len(calls) > 10 * len(operations)
    assert any(400 <= c < 500 for c in calls) and any(c < 300 for c in calls)
