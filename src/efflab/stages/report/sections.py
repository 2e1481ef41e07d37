"""The report's sections: the facts each template in templates/sections/ says, read from cfg and the records."""
from __future__ import annotations

from pathlib import Path

import pandas as pd

from ... import config, records, registry
from ...measure.stats import EQUIVALENCE_MARGIN, format_ratio
from ...measure.timing import SENTINEL_TOLERANCE
from . import slices, task_quality
from .environments import comparison
from .results import absent
from .tables import MEMORY_TARGET, memory_prediction_table
from .tables.capacity import (
    capacity_estimator_off,
    capacity_held,
    capacity_largest,
    capacity_measured,
)
from .templating import render
from .writing import brief, markdown, one_line, status_text


def section(cfg: dict, metrics: dict, stage: str, title: str, body) -> list[str]:
    """A report section: its body, or one line saying why it has none."""
    why = absent(cfg, metrics, stage)
    if why:
        return [f"{title}\n\n_{why[0].upper()}{why[1:]}._"]
    return [f"{title}\n\n{body().strip()}"]


def header(base: dict, data: dict) -> str:
    return render("sections/header.md.j2", base=base, data=data, env=base["environment"],
                  dtype_note=base.get("dtype_choice", {}).get("reason", f"{base['dtype']} as configured"))


def how_to_read(cfg: dict) -> str:
    isolation = "each in a fresh process" if cfg["runtime"]["isolation"] == "subprocess" else "in the stage process"
    return render("sections/how_to_read.md.j2", isolation=isolation, band=f"{100 * EQUIVALENCE_MARGIN:g}")


def energy_note(jobs: list[dict]) -> str:
    """Where the J/token figures come from, or why there are none: one line under the table."""
    found = [e for e in jobs if e and "joules_per_token" in e]
    if found:
        return f"Energy: {found[0]['source']}, over the measured work, per token."
    reasons = sorted({e.get("unavailable", "not measured") for e in jobs if e})
    return f"Energy: unavailable here: {'; '.join(reasons) or 'not measured'}."


def prompt_count(cfg: dict, metrics: dict) -> int:
    """How many prompts bench_inference asked (as it recorded; else as configured)."""
    done = [m["prompts"] for m in records.ok(metrics["bench_inference"]) if "prompts" in m]
    chosen = cfg["bench_inference"]["prompts"]
    return done[0] if done else len(chosen) if isinstance(chosen, list) else chosen["validation_rows"]


def part_body(part, cfg: dict, metrics: dict, table) -> str:
    """A part without a section of its own: its tables, in order."""
    return render("sections/part.md.j2", tables=[table(t.name) for t in part.tables])


def evaluate_body(cfg: dict, metrics: dict, table) -> str:
    return render("sections/evaluate.md.j2", **task_quality.facts(cfg, metrics["evaluate"]))


def quantize_body(cfg: dict, metrics: dict, table) -> str:
    return render("sections/quantize.md.j2", rows=cfg["quantize"]["eval_rows"], table=table("quantize"),
                  adapter=table("quantize_adapter"))


def prune_body(cfg: dict, metrics: dict, table) -> str:
    return render("sections/prune.md.j2", p=cfg["prune"], table=table("prune"))


def b_min_text(job: dict, method: str) -> str:
    t = job["precision_range_test"][method]
    said = (f"**{t['b_min']} bits**" if t["b_min"] else
            f"not decided at this size (the interval at {t['undecided_at']} bits holds the tolerance)" if t.get("undecided_at")
            else f"none of {job['bits']} bits")
    return said + (f" (but {', '.join(map(str, t['fail_above_b_min']))} bits fail again)"
                   if t.get("fail_above_b_min") else "")


def qat_body(cfg: dict, metrics: dict, table) -> str:
    job = records.ok(metrics["qat"])[0]
    return render("sections/qat.md.j2", q=cfg["qat"], job=job | {"base_perplexity": job.get("base_perplexity")},
                  b_min={m: b_min_text(job, m) for m in ("ptq", "qat")}, table=table("qat"))


def finetune_body(cfg: dict, metrics: dict, table) -> str:
    timed = [r for r in records.ok(metrics["finetune"]) if r.get("time_to_target")]
    return render("sections/finetune.md.j2", table=table("finetune"), knobs=table("finetune_knobs"),
                  energy=energy_note([r.get("energy") for r in records.ok(metrics["finetune"])]),
                  bf=cfg["bench_finetune"], tolerance=SENTINEL_TOLERANCE,
                  target=timed[0]["time_to_target"]["target"] if timed else None,
                  target_every=timed[0]["validation_curve"]["every"] if timed else None,
                  target_table=table("finetune_target"))


def merge_body(cfg: dict, metrics: dict, table) -> str:
    return render("sections/merge.md.j2", table=table("merge"), targets=table("merge_targets"))


def attention_body(cfg: dict, metrics: dict, table) -> str:
    measured = records.ok(metrics["bench_attention"])[0].get("measured", "model forward")
    missing = [f"- {r.get('implementation') or r.get('name')}: {status_text(r)}"
               for r in metrics["bench_attention"] if not records.is_ok(r)]
    return render("sections/attention.md.j2", measured=measured[0].upper() + measured[1:],
                  table=table("bench_attention"), exponents=table("attention_memory_exponent"),
                  missing="Not measured here:\n\n" + "\n".join(missing) if missing else "")


def inference_body(cfg: dict, metrics: dict, table) -> str:
    energy = energy_note([c.get("energy") for m in records.ok(metrics["bench_inference"])
                          for c in records.ok(m.get("cells", []))])
    cells = [c for m in records.ok(metrics["bench_inference"]) for c in records.ok(m.get("cells", []))]
    return render("sections/inference.md.j2", i=cfg["bench_inference"], prompts=prompt_count(cfg, metrics),
                  table=table("bench_inference"), costs=table("bench_inference_costs"), energy=energy,
                  unavailable=unavailable_cells(metrics["bench_inference"]),
                  speculative=table("speculative") if any(c.get("speculation") for c in cells) else "",
                  kv_quant=table("kv_quant") if any(c.get("quantized_cache") for c in cells) else "")


def unavailable_cells(jobs: list[dict]) -> str:
    """The cells that could not run here (a generation mode or engine a variant or machine lacks), one line per
    mode and reason, naming the variants and batch sizes: not rows of dashes in every part of the table."""
    where: dict[tuple[str, str], list[str]] = {}
    for m in jobs:
        for c in m.get("cells", []):
            if c.get("status") == "unavailable":
                where.setdefault((records.cell_mode(c), c.get("reason", "")), []).append(
                    f"{m['variant']} at batch {c['batch_size']}")
    lines = [f"- {mode} ({', '.join(cells)}): unavailable: {reason}" for (mode, reason), cells in where.items()]
    return "Not measured here:\n\n" + "\n".join(lines) if lines else ""


def serving_body(cfg: dict, metrics: dict, table) -> str:
    job = records.ok(metrics["bench_serving"])[0]
    versus = [{"concurrency": c["concurrency"], "ratio": format_ratio(ratio), "verdict": brief(ratio["verdict"])}
              for c in records.ok(job["cells"]) if (ratio := records.serving_ratio(c, "continuous_vs_static"))]
    slo = job.get("slo_search") if (job.get("slo_search") or {}).get("subjects") else None
    return render("sections/serving.md.j2", job=job, bursts=job.get("bursts", 1), versus=versus,
                  table=table("bench_serving"), latency=table("bench_serving_latency"),
                  open_loop=job.get("open_loop"),
                  open_table=table("bench_serving_open_loop") if (job.get("open_loop") or {}).get("cells") else "",
                  slo=slo, slo_table=table("bench_serving_slo_search") if slo else "")


def capacity_body(cfg: dict, metrics: dict, table) -> str:
    job = records.ok(metrics["capacity"])[0]
    return render("sections/capacity.md.j2", job=job, table=table("capacity"), explained=_capacity_explained(job),
                  held=capacity_held([job]))


def capacity_misses(metrics: dict) -> str:
    """details.md: for each search, its measured maximum against the prediction, and what moved it."""
    job = next(iter(records.ok(metrics.get("capacity", []))), None)
    explained = _capacity_explained(job) if job else []
    return render("sections/capacity_misses.md.j2", explained=explained, held=capacity_held([job]),
                  target=MEMORY_TARGET) if explained else ""


def _capacity_explained(job: dict) -> list[dict]:
    return [{"search": s, "largest": capacity_largest(s, job["fixed"]), "measured": capacity_measured(s),
             "cause": s["cause"], "off": capacity_estimator_off(s["at_max"])}
            for s in job["searches"] if records.is_ok(s) and s.get("cause") is not None]


def memory_section(finetune: list[dict], inference: list[dict], environments: dict, allow_mixed: bool) -> str:
    return render("sections/memory.md.j2", target=MEMORY_TARGET,
                  table=comparison(memory_prediction_table(finetune, inference), environments, allow_mixed))


# The default experiment's budget (the product's, not a measurement): `make run` on a 2-core CPU.
DEFAULT_BUDGET_MIN = 15


# The larger experiment the default is cut down from, a file of the project (an input of the report rule)
GPU_PROFILE = Path("workflow/profiles/gpu/params.yaml")
# Lists of a stage's params whose values are cells of another kind, beside the stages' grids of jobs (sizes such
# as sequence lengths or batch sizes differ between machines and are not "left out")
CELL_LISTS = (("qat", "bits"), ("qat", "eval_tasks"), ("bench_attention", "modes"), ("capacity", "runs"),
              ("capacity", "variants"), ("capacity", "kv_quant"), ("bench_inference", "generation"),
              ("bench_inference", "kv_quant"))
# A bench_inference variant's own lists of cells (instead of the stage's): compared variant by variant.
VARIANT_LISTS = ("generation", "kv_quant", "batch_sizes", "kv_cache")


def left_out(cfg: dict, larger: dict) -> list[dict]:
    """What the `larger` experiment runs that `cfg` does not, per stage: the jobs of its grid, and the values of
    the lists that multiply cells (as `stage.key`)."""
    out = []
    for stage in registry.STAGES:
        mine = registry.names(cfg, stage) or []
        missing = [n for n in registry.names(larger, stage) or [] if n not in mine]
        if missing and stage == "evaluate":  # its models are the jobs listed above: their count says enough
            missing = [f"{len(missing)} more models, those of the jobs above"]
        if missing:
            out.append({"what": stage, "values": missing})
    for stage, key in CELL_LISTS:
        missing = [v for v in larger[stage].get(key) or [] if v not in (cfg[stage].get(key) or [])]
        if missing:
            out.append({"what": f"{stage}.{key}", "values": missing})
    b, big = cfg["bench_inference"], larger["bench_inference"]
    for name in [n for n in b["variants"] if n in big["variants"]]:
        for key in VARIANT_LISTS:
            mine, theirs = (v["variants"][name].get(key, v.get(key)) or [] for v in (b, big))
            if missing := [v for v in theirs if v not in mine]:
                out.append({"what": f"bench_inference.variants.{name}.{key}", "values": missing})
    drafts = (b.get("speculative") or {}).get("drafts") or {}
    if missing := [d for d in ((big.get("speculative") or {}).get("drafts") or {}) if d not in drafts]:
        out.append({"what": "bench_inference.speculative.drafts", "values": missing})
    return out


def left_out_of_larger(cfg: dict, larger: Path = GPU_PROFILE) -> list[dict] | None:
    """What this run leaves out of the larger experiment (the GPU profile), or None where that file is absent."""
    larger_file = config.REPO_ROOT / larger
    return left_out(cfg, config.load(larger_file)) if larger_file.is_file() else None


def left_out_details(cfg: dict, larger: Path = GPU_PROFILE) -> str:
    """The list for details.md ('Left out of this run'), or nothing where nothing is left out."""
    entries = left_out_of_larger(cfg, larger)
    if not entries:
        return ""
    return (f"## Left out of this run\n\nRun by the larger experiment in `{larger}`:\n\n"
            + "".join(f"- {e['what']}: {', '.join(map(str, e['values']))}\n" for e in entries))


def run_size(cfg: dict, metrics: dict, larger: Path = GPU_PROFILE) -> str:
    minutes = sum(m.get("wall_s") or 0 for ms in metrics.values() for m in ms) / 60
    served = records.ok(metrics.get("bench_serving", []))  # what ran, where it ran: a run older than open loop had none
    open_loop = served[0].get("open_loop") if served else cfg["bench_serving"].get("open_loop")
    # the SLO search of the run's record; a record older than the search says nothing of it
    slo = (served[0].get("slo_search") if served else cfg["bench_serving"].get("slo_search")) or {}
    slo_clause = "" if served and "slo_search" not in served[0] else (
        f" SLO search: {', '.join(slo['methods'])} on {', '.join(slo['workloads'])}, prefix cache "
        f"{'/'.join('on' if c else 'off' for c in slo['prefix_caching'])}, {slo['schedules']} schedules at "
        f"p{slo['percentile']:g}, {slo['steps']} bisection(s);" if slo.get("methods") else " SLO search left out;")
    return render("sections/run_size.md.j2", ft=cfg["finetune"]["defaults"], q=cfg["quantize"],
                  a=cfg["bench_attention"], i=cfg["bench_inference"], sv=cfg["bench_serving"], ol=open_loop or {},
                  slo_clause=slo_clause,
                  qt=cfg["qat"],
                  cap=cfg["capacity"], prompts=prompt_count(cfg, metrics), minutes=minutes,
                  slices=slices.text(cfg, metrics),
                  budget=DEFAULT_BUDGET_MIN, larger=larger, left_out=left_out_of_larger(cfg, larger))


def withheld(figures: list[dict]) -> str:
    """The figures the records hold beyond their physical bounds (report.screen), each with why it cannot be true:
    left out of every table, line and plot."""
    if not figures:
        return ""
    said = "; ".join(f"{w['stage']}" + (f" {w['job']}" if w["job"] != w["stage"] else "")
                     + f", {w['where']}: {w['metric']} {w['reason']}" for w in figures)
    return (f"**Withheld**, as beyond a physical bound (left out of every table, line and plot): {said}.\n")


def not_run(table: pd.DataFrame) -> str:
    return render("sections/not_run.md.j2", table=markdown(table) if not table.empty else "")


def samples(jobs: list[dict]) -> str:
    """Each question bench_inference asked, its reference answer when it came from the user's data, and every
    variant's greedy answer (first cell of each variant)."""
    answers: dict[str, dict] = {}
    for m in jobs:
        cell = records.reference_cell(m) or next(iter(records.ok(m.get("cells", []))), None)
        for s in (cell or {}).get("samples", []):
            entry = answers.setdefault(s["prompt"], {"question": one_line(s["prompt"]),
                                                     "reference": one_line(s.get("reference")), "by": {}})
            entry["by"][m["variant"]] = one_line(s["answer"])
    return render("sections/samples.md.j2", questions=list(answers.values())) if answers else ""


def profiles(metrics: dict) -> str:
    """Each profiled job's trace, linked, and its 10 operators with the most self time."""
    found = [(f"finetune {m['run']}", f"../finetune/{m['name']}", m["profile"])
             for m in records.ok(metrics["finetune"]) if m.get("profile")]
    found += [(f"bench_inference {m['name']}, KV cache {c['kv_cache']}, batch {c['batch_size']}"
               f"{'' if c.get('generation', 'dynamic') == 'dynamic' else ', ' + c['generation']}",
               f"../bench_inference/{m['name']}", c["profile"])
              for m in records.ok(metrics["bench_inference"]) for c in records.ok(m.get("cells", []))
              if c.get("profile")]
    return render("sections/profile.md.j2", found=[profile_facts(*f) for f in found]) if found else ""


def profile_facts(title: str, folder: str, prof: dict) -> dict:
    if "unavailable" in prof:
        return {"title": title, "unavailable": prof["unavailable"]}
    top = pd.DataFrame(prof["top10"]).rename(columns={
        "self_cpu_ms": "self CPU (ms)", "cpu_total_ms": "CPU total (ms)", "self_device_ms": "self GPU (ms)",
        "device_total_ms": "GPU total (ms)"})
    return {"title": title, "unavailable": None, "folder": folder, "top": markdown(top)} | {
        k: prof[k] for k in ("trace", "steps", "top_ops", "sorted_by")}
