"""Benchmarks: workloads, the runner that drives an engine with a set of policies, metrics,
reports, and the latency profiler. See bench/README.md."""
