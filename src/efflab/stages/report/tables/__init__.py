"""The report's tables: one DataFrame per table of each stage's part (report.parts names its builder, in a module
of this package named after the stage, or its columns: paths into the records), and the tables across stages: the
jobs that did not run and the memory predictions."""
from __future__ import annotations

import pandas as pd

from .... import records
from ....config import lookup
from .. import spread
from ..parts import PARTS, resolve
from ..writing import env_of, percent


def build_tables(metrics: dict) -> dict[str, pd.DataFrame]:
    """Every part's tables, in the report's order, each built from the records of the stages it reads."""
    tables = {}
    for stage, part in PARTS.items():
        for table in part.tables:
            given = [metrics[s] for s in table.reads or (stage,)]
            tables[table.name] = resolve(table.build)(*given) if table.build else columns_table(*given, table.columns)
            tables[table.name].attrs["keys"] = table.keys
    return tables


def columns_table(jobs: list[dict], columns: tuple[tuple[str, str], ...]) -> pd.DataFrame:
    """A table declared by its columns (report_part.Table.columns): one row a job that produced numbers, each column
    the value at a dotted path of its record (empty where the record has none), and the environment it was measured
    in (a record of numbers that depend on no machine has none: "")."""
    def at(record: dict, path: str):
        try:
            return lookup(record, path)
        except (KeyError, TypeError):
            return None

    rows = [{**{heading: at(job, path) for heading, path in columns},
             "env": env_of(job) if "environment" in job else ""} for job in records.ok(jobs)]
    return pd.DataFrame(rows, columns=[heading for heading, _ in columns] + ["env"])


def change_text(record: dict | None, point_key: str = "perplexity_change_pct") -> str:
    """A perplexity change paired row by row, with its 95% interval where its rows give one; a record written
    before per-row pairing gives its point value alone."""
    record = record or {}
    paired = spread.of_change(record.get("perplexity_change"))
    return spread.text(paired or spread.spread(record.get(point_key)), percent)


def not_run_table(metrics: dict[str, list[dict]]) -> pd.DataFrame:
    """Every job of the grid that did not produce numbers, and why: nothing disappears silently."""
    return pd.DataFrame(records.not_run(metrics), columns=["stage", "name", "status", "reason"])


MEMORY_TARGET = 0.15  # issue 5: the estimator within ±15% of the measurement on the embedded default


def _main_terms(terms: dict, top: int = 3) -> str:
    ranked = sorted(((v, k) for k, v in terms.items() if v >= 0.5), reverse=True)[:top]
    return ", ".join(f"{k.replace('_', ' ')} {v:.0f}" for v, k in ranked) or "-"


def memory_prediction_table(finetune_rows: list[dict], inference_rows: list[dict]) -> pd.DataFrame:
    """Each run's and cell's predicted peak (made before it ran) next to its measured peak."""
    def row(what: str, p: dict, env: str, fit: dict | None = None) -> dict:
        ratio, predicted = p.get("ratio"), p.get("total_mib")
        said = {"fit before it ran (budget)": f"{fit['verdict'] or 'not decided'} ({fit['budget_mib'] / 1024:.1f} GiB)"
                } if fit else {}
        return {"run / cell": what, "memory": f"{p.get('measured_kind') or '?'} delta", "predicted (MiB)": predicted,
                "main terms (MiB)": _main_terms(p["terms_mib"]) if predicted else p.get("unavailable"),
                "measured (MiB)": p.get("measured_mib"), "measured / predicted": ratio,
                "within ±15%": None if ratio is None else ("yes" if abs(ratio - 1) <= MEMORY_TARGET else "no"),
                "RSS delta (MiB)": p.get("rss_delta_mib"), "RSS / predicted": p.get("rss_ratio"), **said, "env": env}

    out = [row(f"finetune {r['run']}" + (f" (longest batch {p['batch']['rows']}x{p['batch']['padded_length']})"
                                         if p.get("batch") else f" ({p['phase']})" if p.get("phase") else ""), p, env_of(r),
               r.get("memory_fit"))
           for r in finetune_rows if (p := r.get("memory_prediction"))]
    out += [row(f"inference {r['variant']} (KV {'on' if c['kv_cache'] else 'off'}, batch {c['batch_size']}"
                f"{'' if records.cell_mode(c) == 'dynamic' else ', ' + records.cell_mode(c)})",
                c["memory_prediction"], env_of(r))
            for r in inference_rows for c in r.get("cells", []) if records.is_ok(c) and "memory_prediction" in c]
    return pd.DataFrame(out)
