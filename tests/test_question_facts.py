"""The report's opening answers follow from planted records, not from which option is cheapest or named first."""
from efflab.stages.report import question_facts

MiB = 2**20
CFG = {"tolerance": {"perplexity_pct": 5.0}, "report": {"baseline_scheme": "baseline"},
       "finetune": {"defaults": {"max_steps": 6, "eval_rows": 8}}, "quantize": {"eval_rows": 16},
       "bench_inference": {"repeats": 6}}


def change(pct, lo, hi, n=16):
    return {"change_pct": pct, "ci95_change_pct": None if lo is None else [lo, hi], "n_rows": n}


def scheme(name, mib, ppl=None):
    return {"scheme": name, "status": "ok", "memory_footprint_bytes": mib * MiB, "perplexity_change": ppl}


def variant(name, kind, of, mib, speed=None):
    vs = None if speed is None else {"generation_speedup": {"median": speed[0], "ci95": speed[1:], "rounds": 8}}
    return {"variant": name, "kind": kind, "of": of, "status": "ok", "cells": [
        {"status": "ok", "kv_cache": True, "batch_size": 1, "memory_footprint_bytes": mib * MiB, "vs_base": vs}]}


def metrics(**stages):
    return {s: [] for s in ("quantize", "bench_inference", "finetune", "bench_attention", "merge")} | stages


def render(**stages):
    return "\n".join(question_facts.lines(question_facts.facts(metrics(**stages), CFG), CFG))


QUANTIZE = [scheme("baseline", 256), scheme("int8", 155, change(3.4, 1.0, 4.5)),
            scheme("nf4", 105, change(28.9, 20.0, 38.0)), scheme("fp4", 105, change(2.0, -1.0, 9.0))]
INFERENCE = [variant("baseline", "base", None, 256), variant("int8", "quantized", "int8", 155, (0.58, 0.55, 0.61)),
             variant("nf4", "quantized", "nf4", 105, (1.20, 1.10, 1.30))]


def test_the_smallest_scheme_that_keeps_quality_is_named_with_its_slower_decode_and_nf4_is_not_called_best():
    facts = question_facts.quantize_facts(QUANTIZE, INFERENCE, "baseline", 5.0)
    assert facts["pick"]["name"] == "int8", "nf4 is beyond the tolerance, fp4's interval straddles it"
    assert facts["speed"] == "slower"
    assert facts["by_status"] == {"within": ["int8"], "beyond": ["nf4"], "not decided at this size": ["fp4"], "not measured": [],
                                  "fails the task gate": []}
    text = render(quantize=QUANTIZE, bench_inference=INFERENCE)
    assert "**int8**: 155 MiB (1.65× smaller)" in text and "0.58× [0.55, 0.61] the baseline's speed (slower)" in text
    assert "Beyond the tolerance: **nf4**" in text and "Not decided at this size (the interval holds the tolerance): **fp4**" in text


def test_a_scheme_without_a_decode_cell_says_its_speed_was_not_measured_in_a_sentence():
    """A family run whose bench_inference grid holds no variant of the picked scheme (issue 50, point 9: the glance
    read "It decodes at not measured the baseline's speed (not measured)")."""
    text = render(quantize=QUANTIZE)
    assert "**int8**: 155 MiB (1.65× smaller)" in text
    assert "Its decode speed was not measured (no bench_inference variant of this scheme)." in text
    assert "decodes at not measured" not in text


def test_no_scheme_is_recommended_when_none_is_shown_within_the_tolerance():
    planted = [scheme("baseline", 256), scheme("int8", 155, change(3.4, None, None, n=4))]
    assert "No scheme is shown to keep perplexity within +5.0%" in render(quantize=planted)


def test_the_fastest_variant_is_not_recommended_when_its_quality_is_beyond_the_tolerance():
    facts = question_facts.inference_facts(INFERENCE, QUANTIZE, 5.0)
    assert facts["pick"] is None and facts["top"]["name"] == "nf4"
    text = render(quantize=QUANTIZE, bench_inference=INFERENCE)
    assert "No variant is shown to be both faster than the base model and within the quality tolerance" in text
    assert ("Of the other variants, **nf4** has the highest median speed: 1.2× [1.1, 1.3] the base model's (faster), "
            "with perplexity +28.9% [+20.0, +38.0], beyond the tolerance") in text


def test_a_smaller_or_faster_model_that_fails_the_task_gate_is_not_recommended_and_is_named():
    """int8 keeps perplexity within the tolerance, but its answers fail the evaluate stage's gate: no scheme is
    recommended, and the advice says the smaller one fails the gate; a faster variant that fails it likewise."""
    gates = {"base": "reference", "quantized-int8": "fails", "quantized-nf4": "fails", "quantized-fp4": "passes"}
    facts = question_facts.quantize_facts(QUANTIZE, INFERENCE, "baseline", 5.0, gates)
    assert facts["pick"]["baseline"] and facts["by_status"]["fails the task gate"] == ["int8", "nf4"]
    faster = question_facts.inference_facts(INFERENCE, QUANTIZE, 5.0, gates)
    assert faster["pick"] is None and faster["gate_failed_faster"] == ["nf4"]
    evaluated = [{"status": "ok", "model": m, "gate": {"verdict": v, "failed": []}} for m, v in gates.items()]
    text = render(quantize=QUANTIZE, bench_inference=INFERENCE, evaluate=evaluated)
    assert "No scheme is shown to keep perplexity within +5.0%" in text
    assert "Smaller, but failing the task-quality gate (see *Task quality*), so not recommended: **int8**, **nf4**" in text
    assert "Faster than the base model, but failing the task-quality gate" in text and "| fails |" in text


def test_the_route_closest_to_the_adapter_is_not_called_best_when_another_is_better_in_quality():
    targets = {"original base": {"kl_mean": 0.54, "validation": {"perplexity": 26.6},
                                 "perplexity_change": change(-15.0, -20.0, -10.0, 8)},
               "nf4 round-trip base": {"kl_mean": 0.003, "validation": {"perplexity": 31.4},
                                       "perplexity_change": change(0.1, -0.5, 0.7, 8)}}
    text = render(merge=[{"run": "qlora-r8", "status": "ok", "targets": targets}])
    assert "**nf4 round-trip base** is closest to the adapter" in text
    assert "**original base** has the lower perplexity" in text and "Fidelity to the adapter is not quality" in text


def _run(name, method, rows, step=(1.0, 0.9, 1.1), lr=1e-3, memory=900.0):
    return {"run": name, "method": method, "status": "ok", "settings": {"learning_rate": lr},
            "train_memory": {"kind": "cpu_peak_rss", "peak_mib": memory},
            "step_time": {"median": step[0], "ci95_median": list(step[1:]), "n": 8},
            "validation_after": {"per_row": rows}}


def test_a_lowest_loss_within_noise_is_no_winner_and_a_different_learning_rate_is_said():
    noisy = [[10, 20.0 + d] for d in (0.5, -0.5, 0.4, -0.4, 0.3, -0.3, 0.2, -0.2)]
    runs = [_run("full", "full", [[10, 20.0]] * 8, lr=5e-5, memory=3600.0),
            _run("lora-r8", "lora", noisy, step=(0.5, 0.45, 0.55))]
    facts = question_facts.finetune_facts(runs)
    assert facts["winners"] == {"memory": None, "step_ratio": "lora-r8", "quality": None}
    text = render(finetune=runs)
    assert "Lowest validation perplexity after training: not decided at this size;" in text
    assert "Shortest step: **lora-r8**" in text and "`learning_rate` (full: 5e-05, lora-r8: 0.001)" in text


def test_a_figure_measured_once_per_run_is_undecided_not_no_difference():
    """Peak memory is one measurement per run: 3,600 vs 900 MiB has no interval to separate, and the advice must
    not call that 'no difference measured' (which reads as measured equal)."""
    rows = [[10, 20.0]] * 8
    runs = [_run("full", "full", rows, lr=5e-5, memory=3600.0), _run("lora-r8", "lora", rows)]
    text = render(finetune=runs)
    assert ("Least training memory: not decided at this size (some runs have one measurement and no interval); "
            "lora-r8 has the best point value") in text
    assert "no difference measured" not in text and "undecided" not in text


def test_the_fine_tuning_table_shows_a_peak_with_its_measured_error_not_as_an_interval():
    """decisions.py renders the advice's one fine-tuning table (question_facts.finetune_table): a peak and its kind's measured
    error, never the error band as if it were a 95% interval."""
    def option(name, mib, baseline=False):
        return {"name": name, "baseline": baseline, "method": "lora",
                "axes": {"memory": {"value": mib, "lo": mib * 0.99, "hi": mib * 1.01, "error_pct": 0.8},
                         "step": None, "step_ratio": None, "quality": None}}
    text = question_facts.finetune_table([option("full", 3226.0, True), option("lora-r8", 1685.0)], ["full", "lora-r8"])
    assert "3,226 MiB ± 0.8% (measured error)" in text and "1,685 MiB ± 0.8% (measured error)" in text
    assert "[3,19" not in text and "[1,6" not in text
