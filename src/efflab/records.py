"""Result records: what a job's metrics.json holds, read, filtered and paired in one place.

Every job writes one record (cli.main): `stage`, `name`, `status` (ok, or failed / oom / timeout /
unavailable / skipped with a `reason`), its figures, `environment` and `provenance`. Benchmark records hold
cells (rows) with a status of their own. The report and the claims read records through these functions only.
"""
from __future__ import annotations

import json

from .measure.stats import median_ci_order, percentile, ratio_verdict, ratio_words, said_of_faster_side

# Settings that change what a run costs or buys; the others do not make two runs a knob comparison.
NOT_KNOBS = {"eval_rows", "checkpoint_every", "timing_warmup_steps", "num_machines", "accelerate_config"}


def is_ok(record: dict) -> bool:
    """Whether a job (or a cell) measured something: a record written before statuses existed counts as ok."""
    return record.get("status", "ok") == "ok"


def ok(records: list[dict]) -> list[dict]:
    return [r for r in records if is_ok(r)]


def ok_rows(table):
    """The rows of a report table (a DataFrame with a `status` column, "ok" or "<status>: <reason>") that
    measured something."""
    return table[table["status"] == "ok"]


def load(path) -> dict:
    """The record in one metrics.json: every reader of a record goes through here."""
    return json.loads(path.read_text())


def load_if_there(path) -> dict:
    """The record at `path`, or {} where that job has not written one (yet)."""
    return load(path) if path.is_file() else {}


def read(layout, stage: str, name: str | None = None) -> dict:
    return load(layout.metrics(stage, name))


def read_stage(layout, stage: str, names: list[str] | None) -> list[dict]:
    """The records of a stage's jobs, in the grid's order (one record for a single-job stage)."""
    return [read(layout, stage, n) for n in (names or [None])]


CELL_LISTS = ("cells", "rows", "pairs", "searches")  # where a job's grid cells are recorded
CELL_KEYS = ("method", "variant", "implementation", "mode", "generation", "kv_cache", "batch_size", "concurrency",
             "seq_len", "subject", "dimension", "a", "b")


def not_run(by_stage: dict[str, list[dict]]) -> list[dict]:
    """Every job that did not produce numbers, and every grid cell of a job that did, and why: the cells of one job
    that did not run for the same reason are one row."""
    rows = []
    for stage, records in by_stage.items():
        for r in records:
            if not is_ok(r):
                rows.append({"stage": stage, "name": r.get("name"), "status": r["status"],
                             "reason": r.get("reason", "")})
                continue
            alike: dict[tuple, list[str]] = {}
            cells = (c for key in CELL_LISTS if isinstance(r.get(key), list) for c in r[key])  # not a figure `rows: 12`
            for cell in (c for c in cells if isinstance(c, dict) and not is_ok(c)):
                label = " ".join(f"{k}={cell[k]}" for k in CELL_KEYS if k in cell)
                alike.setdefault((cell["status"], cell.get("reason") or ""), []).append(label)
            rows += [{"stage": stage, "name": f"{r.get('name') or stage}: {', '.join(labels)}", "status": status,
                      "reason": reason} for (status, reason), labels in alike.items()]
    return rows


def reference_cell(job: dict) -> dict | None:
    """A bench_inference job's measured cell at batch 1 with the KV cache and generate()'s dynamic full-precision
    cache: the one every variant has by default, the one variants are compared on (a record made before generation
    modes has no `generation`: dynamic)."""
    return next((c for c in ok(job.get("cells", [])) if c["kv_cache"] and c["batch_size"] == 1
                 and c.get("generation", "dynamic") == "dynamic" and not c.get("kv_quant")), None)


def cell_mode(cell: dict) -> str:
    """A bench_inference cell's way of generating, as the report names it: 'dynamic', 'dynamic, KV cache quanto-4',
    'assisted by healed-layers-half'."""
    mode = cell.get("generation", "dynamic")
    if cell.get("draft"):
        return f"{mode} by {cell['draft']}"
    return f"{mode}, KV cache {cell['kv_quant']}" if cell.get("kv_quant") else mode


def interleaved_pair(bench_finetune: list[dict], a: str, b: str) -> dict | None:
    """bench_finetune's measured pair of runs a and b (paired as knob_pairs pairs them: a first), or None."""
    return next((pair for job in ok(bench_finetune) for pair in ok(job.get("pairs", []))
                 if (pair["a"], pair["b"]) == (a, b)), None)


def serving_ratio(cell: dict, key: str) -> dict | None:
    """A bench_serving cell's paired throughput ratio (`throughput_vs_naive`, `continuous_vs_static`): median,
    95% interval where the burst rounds give one, verdict said of the cell; a record of one burst holds a bare
    number, read as one round (no interval, no verdict)."""
    value = cell.get(key)
    if isinstance(value, (int, float)):
        return said_of_faster_side(ratio_verdict([value])) | {"ratios": [value]}
    return value


def paired_step_times(a: dict, b: dict) -> list[float] | None:
    """Run b's step time over run a's, step by step, sorted; None unless both records carry `step_time.samples`
    of equal length (at least 2) and the same `tokens_seen`: the same batches in the same order, so step i of
    one run is step i of the other, and the ratio takes the batches' different lengths out of the spread."""
    xs, ys = (a.get("step_time") or {}).get("samples"), (b.get("step_time") or {}).get("samples")
    if not xs or not ys or len(xs) != len(ys) or len(xs) < 2 or a.get("tokens_seen") is None \
            or a.get("tokens_seen") != b.get("tokens_seen"):
        return None
    return sorted(y / x for x, y in zip(xs, ys))


def speed_changed(a: dict, b: dict, tolerance: float) -> str | None:
    """Why two runs' own step times cannot be compared, when the matmul ceilings their processes measured
    differ by more than `tolerance` (measure.timing.SENTINEL_TOLERANCE): the machine ran at another speed."""
    ca, cb = (r.get("throughput", {}).get("matmul_ceiling", {}).get("tflops") for r in (a, b))
    if ca and cb and abs(cb / ca - 1) > tolerance:
        return (f"the machine's speed changed between the runs (matmul ceiling {1000 * ca:.0f} vs "
                f"{1000 * cb:.0f} GFLOP/s)")
    return None


def step_ratio(a: dict, b: dict, bench_finetune: list[dict], tolerance: float) -> dict | None:
    """Run b's step time over run a's, measured one way for every reader (the report's knob table and its
    fine-tuning decision, the claims): `median`, `ci95` (None where n gives none), `n`, `source` and `verdict`
    (stats.ratio_words: slower / faster / same within ±10% / not decided), `why` where there is no comparison.

    Sources, best first: bench_finetune's interleaved steps of the pair (`interleaved`, `pair`); the two runs'
    steps paired step by step where they drew the same batches in the same order (`paired`, `ratios`, the
    interval's `coverage`); else the two runs' medians (`runs`), whose interval is the ratio of their
    intervals' far ends (apart only where the intervals are). The runs' own steps compare only where the matmul
    ceilings of their processes agree within `tolerance` (speed_changed). None without two timed runs."""
    for x, y, flip in ((a, b, False), (b, a, True)):
        pair = interleaved_pair(bench_finetune, x["run"], y["run"])
        if pair:
            r = pair["step_time_ratio"]
            median, ci = r.get("median"), r.get("ci95")
            if flip and median is not None:
                median, ci = 1 / median, ci and [1 / ci[1], 1 / ci[0]]
            out = {"median": median, "ci95": ci, "n": r.get("rounds"), "source": "interleaved", "pair": pair,
                   "why": r["verdict"] if median is None else None}
            return out | {"verdict": ratio_words(out, "slower", "faster")}
    sa, sb = a.get("step_time"), b.get("step_time")
    if not sa or not sb or sa.get("n", 0) < 2 or sb.get("n", 0) < 2:
        return None
    ratios = paired_step_times(a, b)
    if ratios:
        interval = median_ci_order(ratios)
        out = {"median": percentile(ratios, 0.5), "ci95": interval and interval[0], "n": len(ratios),
               "coverage": interval and interval[1], "source": "paired", "ratios": ratios}
    else:
        ia, ib = sa.get("ci95_median"), sb.get("ci95_median")
        out = {"median": sb["median"] / sa["median"], "ci95": [ib[0] / ia[1], ib[1] / ia[0]] if ia and ib else None,
               "n": min(sa["n"], sb["n"]), "source": "runs"}
    out["why"] = speed_changed(a, b, tolerance)
    return out | {"verdict": ratio_words(out, "slower", "faster")}


def flat_settings(settings: dict, prefix: str = "") -> dict:
    """A run's settings as `lora.r: 8` pairs, without the ones that are not knobs."""
    out = {}
    for key, value in settings.items():
        if isinstance(value, dict):
            out |= flat_settings(value, f"{prefix}{key}.")
        elif key not in NOT_KNOBS:
            out[prefix + key] = value
    return out


def knob_pairs(runs: list[dict]) -> list[tuple[str, object, object, dict, dict]]:
    """Pairs of trained runs whose settings differ in exactly one knob (the earlier run in params.yaml order
    first): (knob, its value in a, in b ("-" where a run lacks it), a, b). Runs with equal knobs (e.g. other eval_rows) pair once."""
    flat = [(r, flat_settings(r["settings"])) for r in ok(runs)]
    pairs, seen = [], set()
    for i, (a, fa) in enumerate(flat):
        for b, fb in flat[i + 1:]:
            differ = [k for k in fa.keys() | fb.keys() if fa.get(k) != fb.get(k)]
            same = frozenset({json.dumps(fa, sort_keys=True), json.dumps(fb, sort_keys=True)})
            if len(differ) == 1 and same not in seen:
                seen.add(same)
                pairs.append((differ[0], fa.get(differ[0], "-"), fb.get(differ[0], "-"), a, b))
    return pairs
