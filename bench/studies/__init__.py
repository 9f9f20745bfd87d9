"""One-off studies behind committed results: each module is a `python -m bench.studies.NAME`
script that answers one question of an issue. Nothing in the bench library imports them."""
