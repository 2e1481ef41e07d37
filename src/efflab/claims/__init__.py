"""Stage claims: every numeric claim of the seed texts, reported vs reproduced.

The registry (workflow/claims.yaml, schema workflow/schemas/claims.schema.yaml) says for each claim what
it would take to check it. analytic claims are computed by efflab.estimate from a shipped model config;
measured claims are read from this pipeline's own results (a small model on this machine: the scale
difference is stated in each row); hardware claims need a GPU and are marked so until run on one. Each
row gets a verdict: reproduced (within tolerance), differs (with the reason found), inconclusive (a measured
figure whose 95% CI crosses an edge of the tolerance band: reproduced needs the whole CI inside it), not
reproducible here (with why) or needs GPU: <which>. A hardware claim whose estimate the registry marks
sufficient (a footprint whose only missing piece is the real weights) gets an analytic verdict, "reproduced
(analytic)" or "differs (analytic)", counted with reproduced / differs, until a GPU measurement replaces it.
Writes claims.csv and claims.md.

Byte figures are compared like with like: a seed's KB/MB/GB are read in the claim's recorded unit convention
(`units` in the registry: binary where the seed's code, the tool that printed the figure, or the arithmetic
shows its GB are GiB, with that evidence), decimal otherwise; a figure that fits only in the other convention
differs, and the row says so.
"""
from .stage import run  # noqa: E402  the stage's entry point: efflab.<stage>.run, as for every stage

__all__ = ["run"]
