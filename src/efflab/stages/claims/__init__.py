"""Stage claims: every numeric claim of the seed texts, reported vs reproduced.

The registry (workflow/claims.yaml, schema workflow/schemas/claims.schema.yaml) says for each claim what it would
take to check it, for each seed text its title and the one unit convention of its KB/MB/GB (with the evidence),
and which of a seed's other numbers are deliberately not claims, with why. analytic claims are computed by
efflab.estimators.analytic from a shipped model config (quantities.py); measured claims are read from this pipeline's own
results (readings.py, finetune_readings.py), with the cause of a figure computed from the records where one is
(causes.py); hardware claims need a GPU and are marked so until run on one, unless a computation settles them (a
footprint whose only missing piece is the real weights). Each row gets a verdict by equivalence with the claim's
tolerance band (verdict.py): reproduced, differs, inconclusive, not reproducible here or needs GPU: <which>; and
the evidence it rests on: measured (by this run, with its interval), computed (from the seed's own inputs) or
definition (a parameter count, a format, a default). Writes claims.csv, the compact claims.md (page.py) and
summary.json, the counts by evidence x verdict the report quotes (stage.py).
"""
from .stage import run  # the stage's entry point: efflab.stages.<stage>.run, as for every stage

__all__ = ["run"]
