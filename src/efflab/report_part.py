"""How the report lays out a stage (its registry row's `report`): the part's title and section, its tables (with the
columns that name a row, and the verdict columns the ledger states), its plots (with their category in Snakemake's
HTML report). The report stage reads them (report.parts); workflow/rules/report.smk draws the plots.

Each part names its code by convention, all of it in the report package:
- its section: `sections.<section>_body(cfg, metrics, table)` renders `templates/sections/<section>.md.j2`; a part
  without one is its tables, one after another (`sections.part_body`);
- a table: `Table.build`, a function `module.name` of the report package given the records of the stages it reads,
  or `Table.columns`: one row a job, each column a path into its record;
- a plot `<plot>`: drawn to results/report/<plot>.png by `draw.<plot>`, captioned by workflow/report/<plot>.rst.

No pandas, torch or matplotlib here: Snakemake reads the registry while it plans the DAG.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Says:
    """A verdict column of a table, stated in the ledger (report.ledger) as the verdict of `finding` (a question of
    decisions.json, or the table's own) on `metric` of the row's subject: `subject` formats the row's columns
    (str.format). Where decisions.json states the same finding, subject and metric, the checker holds them equal."""
    finding: str
    subject: str
    column: str
    metric: str


@dataclass(frozen=True)
class Table:
    name: str  # its key among the report's tables (in the section's `table(name)` and the report's metrics.json)
    build: str = ""  # its builder, `module.function` of the report package, e.g. "tables.prune.prune_table"
    # How many leading columns name a row: a table wider than the report allows is split into parts that repeat
    # them (fmt.markdown; None: its leading text columns, up to 4).
    keys: int | None = None
    reads: tuple[str, ...] = ()  # the stages whose records the builder takes, in order; () for its part's own
    # A table a reader looks up rather than reads: its heading in details.md, where it goes; report.md links it there.
    details: str | None = None
    says: tuple[Says, ...] = ()  # its verdict columns, each a finding's verdict in the ledger
    # Without a builder: (heading, dotted path into a job's record) a column, one row a job that produced numbers.
    columns: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class Part:
    title: str  # its heading in report.md
    category: str  # its plots' category in Snakemake's HTML report
    section: str = ""  # sections.<section>_body renders templates/sections/<section>.md.j2; "": its tables alone
    tables: tuple[Table, ...] = ()
    plots: tuple[str, ...] = ()  # results/report/<plot>.png: drawn by draw.<plot>, caption workflow/report/<plot>.rst
