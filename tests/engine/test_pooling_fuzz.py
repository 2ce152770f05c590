"""Schemathesis on the pooling routes of a real pooling server (the launcher on the tiny BERT embedder): no 5xx,
every answer as /api-doc/openapi.json declares it, schema-invalid bodies refused. test_openapi_fuzz.py does
the same for every route of a generative server, where these routes answer their 422."""
from __future__ import annotations

import pytest

pytest.importorskip("torch")
schemathesis = pytest.importorskip("schemathesis")
hypothesis = pytest.importorskip("hypothesis")

from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402
from schemathesis import GenerationMode  # noqa: E402
from test_clients import start_server, stop_server  # noqa: E402
from test_openapi_fuzz import CHECKS, MAX_EXAMPLES  # noqa: E402

POOLING_ROUTES = ["POST /v1/embeddings", "POST /embed", "POST /rerank", "POST /predict", "POST /v1/rerank",
                  "POST /v1/score"]


@pytest.fixture(scope="module")
def operations(model_path, tmp_path_factory):
    proc, url, log = start_server(model_path("tiny-bert-embed"), tmp_path_factory.mktemp("fuzz-pooling"),
                                  "--max-client-batch-size", "16", "--cpu-threads", "1")
    schema = schemathesis.openapi.from_url(f"{url}/api-doc/openapi.json")
    yield {op.label: op for op in (r.ok() for r in schema.get_all_operations()) if op.label in POOLING_ROUTES}
    stop_server(proc)
    assert "Traceback" not in log.read_text()


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE], ids=["valid", "invalid"])
def test_pooling_routes_match_their_openapi_document(operations, mode):
    assert sorted(operations) == sorted(POOLING_ROUTES)
    failures = []
    for label, operation in sorted(operations.items()):
        @given(case=operation.as_strategy(generation_mode=mode))
        @settings(max_examples=MAX_EXAMPLES, derandomize=True, deadline=None, database=None,
                  phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
        def check(case):
            case.call_and_validate(checks=CHECKS, timeout=60)

        try:
            check()
        except Exception as exc:  # noqa: BLE001 - every operation is run, then all failures are shown
            failures.append(f"--- {label} ({mode.value}):\n{str(exc)[:3000]}")
    assert not failures, "\n".join(failures)
