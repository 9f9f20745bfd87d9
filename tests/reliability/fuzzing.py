"""Sending schemathesis cases to the live gateway and keeping what went wrong.

A `Prober` loads the gateway's own `/openapi.json`, sends each case with the credentials its
operation needs (the admin token for `/admin/...`, else the tenant's key, or a key the caller
names) and runs the checks on every answer: no 5xx, and status, content type, headers and body
as the document says. A failing answer does not stop the run: it becomes a `Finding`, and
distinct findings (operation, status, check) are reported together at the end, each with one
command that reproduces it, so one run shows everything that is wrong at once.
"""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import hypothesis
import requests
import schemathesis
from hypothesis import HealthCheck, Phase
from schemathesis import APIOperation, Case, GenerationMode, Response
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
    unsupported_method,
)

from tests.reliability.live import LiveGateway

SEED = 16
"""Hypothesis' seed for every generated case: a run is repeatable."""

RESPONSE_CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
]
"""What every answer must satisfy: no 5xx, and a status, content type, headers and body the
document declares for the operation."""

COVERAGE_CHECKS = [*RESPONSE_CHECKS, unsupported_method]
"""The coverage phase also sends methods a path does not serve: 405 with an `Allow` header."""

REQUEST_TIMEOUT_S = 60.0
"""Generous: a generated request may ask for thousands of tokens (the simulator is fast)."""

_REPRO_CHARS = 600


@dataclass(frozen=True)
class Finding:
    """One answer that failed a check."""

    operation: str
    """The documented operation, e.g. ``POST /v1/files``."""
    method: str
    """The method sent (the coverage phase also sends undeclared ones)."""
    status: int
    check: str
    """The failed check: schemathesis' code and title, e.g. ``ST101 Server error``."""
    message: str
    reproduce: str
    """A curl command that sends the same request (credentials filtered)."""

    @property
    def kind(self) -> tuple[str, str, int]:
        """What makes two findings the same problem: operation, check and status."""
        return (self.operation, self.check, self.status)


@dataclass
class Prober:
    """Sends cases to one live gateway and collects the findings."""

    live: LiveGateway
    schema: Any
    """The gateway's OpenAPI document, loaded by schemathesis."""
    session: requests.Session = field(default_factory=requests.Session)
    cases: int = 0
    """Requests sent."""
    statuses: collections.Counter[int] = field(default_factory=collections.Counter)
    findings: dict[tuple[str, str, int], Finding] = field(default_factory=dict)
    """The first finding of each kind."""
    counts: collections.Counter[tuple[str, str, int]] = field(default_factory=collections.Counter)
    """How many answers failed each kind."""

    @classmethod
    def of(cls, live: LiveGateway) -> Prober:
        """A prober of *live*, on the document the gateway itself serves."""
        reply = requests.get(live.base_url + "/openapi.json", timeout=REQUEST_TIMEOUT_S)
        reply.raise_for_status()
        return cls(live, schemathesis.openapi.from_dict(reply.json()))

    def operations(self) -> Iterator[APIOperation]:
        """Every documented operation."""
        for result in self.schema.get_all_operations():
            yield result.ok()

    def operation(self, label: str) -> APIOperation:
        """The operation called *label*, e.g. ``POST /v1/files``."""
        method, path = label.split(" ", 1)
        return self.schema[path][method]

    def credentials(self, operation: APIOperation) -> str:
        """The bearer token an operation needs: the admin token for the admin API, else the
        tenant's key."""
        admin = operation.path.startswith("/admin/")
        return self.live.admin_token if admin else self.live.tenant_key

    def send(
        self,
        case: Case,
        *,
        token: str | None = None,
        checks: list[Any] | None = None,
    ) -> Response | None:
        """Sends *case* with *token* (default: what its operation needs), checks the answer and
        records what fails; the answer (None when the connection itself failed, which is a
        finding too)."""
        token = token if token is not None else self.credentials(case.operation)
        headers = {"Authorization": f"Bearer {token}"}
        self.cases += 1
        try:
            response = case.call(
                base_url=self.live.base_url,
                session=self.session,
                headers=headers,
                timeout=REQUEST_TIMEOUT_S,
            )
        except requests.RequestException as exc:
            self._found(case, 0, "transport error", f"{type(exc).__name__}: {exc}")
            return None
        self.statuses[response.status_code] += 1
        try:
            case.validate_response(response, checks=checks or RESPONSE_CHECKS, headers=headers)
        except BaseExceptionGroup as group:
            for failure in group.exceptions:
                self._failed(case, response, failure)
        except AssertionError as failure:
            self._failed(case, response, failure)
        return response

    def coverage(self, operation: APIOperation) -> None:
        """Schemathesis' coverage phase: deterministic boundary and invalid values of every
        parameter and body field, and every method the path does not serve."""
        modes = [GenerationMode.POSITIVE, GenerationMode.NEGATIVE]
        config = self.schema.config.generation_for(operation=operation)
        for case in self.schema.iter_coverage_cases(
            operation, generation_modes=modes, generation_config=config
        ):
            self.send(case, checks=COVERAGE_CHECKS)

    def fuzz(self, operation: APIOperation, mode: GenerationMode, examples: int) -> None:
        """*examples* cases hypothesis generates from the operation's schema (valid ones, or
        ones that break it: *mode*), with the fixed seed."""

        @hypothesis.seed(SEED)
        @hypothesis.settings(fuzz_settings(examples))
        @hypothesis.given(case=operation.as_strategy(mode))
        def each(case: Case) -> None:
            self.send(case)

        # Unsatisfiable: nothing to break (an operation without parameters has no invalid case)
        with contextlib.suppress(hypothesis.errors.Unsatisfiable):
            each()

    def summary(self, name: str) -> str:
        """One line: cases sent, statuses, findings."""
        statuses = ", ".join(f"{s}: {n}" for s, n in sorted(self.statuses.items()))
        server_errors = sum(n for s, n in self.statuses.items() if s >= 500)
        return (
            f"reliability {name}: {self.cases} cases, {server_errors} answered 5xx, "
            f"{len(self.findings)} distinct findings ({sum(self.counts.values())} failed "
            f"checks); statuses {{{statuses}}}"
        )

    def report(self) -> str:
        """Every distinct finding (operation, check, status) with how often it failed, grouped by
        check, and one command that reproduces each group's first."""
        lines = [f"{len(self.findings)} distinct findings:"]
        by_check: dict[tuple[str, int], list[Finding]] = collections.defaultdict(list)
        for finding in self.findings.values():
            by_check[(finding.check, finding.status)].append(finding)
        for (check, status), findings in sorted(by_check.items()):
            lines.append(f"* {check}, status {status}:")
            for finding in sorted(findings, key=lambda f: f.operation):
                count = self.counts[finding.kind]
                lines.append(f"    {finding.operation} (sent {finding.method}, {count}x): ")
                lines[-1] += finding.message[:160]
            lines.append(f"    reproduce: {findings[0].reproduce}")
        return "\n".join(lines)

    def _failed(self, case: Case, response: Response, failure: BaseException) -> None:
        code = getattr(failure, "code", "")
        title = getattr(failure, "title", type(failure).__name__)
        message = str(getattr(failure, "message", failure)).strip().splitlines()
        self._found(case, response.status_code, f"{code} {title}".strip(), " ".join(message))

    def _found(self, case: Case, status: int, check: str, message: str) -> None:
        finding = Finding(
            operation=case.operation.label,
            method=case.method,
            status=status,
            check=check,
            message=message[:300],
            reproduce=_curl(case),
        )
        self.counts[finding.kind] += 1
        self.findings.setdefault(finding.kind, finding)


def fuzz_settings(examples: int, **more: Any) -> hypothesis.settings:
    """Hypothesis settings for fuzzing a live server: no example database (a run depends on
    nothing but the seed), no deadline (the server's time is not the test's), no shrinking (a
    finding is recorded, not raised), no health checks (generating is cheap next to a request)."""
    return hypothesis.settings(
        max_examples=examples,
        database=None,
        deadline=None,
        phases=[Phase.explicit, Phase.generate],
        suppress_health_check=list(HealthCheck),
        **more,
    )


def _curl(case: Case) -> str:
    try:
        text = case.as_curl_command(headers={"Authorization": "Bearer [filtered]"})
    except Exception as exc:  # a case whose command cannot be written is still a finding
        return f"(no command: {type(exc).__name__})"
    return text if len(text) <= _REPRO_CHARS else text[:_REPRO_CHARS] + " …"
