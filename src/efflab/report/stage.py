"""Stage report: gather every stage's metrics.json into tables, plots, a tidy results table and report.md."""
from __future__ import annotations

import logging


from .. import provenance
from ..config import UserError
from . import advice, notes
from .environments import comparison, environment_table, provenance_table
from .fmt import env_of, markdown
from .pareto import finetune_pareto, inference_pareto, write_fronts
from .plots import draw_plots
from .render import render
from .results import absent, read_results
from .sections import (HOW_TO_READ, attention_body, capacity_lines, finetune_body, header_lines, inference_body,
                       memory_prediction_section, merge_body, not_run_lines, profile_lines, prune_body, qat_body,
                       quantize_body, run_size_lines, sample_lines, section, serving_body)
from .tables import build_tables, not_run_table
from .tidy import results_table

log = logging.getLogger("efflab")


def run(cfg: dict, paths: dict) -> dict:
    """Write report.md, the plots and summary.csv (every figure in long format) from every stage's metrics."""
    layout, out = paths["layout"], paths["out"]
    allow_mixed = cfg["report"]["allow_mixed_environments"]
    metrics = read_results(cfg, layout)
    base, data = metrics["base_model"][0], metrics["prepare_data"][0]
    jobs = {f"{s}/{m['name']}" if m.get("name") else s: m for s, ms in metrics.items() for m in ms}
    stale = provenance.check(layout, jobs)
    if stale:
        raise UserError(f"results mix artifacts: {stale[0]}" + (f" (and {len(stale) - 1} more)" if len(stale) > 1
                                                              else "") + "; rerun it (snakemake reruns what changed)")
    tables = build_tables(metrics)
    fronts = {"finetune": finetune_pareto(metrics["finetune"]),
              "inference": inference_pareto(metrics["bench_inference"], metrics["quantize"])}
    plots = draw_plots(cfg, metrics, tables, fronts, layout, out)
    write_fronts(fronts, out)
    results_table(metrics).to_csv(out / "summary.csv", index=False)
    environments = {env_of(m): m["environment"] for ms in metrics.values() for m in ms if "environment" in m}

    def table(key: str) -> str:
        return comparison(tables[key], environments, allow_mixed)

    def part(stage: str, title: str, body) -> list[str]:
        return section(cfg, metrics, stage, title, lambda: body(cfg, metrics, table))

    not_run = not_run_table(metrics)
    isolation = "each in a fresh process" if cfg["runtime"]["isolation"] == "subprocess" else "in the stage process"
    lines = [
        *header_lines(base, data), *advice.lines(metrics, cfg), *notes.qat_lines(metrics["qat"]),
        *notes.capacity_lines(metrics["capacity"]), *notes.surprise_lines(metrics),
        *notes.claims_lines(metrics["claims"], "../claims/claims.md"),
        "## In detail", "", HOW_TO_READ.format(isolation=isolation), "",
        *part("quantize", "## Quantization (post-training, bitsandbytes)", quantize_body),
        *part("prune", "## Structured pruning", prune_body),
        *part("qat", "## Quantization-aware training and the precision range test", qat_body),
        *part("finetune", "## Fine-tuning: full vs LoRA vs QLoRA", finetune_body),
        *part("merge", "## Merging adapters", merge_body),
        *part("bench_attention", "## Attention implementations", attention_body),
        *part("bench_inference", "## Inference variants (greedy, fixed length)", inference_body),
        *part("bench_serving", "## Serving: naive vs static vs continuous batching", serving_body),
        *(capacity_lines(metrics["capacity"], table("capacity")) if not absent(cfg, metrics, "capacity") else
          section(cfg, metrics, "capacity", "## Capacity: the largest batch and sequence that fit", list)),
        *profile_lines(metrics), *sample_lines(metrics["bench_inference"]),
        *not_run_lines(not_run), *run_size_lines(cfg, metrics),
        *memory_prediction_section(metrics["finetune"], metrics["bench_inference"], environments, allow_mixed),
        "## Provenance and environments", "",
        "What each job wrote and measured on, and the machines and library versions: [provenance.md](provenance.md).",
        "",
    ]
    (out / "provenance.md").write_text(render("provenance.md.j2", provenance=markdown(provenance_table(jobs)),
                                              environments=markdown(environment_table(environments))))
    (out / "report.md").write_text("\n".join(lines))
    log.info("report: %s", paths["final"] / "report.md")
    return {"tables": {k: len(v) for k, v in tables.items()}, "plots": plots, "not_run": len(not_run),
            "environments": len(environments)}
