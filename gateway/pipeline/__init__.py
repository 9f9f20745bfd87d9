"""The request pipeline: one route for every request, an HTTP call or a batch line alike —
parse → prepare → admit → place → run → record. Read gateway/pipeline/stages.py first; the
stages' own pieces are prepare.py, admission.py, placement.py and outcome.py."""
