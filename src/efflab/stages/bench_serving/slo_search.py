"""The SLO search (`slo_search`): for each subject (a method serving a workload, its prefix cache on or off), the
highest request rate whose percentile of TTFT, TPOT and end-to-end latency stays within `slo`, searched on several
Poisson schedules (measure.rate_search: the requests per probe, the schedules, the bracketing, the answer and its
interval). The subjects' probes are interleaved round by round; every probe's requests go to
slo_search_requests.csv, from which each probe's figures are computed.

Workloads: `chat`, the burst's prompts (varied lengths); `shared_prefix`, the same prompts after one system prompt of
`prefix_tokens` tokens that every request shares (the training rows' text), the workload a prefix cache serves."""
from __future__ import annotations

import logging

from ...measure import rate_search
from ...models import engines
from .servers import SERVERS, prefix_caching_reason, unavailable_reason

log = logging.getLogger("efflab")

COLUMNS = ("subject", "schedule", "rate", "request", "arrival_s", "first_token_s", "finished_s", "prompt_tokens",
           "output_tokens")


def subject_name(method: str, workload: str, caching: bool) -> str:
    return f"{method} {workload} cache {'on' if caching else 'off'}"


def subjects(o: dict, model) -> list[dict]:
    """Every (method, workload, prefix caching) of `o`, each marked unavailable where it cannot be served here."""
    out = []
    for method in o["methods"]:
        for workload in o["workloads"]:
            for caching in o["prefix_caching"]:
                why = unavailable_reason(method, model) or (prefix_caching_reason(method) if caching else None)
                out.append({"name": subject_name(method, workload, caching), "method": method, "workload": workload,
                            "prefix_caching": caching} | ({"status": "unavailable", "reason": why} if why else {}))
    return out


def shared_prefix(rows: list[dict], tokens: int) -> list[int]:
    """A system prompt of `tokens` tokens: the rows' token ids one after another (cycled where they are fewer)."""
    ids = [t for r in rows for t in r["input_ids"]]
    return (ids * (tokens // max(len(ids), 1) + 1))[:tokens]


def workload_requests(reqs: list[dict], workload: str, prefix: list[int]) -> list[dict]:
    return reqs if workload == "chat" else [r | {"prompt": prefix + r["prompt"]} for r in reqs]


def make_server(model, tokenizer, device, o: dict, load_engine):
    """serve(subject, requests, arrivals) -> rows: the subject's method with its prefix cache on or off (an engine
    loaded once per cache setting, by `load_engine(method, caching)`)."""
    loaded = {}

    def serve(subject: dict, reqs: list[dict], arrivals: list[float]) -> list[dict]:
        method, caching = subject["method"], subject["prefix_caching"]
        if method in engines.ENGINES:
            key = (method, caching)
            if key not in loaded:
                loaded[key] = load_engine(method, caching)
            return SERVERS[method](loaded[key], tokenizer, reqs, o["concurrency"], device, arrivals)
        if method == "continuous":
            return SERVERS[method](model, tokenizer, reqs, o["concurrency"], device, arrivals, caching,
                                   o["page_tokens"])
        return SERVERS[method](model, tokenizer, reqs, o["concurrency"], device, arrivals)
    return serve


def _load_rows(served: list[dict]) -> list[dict]:
    return [{"arrival_s": r["submitted_s"]} | {k: r[k] for k in ("request", "first_token_s", "finished_s",
                                                                  "prompt_tokens", "output_tokens")} for r in served]


def run_search(o: dict, slo: dict, live: list[dict], requests_of, serve, seed: int) -> tuple[list[dict], list]:
    """Warm each subject up (its first two requests, untimed), then search them all (rate_search.search); a
    subject whose serving raises is marked (unavailable on its warm-up, else failed) and its searches stop.
    Returns the rows of every probe and the schedules."""
    n = rate_search.requests_for(o["percentile"])
    schedules = [rate_search.unit_schedule(n, seed, k) for k in range(o["schedules"])]
    by_name, rows = {s["name"]: s for s in live}, []

    def attempt(subject: dict, reqs: list[dict], arrivals: list[float], warm: bool):
        try:
            return serve(subject, reqs, arrivals)
        except Exception as err:  # a serving path this stack cannot run is a row, not a crash
            subject |= {"status": "unavailable" if warm else "failed",
                        "reason": f"{type(err).__name__}: {str(err).splitlines()[0]}"}
            log.warning("slo search %s: %s: %s", subject["name"], subject["status"], subject["reason"])
            return None

    for s in live:
        attempt(s, requests_of(s)[:2], [0.0, 0.0], True)

    def probe(name: str, k: int, rate: float) -> dict | None:
        subject = by_name[name]
        if "status" in subject:
            return None
        arrivals, window = rate_search.at_rate(schedules[k], rate)
        served = attempt(subject, requests_of(subject), arrivals, False)
        if served is None:
            return None
        got = _load_rows(served)
        rows.extend({"subject": name, "schedule": k, "rate": rate} | r for r in got)
        figures = rate_search.probe_figures(got, rate, window, slo, o["percentile"])
        log.info("slo search %s, schedule %d at %.3g requests/s: %s (p%g %s)", name, k, rate,
                 "meets" if figures["meets"] else "fails", o["percentile"],
                 ", ".join(f"{key} {v:.3g}" for key, v in figures[f"p{o['percentile']:g}"].items()))
        return figures

    lowest, highest = o["range"]
    searches = rate_search.search(probe, [s["name"] for s in live if "status" not in s], o["schedules"],
                                  o["start_rate"], lowest, highest, o["steps"])
    for s in live:
        mine = [x for x in searches if x.subject == s["name"]]
        if "status" not in s and mine:
            s |= {"status": "ok", "answer": rate_search.answer(mine, lowest, highest),
                  "probes": [p for x in mine for p in ({"schedule": x.schedule} | f for f in x.probes)]}
    return rows, [{k: v for k, v in sch.items() if k != "arrivals"} for sch in schedules]


def search(s: dict, model, tokenizer, device, inputs, load_engine):
    """The SLO search of `slo_search` (None: left out): its rows and record. `inputs(n)`: n requests (the burst's
    prompts and output lengths) and the training rows (the shared prefix's text), read only where the search runs."""
    o, slo = s.get("slo_search"), s.get("slo") or {}
    if not o or not o["methods"]:
        return [], None
    if not any(v is not None for v in slo.values()):
        return [], {"status": "unavailable", "reason": "bench_serving.slo sets no bound: no rate is the highest"}
    listed, n = subjects(o, model), rate_search.requests_for(o["percentile"])
    reqs, train_rows = inputs(n)
    prefix = shared_prefix(train_rows, o["prefix_tokens"])
    requests_of = lambda subject: workload_requests(reqs, subject["workload"], prefix)  # noqa: E731
    serve = make_server(model, tokenizer, device, o, load_engine)
    rows, schedules = run_search(o, slo, [x for x in listed if "status" not in x], requests_of, serve, s["seed"])
    for x in (x for x in listed if x.get("status") == "ok"):
        a = x["answer"]
        log.info("slo search %s: meets the SLO at p%g up to %.3g requests/s (%s [%.3g, %s] of %d schedules)%s",
                 x["name"], o["percentile"], a["value"], a["interval"], a["lo"],
                 "-" if a["hi"] is None else f"{a['hi']:.3g}", a["n"], f"; {a['censored']}" if a["censored"] else "")
    return rows, o | {"slo": slo, "requests_per_probe": n,
                      "beyond_percentile": rate_search.BEYOND, "rate_tolerance": rate_search.RATE_TOLERANCE,
                      "prefix_tokens_sent": len(prefix), "schedules_drawn": schedules, "subjects": listed,
                      "rule": rate_search.RULE}
