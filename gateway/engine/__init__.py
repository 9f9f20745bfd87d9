"""The gateway's side of one engine: the HTTP client for generations (`client`), the control
endpoint client and its loop (`control`), the polling of load and backlog for metrics
(`sampler`) and the time-share gauges read from the engine's counters (`stats`)."""
