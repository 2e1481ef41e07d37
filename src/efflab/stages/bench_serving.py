"""Stage bench_serving: a burst of N requests of varied lengths served three ways, at each concurrency level,
the burst repeated and the ways interleaved so that their throughputs carry an interval.

All N requests arrive at once (an offline burst: latency includes the wait in the queue). `concurrency` is
how many the server works on at a time:
  naive       one request at a time, `generate()` each (concurrency does not apply: it is the floor);
  static      batches of `concurrency` requests, left-padded, each batch generated until its longest request
              is done and returned as a whole (a request's latency is its batch's end);
  continuous  transformers' continuous batching (paged KV cache; `max_requests_per_batch` = concurrency): a
              finished request leaves the batch at once and a waiting one takes its place;
  vllm        vLLM's engine on the base model's folder (efflab.models.engines), where it is installed and the device is a
              CUDA GPU, else `unavailable`: at most `concurrency` requests in the engine at a time, a finished one
              replaced by a waiting one at once (vLLM batches those in the engine continuously, paged KV cache).
After one untimed warm-up pass, each of `bursts` rounds serves the burst once with every (method, concurrency)
cell, measured as bench_inference's rounds are (measure.timing): the cells in a balanced order (balanced_order:
rotated by one every two rounds, every other round the reverse of the one before, A B C, C B A, B C A, A C B, ...),
so that in each two rounds served (the first and second, the third and fourth, ...) every pair of cells runs once
in each order; a speed probe before the first burst and after each, outside the serving (sentinel_rounds); a burst
whose probes strayed beyond ±`sentinel_tolerance` of the median probe set aside, with why, and another served in
its place (at most `bursts` more). Every request's burst, times (submitted, first token, finished) and lengths go to
requests.csv (set-aside bursts too: the record's `sentinel` names them), from which every figure of the metrics is
computed, of the stable bursts (of every burst, the record `unstable`, where fewer than `bursts` stayed stable):
each burst's requests/s and output tokens/s, their median over the bursts with its 95% interval where the bursts
give one, the paired per-round ratios over naive and of continuous over static batching
(measure.stats.ratio_verdict; no verdict where too few bursts were stable), and percentiles of TTFT and latency
over the pooled requests of those bursts.

Open loop (`open_loop`; null or no rates: left out): at each offered rate, `requests` requests sent with Poisson
arrivals (measure.load.arrivals: seeded by seed, rate and round, so that every method is sent the same schedule in a
round), naive one at a time in arrival order, continuous batching (and vLLM, where its engine takes `arrivals`) each
request submitted at its arrival, at most max(`concurrency`) at once; static batching is not served open loop. The
methods at a rate are the cells of serve_rounds (warm-up, balanced order, speed sentinel), `repeats` rounds. Every
request's scheduled arrival, first token and end go to open_loop_requests.csv, and every open-loop figure (measure.load:
throughput, goodput under `slo`, TTFT / TPOT / latency percentiles from the scheduled arrival, the saturation rule) is
computed from those rows.
"""
from __future__ import annotations

import csv
import inspect
import logging
import random
import time
from pathlib import Path

import torch

from .. import cli
from ..layout import Job
from ..measure import load, timing
from ..measure.device import synchronize
from ..measure.env import environment
from ..measure.stats import format_ratio, percentile, ratio_verdict, said_of_faster_side, summarize
from ..measure.timing import SENTINEL_TOLERANCE, balanced_order
from ..models import engines
from ..models.modeling import load_model, read_split

# transformers takes seconds to import: it is imported inside the functions that use it.

log = logging.getLogger("efflab")
CPU = torch.device("cpu")

REQUEST_COLUMNS = ("method", "concurrency", "burst", "request", "prompt_tokens", "output_tokens", "submitted_s",
                   "first_token_s", "finished_s")


def requests(cfg: dict, layout, n: int | None = None) -> list[dict]:
    """N prompts (`requests`, or n) from the validation rows (their prompt part: varied lengths) with seeded output
    lengths: n requests are the first n of any longer list."""
    s = cfg["bench_serving"]
    rows = read_split(layout.split("validation")) + read_split(layout.split("train"))
    rng = random.Random(s["seed"])
    lo, hi = s["max_new_tokens"]
    out = []
    for i in range(s["requests"] if n is None else n):
        row = rows[i % len(rows)]
        prompt = [t for t, label in zip(row["input_ids"], row["labels"]) if label == -100] or row["input_ids"][:8]
        out.append({"request": i, "prompt": prompt, "new_tokens": rng.randint(lo, hi)})
    return out


class FirstToken:
    """A generate() streamer that notes when the first new token of a batch appears (the second put())."""

    def __init__(self, device: torch.device):
        self.device, self.puts, self.first = device, 0, None

    def put(self, value):
        self.puts += 1
        if self.puts == 2:
            synchronize(self.device)
            self.first = time.perf_counter()

    def end(self):
        pass


def _generate(model, tokenizer, prompts: list[list[int]], new_tokens: int, device) -> tuple[float, torch.Tensor]:
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    clock = FirstToken(device)
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                             do_sample=False, num_beams=1, pad_token_id=pad, streamer=clock)
    synchronize(device)
    return clock.first, out


def _wait_until(t: float) -> None:
    if t > time.perf_counter():
        time.sleep(t - time.perf_counter())


def serve_naive(model, tokenizer, reqs: list[dict], concurrency: int, device, arrivals=None) -> list[dict]:
    """One request at a time in arrival order (`arrivals`: seconds from the start; None: all at once), each waiting
    for the one before it to finish."""
    arrivals = arrivals or [0.0] * len(reqs)
    t0, log_ = time.perf_counter(), []
    for r, at in zip(reqs, arrivals):
        _wait_until(t0 + at)
        first, _ = _generate(model, tokenizer, [r["prompt"]], r["new_tokens"], device)
        log_.append(_row(r, t0, first, time.perf_counter(), arrival=at))
    return log_


def serve_static(model, tokenizer, reqs: list[dict], concurrency: int, device) -> list[dict]:
    t0, log_ = time.perf_counter(), []
    for i in range(0, len(reqs), concurrency):
        batch = reqs[i:i + concurrency]
        first, _ = _generate(model, tokenizer, [r["prompt"] for r in batch], max(r["new_tokens"] for r in batch), device)
        done = time.perf_counter()
        log_ += [_row(r, t0, first, done) for r in batch]
    return log_


def _continuous_config(tokenizer, reqs: list[dict], concurrency: int):
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    gen = GenerationConfig(do_sample=False, max_new_tokens=max(r["new_tokens"] for r in reqs),
                           eos_token_id=-1, pad_token_id=tokenizer.pad_token_id)  # forced lengths: no early stop
    # A paged cache sized to this burst (every request's prompt and output, in 256-token pages, twice over):
    # left to itself it takes most of the free memory, 14 GB here, which a CPU spends seconds zeroing.
    page = 256
    pages = sum(-(-(len(r["prompt"]) + r["new_tokens"]) // page) for r in reqs)
    # transformers 5.17 (efflab's floor) names the page block_size; later versions page_size (block_size deprecated)
    size_key = "page_size" if "page_size" in inspect.signature(ContinuousBatchingConfig).parameters else "block_size"
    cb = ContinuousBatchingConfig(max_requests_per_batch=concurrency, num_blocks=2 * pages + 2, **{size_key: page},
                                  max_batch_tokens=max(page, concurrency * max(len(r["prompt"]) for r in reqs)))
    return gen, cb


def _submit_and_collect(manager, reqs: list[dict], arrivals: list[float], t0: float) -> dict:
    """Each request handed to the manager at its arrival (a burst: all at once), its result kept as it finishes."""
    results, due = {}, 0
    while len(results) < len(reqs):
        now = time.perf_counter() - t0
        while due < len(reqs) and arrivals[due] <= now:
            r = reqs[due]
            manager.add_request(r["prompt"], request_id=f"r{r['request']}", max_new_tokens=r["new_tokens"],
                                record_timestamps=True)
            due += 1
        out = manager.get_result(timeout=max(arrivals[due] - now, 1e-3) if due < len(reqs) else 60)
        if out is None and due >= len(reqs):
            raise RuntimeError("continuous batching stopped before every request finished")
        if out is not None and out.is_finished():
            if out.error:
                raise RuntimeError(f"continuous batching: {out.error}")
            results[out.request_id] = (out, time.perf_counter())
    return results


def serve_continuous(model, tokenizer, reqs: list[dict], concurrency: int, device, arrivals=None) -> list[dict]:
    """transformers' continuous batching, each request submitted at its arrival (None: all at once)."""
    arrivals = arrivals or [0.0] * len(reqs)
    gen, cb = _continuous_config(tokenizer, reqs, concurrency)
    logging.getLogger("ContinuousBatchingLogger").setLevel(logging.WARNING)
    with model.continuous_batching_context_manager(generation_config=gen, continuous_batching_config=cb,
                                                   warmup=False) as manager:
        t0 = time.perf_counter()
        results = _submit_and_collect(manager, reqs, arrivals, t0)
    rows = []
    for r, at in zip(reqs, arrivals):
        out, seen = results[f"r{r['request']}"]
        stamps = out.timestamps or []
        finished = out.lifespan[1] if out.lifespan[1] > 0 else seen
        rows.append(_row(r, t0, stamps[0] if stamps else None, finished, len(out.generated_tokens), at))
    return rows


def _row(r: dict, t0: float, first: float | None, finished: float, output_tokens: int | None = None,
         arrival: float = 0.0) -> dict:
    return {"request": r["request"], "prompt_tokens": len(r["prompt"]),
            "output_tokens": r["new_tokens"] if output_tokens is None else output_tokens, "submitted_s": arrival,
            "first_token_s": None if first is None else first - t0, "finished_s": finished - t0}


def serve_engine(engine, tokenizer, reqs: list[dict], concurrency: int, device, arrivals=None) -> list[dict]:
    """An inference engine's server (efflab.models.engines: `engine.serve`), the engine in the model's place: each request's
    first token and end as the engine's steps return them, and the tokens it generated; open loop, the engine's
    serve given the `arrivals` (unavailable_reason says where it takes none)."""
    prompts, lengths = [r["prompt"] for r in reqs], [r["new_tokens"] for r in reqs]
    served = engine.serve(prompts, lengths, concurrency, **({} if arrivals is None else {"arrivals": arrivals}))
    return [_row(r, 0.0, s["first_token_s"], s["finished_s"], s["output_tokens"], at)
            for r, s, at in zip(reqs, served, arrivals or [0.0] * len(reqs))]


SERVERS = {"naive": serve_naive, "static": serve_static, "continuous": serve_continuous, "vllm": serve_engine}


def server(model, tokenizer, reqs: list[dict], device, load_engine, open_reqs: list[dict] = (), seed: int = 0):
    """serve(cell, warm) for serve_rounds: the warm-up pass serves the first two requests, a burst all of them; an
    open-loop cell (one with a `rate`) `open_reqs` at their arrivals (open_schedule), warmed up at its method's first
    rate only. An engine's method (efflab.models.engines) by the engine, `load_engine(method)` once, at its first
    serving, for the bursts and the open loop alike (a load that fails is the failure of that method's cells,
    recorded, and is not tried again), every other method by the transformers model."""
    loaded, warmed, rounds = {}, set(), {}

    def serve(cell: dict, warm: bool) -> list[dict]:
        method = cell["method"]
        if method in engines.ENGINES and method not in loaded:
            try:
                loaded[method] = load_engine(method)
            except Exception as err:
                loaded[method] = err
        if isinstance(loaded.get(method), Exception):
            raise loaded[method]
        if "rate" not in cell:
            return SERVERS[method](loaded.get(method, model), tokenizer, reqs[:2] if warm else reqs,
                                   cell["concurrency"], device)
        if warm and method in warmed:
            return []
        warmed.add(method)
        rounds[id(cell)] = k = rounds.get(id(cell), -1) + (not warm)  # this cell's k-th round (-1: its warm-up)
        sent, arrivals = open_schedule(open_reqs, cell["rate"], seed, max(k, 0), warm)
        return SERVERS[method](loaded.get(method, model), tokenizer, sent, cell["concurrency"], device, arrivals)
    return serve


def open_schedule(reqs: list[dict], rate: float, seed: int, repeat: int, warm: bool = False):
    """The requests and their arrivals (measure.load.arrivals) in round `repeat` at `rate`: the same for every method
    in that round; the warm-up, the first two of round 0's."""
    arrivals = load.arrivals(len(reqs), rate, seed, repeat)
    return (reqs[:2], arrivals[:2]) if warm else (reqs, arrivals)


def unavailable_reason(method: str, model) -> str | None:
    if method in engines.ENGINES:
        return engines.unavailable(method, model.device, "base")
    if method == "continuous" and not hasattr(model, "continuous_batching_context_manager"):
        import transformers

        return f"transformers {transformers.__version__} has no continuous batching (generate_batch)"
    return None


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


OPEN_COLUMNS = ("method", "rate", "repeat", "request", "arrival_s", "first_token_s", "finished_s", "prompt_tokens",
                "output_tokens")


def open_row(r: dict, rate: float) -> dict:
    """A served open-loop request as open_loop_requests.csv has it: its round is its repeat, its arrival scheduled."""
    return {"method": r["method"], "rate": rate, "repeat": r["burst"], "arrival_s": r["submitted_s"]} | {
        k: r[k] for k in ("request", "first_token_s", "finished_s", "prompt_tokens", "output_tokens")}


def measure_open(cells: list[dict], serve, repeats: int, slo: dict, device: torch.device = CPU,
                 tolerance: float = SENTINEL_TOLERANCE) -> tuple[list[dict], list[dict]]:
    """Rate by rate, the methods' cells at that rate (those not marked unavailable) served `repeats` stable rounds
    (serve_rounds: a warm-up, the balanced order, the speed sentinel), every method sent the same schedule in a round;
    then each cell's figures (measure.load.cell_figures) from its rows of the rounds the figures are of. Returns the
    rows of every round (OPEN_COLUMNS) and, per rate, the sentinel's record."""
    rows, sentinels = [], []
    for rate in sorted({c["rate"] for c in cells}):
        here = [c for c in cells if c["rate"] == rate and "status" not in c]
        served, sentinel = serve_rounds(serve, here, repeats, device, tolerance)
        rows += [open_row(r, rate) for r in served]
        kept = set(sentinel["figures_of_bursts"]) if sentinel else set()
        for c in (c for c in here if "status" not in c):
            c |= {"status": "ok"} | load.cell_figures([r for r in rows if (r["method"], r["rate"]) == (
                c["method"], rate) and r["repeat"] in kept], rate, slo)
        sentinels.append({"rate": rate, "sentinel": sentinel})
    return rows, sentinels


def open_loop(s: dict, model, serve, device) -> tuple[list[dict], dict | None]:
    """The open-loop sweep of `open_loop` (None, or no rates or methods: left out): each method at each rate, at most
    max(`concurrency`) requests worked on at once; the rows and the record, with each method's saturation rate."""
    o, slo = s.get("open_loop") or {}, s.get("slo") or {}
    if not o.get("rates") or not o.get("methods"):
        return [], None
    reasons = {m: unavailable_reason(m, model) for m in o["methods"]}
    cells = [{"method": m, "rate": rate, "concurrency": max(s["concurrency"])} for rate in o["rates"]
             for m in o["methods"]]
    for c in cells:  # the name labels the cell in summary.csv (report.tidy), as in the round orders
        c |= {"name": cell_name(c)} | ({"status": "unavailable", "reason": reasons[c["method"]]}
                                       if reasons[c["method"]] else {})
    rows, sentinels = measure_open(cells, serve, o["repeats"], slo, device, s["sentinel_tolerance"])
    saturation = {m: load.saturation(ok) for m in o["methods"]
                  if (ok := [c for c in cells if c["method"] == m and c["status"] == "ok"])}
    for c in (c for c in cells if c["status"] == "ok"):
        log.info("open loop %s: %.2f requests/s achieved, goodput %.2f requests/s, TTFT p50 %.3f s%s", cell_name(c),
                 c["requests_per_s"]["median"], c["goodput_per_s"]["median"], (c["ttft_s"] or {}).get("p50", 0.0),
                 ", saturated" if c["saturated"] else "")
    return rows, o | {"concurrency": max(s["concurrency"]), "slo": slo, "measured": load.MEASURED,
                      "arrival": "Poisson (exponential gaps of mean 1/rate, seeded by seed, rate and repeat; the "
                                 "same schedule for every method); TTFT and latency from the scheduled arrival",
                      "saturation_rule": load.SATURATION_RULE, "by_rate": sentinels, "cells": cells,
                      "saturation": saturation}


def write_csv(path: Path, columns: tuple[str, ...], rows: list[dict]) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)


def run(cfg: dict, job: Job) -> dict:
    """Serve the same burst of requests every way, at every concurrency level, `bursts` interleaved times; write
    the per-request log."""
    s, layout = cfg["bench_serving"], job.layout
    device, dtype, tokenizer = job.device, job.dtype, job.tokenizer
    model = load_model(layout.base_model(), dtype, device).eval()
    reqs = requests(cfg, layout)
    cells = []
    for method in s["methods"]:
        reason = unavailable_reason(method, model)
        for concurrency in [1] if method == "naive" else s["concurrency"]:
            cells.append({"method": method, "concurrency": concurrency}
                         | ({"status": "unavailable", "reason": reason} if reason else {}))
    open_reqs = requests(cfg, layout, s["open_loop"]["requests"]) if s.get("open_loop") else []
    serve = server(model, tokenizer, reqs, device, lambda method: engines.load(method, layout.base_model(), dtype,
                                                                              s["seed"]), open_reqs, s["seed"])
    log_rows, sentinel = measure(cells, serve, s["bursts"], device, s["sentinel_tolerance"])
    if sentinel and sentinel["set_aside"]:
        log.warning("%d of %d bursts set aside by the speed sentinel: %s", sentinel["set_aside"],
                    len(sentinel["rounds"]), sentinel.get("unstable") or "served again")
    for c in (c for c in cells if c["status"] == "ok"):
        log.info("%s at concurrency %d: median over %d bursts %.2f requests/s, %.1f output tokens/s; %s; "
                 "TTFT p50 %.3f s, latency p90 %.3f s", c["method"], c["concurrency"], c["bursts"],
                 c["requests_per_s"]["median"], c["output_tokens_per_s"]["median"],
                 f"x naive {format_ratio(c['throughput_vs_naive'])}" if "throughput_vs_naive" in c else "naive",
                 (c["ttft_s"] or {}).get("p50", float("nan")), c["latency_s"]["p90"])
    open_rows, open_record = open_loop(s, model, serve, device)
    write_csv(Path(job.out) / "requests.csv", REQUEST_COLUMNS, log_rows)
    write_csv(Path(job.out) / "open_loop_requests.csv", OPEN_COLUMNS, open_rows)
    return {"dtype": dtype, "requests": len(reqs), "prompt_tokens": [len(r["prompt"]) for r in reqs],
            "new_tokens": [r["new_tokens"] for r in reqs], "arrival": "all requests at once (offline burst)",
            "bursts": s["bursts"], "sentinel_tolerance": s["sentinel_tolerance"],
            "round_orders": [r["order"] for r in sentinel["rounds"]] if sentinel else [], "sentinel": sentinel,
            "cells": cells, "open_loop": open_record, "environment": environment(device, s)}


if __name__ == "__main__":
    cli.main("bench_serving", run)
