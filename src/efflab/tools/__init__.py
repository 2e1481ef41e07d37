"""Commands run with `python -m efflab.tools.<name>` to make files, not imported by any stage: the offline bundle
for an air-gapped machine (bundle)."""
