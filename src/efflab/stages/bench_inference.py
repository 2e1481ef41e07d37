"""Stage bench_inference: greedy generation of a fixed length over a fixed prompt set, per variant.

Variants: the base model, a quantized scheme, a merged run, or an adapter on its base; each over its
cells of KV cache on/off × batch size × generation mode, every cell in its own process (runtime.isolation).
A streamer timestamps every token as generate() emits it, so one call gives the prefill (time to first
token) and the decode (time per output token) apart; the generation length is forced so runs compare.

Generation modes (transformers' own): `dynamic`, generate()'s default growing KV cache; `static`, a
preallocated StaticCache (no compile); `compiled`, the static cache with the forward compiled by
torch.compile, its compile and first generations timed apart from the steady rate; `vllm`, vLLM's engine on
the same prompts where it runs (efflab.models.engines). A mode other than dynamic is interleaved with the same model's
dynamic generate(), round by round: what the mode buys, on the same prompts and forced length.
"""
from __future__ import annotations

import logging
import math
import random
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from .. import architecture, cli, experiment, profiling, quality, records
from ..config import UserError
from ..estimators.generation_memory import Generation, generation_peak, quantized_layer_transient, variant_quant
from ..estimators.memory import compared
from ..layout import Job, Layout
from ..measure.bandwidth import bandwidth_ceiling, decode_roofline, roofline, speculative_costs
from ..measure.device import DTYPES
from ..measure.energy import energy_of, energy_per_token
from ..measure.env import environment
from ..measure.flops import matmul_ceiling, matmul_params
from ..measure.isolation import prestart, run_cell
from ..measure.memory import track_memory
from ..measure.stats import percentile, speedup, summarize
from ..measure.timing import INTERLEAVE_RECORD, SENTINEL_TOLERANCE, figure_rounds, interleave, seconds_since, stamp
from ..models import engines, quantization, speculative
from ..models import kv_cache as kv_quant
from ..models.modeling import load_model, load_tokenizer, load_variant, read_split, require_input
from ..models.speculative import SPECULATIVE
from ..registry import built_on

# pandas (reading the validation prompts, the default prompts) and transformers' CompileConfig (a compiled generation)
# are imported inside the one function each that uses them, so that importing this module loads neither (under 1 s and
# 1-2 s on 2 cores): the job imports pandas when it reads the prompts, and transformers with its first model (modeling).

log = logging.getLogger("efflab")


class TokenClock:
    """A generate() streamer that stamps each put(): first the prompt, then each new token. On a GPU the
    stamps are CUDA events recorded in the stream, read after the generation, so they time the kernels
    rather than their asynchronous launch and add no synchronisation to the loop; on a CPU, perf_counter."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self._stamps: list = []
        self.counts: list[int] = []  # tokens per sequence in each put(): more than 1 where a speculative step accepted
        self.start()

    def start(self):
        self._origin = stamp(self.cuda)

    def put(self, value):
        self._stamps.append(stamp(self.cuda))
        self.counts.append(int(value.shape[-1]) if getattr(value, "ndim", 1) > 1 else 1)

    def end(self):
        pass

    def seconds(self) -> list[float]:
        """Each put()'s time since start(), in seconds."""
        return seconds_since(self._origin, self._stamps, self.cuda)


TAIL_RATIO = 1.5


def explain_tail(runs: list[dict], kv_cache: bool) -> str | None:
    """Why the per-token latency's p99 is more than TAIL_RATIO x its median, from the gaps themselves."""
    gaps = [g for r in runs for g in r["token_gaps_s"]]
    if len(gaps) < 2:
        return None
    ordered = sorted(gaps)
    p50, p99 = percentile(ordered, 0.5), percentile(ordered, 0.99)
    if p99 <= TAIL_RATIO * p50:
        return None
    if not kv_cache and all(r["token_gaps_s"][-1] > r["token_gaps_s"][0] for r in runs if len(r["token_gaps_s"]) > 1):
        return "no KV cache: every token recomputes the whole prefix, so later tokens take longer"
    later = sorted(g for r in runs for g in r["token_gaps_s"][1:])
    if later and percentile(later, 0.99) <= TAIL_RATIO * percentile(later, 0.5):
        return "the first decode step of each generation (the KV cache's first growth, first-call kernels)"
    slow = sum(g > TAIL_RATIO * p50 for g in gaps)
    return (f"isolated slow tokens ({slow} of {len(gaps)} above {TAIL_RATIO}x the median) spread over the "
            "generations: interference (other processes, clock changes) or the garbage collector")


def prompts(b: dict, layout, tokenizer) -> list[dict]:
    """What the models are asked: by default `validation_rows` rows of the user's validation split, drawn with
    `seed`, as fine-tuning templated them, each with its reference answer; or the configured texts, each
    chat-templated. Each: {question, text (what the model reads), reference}."""
    import pandas as pd

    chosen = b["prompts"]
    if isinstance(chosen, list):
        return [{"question": p, "reference": None,
                 "text": tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                                       tokenize=False)} for p in chosen]
    path = require_input(layout.split("validation"))
    frame = pd.read_parquet(path)
    if "prompt" not in frame.columns:
        raise UserError(f"{path}: no prompt column (written by an older prepare_data): rerun prepare_data")
    picked = sorted(random.Random(chosen["seed"]).sample(range(len(frame)), min(chosen["validation_rows"], len(frame))))
    return [{"question": r.question, "text": r.prompt, "reference": r.answer} for r in frame.iloc[picked].itertuples()]


def prompt_batches(tokenizer, texts: list[str], batch_size: int, device: torch.device) -> list[dict]:
    """The templated prompts, left-padded into batches of `batch_size` (cycling through the prompt set so that
    every batch is full and each prompt appears at least once)."""
    count = math.ceil(len(texts) / batch_size) * batch_size
    cycled = [texts[i % len(texts)] for i in range(count)]
    tokenizer.padding_side = "left"
    return [tokenizer(cycled[i:i + batch_size], return_tensors="pt", padding=True, add_special_tokens=False).to(device)
            for i in range(0, count, batch_size)]


def mode_kwargs(mode: str, device: torch.device) -> dict:
    """generate()'s arguments for a generation mode (transformers' cache_implementation and compile_config)."""
    if mode == "dynamic" or mode in SPECULATIVE:  # a speculative mode's arguments: cell_kwargs
        return {}
    if mode == "static":  # transformers would compile a static-cache generate() on CUDA by itself: not here
        return {"cache_implementation": "static", "disable_compile": True}
    from transformers import CompileConfig

    # transformers' defaults on CUDA (fullgraph off, static shapes, inductor, reduce-overhead: CUDA graphs);
    # elsewhere it compiles only when told to, and CUDA graphs do not apply
    config = CompileConfig() if device.type == "cuda" else CompileConfig(mode="default")
    config._compile_all_devices = device.type != "cuda"
    return {"cache_implementation": "static", "compile_config": config}


def mode_unavailable(mode: str, model) -> str | None:
    """Why `model` cannot generate in `mode` here (None: it can). transformers falls back to eager generation,
    silently, for a quantizer it cannot compile: that is recorded here, not timed as if compiled."""
    quantizer = getattr(model, "hf_quantizer", None)
    if mode == "compiled" and quantizer is not None and not quantizer.is_compileable:
        return (f"transformers does not compile {type(quantizer).__name__} models (hf_quantizer.is_compileable "
                "is False): generate() would run them eagerly")
    return None


def generate_timed(model, tokenizer, batch: dict, new_tokens: int, kv_cache: bool = True,
                   mode: str = "dynamic", extra: dict | None = None) -> dict:
    """One greedy generation of exactly `new_tokens` tokens per sequence, timestamped as generate() hands them out
    (a token at a time; speculative modes, the tokens a verification step accepted at once). `extra`: generate()'s
    arguments for a quantized cache or a speculative mode (cell_kwargs)."""
    prompt_len = batch["input_ids"].shape[1]
    clock = TokenClock(batch["input_ids"].device)
    with torch.no_grad():
        out = model.generate(**batch, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                             num_beams=1, use_cache=kv_cache, streamer=clock, pad_token_id=tokenizer.pad_token_id,
                             **mode_kwargs(mode, batch["input_ids"].device), **(extra or {}))
    token_times = clock.seconds()[1:]  # the first put() is the prompt itself
    gaps = [(b - a) / k for a, b, k in zip(token_times, token_times[1:], clock.counts[2:]) for _ in range(k)]
    return {"ttft_s": token_times[0], "token_gaps_s": gaps,
            "decode_s": token_times[-1] - token_times[0], "new_tokens": out.shape[1] - prompt_len,
            "decoded_tokens": out.shape[1] - prompt_len - clock.counts[1],  # after the first put's
            "batch_size": int(out.shape[0]), "prompt_tokens": int(batch["attention_mask"].sum()),
            "texts": tokenizer.batch_decode(out[:, prompt_len:], skip_special_tokens=True),
            "token_ids": out[:, prompt_len:].tolist()}


@dataclass(frozen=True)
class Where:
    """Where a cell runs: the params, the results, the variant's name, the compute dtype and the device."""
    cfg: dict
    layout: Layout
    name: str
    dtype: str
    device: torch.device


def timed_rounds(where: Where, model, tokenizer, batches: list, cell: dict, extra: dict
                 ) -> tuple[list[dict], dict | None]:
    """The timed generations of every prompt batch, `repeats` rounds: the base variant's dynamic generation alone;
    any other variant's interleaved round by round with the base model's (its speed against the base's with an
    interval, free of the machine's drift between jobs); any other mode, a quantized cache or a speculative one,
    with the same model's dynamic generation (what the mode buys). (the kept rounds' generations, the comparison or
    None)"""
    b, name, device = where.cfg["bench_inference"], where.name, where.device
    n, by_round, kv_cache, mode = b["max_new_tokens"], {}, cell["kv_cache"], cell.get("generation", "dynamic")
    plain = plain_cell(cell)

    def mine(round_):
        by_round[round_] = [generate_timed(model, tokenizer, batch, n, kv_cache, mode, extra) for batch in batches]
    if plain and b["variants"][name]["kind"] == "base":
        for r in range(b["repeats"]):
            mine(r)
        return [g for r in range(b["repeats"]) for g in by_round[r]], None
    against, other = ("dynamic", model) if not plain else (
        "base", load_model(where.layout.base_model(), where.dtype, device))
    timed = interleave({name: mine, against: lambda r: [generate_timed(other, tokenizer, x, n, kv_cache)
                                                        for x in batches]},
                       b["repeats"], device, warmup=b["warmup"], tolerance=SENTINEL_TOLERANCE)
    kept = [b["warmup"] + i for i in figure_rounds(timed["rounds"], b["repeats"])]
    whose = ("the same model, generate()'s own full-precision dynamic cache, no speculation" if against == "dynamic"
             else "the base model")
    versus = compared_with(timed, name, against, "whole generations of every prompt batch per round; speedup = "
                           f"{against}'s time over this cell's ({whose}); the verdict is said of this cell")
    return [g for r in kept for g in by_round[r]], versus  # the rounds the figures are of (not the warmup's)


def compared_with(timed: dict, mine: str, against: str, measured: str) -> dict:
    """A cell's interleave() against `against`: the speedup (against's time over mine) with its interval and
    verdict, what was timed, against's own times, the rounds and probes, and `unstable` where the machine was."""
    return {"against": against, "generation_speedup": speedup(timed, mine, against), "measured": measured,
            f"{against}_generation_s": timed["variants"][against], **{k: timed[k] for k in INTERLEAVE_RECORD},
            **({"unstable": timed["unstable"]} if "unstable" in timed else {})}


def first_generations(model, tokenizer, batches: list, n: int, kv_cache: bool, mode: str, warmup: int,
                      extra: dict | None = None) -> dict:
    """The untimed generations before the timed ones, the first ones timed apart: for `compiled`, each prompt
    batch's first generation (torch.compile's tracing and code generation for its shapes), for another mode the
    first batch's; then more of the first batch, `warmup` in all (one-time work: lazy initialisation, first
    allocations)."""
    def wall(batch) -> float:
        t0 = time.perf_counter()
        generate_timed(model, tokenizer, batch, n, kv_cache, mode, extra)  # returns once the tokens are read back
        return time.perf_counter() - t0
    firsts = [wall(batch) for batch in (batches if mode == "compiled" else batches[:min(1, warmup)])]
    for _ in range(warmup - 1):
        generate_timed(model, tokenizer, batches[0], n, kv_cache, mode, extra)
    return {"first_generations_s": firsts,
            "measured": "wall clock of each prompt batch's first generation, before the timed ones" +
                        (": torch.compile's work for that batch's shapes included" if mode == "compiled" else "")}


def plain_cell(cell: dict) -> bool:
    """Whether a cell is generate()'s own dynamic full-precision generation (no other mode, no quantized cache)."""
    return cell.get("generation", "dynamic") == "dynamic" and not cell.get("kv_quant")


def cell_kwargs(cfg: dict, cell: dict, layout, dtype: str, device: torch.device) -> tuple[dict, object]:
    """generate()'s arguments for a cell's quantized cache or speculative mode, and the draft model it loaded."""
    b = cfg["bench_inference"]
    if cell.get("kv_quant"):
        return kv_quant.generate_kwargs(cell["kv_quant"], b["kv_quant_options"]), None
    mode = cell.get("generation", "dynamic")
    if mode not in speculative.SPECULATIVE:
        return {}, None
    draft = speculative.load_draft(cfg, cell["draft"], layout, dtype, device) if mode == "assisted" else None
    return speculative.generate_kwargs(mode, b["speculative"], draft), draft


def speculation(model, tokenizer, batches: list, n: int, extra: dict) -> dict:
    """A speculative cell's acceptance, counted in a pass of its own (the counting hook stays out of the timed
    rounds), and whether its greedy tokens equal the model's own greedy generation, token for token, batch by batch."""
    counts, differ = [], []
    for i, batch in enumerate(batches):
        own = generate_timed(model, tokenizer, batch, n)
        with speculative.Verifications(model) as seen:
            spec = generate_timed(model, tokenizer, batch, n, extra=extra)
        counts.append(seen.of_generation(int(batch["attention_mask"].sum()), spec["new_tokens"]))
        if own["token_ids"] != spec["token_ids"]:
            differ.append(i)
    return speculative.acceptance(counts) | {"greedy_equal": not differ, "batches_compared": len(batches),
                                             "batches_differing": differ}


def quantized_cache(cfg: dict, layout, model, spec: str) -> dict:
    """What a quantized KV cache costs and holds: the paired perplexity change on validation rows fed through it
    in chunks against the same chunks through a full-precision cache, and the memory each cache holds after a
    prefill of each context length (up to the model's positions)."""
    o = cfg["bench_inference"]["kv_quant_options"]
    rows = read_split(layout.split("validation"), o["eval_rows"])
    change = quality.paired_change(kv_quant.chunked_row_nll(model, rows, kv_quant.NONE, o, o["chunk"]),
                                   kv_quant.chunked_row_nll(model, rows, spec, o, o["chunk"]))
    top = getattr(model.config.get_text_config(decoder=True), "max_position_embeddings", None) or 2**31
    lengths = [n for n in o["context_lengths"] if n <= top]
    tokens = [t for r in rows for t in r["input_ids"]]
    full, mine = (kv_quant.memory_by_context(model, tokens, s, o, lengths) for s in (kv_quant.NONE, spec))
    return {"cache": spec, "options": o, "perplexity_change": change,
            "quality_measured": f"{len(rows)} validation rows fed {o['chunk']} tokens at a time through the cache, "
                                "paired with the same chunks through a full-precision cache",
            "memory_by_context": [{"context": a["context"], "full_mib": a["held_mib"], "quantized_mib": b["held_mib"],
                                   "ratio": b["held_mib"] / a["held_mib"] if a["held_mib"] and b["held_mib"] else None,
                                   "kind": a["kind"]} for a, b in zip(full, mine)],
            "contexts_left_out": [n for n in o["context_lengths"] if n > top]}


def inference_cell(cfg: dict, results: str, name: str, dtype: str, device: str, cell: dict, limits: dict,
                   profile_dir: str | None = None) -> dict:
    """Measure one cell of a variant (`cell`: kv_cache, batch_size, generation mode, and a quantized cache or a
    draft where it has one): prefill and decode, apart, at a fixed length."""
    b, layout, device = cfg["bench_inference"], Layout(Path(results)), torch.device(device)
    kv_cache, batch_size, generation = cell["kv_cache"], cell["batch_size"], cell.get("generation", "dynamic")
    tokenizer = load_tokenizer(layout.base_model())
    model = load_variant(cfg, b["variants"][name], layout, dtype, device)
    if reason := mode_unavailable(generation, model) or kv_quant.unavailable(cell.get("kv_quant", "none"),
                                                                             model.config):
        return {"status": "unavailable", "reason": reason}
    asked = prompts(b, layout, tokenizer)
    batches = prompt_batches(tokenizer, [a["text"] for a in asked], batch_size, device)
    n = b["max_new_tokens"]
    extra, draft = cell_kwargs(cfg, cell, layout, dtype, device)
    plain = plain_cell(cell)
    try:
        firsts = first_generations(model, tokenizer, batches, n, kv_cache, generation, b["warmup"], extra)
    except (ValueError, TypeError, NotImplementedError, RuntimeError) as err:
        if plain or isinstance(err, torch.OutOfMemoryError):
            raise  # a failure of generate() itself, or memory: recorded as such by run_cell
        what = f"a {cell['kv_quant']} KV cache" if cell.get("kv_quant") else f"{generation} generation"
        return {"status": "unavailable", "reason": f"{what} is not supported for this model here: "
                                                   f"{type(err).__name__}: {str(err).splitlines()[0][:300]}"}
    extras = {"speculation": speculation(model, tokenizer, batches, n, extra)} if generation in SPECULATIVE else {}
    if cell.get("kv_quant"):
        extras["quantized_cache"] = quantized_cache(cfg, layout, model, cell["kv_quant"])
    transient = quantized_layer_transient(model, dtype) if device.type == "cpu" else 0
    shape = Generation(batch_size, max(x["input_ids"].shape[1] for x in batches), n, kv_cache)
    prediction = generation_peak(layout.base_model(), dtype, variant_quant(cfg, b["variants"][name]), shape,
                                 frozen=not any(p.requires_grad for p in model.get_output_embeddings().parameters()),
                                 device=device.type, quantized_transient_bytes=transient)
    # Time and memory in separate passes: on a CPU the memory tracker records every allocation through
    # torch.profiler (tens of thousands of events per generation), which would slow the timed decode.
    with track_memory(device) as mem:
        for batch in batches:
            generate_timed(model, tokenizer, batch, n, kv_cache, generation, extra)
    # And energy in a pass of its own (this cell alone: the timed rounds interleave another)
    energy = energy_per_token(*energy_of(lambda: sum(generate_timed(model, tokenizer, x, n, kv_cache, generation,
                                                                    extra)["batch_size"] * n for x in batches), device))
    runs, versus = timed_rounds(Where(cfg, layout, name, dtype, device), model, tokenizer, batches, cell, extra)
    profile = None
    if profile_dir:  # after every timed pass: the profiler's cost lands in none of them
        folder = Path(profile_dir)
        profile = profiling.profile_generation(cfg["profile"], folder, f"{profiling.FOLDER}/{folder.name}", device,
                                               lambda: generate_timed(model, tokenizer, batches[0], n, kv_cache,
                                                                      generation, extra))
    if any(r["new_tokens"] != n for r in runs):
        raise RuntimeError(f"generation length differs from max_new_tokens={n}")
    ttft = summarize([r["ttft_s"] for r in runs])
    decode_tps = summarize([r["batch_size"] * r["decoded_tokens"] / r["decode_s"] for r in runs], unit="tokens/s")
    footprint = quantization.footprint_bytes(model)
    # a decode step reads one row of the input embedding, unless it is the output head too (tied), read whole
    embedding, head = model.get_input_embeddings().weight, model.get_output_embeddings()
    tied = head is not None and head.weight.data_ptr() == embedding.data_ptr()
    prompt_len = sum(r["prompt_tokens"] / r["batch_size"] for r in runs) / len(runs)
    costs = decode_roofline(architecture.shape(model.config),
                            footprint - (0 if tied else quantization.tensor_bytes(embedding)), DTYPES[dtype].itemsize,
                            matmul_params(model)["total"], prompt_len, n, batch_size, kv_cache)
    if "speculation" in extras:  # a pass of the model gives several tokens: a token costs a share of its reads
        costs = speculative_costs(costs, extras["speculation"])
    per_token = summarize([g for r in runs for g in r["token_gaps_s"]], keep_samples=False)
    per_token |= {"p99_over_p50": per_token["p99"] / per_token["p50"] if per_token["p50"] else None,
                  "tail_cause": explain_tail(runs, kv_cache)}
    log.info("%s kv_cache=%s batch %d %s: TTFT median %.3f s, decode %.1f tokens/s (per token p50 %.1f / p99 %.1f ms), "
             "peak delta %s MiB (%s)", name, kv_cache, batch_size, records.cell_mode(cell), ttft["median"],
             decode_tps["median"],
             1000 * per_token["median"], 1000 * per_token["p99"], _fmt(mem.get("delta_mib")), mem["kind"])
    return {"ttft": ttft, "decode_tokens_per_s": decode_tps, "per_token_latency": per_token, "memory": mem,
            "generations": len(runs), "prompt_tokens": [r["prompt_tokens"] for r in runs[:len(batches)]],
            "memory_footprint_bytes": footprint,
            "roofline": roofline(decode_tps["median"], costs, limits["bandwidth"], limits["matmul"]),
            # the estimator models generate()'s full-precision cache and no draft: no prediction for the others
            **({} if extras or draft is not None else {"memory_prediction": compared(prediction, mem)}),
            "first_generations": firsts,
            "vs_base": None, **({f"vs_{versus['against']}": versus} if versus else {}), "energy": energy,
            "profile": profile, **extras, **({"draft_parameters": sum(p.numel() for p in draft.parameters())}
                                             if draft is not None else {}),
            "samples": [{"prompt": a["question"], "answer": t, "reference": a["reference"]}
                        for a, t in zip(asked, runs[0]["texts"])]}


def engine_cell(cfg: dict, results: str, name: str, dtype: str, device: str, cell: dict, limits: dict,
                profile_dir: str | None = None) -> dict:
    """An engine's cell (efflab.models.engines): the same prompt batches, as token ids, at the same forced length, through
    the engine, interleaved round by round with the same model's dynamic generate(). An engine gives no per-token
    stamps offline, so its rate is of whole generations (prefill included), and so is the speedup."""
    b, layout, device = cfg["bench_inference"], Layout(Path(results)), torch.device(device)
    kv_cache, batch_size, generation = cell["kv_cache"], cell["batch_size"], cell["generation"]
    tokenizer, variant, n = load_tokenizer(layout.base_model()), b["variants"][name], b["max_new_tokens"]
    engine = engines.load(generation, layout.variant_folders(variant)[-1], dtype, cfg["base_model"]["seed"])
    model = load_variant(cfg, variant, layout, dtype, device)
    asked = prompts(b, layout, tokenizer)
    batches = prompt_batches(tokenizer, [a["text"] for a in asked], batch_size, device)
    ids = [[t for t, m in zip(row.tolist(), mask.tolist()) if m] for x in batches
           for row, mask in zip(x["input_ids"], x["attention_mask"])]  # the very tokens generate() reads, unpadded
    by_round = {}

    def mine(round_):
        by_round[round_] = [engine.generate(ids[i:i + batch_size], n) for i in range(0, len(ids), batch_size)]
    timed = interleave({generation: mine, "dynamic": lambda r: [generate_timed(model, tokenizer, x, n, kv_cache)
                                                                 for x in batches]},
                       b["repeats"], device, warmup=b["warmup"], tolerance=SENTINEL_TOLERANCE)
    if any(k != n for outs in by_round.values() for out in outs for k in out["new_tokens"]):
        raise RuntimeError(f"{generation}'s generation length differs from max_new_tokens={n}")
    kept = [timed["rounds"][i] for i in figure_rounds(timed["rounds"], b["repeats"])]
    return {"engine": {"name": generation, "version": engine.version},
            "generation_tokens_per_s": summarize([len(ids) * n / r["seconds"][generation] for r in kept],
                                                 unit="tokens/s"),
            "vs_dynamic": compared_with(timed, generation, "dynamic", "whole generations of every prompt batch per "
                                        "round, prefill included; speedup = the same model's dynamic generate() time "
                                        "over the engine's"),
            "generations": len(kept) * len(batches), "memory_footprint_bytes": quantization.footprint_bytes(model),
            "samples": [{"prompt": a["question"], "answer": t, "reference": a["reference"]}
                        for a, t in zip(asked, [t for out in by_round[max(by_round)] for t in out["texts"]])]}


def _fmt(value) -> str:
    return "n/a" if value is None else f"{value:.0f}"


def cells_of(b: dict, variant: dict) -> list[dict]:
    """A variant's cells: KV cache × batch size × generation mode (its own lists, else the stage's), in that order;
    `assisted` once per draft, and beside the dynamic cell one per quantized cache (kv_quant). A mode that is a way
    of keeping the KV cache (static, compiled, an engine, a speculative one, a quantized cache) has no cell
    without one."""
    drafts = experiment.drafts_of(b, variant)
    out = []
    for kv in variant.get("kv_cache", b["kv_cache"]):
        for batch in variant.get("batch_sizes", b["batch_sizes"]):
            for mode in variant.get("generation", b["generation"]):
                cell = {"kv_cache": kv, "batch_size": batch, "generation": mode}
                if not kv and mode != "dynamic":
                    continue
                out += [cell | {"draft": d} for d in drafts] if mode == "assisted" else [cell]
                if mode == "dynamic" and kv:
                    out += [cell | {"kv_quant": q} for q in variant.get("kv_quant", b.get("kv_quant") or [])]
    return out


def cell_folder(cell: dict) -> str:
    """A cell's folder name (its profiles): kv-cache-true-batch-1[-mode][-draft][-kv-quanto-4]."""
    return (f"kv-cache-{str(cell['kv_cache']).lower()}-batch-{cell['batch_size']}"
            + ("" if cell["generation"] == "dynamic" else f"-{cell['generation']}")
            + (f"-{cell['draft']}" if cell.get("draft") else "") + (f"-kv-{cell['kv_quant']}" if cell.get("kv_quant")
                                                                   else ""))


def run(cfg: dict, job: Job) -> dict:
    """Benchmark greedy generation of one variant over its KV-cache, batch-size and generation-mode cells."""
    b, rt, name, layout = cfg["bench_inference"], cfg["runtime"], job.name, job.layout
    variant = b["variants"][name]
    prestart(rt["isolation"])  # the cells' forkserver imports beside this job
    device, dtype = job.device, job.dtype
    skipped = layout.skipped_because(built_on(cfg, "bench_inference", name))
    if skipped:
        return {**skipped, "variant": name, "kind": variant["kind"], "of": variant.get("of"), "cells": [],
                "environment": environment(device, b)}
    for folder in layout.variant_folders(variant):  # a missing input is the user's error, not a failed cell
        require_input(folder)
    made_by = layout.job_metrics(experiment.made_by(variant["kind"], variant.get("of")))
    journal = job.journal({"bench_inference": b, "runtime": rt, "built_on": made_by.read_text()})
    cells = []
    # The machine's two limits, measured once in this job and given to every cell (each cell is a fresh process)
    limits = {"bandwidth": bandwidth_ceiling(device), "matmul": matmul_ceiling(dtype, device)}
    profiles = layout.out("bench_inference") / f".{name}.{profiling.FOLDER}"  # beside the journal, until the end
    if journal.resumed == 0:
        shutil.rmtree(profiles, ignore_errors=True)  # a killed earlier run's
    for cell in cells_of(b, variant):
        if reason := engines.unavailable(cell["generation"], device, variant["kind"]) or (
                speculative.batch_unavailable(cell["generation"], cell["batch_size"])):
            cells.append(cell | {"status": "unavailable", "reason": reason})
            continue
        folder = cell_folder(cell)
        profile_dir = str(profiles / folder) if profiling.wanted(cfg, "bench_inference") else None
        result = journal.result(cell, lambda: run_cell(
            engine_cell if cell["generation"] in engines.ENGINES else inference_cell,
            dict(cfg=cfg, results=str(layout.root), name=name, dtype=dtype, device=str(device), cell=cell,
                 limits=limits, profile_dir=profile_dir),
            isolation=rt["isolation"], timeout_s=rt["cell_timeout_s"], memory_cap_mib=rt["cell_memory_cap_mib"]))
        if not records.is_ok(result):
            log.warning("%s %s: %s: %s", name, cell, result["status"], result.get("reason"))
        cells.append(cell | result)
    journal.remove()
    if profiles.is_dir():
        shutil.move(str(profiles), str(job.out / profiling.FOLDER))
    return {
        "status": "ok" if records.ok(cells) else "failed",
        "variant": name, "kind": variant["kind"], "of": variant.get("of"), "dtype": dtype,
        "prompts": len(prompts(b, layout, job.tokenizer)),
        "prompts_from": "configured" if isinstance(b["prompts"], list) else "validation rows",
        "new_tokens": b["max_new_tokens"], "repeats": b["repeats"],
        "warmup": b["warmup"], "cells": cells, "limits": limits, "environment": environment(device, b),
    }


if __name__ == "__main__":
    cli.main("bench_inference", run)
