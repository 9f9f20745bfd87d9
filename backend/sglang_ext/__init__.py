"""The only code that imports SGLang: tandem's plugin and what it installs in the scheduler.

Importing this package imports nothing from SGLang; each module says what it needs. Only
``plugin`` (the ``sglang.srt.plugins`` entry point), ``hooks`` and ``kv_layout_engine`` touch
SGLang itself; ``driver``, ``directive``, ``mirror``, ``batch_ops``, ``request_meta`` and
``views`` read SGLang's objects through the Protocols of ``views`` and run on stand-ins in unit
tests. The server's command line and environment are ``backend.launch.sglang``.
"""
