"""The report's sections: what each stage's numbers rest on, with its table and plot."""
from __future__ import annotations

import pandas as pd

from .. import records
from ..measure import SENTINEL_TOLERANCE
from .environments import comparison
from .fmt import markdown, one_line
from .results import absent
from .tables import MEMORY_TARGET, memory_prediction_table


def qat_lines(job: dict) -> list[str]:
    """What the table rests on, and each method's B_min."""
    if not records.is_ok(job):
        return [f"_qat did not run: {job['status']}: {job.get('reason', '')}_"]
    tests = job["precision_range_test"]

    def b_min(method: str) -> str:
        t = tests[method]
        said = f"**{t['b_min']} bits**" if t["b_min"] else f"none of {job['bits']} bits"
        return said + (f" (but {', '.join(map(str, t['fail_above_b_min']))} bits fail again)"
                       if t["fail_above_b_min"] else "")

    return [f"Validation perplexity of the base model {job['base_perplexity']:.2f}; fine-tuned in full precision "
            f"{job['reference_perplexity']:.2f}, so a width passes at {job['threshold']:g} x that = "
            f"{job['threshold'] * job['reference_perplexity']:.2f} or less. B_min: PTQ {b_min('ptq')}, "
            f"QAT {b_min('qat')}.", ""]


def capacity_lines(jobs: list[dict], table: str) -> list[str]:
    job = next(iter(records.ok(jobs)), None)
    if job is None:
        return ["## Capacity: the largest batch and sequence that fit", "",
                f"_capacity did not run: {jobs[0]['status'] if jobs else 'no metrics'}_", ""]
    b = job["budget"]
    return ["## Capacity: the largest batch and sequence that fit", "",
            f"Budget: {b['mib']:.0f} MiB ({b['source']}); memory held against it: {b['memory']}. For each training "
            "run and inference variant the estimator predicts the largest size (from the memory measured with the "
            "model loaded, at the smallest size); isolated cells then confirm it: the measured maximum ran "
            f"{job['steps']['warmup']} + {job['steps']['timed']} steps within the budget and the next size ran out "
            "of memory (a recorded result, not a crash). Tokens/s at the maximum are over its timed steps. Every "
            "cell is in `results/capacity/cells.csv`.", "", table, "", "![capacity](capacity.png)", ""]


def profile_lines(metrics: dict) -> list[str]:
    """Each profiled job's trace, linked, and its 10 operators with the most self time."""
    found = [(f"finetune {m['run']}", f"../finetune/{m['name']}", m["profile"])
             for m in records.ok(metrics["finetune"]) if m.get("profile")]
    found += [(f"bench_inference {m['name']}, KV cache {c['kv_cache']}, batch {c['batch_size']}",
               f"../bench_inference/{m['name']}", c["profile"])
              for m in records.ok(metrics["bench_inference"]) for c in records.ok(m.get("cells", []))
              if c.get("profile")]
    if not found:
        return []
    lines = ["## Where the time goes: profiler traces", "",
             "Traces recorded on demand (`profile.stages`), phases labelled (data, forward, backward, optimizer step; "
             "generate): open a trace in Perfetto (ui.perfetto.dev) or chrome://tracing. A profiled run's own times "
             "include the profiler's cost.", ""]
    for title, folder, prof in found:
        if "unavailable" in prof:
            lines += [f"### {title}", "", f"_unavailable: {prof['unavailable']}_", ""]
            continue
        top = pd.DataFrame(prof["top10"]).rename(columns={
            "self_cpu_ms": "self CPU (ms)", "cpu_total_ms": "CPU total (ms)", "self_device_ms": "self GPU (ms)",
            "device_total_ms": "GPU total (ms)"})
        if not top.get("GPU total (ms)", pd.Series(dtype=float)).any():
            top = top.drop(columns=["self GPU (ms)", "GPU total (ms)"], errors="ignore")
        lines += [f"### {title}", "", f"[trace]({folder}/{prof['trace']}) ({prof['steps']} steps), "
                  f"[every operator]({folder}/{prof['top_ops']}); the top 10 by {prof['sorted_by']}:", "",
                  markdown(top), ""]
    return lines


def energy_note(jobs: list[dict]) -> str:
    """Where the J/token figures come from, or why there are none: one line under the table."""
    found = [e for e in jobs if e and "joules_per_token" in e]
    if found:
        return f"Energy: {found[0]['source']}, over the measured work, per token."
    reasons = sorted({e.get("unavailable", "not measured") for e in jobs if e})
    return f"Energy: unavailable here: {'; '.join(reasons) or 'not measured'}."


def prompt_count(cfg: dict, metrics: dict) -> int:
    """How many prompts bench_inference asked (as it recorded; else as configured)."""
    done = [m["prompts"] for m in records.ok(metrics["bench_inference"]) if "prompts" in m]
    chosen = cfg["bench_inference"]["prompts"]
    return done[0] if done else len(chosen) if isinstance(chosen, list) else chosen["validation_rows"]


def sample_lines(jobs: list[dict]) -> list[str]:
    """Each question bench_inference asked, its reference answer when it came from the user's data, and every
    variant's greedy answer (first cell of each variant), as a table per question."""
    answers: dict[str, dict] = {}
    for m in jobs:
        cell = next(iter(records.ok(m.get("cells", []))), None)
        for s in (cell or {}).get("samples", []):
            entry = answers.setdefault(s["prompt"], {"reference": s.get("reference"), "by": {}})
            entry["by"][m["variant"]] = s["answer"]
    if not answers:
        return []
    lines = ["### Sample answers", "",
             "Greedy answers of each variant (first cell; cut at the benchmark's fixed length) to the questions "
             "asked, with the data's own answer where the question is one of its validation rows.", ""]
    for i, (question, entry) in enumerate(answers.items(), 1):
        lines += [f"**Q{i}.** {one_line(question)}", ""]
        if entry["reference"]:
            lines += [f"_Reference answer:_ {one_line(entry['reference'])}", ""]
        lines += ["| variant | answer |", "|---|---|"] + [f"| {v} | {one_line(a)} |" for v, a in entry["by"].items()]
        lines.append("")
    return lines


def merge_route_lines(rows: list[dict]) -> list[str]:
    """Fidelity and quality of the merge routes, said apart: the route closest to the adapter is not
    necessarily the one with the lowest perplexity, and the reader is told when they differ."""
    out = []
    for r in records.ok(rows):
        targets = r.get("targets") or {}
        if len(targets) < 2:
            continue
        closest = r["closest_target"]
        lowest = min(targets, key=lambda t: targets[t]["validation"]["perplexity"])
        ppl = {t: v["validation"]["perplexity"] for t, v in targets.items()}
        rows_n = targets[lowest]["validation"].get("rows")
        if lowest == closest:
            out.append(f"- {r['run']}: merging into the {closest} is both closest to the adapter (KL "
                       f"{targets[closest]['kl_mean']:.3g}) and lowest in perplexity ({ppl[closest]:.2f}).")
        else:
            out.append(f"- {r['run']}: merging into the {closest} is closest to the adapter that was trained (KL "
                       f"{targets[closest]['kl_mean']:.3g}, perplexity {ppl[closest]:.2f}), but merging into the "
                       f"{lowest} has the lower perplexity ({ppl[lowest]:.2f}): fidelity to the adapter is not "
                       "quality. " + (f"On {rows_n} validation rows, without an interval, this run cannot say "
                                      "the difference would hold." if rows_n else ""))
    return out + [""] if out else []


def memory_prediction_section(finetune_rows: list[dict], inference_rows: list[dict], environments: dict,
                              allow_mixed: bool) -> list[str]:
    return [
        "## Predicted vs measured memory", "",
        "Before each fine-tuning run and each inference cell starts, `efflab.memory_estimate` predicts the memory "
        "it will add to what is already resident, from the base model's config and the run's settings alone "
        "(method, dtypes, mixed precision, batch, the padded lengths of the batches the Trainer will draw, LoRA "
        "rank and targets, optimizer). It predicts tensor bytes: fine-tuning peaks at the start of the backward "
        "pass of its longest batch (optimizer states + autocast weight copies + saved activations + three fp32 "
        "vocabulary-sized loss tensors), at the optimizer step, or, with gradient checkpointing (which keeps only "
        "each layer's input), when the last layer is recomputed; generation adds the KV cache and transients "
        "to the loaded model. It is compared with the measured peak of the same kind: live tensor bytes over "
        "those at the start (`cpu_tensor_peak` on CPU, counted from the CPU allocator's events through "
        "torch.profiler: the counterpart of `cuda_max_allocated`, which is what it is compared with on GPU). "
        f"Target: within ±{100 * MEMORY_TARGET:.0f}%. On CPU the resident-memory delta (`cpu_peak_rss`) is shown "
        "too: it is what the OS charges, and it also holds what glibc malloc keeps after tensors are freed, which "
        "grows each time a batch is longer than any before it, so its ratio is above the tensor ratio by the "
        "allocator's share, not by a tensor the estimate misses.", "",
        comparison(memory_prediction_table(finetune_rows, inference_rows), environments, allow_mixed), ""]


def run_size_lines(cfg: dict, metrics: dict[str, list[dict]]) -> list[str]:
    """What this run measured over, and why that size: the numbers of a short run say less than a long one's,
    and the reader should see the size next to them, not only in params.yaml."""
    ft, q, a, i = cfg["finetune"]["defaults"], cfg["quantize"], cfg["bench_attention"], cfg["bench_inference"]
    stage_s = sum(m.get("wall_s") or 0 for ms in metrics.values() for m in ms)
    return [
        "## Run size", "",
        f"This run's sizes (params.yaml): fine-tuning {ft['max_steps']} optimizer steps of {ft['batch_size']}"
        f"×{ft['gradient_accumulation_steps']} rows per run (runs may override), validation loss on "
        f"{ft['eval_rows']} rows before and after; quantization perplexity on {q['eval_rows']} rows; attention "
        f"{a['warmup']} warm-up + {a['repeats']} timed calls per cell at {', '.join(map(str, a['seq_lens']))} "
        f"tokens; inference {prompt_count(cfg, metrics)} prompts × {i['repeats']} repeats of exactly {i['max_new_tokens']} "
        f"new tokens per cell after {i['warmup']} warm-up generation(s). The stages took {stage_s / 60:.1f} "
        "minutes in all (their own wall times, process start-up not included).",
        "",
        "The shipped defaults are sized so that `make run` stays within 15 minutes on a 2-core CPU without "
        "native bf16 (fp32 only, where every step costs about three times what it costs with AVX512-BF16): few "
        "steps, few rows, few repeats. What such a run shows holds for what it measured — memory, the cost of a "
        "step, the direction of the loss — and its confidence intervals say how far; a long fine-tune's final "
        "quality does not follow from it. On a GPU, or for tighter intervals, raise `finetune.defaults.max_steps`, "
        "the `eval_rows` and the `repeats`.", "",
    ]


def section(cfg: dict, metrics: dict, stage: str, title: str, body) -> list[str]:
    """A report section: its body, or one line saying why it has none."""
    why = absent(cfg, metrics, stage)
    if why:
        return [title, "", f"_{why[0].upper()}{why[1:]}._", ""]
    return [title, "", *body(), ""]


def header_lines(base: dict, data: dict) -> list[str]:
    env = base["environment"]
    dtype_note = base.get("dtype_choice", {}).get("reason", f"{base['dtype']} as configured")
    return [
        "# efflab report", "",
        f"Model: `{base['source']}` ({base['model_type']}, {base['parameters']:,} parameters"
        f"{', random init' if base['random_init'] else ''}), compute dtype **{base['dtype']}** — {dtype_note}.",
        f"Data: `{data['source']}` — {data['train']['rows']} train / {data['validation']['rows']} validation rows, "
        f"template {data['template']}, loss on {'response tokens only' if data['mask_prompt'] else 'all tokens'}."
        + (f" {data['attribution']}" if data["attribution"] else ""),
        f"Measured on: {env['device']} — {env['cpu']} ({env['cpu_cores']} cores)"
        + (f", {env['gpu']}" if env.get("gpu") else "") + f"; torch {env['packages']['torch']}, "
        f"transformers {env['packages']['transformers']}, peft {env['packages']['peft']}, "
        f"bitsandbytes {env['packages']['bitsandbytes']}; commit {env['git_commit']}.", ""]


HOW_TO_READ = (
    "**How to read the numbers.** Latencies are medians of repeats after warmup (perf_counter on CPU, CUDA "
    "events on GPU) with the p90/p99 and the distribution-free 95% interval of the median from order statistics "
    "where n gives one (6 values or more); with fewer, the range of the n values, named so. Plots show that "
    "interval or range as error bars. Memory names its kind: `cpu_peak_rss` is the resident-memory high-water mark "
    "of the measured work (reset at its start; 'delta' is over the resident memory just before it), "
    "`cuda_max_allocated` the allocator's peak of live tensors. Benchmark cells run {isolation} "
    "(`runtime.isolation`); a cell that fails, runs out of memory or times out is a row with its status.")


def quantize_body(cfg: dict, metrics: dict, table) -> list[str]:
    rows = records.ok(metrics["quantize"])[0]["validation"]["rows"]
    return ["Footprint is `get_memory_footprint()` (parameters and buffers as loaded); perplexity on "
            f"{rows} validation rows; change is against the baseline scheme.", "",
            table("quantize"), "", "![quantization](quantize.png)"]


def prune_body(cfg: dict, metrics: dict, table) -> list[str]:
    pr = cfg["prune"]
    healing = (f"Healing: LoRA ({pr['heal']['lora']['target_modules']}, r {pr['heal']['lora']['r']}) fine-tuned "
               f"{pr['heal']['steps']} steps on the training rows and merged back, a model of the pruned shape "
               "(results/prune/<strategy>/healed)." if pr["heal"]["steps"] else "Healing is off (prune.heal.steps: 0).")
    return [f"Heads removed from every layer's attention projections and whole layers removed (importance: "
            f"`{pr['importance']}`), the model rebuilt from its smaller config: parameters, footprint and "
            "time really shrink, and the folder loads in plain transformers. Grouped-query attention keeps the same "
            "number of key/value heads and of query heads per key/value head in every layer, so the heads asked for "
            f"are met by the nearest count that allows. Perplexity on {pr['eval_rows']} validation rows, base and "
            f"pruned in the same process; generation of {pr['max_new_tokens']} greedy tokens, the pruned and the base "
            f"model timed interleaved. {healing}", "", table("prune"), "", "![pruning](prune.png)"]


def qat_body(cfg: dict, metrics: dict, table) -> list[str]:
    job = records.ok(metrics["qat"])[0]
    return [f"The base model fine-tuned {cfg['qat']['train']['steps']} steps in full precision, then its weights "
            "quantized (PTQ), against the base fine-tuned on the same batches with the weights fake-quantized in "
            "every forward pass and quantized at the end (QAT): the two differ only in whether training saw the "
            f"quantization. torchao, symmetric int weights with one scale per {cfg['qat']['group_size']} weights, "
            "round to nearest; quantized: " + (job.get("quantized") or "") + ". Perplexity on "
            f"{cfg['qat']['eval_rows']} validation rows; packed weights is bits/8 per weight plus a bf16 scale per "
            "group (torchao holds each code in an int8 here). The precision range test scans from the lowest width "
            "up: B_min is the first that passes. Every figure is recomputed from `results/qat/evals.csv`.", "",
            *qat_lines(job), table("qat"), "", "![precision range test](qat.png)"]


def finetune_body(cfg: dict, metrics: dict, table) -> list[str]:
    return [
        "Tokens/s counts real (non-padding) tokens. MFU = model FLOPs per token (PaLM's 6N + 12·L·d·T for full "
        "fine-tuning; 4N + 2·N_trainable + 12·L·d·T with frozen weights) × tokens/s, over the matmul throughput "
        "measured on this machine in the training dtype at the start of the run (and over the published peak "
        "on known GPUs). Peak memory is of the training loop, kind named in the column.",
        "", table("finetune"), "", energy_note([r.get("energy") for r in records.ok(metrics["finetune"])]), "",
        "![memory and throughput](finetune.png)", "",
        "![memory vs throughput: Pareto frontier](finetune_pareto.png)", "", "![loss curves](finetune_loss.png)",
        "", "### What each knob costs and buys", "",
        "Every pair of trained runs whose settings differ in exactly one knob, everything else equal (add runs "
        "to `finetune.runs` to sweep a knob). Memory change is of the training memory over the process's "
        "resident memory before training; step time change is of the mean wall time per optimizer step; the median "
        "step and its 95% interval (or its range, where too few steps give no interval) leave out the first "
        "(warm-up) step. The step time ratio and its "
        "verdict come from `bench_finetune`, which builds both runs of the pair in one process and times their "
        "training steps interleaved (A B, then B A) over the same batches, "
        f"{cfg['bench_finetune']['rounds']} stable rounds, with a matmul speed probe before and after each round: a "
        f"round in which the machine's speed moved by more than {cfg['bench_finetune']['sentinel_tolerance']:.0%} "
        "is set aside and run again, and a pair left without enough stable rounds gets no verdict. The ratio is "
        "the median of the per-round ratios with its distribution-free 95% interval (order statistics); the verdict "
        "says slower or faster only when that interval excludes 1, else no significant difference. A pair "
        "bench_finetune did not measure falls back to the runs' own steps (step by step where they drew the same "
        "batches), and gets no verdict when the matmul ceilings the two runs measured differ by more than "
        f"{SENTINEL_TOLERANCE:.0%}.", "",
        table("finetune_knobs"), "",
        "Determinism: on CPU a rerun gives a bitwise-identical loss curve (tested); on a GPU see "
        "docs/concepts/determinism.md."]


def merge_body(cfg: dict, metrics: dict, table) -> list[str]:
    return ["Reference: the adapter on the base it was trained against. Differences are max |logit| over "
            "every real token of the validation rows.", "", table("merge"), "",
            "### Which merge keeps a QLoRA fine-tune", "",
            "The QLoRA adapter learned corrections to the 4-bit weights. Merged into the original base it corrects "
            "errors that are not there; merged into the base after the same NF4 quantize→dequantize round trip "
            "it reproduces what was trained; re-quantizing that merge adds fresh rounding. KL is the mean "
            "KL(adapter ‖ merged) per token.", "", table("merge_targets"), "", *merge_route_lines(metrics["merge"])]


def attention_body(cfg: dict, metrics: dict, table) -> list[str]:
    measured = records.ok(metrics["bench_attention"])[0].get("measured", "model forward")
    return [f"{measured}; `forward_backward` freezes the weights "
            "and back-propagates into the input embeddings, so its memory is the activations training keeps. "
            "Agreement vs eager: max |difference| of the output (forward) or of the input gradient (forward+backward). "
            "Each implementation's cell also runs eager on the same inputs, the two timed interleaved (A B, then B A) "
            "with a speed probe around each round: the speedup is the median of eager's time over the "
            "implementation's per round, with its distribution-free 95% interval; the verdict (of the implementation) "
            "says faster or slower only when that interval excludes 1.",
            "", table("bench_attention"), "", "![attention latency](bench_attention.png)", "",
            "### Memory vs sequence length", "",
            "Least-squares exponent k of peak memory delta ∝ seq_len^k (k ≈ 2: quadratic, k ≈ 1: linear).", "",
            table("attention_memory_exponent"), "", "![attention memory](bench_attention_memory.png)"]


def inference_body(cfg: dict, metrics: dict, table) -> list[str]:
    inf = cfg["bench_inference"]
    return [f"Exactly {inf['max_new_tokens']} new tokens per sequence, {prompt_count(cfg, metrics)} prompts × "
            f"{inf['repeats']} repeats after warmup, per cell (KV cache on/off × batch size). TTFT = prefill; decode "
            "tokens/s counts every sequence of the batch and excludes the first token; per-token latencies are the "
            "gaps between consecutive tokens. Every variant but the base model is timed interleaved with the base "
            "model on the same prompts, round by round (A B, then B A, with a speed probe around each round): the "
            "speedup is the median of the base's generation time over the variant's per round, with its "
            "distribution-free 95% interval and a verdict said of the variant.", "",
            table("bench_inference"), "",
            energy_note([c.get("energy") for m in records.ok(metrics["bench_inference"])
                         for c in records.ok(m.get("cells", []))]),
            "", "![inference](bench_inference.png)", "",
            "![memory vs decode speed vs perplexity: Pareto frontier](inference_pareto.png)"]


def serving_body(cfg: dict, metrics: dict, table) -> list[str]:
    bs = cfg["bench_serving"]
    return [f"{bs['requests']} requests (prompts of the data's own lengths, outputs of "
            f"{bs['max_new_tokens'][0]}-{bs['max_new_tokens'][1]} tokens, forced) arrive at once; naive serves one at "
            "a time, static batching `concurrency` at a time (a batch returns when its longest request is done), "
            "continuous batching (transformers' paged scheduler) lets a finished request leave and a waiting one "
            "join. Latency is from arrival, queueing included. Every figure is recomputed from "
            "`results/bench_serving/requests.csv`.", "", table("bench_serving"), "", "![serving](bench_serving.png)"]


def not_run_lines(not_run: pd.DataFrame) -> list[str]:
    return ["## Did not run", "",
            "Jobs and grid cells that failed, ran out of memory, were unavailable for this model or device, or "
            "were skipped because what they build on did not run; the rest ran. A failed job's log is "
            "results/logs/<stage>/<name>.log.", "",
            markdown(not_run) if not not_run.empty else "_none: every job ran_", ""]
