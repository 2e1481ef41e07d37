"""The options of each decision the report answers, read from the records: each axis a value with its interval.

Axes: `memory` (MiB; footprints are exact byte counts, a run's peak is one measurement, with its kind's measured
error as its interval where the records read that kind twice: memory_errors), `speed` (a ratio
over the decision's baseline from an interleaved comparison, with its order-statistic interval; the baseline is
exactly 1), `step` (a run's median step time in s with its interval: runs in separate processes), `quality`
(the perplexity change in % over the baseline on the same validation rows, with its paired interval), `kl`
(a merge's mean KL to the adapter: fidelity, one value).
"""
from __future__ import annotations

from ... import quality, records
from ...measure.memory import allocated_delta
from ...measure.timing import SENTINEL_TOLERANCE
from .dominance import axis
from .writing import MiB, peak_mib


def ratio_axis(ratio: dict | None) -> dict | None:
    """An interleaved speedup (measure.stats.speedup) as an axis: its median and 95% interval, or no interval; a
    speedup the sentinel left without a figure (no stable rounds) is an axis with no value and its `why`."""
    if not ratio:
        return None
    if ratio.get("median") is None:
        why = ratio.get("verdict") or ""
        return {"value": None, "lo": None, "hi": None, "n": ratio.get("rounds"),
                "why": why.removeprefix("not a verdict: ")} if why.startswith("not a verdict") else None
    lo, hi = ratio.get("ci95") or (None, None)
    return axis(ratio["median"], lo, hi, n=ratio.get("rounds"))


def change_axis(change: dict | None) -> dict | None:
    """A paired perplexity change (quality.paired_change) in %, with its interval where n gives one."""
    if not change or change.get("change_pct") is None:  # none, or unavailable (e.g. evaluated on other rows)
        return None
    lo, hi = change.get("ci95_change_pct") or (None, None)
    return axis(change["change_pct"], lo, hi, n=change.get("n_rows"))


def _zero(n=None) -> dict:
    return axis(0.0, exact=True, n=n)


def _one() -> dict:
    return axis(1.0, exact=True)


def decode_speedup(inference: list[dict], kind: str, of: str | None) -> dict | None:
    """A variant's interleaved decode speedup over the base model, its batch-1 KV-cache cell."""
    for job in records.ok(inference):
        cell = records.reference_cell(job)
        if cell and job["kind"] == kind and (of is None or job.get("of") == of):
            return (cell.get("vs_base") or {}).get("generation_speedup")
    return None


def quantize_options(quantize: list[dict], inference: list[dict], baseline: str) -> list[dict]:
    out = []
    for r in records.ok(quantize):
        base = r["scheme"] == baseline
        out.append({"name": r["scheme"], "baseline": base, "axes": {
            "memory": axis(r["memory_footprint_bytes"] / MiB, exact=True),
            "quality": _zero() if base else change_axis(r.get("perplexity_change")),
            "speed": _one() if base else ratio_axis(decode_speedup(inference, "quantized", r["scheme"]))}})
    return out


def fine_tuned_quality(finetune: list[dict], merge: list[dict]) -> dict[tuple[str, str], dict | None]:
    """The perplexity change over the untouched base model of each adapter and merged model, paired on the
    fine-tuning validation rows: (kind, run) -> axis. The base's rows are a full-precision run's validation before
    training; a model evaluated on other rows has none."""
    runs = records.ok(finetune)
    base = next((r["validation_before"] for r in runs if r["method"] != "qlora" and r.get("validation_before")), None)

    def over_base(evaluation: dict | None) -> dict | None:
        try:
            return change_axis(quality.paired_change(base["per_row"], evaluation["per_row"]))
        except (KeyError, TypeError, ValueError):  # no base rows, or not the same rows
            return None

    out = {("adapter", r["run"]): over_base(r.get("validation_after")) for r in runs}
    out |= {("merged", m["run"]): over_base((m.get("merged") or {}).get("validation")) for m in records.ok(merge)}
    return out


def inference_options(inference: list[dict], quantize: list[dict], finetune: list[dict] = (),
                      merge: list[dict] = ()) -> list[dict]:
    """Each inference variant: its footprint, its interleaved speed over the base, and its perplexity change over
    the base (a quantized scheme's on quantize's rows; an adapter's or merged model's on the fine-tuning rows)."""
    changes = {r["scheme"]: r.get("perplexity_change") for r in records.ok(quantize)}
    tuned = fine_tuned_quality(finetune, merge)
    out = []
    for job in records.ok(inference):
        cell = records.reference_cell(job)
        if cell is None or job["kind"] not in ("base", "quantized", "merged", "adapter"):
            continue
        base = job["kind"] == "base"
        quality_axis = _zero() if base else change_axis(changes.get(job["of"])) if job["kind"] == "quantized" \
            else tuned.get((job["kind"], job.get("of")))
        out.append({"name": job["variant"], "baseline": base, "kind": job["kind"], "of": job.get("of"), "axes": {
            "memory": axis(cell["memory_footprint_bytes"] / MiB, exact=True),
            "speed": _one() if base else ratio_axis((cell.get("vs_base") or {}).get("generation_speedup")),
            "quality": quality_axis}})
    return [o for o in out if o["baseline"] or not any(p["name"] == o["name"] for p in out if p is not o)]


def _per_row(record: dict) -> list | None:
    return (record.get("validation_after") or {}).get("per_row")


def step_ratio_axis(reference: dict, run: dict, bench_finetune: list[dict]) -> dict | None:
    """A run's step time over the reference run's (records.step_ratio: the knob table's and the claims' one
    measurement), with its interval; `why` where the runs cannot be compared."""
    if run is reference:
        return _one()
    ratio = records.step_ratio(reference, run, bench_finetune, SENTINEL_TOLERANCE)
    if not ratio or ratio["median"] is None:
        return None
    lo, hi = ratio["ci95"] or (None, None)
    return axis(ratio["median"], None if ratio["why"] else lo, None if ratio["why"] else hi, n=ratio["n"]) | {
        "why": ratio["why"], "source": ratio["source"]}


def paired_axis(reference: dict | None, variant: dict | None) -> dict | None:
    """The paired perplexity change of two evaluations of the same rows as an axis; None where they differ."""
    try:
        return change_axis(quality.paired_change(reference["per_row"], variant["per_row"]))
    except (KeyError, TypeError, ValueError):  # not evaluated, or not on the same rows
        return None


# Where memory_errors' repeated readings come from, said with the error.
LOADED_REPEATS = ("capacity: the memory its budget holds with the model loaded, before any step, read in a fresh "
                  "process per cell; each search's maximum read again against its first cell")


def _loaded_pair(search: dict) -> tuple[float, float] | None:
    """A capacity search's two readings of its subject's loaded memory, in two cell processes: its first cell's
    and its maximum's (`at_max.loaded_shift_mib` is their difference); None where the maximum is the first cell."""
    m = search.get("at_max") or {}
    loaded, shift = m.get("loaded_mib"), m.get("loaded_shift_mib")
    first = (search.get("grid") or [[None, None]])[0][0 if search.get("dimension") == "batch_size" else 1]
    rerun = search.get("timed_in") == "a re-run of the maximum"
    if loaded is None or shift is None or not rerun and first in (None, search.get("measured_max")):
        return None
    return (loaded - shift, loaded) if min(loaded - shift, loaded) > 0 else None


PEAK_REPEATS = ("capacity: the peak its budget holds of one training or generation cell, run twice in two fresh "
                "processes (each search's maximum, in the search and again to be timed)")


def _peak_pair(search: dict) -> tuple[float, float] | None:
    """A capacity search's two readings of its maximum's peak, in the search's cell and in its timed re-run: the same
    work measured twice, the error a peak of that work carries."""
    a, b = search.get("search_peak_mib"), (search.get("at_max") or {}).get("peak_mib")
    return (a, b) if a and b and search.get("timed_in") == "a re-run of the maximum" else None


def repeat_error(kind: str, pairs: list[tuple[float, float]], source: str = LOADED_REPEATS) -> dict:
    """The measurement error of a memory kind from pairs of readings of the same thing in separate processes: the
    largest relative difference of a pair (over its smaller reading), with how many pairs and where from."""
    largest = max(pairs, key=lambda p: abs(p[0] - p[1]) / min(p))
    return {"kind": kind, "pct": 100 * abs(largest[0] - largest[1]) / min(largest), "pairs": len(pairs),
            "largest_mib": abs(largest[0] - largest[1]), "of_mib": min(largest), "from": source}


def memory_errors(capacity: list[dict]) -> dict[str, dict]:
    """The run-to-run spread of each memory kind the records read twice (repeat_error), by kind, of the kind
    capacity's budget holds (`budget.memory`: cpu_peak_rss on a CPU): the peaks of one cell's work run twice where
    the records hold them (the kind of work a training peak is), else the loaded model's memory read twice (records
    made before). A kind no record read twice has none: its single measurements decide nothing."""
    out: dict[str, dict] = {}
    for job in records.ok(capacity):
        kind = str((job.get("budget") or {}).get("memory", "")).split(":")[0]
        searches = records.ok(job.get("searches", []))
        peaks = [p for p in map(_peak_pair, searches) if p]
        loaded = [p for p in map(_loaded_pair, searches) if p]
        if kind and (peaks or loaded):
            out[kind] = repeat_error(kind, peaks, PEAK_REPEATS) if peaks else repeat_error(kind, loaded)
    return out


def memory_axis(memory: dict | None) -> dict | None:
    """A run's peak memory, one measurement, with its kind's measured error (`error`, memory_errors: put on the
    record by decisions.build) as its interval, value ± `error_pct`; without one, no interval."""
    return _peak_axis(peak_mib(memory), (memory or {}).get("error"))


def finetune_options(finetune: list[dict], bench_finetune: list[dict] = ()) -> list[dict]:
    """Each run: its peak training memory (memory_axis), its median step time (interval from its own steady
    steps, a separate process per run), its step time over the first run's (step_ratio_axis) and its validation
    perplexity after training over the first run's, paired on the same rows where both recorded them."""
    runs = records.ok(finetune)
    if not runs:
        return []
    reference = runs[0]
    out = []
    for r in runs:
        step = r.get("step_time") or {}
        lo, hi = step.get("ci95_median") or (None, None)
        change = None
        if r is reference:
            change = _zero(len(_per_row(r) or []) or None)
        elif _per_row(r) and _per_row(reference):
            try:
                change = change_axis(quality.paired_change(_per_row(reference), _per_row(r)))
            except ValueError:  # different validation rows: not paired
                change = None
        out.append({"name": r["run"], "baseline": r is reference, "method": r["method"], "axes": {
            "memory": memory_axis(r["train_memory"]),
            "step": axis(step.get("median"), lo, hi, n=step.get("n")) if step else None,
            "step_ratio": step_ratio_axis(reference, r, bench_finetune),
            "quality": change}, "settings": r.get("settings", {}),
            "memory_kind": r["train_memory"]["kind"]})
    return out


ATTENTION_REPEATS = "bench_attention: each cell's peak over its start, its step measured twice in one process"


def attention_memory_error(attention: list[dict]) -> dict | None:
    """The error of an attention cell's peak (allocated_delta's kind), from every cell's two readings of the same
    step (repeat_error); None for records that read it once: their single peaks decide nothing."""
    pairs, kind = [], None
    for r in records.ok(attention):
        for row in records.ok(r.get("rows", [])):
            (a, kind), (b, _) = allocated_delta(row["memory"]), allocated_delta(row.get("memory_again") or {})
            if a and b and a > 0 and b > 0:
                pairs.append((a, b))
    return repeat_error(kind, pairs, ATTENTION_REPEATS) if pairs else None


def _peak_axis(peak: float | None, error: dict | None) -> dict | None:
    """One peak, ± its kind's measured error where there is one (as memory_axis does a training peak)."""
    if peak is None or not error:
        return axis(peak, n=1)
    half = peak * error["pct"] / 100
    return axis(peak, peak - half, peak + half, n=1) | {"error_pct": error["pct"]}


def attention_options(attention: list[dict]) -> tuple[list[dict], dict | None]:
    """Each implementation at the longest forward cell every one of them ran (batch of the first): its interleaved
    speedup over eager and its peak memory over the baseline, ± the error of its kind the cells measured
    (attention_memory_error); and that cell's (mode, seq_len, batch)."""
    cells = {}
    for r in records.ok(attention):
        for row in records.ok(r.get("rows", [])):
            cells.setdefault((row.get("mode", "forward"), row["seq_len"], row["batch_size"]), {})[
                row["implementation"]] = row
    full = [k for k, v in cells.items() if len(v) == max(map(len, cells.values()))] if cells else []
    if not full:
        return [], None
    key = max(full, key=lambda k: (k[0] == "forward", k[1], -k[2]))
    error, out = attention_memory_error(attention), []
    for impl, row in cells[key].items():
        eager = impl == "eager"
        peak, kind = allocated_delta(row["memory"])  # the kind the attention table and its plot read, named
        out.append({"name": impl, "baseline": eager, "memory_kind": kind, "axes": {
            "speed": _one() if eager else ratio_axis((row.get("vs_eager") or {}).get("speedup")),
            "memory": _peak_axis(peak, error),
            "agreement": axis(row.get("max_abs_diff_vs_eager"), exact=True)}})
    return out, {"mode": key[0], "seq_len": key[1], "batch": key[2]}


def merge_options(job: dict) -> list[dict]:
    """A merged run's routes (merge targets): fidelity to the adapter (mean KL) and perplexity change over the
    adapter on the same rows (paired, where the record has it)."""
    return [{"name": target, "baseline": False, "axes": {
        "kl": axis(t["kl_mean"], exact=True),
        "quality": change_axis(t.get("perplexity_change"))},
        "perplexity": t["validation"]["perplexity"]} for target, t in (job.get("targets") or {}).items()]
