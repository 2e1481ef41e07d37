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
import logging
import random
from pathlib import Path

from ...layout import Job
from ...measure.env import environment
from ...measure.stats import format_ratio
from ...models import engines
from ...models.modeling import load_model, read_split
from . import open_loop, slo_search
from .rounds import measure
from .servers import server, unavailable_reason

log = logging.getLogger("efflab")

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
    open_rows, open_record = open_loop.sweep(s, model, serve, device)
    slo_rows, slo_record = slo_search.search(
        s, model, tokenizer, device, lambda n: (requests(cfg, layout, n), read_split(layout.split("train"))),
        lambda method, caching: engines.load(  # beside the bursts' engine (0.3)
            method, layout.base_model(), dtype, s["seed"], caching, memory_fraction=0.2))
    write_csv(Path(job.out) / "requests.csv", REQUEST_COLUMNS, log_rows)
    write_csv(Path(job.out) / "open_loop_requests.csv", open_loop.OPEN_COLUMNS, open_rows)
    write_csv(Path(job.out) / "slo_search_requests.csv", slo_search.COLUMNS, slo_rows)
    return {"dtype": dtype, "requests": len(reqs), "prompt_tokens": [len(r["prompt"]) for r in reqs],
            "new_tokens": [r["new_tokens"] for r in reqs], "arrival": "all requests at once (offline burst)",
            "bursts": s["bursts"], "sentinel_tolerance": s["sentinel_tolerance"],
            "round_orders": [r["order"] for r in sentinel["rounds"]] if sentinel else [], "sentinel": sentinel,
            "cells": cells, "open_loop": open_record, "slo_search": slo_record, "environment": environment(device, s)}

