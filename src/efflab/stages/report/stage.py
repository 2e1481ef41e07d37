"""Stage report: gather every stage's metrics.json into tables, plots, a tidy results table and report.md."""
from __future__ import annotations

import logging
from functools import partial

from ... import provenance, records
from ...config import UserError
from ...layout import Job
from . import annotate, decisions, glance, ledger, notes, question_facts, short_glance, task_quality
from . import sections as sec
from .draw import Inputs, draw_plots, questions
from .environments import comparison, environment_table, provenance_table
from .glance import fact
from .pareto import finetune_pareto, inference_pareto, write_fronts
from .parts import PARTS, details_tables
from .results import read_results
from .screen import screen
from .tables import build_tables, not_run_table
from .templating import render
from .tidy import results_table
from .writing import anchor, env_of, markdown

log = logging.getLogger("efflab")
DETAILS = {t.name: t.details for t in details_tables()}  # the tables report.md links to details.md, by name


def refuse_stale(layout, jobs: dict[str, dict]) -> None:
    stale = provenance.check(layout, jobs)
    if stale:
        raise UserError(f"results mix artifacts: {stale[0]}" + (f" (and {len(stale) - 1} more)" if len(stale) > 1
                                                              else "") + "; rerun it (snakemake reruns what changed)")


def report_text(cfg: dict, metrics: dict, tables: dict, environments: dict, made: dict, withheld: list[dict]) -> str:
    """report.md: the answers first, then each stage in detail, then what did not run and the run's size."""
    def table(key: str) -> str:
        if key in DETAILS:
            return f"In details.md: [{DETAILS[key]}](details.md#{anchor(DETAILS[key])})."
        return comparison(tables[key], environments, cfg["report"]["allow_mixed_environments"])

    parts = [sec.header(metrics["base_model"][0], metrics["prepare_data"][0]), *question_facts.glance(made, cfg, metrics),
             *filter(None, [sec.withheld(withheld)]),
             *notes.lines(metrics, [fact(f) for f in made.get("facts", [])]),
             *notes.claims_lines(metrics["claims"], "../claims/claims.md", made),
             "## In detail\n\nHow to read the numbers, and the words of every verdict: "
             "[details.md](details.md#how-to-read-the-numbers).\n"]
    for stage, part in PARTS.items():
        body = getattr(sec, f"{part.section}_body") if part.section else partial(sec.part_body, part)
        parts += sec.section(cfg, metrics, stage, part.title, lambda body=body: body(cfg, metrics, table))
    parts += [sec.profiles(metrics), sec.not_run(not_run_table(metrics)),
              sec.run_size(cfg, metrics), render("sections/footer.md.j2")]
    return "\n".join(p.rstrip("\n") + "\n" if p else "" for p in parts)


def check_statements(made: dict, tables: dict, claims: list[dict], withheld: list[dict], out) -> None:
    """statements.jsonl: what decisions.json, the tables' verdict columns and the glance state of each finding, and
    what was withheld; the report stops where two of them disagree, a verdict is outside the vocabulary or a figure
    beyond its bound."""
    book = ledger.Ledger()
    book.from_decisions(made)
    book.from_tables(tables, PARTS)
    book.from_claims(claims)
    book.withheld(withheld)
    book.write(out / "statements.jsonl")
    problems = (ledger.check(book.statements)
                + ledger.check_lines(book.statements, glance.by_question(made), "details.md")
                + ledger.check_lines(book.statements, short_glance.lines(made), "report.md")
                + [p for name in ("report.md", "details.md")
                   for p in ledger.check_document(book.statements, (out / name).read_text(), name)]
                + _claims_page(claims, out.parent / "claims" / "claims.md"))
    for problem in problems:
        log.error("report: statements disagree: %s", problem)
    if problems:
        raise RuntimeError(f"the report contradicts itself ({len(problems)}, each in the log): " + "; ".join(problems[:3]))


def _claims_page(claims: list[dict], page) -> list[str]:
    """The claims page's verdict words against the claims record's vocabulary (where both are there)."""
    job = next(iter(records.ok(claims)), None)
    if not job or not page.is_file() or not job.get("by_verdict"):
        return []
    return ledger.check_claims_page(page.read_text(), list(job["by_verdict"]))


def more_tables(cfg: dict, tables: dict, environments: dict) -> str:
    """details.md's tables that report.md links to, each under its heading; none where no stage gave rows."""
    shown = [f"### {DETAILS[k]}\n\n{comparison(tables[k], environments, cfg['report']['allow_mixed_environments'])}"
             for k in DETAILS if k in tables and not tables[k].empty]
    return "## More tables\n\n" + "\n\n".join(shown) if shown else ""


def run(cfg: dict, job: Job) -> dict:
    """Write report.md, details.md, the plots and summary.csv (every figure in long format) from every
    stage's metrics."""
    layout, out = job.layout, job.out
    metrics = read_results(cfg, layout)
    jobs = {f"{s}/{m['name']}" if m.get("name") else s: m for s, ms in metrics.items() for m in ms}
    refuse_stale(layout, jobs)
    metrics, withheld = screen(metrics)  # a figure beyond its physical bound is withheld from every place alike
    metrics = annotate.against_tolerance(cfg, metrics)
    tables = build_tables(metrics)
    made = decisions.build(cfg, metrics)  # every verdict, once: the glance, the plots and figures.json read it
    decisions.write(made, out / "decisions.json")
    facts = made["_facts"]
    fronts = {"finetune": finetune_pareto(metrics["finetune"], facts["finetune"]),
              "inference": inference_pareto(metrics["bench_inference"], metrics["quantize"], facts["inference"])}
    plots = draw_plots(Inputs(cfg, metrics, tables, fronts, layout, questions(out)), out)
    write_fronts(fronts, out)
    results_table(metrics).to_csv(out / "summary.csv", index=False)
    environments = {env_of(m): m["environment"] for ms in metrics.values() for m in ms if "environment" in m}
    memory = sec.memory_section(metrics["finetune"], metrics["bench_inference"], environments,
                                cfg["report"]["allow_mixed_environments"])
    answers = task_quality.answers(metrics["evaluate"])
    (out / "details.md").write_text(render(
        "details.md.j2", how_to_read=sec.how_to_read(cfg), every_answer=question_facts.every_answer(made),
        decisions="\n".join(question_facts.lines(facts, cfg)), memory=memory,
        more=more_tables(cfg, tables, environments), samples=sec.samples(metrics["bench_inference"]),
        capacity=sec.capacity_misses(metrics),
        left_out=sec.left_out_details(cfg),
        provenance=markdown(provenance_table(jobs)),
        environments=markdown(environment_table(environments)),
        answers=render("answers.md.j2", answers=answers, max_new_tokens=cfg["evaluate"]["max_new_tokens"],
                       **{k: v for k, v in task_quality.facts(cfg, metrics["evaluate"]).items()
                          if k in ("resolution", "commands")}) if answers else ""))
    (out / "report.md").write_text(report_text(cfg, metrics, tables, environments, made, withheld))
    check_statements(made, tables, metrics["claims"], withheld, out)
    log.info("report: %s", job.final / "report.md")
    return {"tables": {k: len(v) for k, v in tables.items()}, "plots": plots,
            "not_run": len(not_run_table(metrics)), "environments": len(environments),
            "decisions": decisions.answers(made)}
