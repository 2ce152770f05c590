"""Schemathesis from our own /api-doc/openapi.json against the real launcher on a tiny model: no 5xx, every
response (status, media type, body) as declared, schema-invalid requests refused, undeclared methods 405.

Bounded: a fixed number of derandomized examples per operation, a 64-token context and a 4-token default
answer, so the run takes about a minute on 2 cores. Runtime LoRA is on, so that the adapter routes' own checks
are fuzzed (not only the 404 a server without it answers)."""
from __future__ import annotations

import os

import httpx
import pytest

pytest.importorskip("torch")
schemathesis = pytest.importorskip("schemathesis")
hypothesis = pytest.importorskip("hypothesis")

from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402
from schemathesis import GenerationMode  # noqa: E402
from schemathesis.checks import (content_type_conformance, negative_data_rejection,  # noqa: E402
                                 not_a_server_error, response_schema_conformance, status_code_conformance)
from test_clients import start_server, stop_server  # noqa: E402

MAX_EXAMPLES = int(os.environ.get("TGI_HPC_FUZZ_EXAMPLES", "20"))  # per operation and mode; raise it to hunt
METHODS = ("GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS")
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance,
          negative_data_rejection]


@pytest.fixture(scope="module")
def fuzz_server(model_path, tmp_path_factory):
    proc, url, log = start_server(model_path("tiny-llama"), tmp_path_factory.mktemp("fuzz"), "--max-total-tokens",
                                  "64", "--max-new-tokens-default", "4", "--max-concurrent-requests", "8",
                                  "--cpu-threads", "1", "--enable-runtime-lora", "--max-loras", "1")
    yield url
    stop_server(proc)
    assert "Traceback" not in log.read_text()


@pytest.fixture(scope="module")
def operations(fuzz_server):
    schema = schemathesis.openapi.from_url(f"{fuzz_server}/api-doc/openapi.json")
    return {op.label: op for op in (result.ok() for result in schema.get_all_operations())}


def test_every_route_is_fuzzed(operations):
    from engine.server.openapi import _ROUTES
    declared = {f"{method.upper()} {path}" for method, path, *_ in _ROUTES}
    assert set(operations) == declared - {"GET /api-doc/openapi.json"}  # schemathesis leaves the document out


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE], ids=["valid", "invalid"])
def test_api_matches_its_openapi_document(operations, mode):
    # schemathesis' pytest plugin (from_fixture) does not run under pytest 9: one hypothesis test per operation
    failures = []
    for label, operation in sorted(operations.items()):
        if mode is GenerationMode.NEGATIVE and "requestBody" not in operation.definition.raw:
            continue  # a GET without parameters has nothing to break

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


def test_undeclared_methods_are_405(fuzz_server):
    spec = httpx.get(f"{fuzz_server}/api-doc/openapi.json").json()
    for path, operations in spec["paths"].items():
        declared = {m.upper() for m in operations}
        for method in set(METHODS) - declared:
            r = httpx.request(method, f"{fuzz_server}{path}", timeout=30)
            assert r.status_code == 405, (method, path, r.status_code)
            assert set(r.headers["allow"].split(", ")) == declared, (method, path)
            if method != "HEAD":
                assert r.json()["error_type"] == "method_not_allowed"
