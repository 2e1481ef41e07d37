"""Measured claims of fine-tuning: figures read from the finetune jobs' records (and bench_finetune's interleaved
steps), each a Reading (verdict.Reading). Unlike the other readings (readings.py) they take the fine-tuning jobs'
names as well: the grid the report reads.
"""
from __future__ import annotations

from ... import records
from ...measure.timing import SENTINEL_TOLERANCE
from .verdict import NotHere, Reading


def _finetune_runs(layout, names: list[str]) -> list[dict]:
    """The fine-tuning jobs `names` (registry.names(cfg, "finetune"): the grid the report reads too) that trained,
    in the grid's order; a job without a record yet, or one that did not train, measured nothing."""
    return records.ok([r for r in (records.load_if_there(layout.metrics("finetune", n)) for n in names) if r])


def _among(runs: list[dict], names: list[str]) -> str:
    """Where a claim looked for its fine-tuning runs, for its reason: the jobs of finetune.runs that trained, and
    those that did not (or have no record yet)."""
    trained = [r["run"] for r in runs]
    others = [n for n in names if n not in trained]
    return (f"among the finetune runs that trained ({', '.join(trained) or 'none'}"
            f"{'; no trained record of ' + ', '.join(others) if others else ''})")


def finetune_trainable(layout, metric: dict, names: list[str]) -> Reading:
    trained = _finetune_runs(layout, names)
    runs = [r for r in trained if r.get("method") == metric["method"]]
    if not runs:
        raise NotHere(f"no {metric['method']} run {_among(trained, names)}")
    r = runs[0]
    p = r["parameters"]
    return Reading(100 - p["trainable_pct"], f"run {r['run']}: {p['trainable']:,} trainable of {p['total']:,} "
                                             f"parameters", exact=True)


def finetune_pair(layout, metric: dict, names: list[str]) -> Reading:
    """The claim's statistic of run a's `key` over run b's, for the fine-tuning runs of `names` that differ only in
    `differ` (records.knob_pairs, as the report pairs them), read by _pair_reading: the report's one pair rule."""
    key, differ = metric["key"], metric["differ"]
    stat = (lambda r: 100 * (1 - r)) if metric["stat"] == "drop_pct" else (lambda r: 100 * (r - 1))
    trained = _finetune_runs(layout, names)
    for knob, value_a, value_b, a, b in records.knob_pairs(trained):
        if knob != differ:
            continue
        if (value_a, value_b) == (metric["b"], metric["a"]):  # the pair in the claim's order
            value_a, value_b, a, b = value_b, value_a, b, a
        if (value_a, value_b) == (metric["a"], metric["b"]):
            return _pair_reading(layout, a, b, key, stat)
    raise NotHere(f"no pair of finetune runs that differ only in {differ} ({metric['a']} vs {metric['b']}) "
                  f"{_among(trained, names)}; add one to finetune.runs")


def _pair_reading(layout, a: dict, b: dict, key: str, stat) -> Reading:
    """Run a's `key` (step_s or tokens_per_s) over run b's, from the one step-time ratio the report's knob table
    shows (records.step_ratio: interleaved, paired steps or the runs' intervals, with the speed-changed guard);
    the runs' whole-run figures where they carry no per-step times."""
    whole = f"{key}: run {a['run']} {a[key]:.4g} vs run {b['run']} {b[key]:.4g}"
    path = layout.metrics("bench_finetune")
    bench = [records.load(path)] if path.is_file() else []
    ratio = records.step_ratio(a, b, bench, SENTINEL_TOLERANCE) if key in ("step_s", "tokens_per_s") else None
    if ratio is None:
        return Reading(stat(a[key] / b[key]), f"the two runs' whole-run figures, {whole}")
    if ratio["why"]:
        raise NotHere(f"{ratio['source']} step times of {a['run']} vs {b['run']}: {ratio['why']}")
    median, ci = ratio["median"], ratio["ci95"]
    if key == "step_s":  # b's step time over a's: a's over b's is its inverse; tokens/s (same tokens) is not
        median, ci = 1 / median, ci and [1 / ci[1], 1 / ci[0]]
    interval = ci and tuple(sorted([stat(ci[0]), stat(ci[1])]))
    said = f"{key} of run {a['run']} over run {b['run']}: {median:.4g}"
    if ratio["source"] == "interleaved":
        spread = f"95% interval [{ci[0]:.4g}, {ci[1]:.4g}] from order statistics" if ci else \
            f"no 95% interval ({ratio['pair']['step_time_ratio']['verdict']})"
        return Reading(stat(median), f"{said}, {spread} over bench_finetune's {ratio['n']} interleaved rounds of "
                                     f"both runs' steps over the same batches; the runs' own whole-run figures: "
                                     f"{whole}", interval)
    if ratio["source"] == "runs":
        spread = f"[{ci[0]:.4g}, {ci[1]:.4g}] from the far ends of the runs' own intervals" if ci else \
            "no interval (too few steps in a run for one)"
        return Reading(stat(median), f"{said}, the ratio of the runs' median steps, {spread}; {whole}", interval)
    n = ratio["n"]
    per_step = "step time" if key == "step_s" else f"tokens/s (run {b['run']}'s step time over run {a['run']}'s)"
    said = f"{key} of run {a['run']} over run {b['run']}: median of {n} paired steps' {per_step} ratios {median:.4g}"
    if ci is None:
        xs = ratio["ratios"] if key == "tokens_per_s" else [1 / r for r in ratio["ratios"]]
        return Reading(stat(median), f"{said}, range [{min(xs):.4g}, {max(xs):.4g}] ({n} steps give no 95% "
                                     f"interval; 6 needed); over whole runs, {whole}")
    return Reading(stat(median), f"{said}, {ratio['coverage']:.1%} interval [{ci[0]:.4g}, {ci[1]:.4g}] from order "
                                 f"statistics (the same {a['tokens_seen']:,} tokens in the same order); over whole "
                                 f"runs, {whole}", interval)
