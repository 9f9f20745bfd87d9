"""Cost of quota admission on the request path: one admit + release, in microseconds.
.venv/bin/python -m bench.studies.quota_admission"""

import time
from datetime import UTC, datetime

from gateway.quotas.limiter import QuotaLimiter
from gateway.store.types import Quota, Slo, Tenant

T0 = datetime(2026, 11, 21, tzinfo=UTC)
N = 200_000
CASES = [
    ("unlimited tenant", Quota()),
    (
        "all four limits",
        Quota(
            requests_per_min=10**9,
            tokens_per_min=10**12,
            max_concurrent=10**6,
            monthly_tokens=10**15,
        ),
    ),
]
for label, quota in CASES:
    tenant = Tenant(
        id="ten_x", name="x", tier="rt", slo=Slo(), quota=quota, created_at=T0, updated_at=T0
    )
    limiter = QuotaLimiter("gw_bench")
    start = time.perf_counter()
    for _ in range(N):
        limiter.release(limiter.admit(tenant, 500, 200), 600)
    print(f"{label}: {(time.perf_counter() - start) / N * 1e6:.2f} µs per admit + release")
