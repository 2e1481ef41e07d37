"""The servers: each serves a list of requests one way (naive, static batching, continuous batching, an inference
engine), all at once or open loop at their arrivals, and gives each request's row (its times and lengths)."""
from __future__ import annotations

import inspect
import logging
import time

import torch

from ...measure import load
from ...measure.device import synchronize
from ...models import engines

# transformers takes seconds to import: it is imported inside the functions that use it.


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


def _continuous_config(tokenizer, reqs: list[dict], concurrency: int, prefix_caching: bool | None = None,
                       page: int = 256):
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    gen = GenerationConfig(do_sample=False, max_new_tokens=max(r["new_tokens"] for r in reqs),
                           eos_token_id=-1, pad_token_id=tokenizer.pad_token_id)  # forced lengths: no early stop
    # A paged cache sized to this burst (every request's prompt and output, in `page`-token pages, twice over; at
    # most `concurrency` of them held at once where there are many): left to itself it takes most of the free
    # memory, 14 GB here, which a CPU spends seconds zeroing.
    held = sorted((-(-(len(r["prompt"]) + r["new_tokens"]) // page) for r in reqs), reverse=True)
    pages = sum(held[:concurrency]) if len(reqs) > 4 * concurrency else sum(held)
    # transformers 5.17 (efflab's floor) names the page block_size; later versions page_size (block_size deprecated)
    size_key = "page_size" if "page_size" in inspect.signature(ContinuousBatchingConfig).parameters else "block_size"
    sharing = {} if prefix_caching is None else {"allow_block_sharing": prefix_caching}
    cb = ContinuousBatchingConfig(max_requests_per_batch=concurrency, num_blocks=2 * pages + 2, **{size_key: page},
                                  max_batch_tokens=max(page, concurrency * max(len(r["prompt"]) for r in reqs)),
                                  **sharing)
    return gen, cb


def prefix_caching_reason(method: str) -> str | None:
    """Why `method` cannot serve with its prefix cache switched on and off here (None: it can)."""
    if method == "naive":
        return "naive serving (generate() one request at a time) keeps no cache across requests"
    if method == "continuous":
        from transformers.generation.configuration_utils import ContinuousBatchingConfig

        if "allow_block_sharing" not in inspect.signature(ContinuousBatchingConfig).parameters:
            import transformers

            return f"transformers {transformers.__version__}'s continuous batching has no prefix cache switch"
    return None


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


def serve_continuous(model, tokenizer, reqs: list[dict], concurrency: int, device, arrivals=None,
                     prefix_caching: bool | None = None, page: int = 256) -> list[dict]:
    """transformers' continuous batching, each request submitted at its arrival (None: all at once); its prefix cache
    (block sharing: a prompt's full `page`-token pages computed once for every request that shares them) on or off
    (None: transformers' default)."""
    arrivals = arrivals or [0.0] * len(reqs)
    gen, cb = _continuous_config(tokenizer, reqs, concurrency, prefix_caching, page)
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
