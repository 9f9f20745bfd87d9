"""The only code that imports SGLang: tandem's plugin, request metadata and the server launcher.

Importing this package imports nothing from SGLang; each module says what it needs:

* ``launcher``: the ``python -m sglang.launch_server`` command line, environment and a child
  process handle (no SGLang import; the gateway uses it).
* ``plugin``: the ``sglang.srt.plugins`` entry point, run inside SGLang's processes.
* ``request_meta``: the scheduler-side form of ``common.wire.RequestMeta`` (no SGLang import).
"""
