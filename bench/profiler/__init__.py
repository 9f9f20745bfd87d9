"""Latency profiles: measuring a running engine (`measure`, `probe`, `machine`), the analytic H100
profile (`analytic`) and their fit error (`report`). The profiles themselves live beside the
latency model that reads them, in backend/policy/profiles/."""
