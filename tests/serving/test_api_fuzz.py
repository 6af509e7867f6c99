"""Property-based fuzzing of the app's OpenAPI schema (schemathesis): no input is a 5xx,
and every error is an OpenAI error body. Bounded: ≤ 100 examples in total."""

from __future__ import annotations

import pytest

schemathesis = pytest.importorskip("schemathesis")

from hypothesis import HealthCheck, settings  # noqa: E402

from pdserve.serving.api.app import build_app  # noqa: E402

from .conftest import MODEL, FakeEngineClient  # noqa: E402

_ENGINE = FakeEngineClient(token_delay=0.0, max_model_len=64)
_APP = build_app(_ENGINE, served_model_names=[MODEL], enable_prompt_tokens_details=True)
schema = schemathesis.openapi.from_asgi("/openapi.json", _APP)

# 8 operations x 12 examples = 96 requests at most
_SETTINGS = settings(
    max_examples=12,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=list(HealthCheck),
)


@schema.parametrize()
@_SETTINGS
def test_no_server_errors(case: schemathesis.Case) -> None:
    response = case.call(timeout=10)
    assert response.status_code < 500, (case.method, case.path, case.body, response.text)
    if response.status_code >= 400:
        err = response.json()["error"]
        assert err["code"] == response.status_code and err["message"]
