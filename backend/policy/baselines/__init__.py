"""Baseline scheduling policies: what users would run instead of tandem, as policies over the
same snapshot → plan → observe interface, so every comparison runs the same engine and workload.
Names (registry): fcfs, priority, rr, aggressive, conservative, fixed-offline, static-chunk,
oracle, rt-only."""
