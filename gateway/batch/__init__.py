"""The Batch API's engine side: the runner that feeds BE lines to the engine (runner.py), one
line through the request pipeline (execute.py), the lines' preparation and validation
(prepare.py, validate.py), the store queries (store.py, lines.py) and the output/error file
writer (output.py), the fair share among tenants (fair.py). The pure ordering code is
backend/policy/batch_order/."""
