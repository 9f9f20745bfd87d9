"""The `tandem` console script: serve, admin, batch client, bench and profile commands. The top
layer, and the only place that wires the gateway, the engine launchers and the bench together."""
