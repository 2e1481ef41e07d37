import json

import pandas as pd
import pytest
import torch

from efflab import records
from efflab.measure import env
from efflab.stages.report import bench_plots, environments, knobs, notes, pareto, plots, writing


def _envs():
    here = env.environment(torch.device("cpu"))
    there = here | {"packages": here["packages"] | {"torch": "2.12.0"}, "cpu": "Other CPU"}
    there["fingerprint"] = env.fingerprint(there)
    return here, there


def test_results_from_different_environments_are_not_put_in_one_table_unless_asked():
    here, there = _envs()
    assert here["fingerprint"] != there["fingerprint"]
    envs = {e["fingerprint"]: e for e in (here, there)}
    df = pd.DataFrame([{"variant": "a", "tokens/s": 10.0, "env": here["fingerprint"]},
                       {"variant": "b", "tokens/s": 12.0, "env": there["fingerprint"]}])
    refused = environments.comparison(df, envs, allow_mixed=False)
    assert "Not compared in one table" in refused and "allow_mixed_environments" in refused
    assert f"torch: {here['packages']['torch']} / 2.12.0" in refused and "Other CPU" in refused
    assert refused.count("| variant") == 2, "one table per environment"
    combined = environments.comparison(df, envs, allow_mixed=True)
    assert combined.count("| variant") == 1 and "combined" in combined
    same = environments.comparison(df.assign(env=here["fingerprint"]), envs, allow_mixed=False)
    assert same.count("| variant") == 1 and "env" not in same


def test_missing_values_print_as_a_dash():
    table = writing.markdown(pd.DataFrame([{"a": 1.5, "b": None}, {"a": float("nan"), "b": "x"}]))
    assert "nan" not in table and "-" in table.splitlines()[-1]


def _run(name, memory, step_s, **settings):
    base = {"method": "lora", "gradient_checkpointing": False, "packing": True, "eval_rows": 8, "lora": {"r": 8}}
    return {"run": name, "status": "ok", "settings": base | settings, "step_s": step_s, "tokens_per_s": 100 / step_s,
            "train_memory": {"kind": "cpu_peak_rss", "peak_mib": memory + 1000, "delta_mib": memory},
            "validation_after": {"loss": 3.0}, "environment": {"fingerprint": "e"}}


def test_runs_that_differ_in_one_knob_become_a_knob_row():
    rows = [_run("lora", 400, 1.0), _run("lora-gc", 250, 1.3, gradient_checkpointing=True),
            _run("lora-r16", 420, 1.0, lora={"r": 16}), _run("lora-eval", 400, 1.0, eval_rows=16),
            {"run": "broken", "status": "failed", "reason": "x", "settings": {}}]
    table = knobs.knob_table(rows)
    found = dict(zip(table["knob"], table.to_dict("records")))
    assert set(found) == {"gradient_checkpointing", "lora.r"}, "eval_rows is not a knob; the failed run is left out"
    gc = found["gradient_checkpointing"]
    assert gc["from → to"] == "false → true" and gc["runs"] == "lora → lora-gc"
    assert gc["memory change (%)"] == pytest.approx(-37.5)
    assert gc["tokens/s ratio (interleaved)"] is None, "no ratio from two separate processes (one protocol a pair)"
    assert gc["step time verdict"] == "-", "no per-step times recorded: no verdict"


def test_a_step_time_verdict_pairs_the_same_batches_and_needs_the_interval_off_one():
    from efflab.measure.stats import summarize

    lengths = [1.0, 1.6, 0.7, 1.3, 0.9, 1.1, 1.4]  # batches of different lengths: a wide spread per run
    plain = _run("lora", 400, 1.0) | {"step_time": summarize(lengths), "tokens_seen": 1000}
    recomputed = _run("lora-gc", 250, 1.3, gradient_checkpointing=True) | {
        "step_time": summarize([1.3 * t for t in lengths]), "tokens_seen": 1000}
    noisy = _run("lora-noisy", 400, 1.0, lora={"r": 16}) | {
        "step_time": summarize([t * f for t, f in zip(lengths, (0.8, 1.3, 1.0, 1.2, 0.9, 1.1, 0.95))]),
        "tokens_seen": 1000}
    # each run's own interval overlaps the other's, but every same-batch step is 1.3x: slower
    assert plain["step_time"]["ci95_median"][1] > recomputed["step_time"]["ci95_median"][0]
    ratio = records.step_ratio(plain, recomputed, [], 0.1)
    assert ratio["source"] == "paired" and ratio["median"] == pytest.approx(1.3) and ratio["verdict"] == "slower"
    assert records.step_ratio(recomputed, plain, [], 0.1)["verdict"] == "faster"
    assert records.step_ratio(plain, noisy, [], 0.1)["verdict"].startswith("not decided at this size")
    other_batches = recomputed | {"tokens_seen": 2000}  # not the same batches: the runs' intervals decide
    unpaired = records.step_ratio(plain, other_batches, [], 0.1)
    assert unpaired["source"] == "runs" and unpaired["verdict"].startswith("not decided at this size")
    row = knobs.knob_table([plain, recomputed]).iloc[0]
    assert row["step time verdict"] == "slower" and row["step time ratio [95% CI]"].endswith("(7 paired steps)")


def test_reference_results_keep_the_numbers_and_no_weights_under_the_device_name(tmp_path):
    from efflab.tools.reference import copy_reference, main

    results = tmp_path / "results"
    files = {"base_model/metrics.json": json.dumps({"environment": {"gpu": "NVIDIA H100 80GB HBM3", "cpu": "x"}}),
             "base_model/model/model.safetensors": "weights", "finetune/lora-r8/metrics.json": "{}",
             "finetune/lora-r8/loss.csv": "step,loss\n", "finetune/lora-r8/model/adapter_model.safetensors": "w",
             "report/report.md": "# r", "report/summary.csv": "a\n", "report/finetune.png": "png",
             "claims/claims.csv": "id\n", "logs/finetune/lora-r8.log": "log"}
    for name, text in files.items():
        (results / name).parent.mkdir(parents=True, exist_ok=True)
        (results / name).write_text(text)
    target = copy_reference(results, results / "reference")
    assert target == results / "reference" / "nvidia-h100-80gb-hbm3"
    kept = sorted(str(p.relative_to(target)) for p in target.rglob("*") if p.is_file())
    assert kept == sorted(n for n in files if "/model/" not in n and not n.startswith("logs/"))
    assert copy_reference(results, results / "reference") == target, "a second copy replaces the first"
    # a CPU run is named by the CPU and whether it has fast bf16, the difference that changes every timing
    from efflab.tools.reference import device_name
    for isa, kind in ((["avx2"], "avx2"), (["avx2", "avx512f", "avx512_bf16"], "avx512-bf16")):
        (results / "base_model/metrics.json").write_text(json.dumps({"environment": {"cpu": "AMD EPYC", "cpu_isa": isa}}))
        assert device_name(results) == f"amd-epyc-{kind}"
    with pytest.raises(SystemExit) as exit_:
        main(["--results", str(tmp_path / "nowhere")])
    assert exit_.value.code == 2


MiB = 2**20


def _scheme(name, mib, change=None):
    pct, lo, hi = change or (None, None, None)
    return {"scheme": name, "status": "ok", "memory_footprint_bytes": mib * MiB,
            "perplexity_change": change and {"change_pct": pct, "ci95_change_pct": [lo, hi], "n_rows": 16}}


def _variant(name, kind, mib, speed=None):
    vs = speed and {"generation_speedup": {"median": speed[0], "ci95": list(speed[1:]), "rounds": 8}}
    return {"variant": name, "kind": kind, "of": None if kind == "base" else name, "status": "ok", "cells": [
        {"status": "ok", "kv_cache": True, "batch_size": 1, "memory_footprint_bytes": mib * MiB,
         "decode_tokens_per_s": {"median": 20.0}, "vs_base": vs}]}


@pytest.fixture
def drawn(monkeypatch):
    """The figures the plots save, laid out and written as they are, then kept open to be read."""
    import matplotlib.pyplot as plt

    figures, close = [], plt.close
    monkeypatch.setattr(plt, "close", figures.append)
    yield figures
    for fig in figures:
        close(fig)


def test_the_inference_frontier_is_the_advices_by_intervals_drawn_without_a_line_or_overprinted_labels(drawn, tmp_path):
    """`close` loses to the baseline on every point value but no interval separates them: it stays on the
    frontier; `bad` is beaten by separated intervals. The labels of the two coinciding points do not overlap."""
    from matplotlib.text import Text

    from efflab.stages.report import question_facts

    quantize = [_scheme("baseline", 256), _scheme("int8", 155, (3.4, 1.0, 4.5)), _scheme("nf4", 105, (28.9, 20, 38)),
                _scheme("close", 256, (0.5, -1.0, 2.0)), _scheme("bad", 260, (10.0, 8.0, 12.0))]
    inference = [_variant("baseline", "base", 256), _variant("int8", "quantized", 155, (0.58, 0.55, 0.61)),
                 _variant("nf4", "quantized", 105, (1.2, 1.1, 1.3)),
                 _variant("close", "quantized", 256, (0.98, 0.9, 1.05)),
                 _variant("bad", "quantized", 260, (0.9, 0.85, 0.95))]
    points = pareto.inference_pareto(inference, quantize, question_facts.inference_facts(inference, quantize, 5.0))
    assert {p["name"]: p["dominated"] for p in points} == {"baseline": False, "int8": False, "nf4": False,
                                                           "close": False, "bad": True}
    front = question_facts.inference_facts(inference, quantize, 5.0)["front"]
    assert [p["name"] for p in points if not p["dominated"]] == front
    plots.plot_inference_pareto(points, tmp_path / "front.png")
    (fig,) = drawn
    ax = fig.axes[0]
    assert not [line for line in ax.get_lines() if line.get_linestyle() not in ("None", "none", "")
                and len(line.get_xdata()) > 1], "no line joins the frontier"
    fig.canvas.draw()
    boxes = {t.get_text(): Text.get_window_extent(t) for t in ax.texts}  # the words, not the leader line
    assert any(text.startswith("close: on the frontier; perplexity +0.5% [-1.0%, +2.0%]") for text in boxes)
    assert not [(a, b) for a in boxes for b in boxes if a < b and boxes[a].overlaps(boxes[b])]


def _at_max(predicted, tensors, held, file=0.0, shift=0.0):
    """The memory at a measured maximum as the capacity stage records it, its ratio and gap computed."""
    return {"loaded_mib": 600.0 + shift, "loaded_shift_mib": shift, "peak_mib": 600.0 + shift + held,
            "predicted_growth_mib": predicted,
            "tensor_growth_mib": tensors, "ratio": tensors / predicted, "held_growth_mib": held,
            "gap_mib": held - tensors, "file_growth_mib": file}


def _search(subject, predicted, measured, whole=False, at_max=None, kind="train"):
    return {"subject": subject, "kind": kind, "dimension": "batch_size", "status": "ok", "predicted_max": predicted,
            "measured_max": measured, "whole_range_fits": whole, "first_failing": None if whole else measured + 1,
            **({"at_max": at_max} if at_max else {})}


def _capacity_job(*searches):
    return {"status": "ok", "budget": {"mib": 2048, "source": "capacity.budget_mib.cpu",
                                       "memory": "cpu_peak_rss: the cell process's resident-set high-water mark"},
            "fixed": {"train_seq_len": 128, "prompt_len": 64, "new_tokens": 8},
            "steps": {"warmup": {"train": 2, "generate": 1}, "timed": 2},
            "tensors": {"kind": "cpu_tensor_peak", "over": "the warm-up steps, over the loaded model"},
            "searches": list(searches), "environment": env.environment(torch.device("cpu"))}


def test_a_capacity_search_that_fit_its_whole_grid_is_drawn_as_at_least_its_ceiling(drawn, tmp_path):
    job = _capacity_job(_search("lora", 7, 5, at_max=_at_max(640, 652, 1072)), _search("baseline", 32, 32, True))
    bench_plots.plot_capacity([job], tmp_path / "capacity.png")
    ax = drawn[0].axes[0]
    assert [t.get_text() for t in ax.texts] == ["≥ 32\n(grid ceiling)"]
    measured = {round(r.get_x() + r.get_width() / 2, 1): r for r in ax.patches}
    assert measured[0.2].get_fill() and not measured[0.2].get_hatch(), "a measured maximum is a solid bar"
    assert not measured[1.2].get_fill() and measured[1.2].get_hatch() == "//", "the ceiling is open and hatched"
    growth = drawn[0].axes[2]  # below: the memory at the measured maximum, the one search that has it
    assert [r.get_height() for r in growth.patches] == [640, 652, 1072], "predicted, live tensors, RSS"


def _capacity_report(job) -> tuple[str, str, pd.DataFrame]:
    from efflab.stages.report import annotate, decisions, glance, sections
    from efflab.stages.report.tables import capacity as tables

    metrics = annotate.with_causes({"qat": [], "capacity": [job], "finetune": [], "bench_attention": [],
                                    "base_model": [{"config": {}}]})
    return (sections.capacity_body({}, metrics, lambda key: "TABLE") + sections.capacity_misses(metrics),
            glance.capacity(decisions._capacity(metrics["capacity"][0])),
            tables.capacity_table([job]))


def test_capacity_names_the_memory_beyond_live_tensors_when_the_estimator_s_tensors_are_right():
    """A planted record: at the measured maximum the estimator's live tensors are within 2% of the measured ones,
    and RSS grew 420 MiB beyond them. The report says the tensor count holds and names the gap; it never says the
    estimator is off. Every figure it prints is the record's."""
    section, note, table = _capacity_report(_capacity_job(_search("lora-r8", 7, 5, at_max=_at_max(640, 652, 1072,
                                                                                                  file=264))))
    assert "predicted 7, measured 5 (6 fails)" in section
    assert "live tensors 640 MiB predicted, 652 measured (1.02×, within ±15%)" in section
    assert "RSS grew 1,072 MiB, 420 beyond the live tensors (264 MiB of file pages read after loading)" in section
    assert "Cause: the miss is mostly memory beyond the live tensors." in section
    assert "outside" not in section and "estimator's, on live tensors" not in section
    assert "lora-r8: batch 5" in note and "#capacity-" in note
    assert "estimator's miss" not in note
    row = table.iloc[0]
    assert (row["predicted max"], row["measured max"], row["tensors predicted (MiB)"], row["tensors measured (MiB)"],
            row["RSS growth (MiB)"]) == (7, "5 (6 fails)", 640, 652, 1072)
    assert len(table.columns) <= 10


def test_capacity_says_the_estimator_is_off_only_where_its_tensors_are():
    section, note, _ = _capacity_report(_capacity_job(_search("lora-r8", 7, 4, at_max=_at_max(640, 900, 1000))))
    assert "(1.41×, outside ±15%)" in section and "Cause: the miss is mostly the estimator's, on live tensors" in section
    assert "lora-r8: batch 4" in note, "the glance says what fits; the section why"
    # The QLoRA case of a run: the tensors within 3%, and this cell's loaded model held 253 MiB more than the first
    # cell's, where the prediction starts: that, not the estimator and not the 86 MiB gap, moved the maximum.
    loaded, _, _ = _capacity_report(_capacity_job(_search("qlora-r8", 6, 4, at_max=_at_max(855, 829, 915,
                                                                                          shift=253))))
    assert "Cause: the miss is mostly the loaded model holding 253 MiB more than in the first cell" in loaded
    assert "within ±15%" in loaded and "memory beyond" not in loaded
    right, _, _ = _capacity_report(_capacity_job(_search("lora-r8", 5, 5, at_max=_at_max(640, 652, 1072))))
    assert "Cause: the predicted maximum is the measured one." in right and "outside" not in right
    # A prediction below the measured maximum: the resident memory grew 40 MiB less than the live tensors. The
    # report must not blame memory *beyond* the tensors for it (the reference run once did).
    short, note, _ = _capacity_report(_capacity_job(_search("qlora-r8", 448, 512, at_max=_at_max(866, 829, 789))))
    assert "40 short of the live tensors" in short and "RSS grew by less than the live tensors" in short
    assert "memory beyond the live tensors" not in short + note


def test_the_attention_plot_draws_only_the_interleaved_pairs_and_a_range_where_rounds_give_no_interval(drawn, tmp_path):
    """sdpa's own cell took a tenth of eager's (other processes): the plot ignores that and draws the pairs'
    speedups, 1.2 with its interval and 0.9 with the range of its 3 stable rounds (dashed)."""
    eager = {"status": "ok", "implementation": "eager", "rows": [
        {"implementation": "eager", "mode": "forward", "seq_len": s, "batch_size": 1, "status": "ok",
         "latency": {"median": 0.010}} for s in (64, 128)]}
    rounds = [{"seconds": {"sdpa": 1.0, "eager": e}, "stable": e < 2} for e in (0.8, 0.95, 0.9, 3.0)]
    pairs = {64: {"speedup": {"median": 1.2, "ci95": [1.1, 1.3], "rounds": 8}},
             128: {"speedup": {"median": 0.9, "ci95": None, "rounds": 3}, "rounds": rounds}}
    sdpa = {"status": "ok", "implementation": "sdpa", "rows": [
        {"implementation": "sdpa", "mode": "forward", "seq_len": s, "batch_size": 1, "status": "ok",
         "latency": {"median": 0.001}, "vs_eager": pairs[s]} for s in (64, 128)]}
    speedups = bench_plots.attention_speedups([eager, sdpa])
    assert speedups[["implementation", "speedup", "lo", "hi", "spread", "n"]].values.tolist() == [
        ["sdpa", 1.2, 1.1, 1.3, "95% CI", 8], ["sdpa", 0.9, 0.8, 0.95, "range", 3]]
    bench_plots.plot_attention(speedups, tmp_path / "attention.png")
    ax = drawn[0].axes[0]
    assert [list(line.get_ydata()) for line in ax.get_lines() if line.get_marker() == "o"] == [[1.2, 0.9]]
    bars = {tuple(map(tuple, c.get_segments()[0])): c.get_linestyle()[0][1] is not None for c in ax.collections}
    assert bars == {((64.0, 1.1), (64.0, 1.3)): False, ((128.0, 0.8), (128.0, 0.95)): True}, bars


def test_an_artifact_hash_depends_on_its_files_not_on_where_they_are(tmp_path):
    from efflab.provenance import content_sha256

    for where in ("a", "b"):
        (tmp_path / where / "model").mkdir(parents=True)
        (tmp_path / where / "model" / "config.json").write_text("{}")
        (tmp_path / where / "model" / "weights.bin").write_bytes(b"\x00\x01")
    same = [content_sha256([tmp_path / w / "model"]) for w in ("a", "b")]
    assert same[0] == same[1]
    (tmp_path / "b" / "model" / ".snakemake_timestamp").write_text("")
    assert content_sha256([tmp_path / "b" / "model"]) == same[0], "hidden bookkeeping files are not content"
    (tmp_path / "b" / "model" / "weights.bin").write_bytes(b"\x00\x02")
    assert content_sha256([tmp_path / "b" / "model"]) != same[0]


def test_a_knob_verdict_comes_from_the_interleaved_pair_and_never_from_runs_at_different_speeds():
    from efflab.measure.stats import summarize

    lengths = [1.0, 1.6, 0.7, 1.3, 0.9, 1.1, 1.4]
    ceiling = lambda tflops: {"throughput": {"matmul_ceiling": {"tflops": tflops}}}  # noqa: E731
    plain = _run("lora", 400, 1.0) | {"step_time": summarize(lengths), "tokens_seen": 1000} | ceiling(0.070)
    # checkpointing read 2x faster: its run had the machine to itself, the plain run shared it (half speed)
    gc = _run("lora-gc", 250, 0.5, gradient_checkpointing=True) | {
        "step_time": summarize([0.5 * t for t in lengths]), "tokens_seen": 1000} | ceiling(0.140)
    row = knobs.knob_table([plain, gc]).iloc[0]
    assert row["step time verdict"].startswith("not decided: the machine's speed changed between the runs")
    interleaved = {"status": "ok", "pairs": [{
        "status": "ok", "knob": "gradient_checkpointing", "a": "lora", "b": "lora-gc",
        "step_time_ratio": {"median": 1.31, "ci95": [1.22, 1.40], "rounds": 6, "verdict": "slower"},
        "runs": {"lora": {"tokens_per_s": 200.0}, "lora-gc": {"tokens_per_s": 150.0}}}]}
    row = knobs.knob_table([plain, gc], [interleaved]).iloc[0]
    assert row["step time verdict"] == "slower" and row["tokens/s ratio (interleaved)"] == pytest.approx(0.75)
    assert row["step time ratio [95% CI]"] == "1.31 [1.22, 1.40] (interleaved, 6 rounds)"


def _ft_run(name, method, last, peak, delta, live, **settings):
    return {"run": name, "method": method, "status": "ok", "first_loss": 2.0, "last_loss": last,
            "validation_after": {"loss": last + 0.1},
            "settings": {"gradient_checkpointing": False, "packing": True} | settings,
            "train_memory": {"kind": "cpu_peak_rss", "peak_mib": peak, "delta_mib": delta},
            "memory_prediction": {"measured_mib": live}}


def _notes(finetune=(), bench_attention=(), config=None) -> str:
    metrics = {"qat": [], "capacity": [], "finetune": list(finetune), "bench_attention": list(bench_attention),
               "base_model": [{"config": config or {}}]}
    return "\n".join(notes.lines(metrics))


def test_the_opening_names_identical_runs_and_explains_qlora_peaking_above_lora():

    runs = [_ft_run("lora-r8", "lora", 1.5, 2400, 1200, 890), _ft_run("lora-r8-gc", "lora", 1.5, 2000, 800, 400,
                                                                  gradient_checkpointing=True),
            _ft_run("qlora-r8", "qlora", 1.6, 2600, 1340, 890)]
    assert notes.same_updates(runs) == [["lora-r8", "lora-r8-gc"]]
    note = _notes(runs)
    assert "2,600 vs 2,400 MiB" in note and "1,260 vs 1,200 MiB" in note and "890 vs 890 MiB" in note
    assert "Before training, QLoRA's process held more: 1,260 vs 1,200 MiB." in note
    runs[2]["train_memory"]["peak_mib"] = 2300
    assert notes.qlora_above_lora(runs) is None and "QLoRA" not in _notes(runs), "nothing to explain"


def test_the_qlora_note_says_what_its_numbers_say_when_qlora_held_less_before_training():
    """The reference run's case: QLoRA held less before training (847 vs 932 MiB) and the whole gap came in
    training. The note once said QLoRA 'already held' more; every clause now follows from the two records."""

    runs = [_ft_run("lora-r8", "lora", 1.5, 1100, 168.4, 300), _ft_run("qlora-r8", "qlora", 1.6, 1200, 352.8, 310)]
    note = _notes(runs)
    assert "Before training, QLoRA's process held less: 847 vs 932 MiB." in note, note
    assert "reads the full-precision checkpoint" not in note
    assert "Training added 353 vs 168 MiB." in note and "bitsandbytes" not in note  # no cause a record does not show


def test_the_attention_note_computes_where_the_square_law_takes_over_from_the_config():

    jobs = [{"status": "ok", "implementation": "eager", "rows": [{"seq_len": 64}, {"seq_len": 256}],
             "memory_exponents": [{"mode": "forward", "exponent": 1.03}]}]
    config = {"num_attention_heads": 9, "hidden_size": 576, "intermediate_size": 1536}
    note = _notes(bench_attention=jobs, config=config)
    assert "L ≈ 384 tokens" in note and "64–256 tokens" in note and "linear terms dominate" in note
    jobs[0]["memory_exponents"][0]["exponent"] = 1.9
    assert notes.attention_law(jobs, config) is None and "Eager" not in _notes(bench_attention=jobs, config=config)


def test_a_plot_with_nothing_measured_says_so_instead_of_an_empty_legend(tmp_path, recwarn):
    """Every attention cell failed (or could not run): the plot is still written, with a note and no warning."""
    failed = pd.DataFrame([{"implementation": "flash_attention_2", "mode": "forward", "batch": 1, "seq len": 64,
                            "status": "unavailable: the flash-attn package is not installed",
                            "median (ms)": None, "95% CI or range of median (ms)": None, "peak delta (MiB)": None,
                            "memory kind": None}])
    bench_plots.plot_attention(failed, tmp_path / "attention.png")
    bench_plots.plot_attention_memory(failed, pd.DataFrame(columns=["implementation", "mode", "batch",
                                                               "memory ~ seq^k: k"]), tmp_path / "memory.png")
    assert (tmp_path / "attention.png").stat().st_size > 0 and (tmp_path / "memory.png").stat().st_size > 0
    assert not [w for w in recwarn if "No artists" in str(w.message)]


def test_the_long_results_table_keeps_each_figure_with_its_interval_and_n():
    from efflab.stages.report import tidy

    record = {"name": "int8", "environment": {"cpu": "x"}, "load_s": 1.5, "settings": {"lr": 1.0},
              "cells": [{"kv_cache": True, "batch_size": 1, "prompt_tokens": [3, 4],
                         "ttft": {"median": 0.2, "n": 8, "ci95_median": [0.1, 0.3], "unit": "s"},
                         "vs_base": {"generation_speedup": {"median": 0.6, "ci95": None, "rounds": 2}}}],
              "perplexity_change": {"change_pct": 3.4, "ci95_change_pct": [1.0, 5.8], "n_rows": 16}}
    df = tidy.results_table({"quantize": [record]}).set_index("metric")
    assert list(df.columns) == ["stage", "job", "value", "lower", "upper", "unit", "n"]
    assert df.loc["load_s", "unit"] == "s" and df.loc["load_s", "job"] == "int8"
    ttft = df.loc["cells[batch_size=1,kv_cache=True].ttft"]
    assert (ttft["value"], ttft["lower"], ttft["upper"], ttft["n"]) == (0.2, 0.1, 0.3, 8)
    assert pd.isna(df.loc["cells[batch_size=1,kv_cache=True].vs_base.generation_speedup", "lower"])
    assert df.loc["perplexity_change", "upper"] == 5.8
    assert not any(m.startswith(("environment", "settings")) or "prompt_tokens" in m for m in df.index)


def test_a_wide_table_is_split_into_parts_that_repeat_its_key_columns_and_empty_columns_go():
    df = pd.DataFrame([{"variant": "a", "batch": 1, **{f"c{i}": float(i) for i in range(14)}, "empty": None}])
    df.attrs["keys"] = 2
    parts = writing.markdown(df).split("\n\n")
    assert len(parts) == 2 and all(p.startswith("| variant | batch |") for p in parts)
    assert all(len(p.splitlines()[0].split(" | ")) <= 10 for p in parts) and "empty" not in writing.markdown(df)


def test_the_claims_headline_splits_measured_from_computed_and_definitions():
    job = {"status": "ok", "claims": 5, "by_verdict": {"reproduced": 4, "inconclusive": 1},
           "counts": {"measured": {"reproduced": 1, "inconclusive": 1}, "computed": {"reproduced": 2},
                      "definition": {"reproduced": 1, "differs": 0}}}
    text = "\n".join(notes.claims_lines([job], "../claims/claims.md"))
    assert "- measured here, with an interval: 1 reproduced, 1 inconclusive" in text
    assert "- computed from the seed's own inputs: 2 reproduced" in text and "- definitions and counts: 1 reproduced\n" in text


def test_serving_reads_its_bursts_an_interval_from_six_a_range_below_and_an_old_single_burst_as_it_is(drawn, tmp_path):
    """The table (at most 10 columns), the section, the plot and summary.csv of bench_serving records with 6 and
    with 3 interleaved bursts, and of the reference run's record of one burst."""
    from efflab.stages.report import sections, tidy
    from efflab.stages.report.tables import bench_serving as tables
    from tests.helpers import REPO, serving_record

    drift = [1.0, 1.4, 0.9, 2.0, 1.2, 0.8]
    rates = {("naive", 1): [10 * d for d in drift], ("static", 4): [25 * d for d in drift],
             ("continuous", 4): [32.5 * d for d in drift]}
    six = serving_record(rates)
    six["cells"].append({"method": "vllm", "concurrency": 4, "status": "unavailable", "reason": "not installed"})
    three = serving_record({k: v[:3] for k, v in rates.items()})
    one = json.loads((REPO / "tests/records/bench_serving_one_burst.json").read_text())  # a record of one burst
    table = tables.serving_table([six]).set_index("method")
    assert len(table.columns) + 1 <= writing.MAX_COLUMNS
    assert table.loc["continuous", "x static [95% CI]"] == "1.30 [1.30, 1.30]"
    assert table.loc["continuous", "verdict vs static"] == "faster" == table.loc["static", "verdict vs naive"]
    assert table.loc["continuous", "x naive [95% CI]"] == "3.25 [3.25, 3.25]" and table.loc["naive", "x naive [95% CI]"] == "-"
    assert table.loc["static", "output tokens/s"] == "27.5 [20, 50]" and table.loc["vllm", "status"].startswith("unavail")
    table = tables.serving_table([three]).set_index("method")
    assert table.loc["static", "output tokens/s"] == "25 (range 22.5–35, n=3)"
    assert table.loc["continuous", "x static [95% CI]"] == "1.30 (no 95% interval: 3 rounds)"
    assert table.loc["continuous", "verdict vs static"] == "not decided at this size (n=3, no 95% interval)"
    table = tables.serving_table([one]).set_index(["method", "concurrency"])
    assert table.loc[("continuous", 12), "x naive [95% CI]"] == "3.19 (no 95% interval: 1 rounds)"
    assert table.loc[("continuous", 12), "output tokens/s"] == "74.2"
    metrics = {"bench_serving": [six]}
    built = {"bench_serving": tables.serving_table([six]), "bench_serving_latency": tables.serving_latency_table([six])}
    body = sections.serving_body({}, metrics, lambda key: writing.markdown(built[key]))
    assert "The burst is served 6 times" in body and "8 requests arrive at once" in body
    assert "- Continuous over static batching at concurrency 4: 1.30 [1.30, 1.30], faster." in body
    assert "TTFT and latency percentiles over the requests of all 6 burst(s), pooled" in body
    assert "served the burst once" in sections.serving_body({}, {"bench_serving": [one]}, lambda key: "")
    for record, dashed in ((six, False), (three, True)):
        bench_plots.plot_serving([record], tmp_path / "serving.png")
        vs_naive = drawn[-1].axes[1]
        bars = [c.get_linestyle()[0][1] is not None for c in vs_naive.collections]
        assert bars == [dashed], "the ratios over naive: a 95% interval from 6 rounds, a dashed range from 3"
        assert [t.get_text() for t in vs_naive.texts] == [f"× static\n{'1.3 [1.3, 1.3]' if not dashed else '1.3 (range 1.3–1.3, n=3)'}"]
    bench_plots.plot_serving([one], tmp_path / "serving.png")
    assert "one burst each: no interval" in drawn[-1].axes[1].get_ylabel()
    df = tidy.results_table(metrics).set_index("metric")
    ratio = df.loc["cells[continuous,concurrency=4].continuous_vs_static"]
    assert (ratio["value"], ratio["lower"], ratio["upper"], ratio["n"]) == (1.3, 1.3, 1.3, 6)
    assert not any("by_burst" in m for m in df.index)


def test_a_later_part_of_a_split_table_leaves_out_rows_with_nothing_in_it():
    from efflab.stages.report.writing import markdown

    wide = pd.DataFrame([{"name": n, **{f"c{i}": i + k for i in range(9)}, "ratio": r}
                         for k, (n, r) in enumerate((("eager", None), ("sdpa", 1.5)))])
    first, second = markdown(wide, keys=1).split("\n\n")
    assert "eager" in first and "sdpa" in first, "the first part names every row"
    assert "eager" not in second and "| sdpa | 1.5 |" in second


def test_a_ratio_with_no_median_is_left_out_of_the_long_results_table():
    """The speed sentinel set every round aside (a busy machine): the record keeps the ratio with no median, and
    summary.csv, whose every row has a value, leaves it out."""
    from efflab.stages.report import tidy

    record = {"status": "ok", "vs_base": {"generation_speedup": {"median": None, "ci95": None, "rounds": 0},
                                          "other": {"median": 1.2, "ci95": [1.1, 1.3], "rounds": 6}}}
    rows = tidy.flatten(record)
    assert [r["metric"] for r in rows] == ["vs_base.other"] and rows[0]["value"] == 1.2


def test_the_run_size_names_what_the_default_leaves_to_the_gpu_profile():
    """The default params against the GPU profile: stages' jobs and the lists that multiply cells, QAT's lm-eval
    tasks among them (the CPU default scores none)."""
    from efflab import config
    from efflab.stages.report import sections

    out = {o["what"]: o["values"] for o in sections.left_out(config.load(config.REPO_ROOT / "params.yaml"),
                                                             config.load(config.REPO_ROOT / sections.GPU_PROFILE))}
    assert out["qat.eval_tasks"] == ["efflab_validation_gen", "efflab_validation_ll"]
    assert out["qat.bits"] == [2, 3] and "lora-r8-padded" in out["finetune"]
    # a variant's own cell lists (issue 53): the GPU profile's assisted generation and 2-bit KV cache
    assert "assisted" in out["bench_inference.variants.baseline.generation"]
    assert out["bench_inference.variants.baseline.kv_quant"] == ["quanto-2"]
    assert out["capacity.kv_quant"] == ["quanto-4", "quanto-2"]
    test_params = config.load(config.REPO_ROOT / "tests" / "config" / "params.test.yaml")
    test_params["capacity"].pop("kv_quant", None)  # a params file without the list: nothing asked, nothing fails
    assert sections.left_out(test_params, config.load(config.REPO_ROOT / sections.GPU_PROFILE))


def test_did_not_run_lists_the_failed_cells_of_a_job_that_ran_one_row_per_reason():
    """A job that ran can still hold cells that did not (bench_serving's continuous batching failing on one
    transformers version): each reason is one row naming its cells, and nothing disappears silently."""
    metrics = {"bench_serving": [{"name": None, "status": "ok", "cells": [
        {"method": "naive", "concurrency": 3, "status": "ok"},
        {"method": "continuous", "concurrency": 3, "status": "failed", "reason": "TypeError: page_size"},
        {"method": "continuous", "concurrency": 6, "status": "failed", "reason": "TypeError: page_size"},
        {"method": "vllm", "concurrency": 3, "status": "unavailable", "reason": "vllm is not installed"}]}],
        "quantize": [{"name": "nf4", "status": "oom", "reason": "OutOfMemoryError"}]}
    assert records.not_run(metrics) == [
        {"stage": "bench_serving", "name": "bench_serving: method=continuous concurrency=3, method=continuous "
         "concurrency=6", "status": "failed", "reason": "TypeError: page_size"},
        {"stage": "bench_serving", "name": "bench_serving: method=vllm concurrency=3", "status": "unavailable",
         "reason": "vllm is not installed"},
        {"stage": "quantize", "name": "nf4", "status": "oom", "reason": "OutOfMemoryError"}]


def test_an_axis_measured_without_a_figure_reads_so_and_does_not_break_the_glance():
    """A serving ratio left with no stable burst (the machine's speed changed) has no median: the report says so."""
    from efflab.stages.report.templating import value_text

    assert value_text({"value": None, "lo": None, "hi": None, "n": 6}, "×") == "no figure"
    assert value_text(None) == "not measured"
    assert value_text({"value": 1.5, "lo": 1.2, "hi": 1.8, "n": 6}, "×") == "1.5× [1.2, 1.8]"
