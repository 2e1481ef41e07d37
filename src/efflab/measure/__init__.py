"""The one place efflab measures; every stage uses it, one module per concern: `device`, `stats` (intervals and
verdicts), `timing` (timed functions, interleaved comparisons), `memory`, `energy`, `isolation` (a cell per
process), `flops` and `env` (the environment fingerprint). Import from the module that holds a name: this package
re-exports nothing, so `stats` loads without torch."""
