"""Commands run with `python -m efflab.tools.<name>` to make files, not imported by any stage: dvc.yaml from the
Snakemake DAG (dvcgen), the docs' generated reference pages (docs_reference), a finished run's numbers kept under
results/reference/ (reference), and the offline bundle for an air-gapped machine (bundle)."""
