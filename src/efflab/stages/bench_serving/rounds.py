"""The serving rounds (serve_rounds: a warm-up, the balanced order, the speed sentinel) and the burst's figures: each
cell's throughput and latency percentiles over its bursts, and the paired comparisons between methods."""
from __future__ import annotations

import logging

import torch

from ...measure import timing
from ...measure.stats import percentile, ratio_verdict, said_of_faster_side, summarize
from ...measure.timing import SENTINEL_TOLERANCE, balanced_order

log = logging.getLogger("efflab")
CPU = torch.device("cpu")


def percentiles(rows: list[dict]) -> dict:
    """TTFT and latency percentiles of requests (of one burst, or pooled over bursts)."""
    ttft = sorted(r["first_token_s"] for r in rows if r["first_token_s"] is not None)
    latency = sorted(r["finished_s"] - r["submitted_s"] for r in rows)
    pct = lambda xs: {f"p{q}": percentile(xs, q / 100) for q in (50, 90, 99)} if xs else None  # noqa: E731
    return {"ttft_s": pct(ttft), "latency_s": pct(latency)}


def figures(rows: list[dict]) -> dict:
    """Throughput and latency percentiles of one burst of one (method, concurrency) from its per-request rows."""
    makespan = max(r["finished_s"] for r in rows)
    tokens = sum(r["output_tokens"] for r in rows)
    return {"requests": len(rows), "output_tokens": tokens, "makespan_s": makespan,
            "requests_per_s": len(rows) / makespan, "output_tokens_per_s": tokens / makespan} | percentiles(rows)


def cell_figures(rows: list[dict]) -> dict:
    """A cell's figures over its bursts: each burst's (with its index), the median requests/s and output tokens/s
    over them (with the 95% interval of the median where there are 6 bursts or more), and percentiles over the
    pooled requests."""
    by_burst = [{"burst": b} | figures([r for r in rows if r["burst"] == b])
                for b in sorted({r["burst"] for r in rows})]
    rate = lambda key, unit: summarize([f[key] for f in by_burst], unit)  # noqa: E731
    return {"requests": by_burst[0]["requests"], "output_tokens": by_burst[0]["output_tokens"],
            "bursts": len(by_burst), "makespan_s": rate("makespan_s", "s"),
            "requests_per_s": rate("requests_per_s", "requests/s"),
            "output_tokens_per_s": rate("output_tokens_per_s", "tokens/s"),
            **percentiles(rows), "percentiles_of": f"the {len(rows)} requests of {len(by_burst)} bursts, pooled",
            "by_burst": by_burst}


def paired_throughput(mine: dict, reference: dict, unstable: str | None = None) -> dict:
    """`mine`'s output tokens/s over `reference`'s, burst round by burst round (served in the same round, so a
    drift between rounds cancels): ratio_verdict's median, 95% interval and verdict, said of `mine` (`faster`:
    more tokens/s), and each round's ratio. Where the speed sentinel found the machine `unstable` (too few stable
    bursts), no verdict, as measure.stats.paired_ratio gives none: the ratios are kept, the median is not read."""
    ratios = [a["output_tokens_per_s"] / b["output_tokens_per_s"]
              for a, b in zip(mine["by_burst"], reference["by_burst"])]
    if unstable:
        return {"median": None, "ci95": None, "rounds": len(ratios), "verdict": f"not a verdict: {unstable}",
                "ratios": ratios}
    return said_of_faster_side(ratio_verdict(ratios)) | {"ratios": ratios}


def compare(cells: list[dict], unstable: str | None = None) -> None:
    """Each measured batching cell's paired throughput over naive serving (`throughput_vs_naive`), and each
    continuous batching cell's over static batching at its concurrency (`continuous_vs_static`); no verdicts where
    the bursts were `unstable` (paired_throughput)."""
    ok = {(c["method"], c["concurrency"]): c for c in cells if c["status"] == "ok"}
    naive = ok.get(("naive", 1))
    for (method, concurrency), c in ok.items():
        if naive and method != "naive":
            c["throughput_vs_naive"] = paired_throughput(c, naive, unstable)
        if method == "continuous" and ("static", concurrency) in ok:
            c["continuous_vs_static"] = paired_throughput(c, ok["static", concurrency], unstable)


def cell_name(cell: dict) -> str:
    return f"{cell['method']}@{cell['rate']:g}/s" if "rate" in cell else f"{cell['method']}@{cell['concurrency']}"


def serve_rounds(serve, cells: list[dict], bursts: int, device: torch.device = CPU,
                 tolerance: float = SENTINEL_TOLERANCE, extra_bursts: int | None = None) -> tuple[list[dict], dict]:
    """One warm-up pass (`serve(cell, warm=True)`: first-call work stays out), then `bursts` rounds, each serving
    the burst once with every cell (`serve(cell, warm=False)`: the burst's per-request rows), in measure.timing's
    balanced order (rotated every two rounds, every other round reversed), the rounds watched by the speed sentinel
    (measure.timing.sentinel_rounds: a speed probe between bursts; a burst whose probes strayed beyond ±tolerance of
    the median is set aside and another served in its place, at most `extra_bursts` more, default `bursts`). A cell
    whose serving raises leaves the rounds: a serving path this stack cannot run is a row, not a crash; one that
    raises on its warm-up, before serving anything, is unavailable (DeepSeek-V3's latent cache in transformers'
    paged cache), one that raises later failed. Returns the rows, each with its burst, and the sentinel's record:
    each burst's order, probes, whether it is stable and, for one set aside, why (`set_aside_because`); None where
    no cell is left to serve."""
    def attempt(cell, warm: bool):
        try:
            return serve(cell, warm)
        except Exception as err:  # on its first call, the path cannot run here (e.g. a cache of another layout)
            cell |= {"status": "unavailable" if warm else "failed",
                     "reason": f"{type(err).__name__}: {str(err).splitlines()[0]}"}
            log.warning("%s: %s: %s", cell_name(cell), cell["status"], cell["reason"])
            return None

    live = [c for c in cells if attempt(c, True) is not None]
    if not live:
        return [], None
    rows = {id(c): [] for c in live}

    def burst(index: int) -> dict:
        order = [c for c in balanced_order(live, index) if c.get("status") != "failed"]
        for c in order:
            served = attempt(c, False)
            if served is not None:
                rows[id(c)] += [{"method": c["method"], "concurrency": c["concurrency"], "burst": index, **r}
                                for r in served]
        return {"burst": index, "order": [cell_name(c) for c in order]}

    sentinel = timing.sentinel_rounds(burst, bursts, device, tolerance, extra_bursts)
    for i, why in timing.set_aside_why(sentinel["rounds"], tolerance).items():
        sentinel["rounds"][i]["set_aside_because"] = why
    sentinel["figures_of_bursts"] = [sentinel["rounds"][i]["burst"]
                                     for i in timing.figure_rounds(sentinel["rounds"], bursts)]
    return [r for c in live if c.get("status") != "failed" for r in rows[id(c)]], sentinel


def measure(cells: list[dict], serve, bursts: int, device: torch.device = CPU, tolerance: float = SENTINEL_TOLERANCE,
            extra_bursts: int | None = None) -> tuple[list[dict], dict | None]:
    """Serve the burst with every cell not already marked (unavailable), `bursts` stable interleaved rounds
    (serve_rounds); then each served cell's figures from its own per-request rows of the bursts the figures are of
    (the stable ones; every one, flagged `unstable`, where too few are), and the paired comparisons (compare).
    Returns the per-request rows of every burst served, set-aside ones included, and the sentinel's record."""
    log_rows, sentinel = serve_rounds(serve, [c for c in cells if "status" not in c], bursts, device, tolerance,
                                      extra_bursts)
    kept = set(sentinel["figures_of_bursts"]) if sentinel else set()
    for c in cells:
        if "status" not in c:
            c |= {"status": "ok"} | cell_figures([r for r in log_rows if r["burst"] in kept and
                                                  (r["method"], r["concurrency"]) == (c["method"], c["concurrency"])])
    compare(cells, (sentinel or {}).get("unstable"))
    return log_rows, sentinel
