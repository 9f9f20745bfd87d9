"""Per-tenant quotas: requests/min, tokens/min, concurrent requests, monthly tokens.

Over a limit, a request is refused before it reaches the engine with 429, ``Retry-After`` and an
OpenAI error body whose ``code`` names the limit (``requests_per_min_exceeded``, …). A request
that needs more tokens than the whole tokens/min limit could never pass: it is a 400
``request_too_large_for_limit`` instead (`RequestTooLarge`), which clients do not retry; a
tenant with a limit of 0 (requests_per_min, max_concurrent or monthly_tokens) gets 403
``<limit>_is_zero`` for every request (`LimitIsZero`): no wait can admit it.

How it works
------------
* **Hot path in memory.** `QuotaLimiter.admit` runs per request with no I/O: two token buckets
  (requests/min: one per request; tokens/min: prompt + max_tokens, the most the request can
  cost), an in-flight counter, and the month's token count. `release` at the end gives the
  unused part of the tokens/min reservation back (prompt + completion really used) and adds the
  used tokens to the month. Limits come with the tenant from the auth cache, so a change made
  through the admin API applies on this process at once (the cache is invalidated) and on the
  others as soon as PostgreSQL's notification reaches them (gateway/auth_sync.py), at the latest
  within ``gateway.auth_cache_ttl_s``; no restart.
* **Several gateway processes, one database.** Each process owns a *share* of every limit, and
  the shares add up to the limit, so no process ever needs to ask another before admitting.
  Every ``quota.sync_interval_s`` each process (`QuotaSync`, one short transaction) writes a
  heartbeat (``gateway_instances``) and its recent demand per tenant (``quota_demand``:
  requests/s, tokens/s and concurrency wanted, refused requests included), and reads everyone's.
  All processes compute the same split from the same rows (`shares.weights`): 10 % of each
  limit evenly over the live processes, the rest in proportion to demand. A process's buckets
  are sized (burst and refill) to its share; its concurrency slots are whole numbers allocated by
  largest remainder (`shares.allocate`), so they too sum to the limit. Month tokens are added
  to ``quota_monthly`` with an atomic upsert-increment and each process may spend its share of
  what is left of the budget.
* **Batch-API lines** count toward the monthly budget only: like OpenAI's batches they do not
  draw on the per-minute or concurrency limits (the batch runner paces them itself).
* **Bounds.** One process alone enforces the limits exactly. With several, a limit can be
  exceeded only while the shares are out of date: for at most one sync interval after a process
  starts, stops or its traffic moves, by at most what the moving shares allow in that interval.
  A tenant whose traffic sticks to one process gets (nearly) the whole rate there after one
  sync; its burst refills at that rate (a growing share never adds tokens at once, or shares
  swinging back and forth would mint them). A process that has seen no traffic for a tenant
  keeps only the floor, so its first requests may be refused until the next sync
  (``Retry-After`` then says what the whole limit needs, not this process's share). A crashed
  process stops counting after ``quota.instance_timeout_s``. The monthly budget may be overrun
  by the requests in flight when it runs out (a request is admitted while any budget is left).
  The processes' clocks are assumed in sync (NTP): heartbeats compare wall-clock times.

Modules (import each name from the module that defines it): `limiter` (`QuotaLimiter`,
`QuotaExceeded`, `Ticket`: admission and this process's share of every limit), `sync`
(`QuotaSync`: the database side), `shares` (the split), `bucket` (`TokenBucket`).
"""
