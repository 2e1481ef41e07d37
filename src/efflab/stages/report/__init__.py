"""Stage report: the records of every stage read into advice, tables, plots and report.md (report.stage)."""
