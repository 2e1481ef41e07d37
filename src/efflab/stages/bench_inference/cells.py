"""A variant's cells, each measured in a process of its own (runtime.isolation): inference_cell for generate()'s modes,
engine_cell for an inference engine's (efflab.models.engines)."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from ... import architecture, profiling, records
from ...estimators.generation_memory import Generation, generation_peak, quantized_layer_transient
from ...estimators.memory import compared
from ...experiment import Variant
from ...layout import Layout
from ...measure.bandwidth import decode_roofline, roofline, speculative_costs
from ...measure.device import DTYPES
from ...measure.energy import energy_of, energy_per_token
from ...measure.flops import matmul_params
from ...measure.memory import track_memory
from ...measure.stats import percentile, speedup, summarize
from ...measure.timing import INTERLEAVE_RECORD, SENTINEL_TOLERANCE, figure_rounds, interleave
from ...models import engines, quantization, speculative
from ...models import kv_cache as kv_quant
from ...models.build import build
from ...models.modeling import load_model, load_tokenizer
from ...models.speculative import SPECULATIVE
from .generation import generate_timed, mode_unavailable, prompt_batches, prompts
from .kv_quality import quantized_cache

log = logging.getLogger("efflab")


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


@dataclass(frozen=True)
class Workload:
    """What a cell generates, and how: the model and its tokenizer, the prompt batches, each generated to exactly
    `n` new tokens with the KV cache on or off, in the cell's generation mode with its generate() arguments (`extra`:
    a quantized cache's or a speculative mode's, cell_kwargs)."""
    model: object
    tokenizer: object
    batches: list
    n: int
    kv_cache: bool
    mode: str = "dynamic"
    extra: dict | None = None

    @property
    def batch_size(self) -> int:
        """Sequences per batch: every batch is full (prompt_batches)."""
        return int(self.batches[0]["input_ids"].shape[0])

    def generate(self, batch: dict) -> dict:
        """One timed generation of `batch` (generate_timed)."""
        return generate_timed(self.model, self.tokenizer, batch, self.n, self.kv_cache, self.mode, self.extra)

    def generate_all(self) -> list[dict]:
        """A timed generation of every prompt batch, in order."""
        return [self.generate(batch) for batch in self.batches]

    def plain(self, model=None) -> Workload:
        """The same prompts at the same length through generate()'s own dynamic generation, of `model` (None: this
        workload's), with no quantized cache and no speculation."""
        return replace(self, model=self.model if model is None else model, mode="dynamic", extra=None)


def timed_rounds(work: Workload, b: dict, variant: Variant, plain: bool, layout: Layout, dtype: str,
                 device: torch.device) -> tuple[list[dict], dict | None]:
    """The timed generations of every prompt batch, `repeats` rounds: the base variant's dynamic generation alone;
    any other variant's interleaved round by round with the base model's (its speed against the base's with an
    interval, free of the machine's drift between jobs); any other mode, a quantized cache or a speculative one,
    with the same model's dynamic generation (what the mode buys). `plain`: the cell is generate()'s own dynamic
    full-precision generation (plain_cell). (the kept rounds' generations, the comparison or None)"""
    by_round = {}

    def mine(round_):
        by_round[round_] = work.generate_all()
    name = variant.name
    if plain and variant.model.kind == "base":
        for r in range(b["repeats"]):
            mine(r)
        return [g for r in range(b["repeats"]) for g in by_round[r]], None
    against, other = ("dynamic", work.plain()) if not plain else (
        "base", work.plain(load_model(layout.base_model(), dtype, device)))
    timed = interleave({name: mine, against: lambda r: other.generate_all()},
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


def first_generations(work: Workload, warmup: int) -> dict:
    """The untimed generations before the timed ones, the first ones timed apart: for `compiled`, each prompt
    batch's first generation (torch.compile's tracing and code generation for its shapes), for another mode the
    first batch's; then more of the first batch, `warmup` in all (one-time work: lazy initialisation, first
    allocations)."""
    def wall(batch) -> float:
        t0 = time.perf_counter()
        work.generate(batch)  # returns once the tokens are read back
        return time.perf_counter() - t0
    firsts = [wall(batch) for batch in (work.batches if work.mode == "compiled" else work.batches[:min(1, warmup)])]
    for _ in range(warmup - 1):
        work.generate(work.batches[0])
    return {"first_generations_s": firsts,
            "measured": "wall clock of each prompt batch's first generation, before the timed ones" +
                        (": torch.compile's work for that batch's shapes included" if work.mode == "compiled" else "")}


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


def unsupported(cell: dict, err: Exception) -> dict:
    """The record of a cell whose quantized cache or generation mode generate() refused for this model."""
    what = f"a {cell['kv_quant']} KV cache" if cell.get("kv_quant") else f"{cell.get('generation', 'dynamic')} generation"
    return {"status": "unavailable", "reason": f"{what} is not supported for this model here: "
                                               f"{type(err).__name__}: {str(err).splitlines()[0][:300]}"}


def cell_extras(cfg: dict, layout, work: Workload, cell: dict) -> dict:
    """What a speculative cell (its `speculation`) or a quantized cache's (its `quantized_cache`) records besides the
    figures every cell has, each measured in passes of its own."""
    extras = {"speculation": speculation(work.model, work.tokenizer, work.batches, work.n, work.extra)
              } if work.mode in SPECULATIVE else {}
    if cell.get("kv_quant"):
        extras["quantized_cache"] = quantized_cache(cfg, layout, work.model, cell["kv_quant"])
    return extras


def predicted_peak(layout, variant: Variant, work: Workload, dtype: str, device: torch.device):
    """The memory estimator's peak of this cell's generation (estimators.generation_memory.generation_peak)."""
    transient = quantized_layer_transient(work.model, dtype) if device.type == "cpu" else 0
    shape = Generation(work.batch_size, max(x["input_ids"].shape[1] for x in work.batches), work.n, work.kv_cache)
    frozen = not any(p.requires_grad for p in work.model.get_output_embeddings().parameters())
    return generation_peak(layout.base_model(), dtype, variant.model.quant, shape, frozen=frozen,
                           device=device.type, quantized_transient_bytes=transient)


def decode_costs(work: Workload, runs: list[dict], footprint: int, dtype: str, speculated: dict | None) -> dict:
    """A decode step's bytes read and FLOPs (measure.bandwidth.decode_roofline); a speculative cell's
    (`speculated`: its acceptance), per token."""
    model = work.model
    # a decode step reads one row of the input embedding, unless it is the output head too (tied), read whole
    embedding, head = model.get_input_embeddings().weight, model.get_output_embeddings()
    tied = head is not None and head.weight.data_ptr() == embedding.data_ptr()
    prompt_len = sum(r["prompt_tokens"] / r["batch_size"] for r in runs) / len(runs)
    costs = decode_roofline(architecture.shape(model.config),
                            footprint - (0 if tied else quantization.tensor_bytes(embedding)), DTYPES[dtype].itemsize,
                            matmul_params(model)["total"], prompt_len, work.n, work.batch_size, work.kv_cache)
    if speculated is not None:  # a pass of the model gives several tokens: a token costs a share of its reads
        costs = speculative_costs(costs, speculated)
    return costs


def per_token_latency(runs: list[dict], kv_cache: bool) -> dict:
    """The per-token gaps' summary, its tail over its median, and why the tail is long where it is (explain_tail)."""
    per_token = summarize([g for r in runs for g in r["token_gaps_s"]], keep_samples=False)
    return per_token | {"p99_over_p50": per_token["p99"] / per_token["p50"] if per_token["p50"] else None,
                        "tail_cause": explain_tail(runs, kv_cache)}


def profiled(cfg: dict, profile_dir: str | None, work: Workload, device: torch.device) -> dict | None:
    """The profiler's record of one generation of the first batch, where profiling is wanted (`profile_dir`)."""
    if not profile_dir:
        return None
    folder = Path(profile_dir)
    return profiling.profile_generation(cfg["profile"], folder, f"{profiling.FOLDER}/{folder.name}", device,
                                        lambda: work.generate(work.batches[0]))


def inference_cell(cfg: dict, results: str, variant: Variant, dtype: str, device: str, cell: dict, limits: dict,
                   profile_dir: str | None = None) -> dict:
    """Measure one cell of a variant (`cell`: kv_cache, batch_size, generation mode, and a quantized cache or a
    draft where it has one): prefill and decode, apart, at a fixed length."""
    b, layout, device = cfg["bench_inference"], Layout(Path(results)), torch.device(device)
    kv_cache, batch_size, generation = cell["kv_cache"], cell["batch_size"], cell.get("generation", "dynamic")
    tokenizer = load_tokenizer(layout.base_model())
    model = build(variant.model, layout, dtype, device)
    if reason := mode_unavailable(generation, model) or kv_quant.unavailable(cell.get("kv_quant", "none"),
                                                                             model.config):
        return {"status": "unavailable", "reason": reason}
    asked = prompts(b, layout, tokenizer)
    batches = prompt_batches(tokenizer, [a["text"] for a in asked], batch_size, device)
    n = b["max_new_tokens"]
    extra, draft = cell_kwargs(cfg, cell, layout, dtype, device)
    work = Workload(model, tokenizer, batches, n, kv_cache, generation, extra)
    try:
        firsts = first_generations(work, b["warmup"])
    except (ValueError, TypeError, NotImplementedError, RuntimeError) as err:
        if plain_cell(cell) or isinstance(err, torch.OutOfMemoryError):
            raise  # a failure of generate() itself, or memory: recorded as such by run_cell
        return unsupported(cell, err)
    extras = cell_extras(cfg, layout, work, cell)
    prediction = predicted_peak(layout, variant, work, dtype, device)
    # Time and memory in separate passes: on a CPU the memory tracker records every allocation through
    # torch.profiler (tens of thousands of events per generation), which would slow the timed decode.
    with track_memory(device) as mem:
        work.generate_all()
    # And energy in a pass of its own (this cell alone: the timed rounds interleave another)
    energy = energy_per_token(*energy_of(lambda: sum(work.generate(x)["batch_size"] * n for x in batches), device))
    runs, versus = timed_rounds(work, b, variant, plain_cell(cell), layout, dtype, device)
    profile = profiled(cfg, profile_dir, work, device)  # after every timed pass: the profiler's cost lands in none
    if any(r["new_tokens"] != n for r in runs):
        raise RuntimeError(f"generation length differs from max_new_tokens={n}")
    ttft = summarize([r["ttft_s"] for r in runs])
    decode_tps = summarize([r["batch_size"] * r["decoded_tokens"] / r["decode_s"] for r in runs], unit="tokens/s")
    footprint = quantization.footprint_bytes(model)
    costs = decode_costs(work, runs, footprint, dtype, extras.get("speculation"))
    per_token = per_token_latency(runs, kv_cache)
    log.info("%s kv_cache=%s batch %d %s: TTFT median %.3f s, decode %.1f tokens/s (per token p50 %.1f / p99 %.1f ms), "
             "peak delta %s MiB (%s)", variant.name, kv_cache, batch_size, records.cell_mode(cell), ttft["median"],
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


def engine_cell(cfg: dict, results: str, variant: Variant, dtype: str, device: str, cell: dict, limits: dict,
                profile_dir: str | None = None) -> dict:
    """An engine's cell (efflab.models.engines): the same prompt batches, as token ids, at the same forced length, through
    the engine, interleaved round by round with the same model's dynamic generate(). An engine gives no per-token
    stamps offline, so its rate is of whole generations (prefill included), and so is the speedup."""
    b, layout, device = cfg["bench_inference"], Layout(Path(results)), torch.device(device)
    kv_cache, batch_size, generation = cell["kv_cache"], cell["batch_size"], cell["generation"]
    tokenizer, n = load_tokenizer(layout.base_model()), b["max_new_tokens"]
    engine = engines.load(generation, layout.variant_folders(variant.model)[-1], dtype, cfg["base_model"]["seed"])
    model = build(variant.model, layout, dtype, device)
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

