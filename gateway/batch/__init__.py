"""The Batch API's engine side: the runner that feeds BE lines to the engine (runner.py), its
store queries (store.py), the output/error file writer (output.py) and the pure ordering code
(order/, which imports no aiohttp, sqlalchemy or torch)."""
