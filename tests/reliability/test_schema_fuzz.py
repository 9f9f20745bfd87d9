"""Every documented operation, probed with schemathesis: boundary and invalid values of every
parameter and body field, undeclared methods, and cases hypothesis generates from the schema
(valid and invalid) with a fixed seed. Whatever a client sends, the gateway answers without a
5xx, with a status, content type, headers and body its own OpenAPI document declares.
"""

from __future__ import annotations

import pytest
from schemathesis import GenerationMode

from tests.reliability.fuzzing import Prober
from tests.reliability.live import LiveGateway

EXAMPLES_PER_MODE = 10
"""Generated cases per operation and mode (valid, invalid), on top of the coverage phase (which
makes most of the cases: 2,622 per database with 20 here, after the tool-calling fields grew
the chat schema; 10 keeps the run well above MIN_CASES in less time)."""
MIN_CASES = 1000


@pytest.mark.slow
def test_no_request_gets_a_5xx_or_an_undocumented_answer(live: LiveGateway) -> None:
    prober = Prober.of(live)
    for operation in prober.operations():
        prober.coverage(operation)
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            prober.fuzz(operation, mode, EXAMPLES_PER_MODE)
    print(prober.summary("schema fuzz"))
    assert prober.cases >= MIN_CASES, prober.summary("schema fuzz")
    assert not prober.findings, prober.report()
