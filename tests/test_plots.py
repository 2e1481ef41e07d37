"""The report's plots draw what decisions.json decides: the verdicts written on them are its words, the frontiers
marked are its frontiers, and every interval the records carry is drawn. The report stage runs once on a copy of
the AVX2 reference run's records (every figure it saves kept by name, its artists inspected); planted records
cover what that run lacks (other generation modes and batches, a frontier the points do not say)."""
import json
import shutil
from pathlib import Path

import matplotlib.pyplot as plt
import pandas as pd
import pytest
import yaml
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.collections import PathCollection
from matplotlib.colors import to_hex
from matplotlib.container import ErrorbarContainer
from matplotlib.figure import Figure

from efflab.stages.report import bench_plots, knobs, plots
from efflab.stages.report.spread import CI, spread
from efflab.tools.reference import rerender_params
from tests.helpers import REPO, run_stage

REFERENCE = REPO / "results" / "reference" / "amd-epyc-avx2"


def _keeping(mp: pytest.MonkeyPatch) -> dict:
    """Every figure saved from now on, by file name (closing a figure leaves its artists to inspect)."""
    kept, save = {}, Figure.savefig

    def keep(fig, path, *args, **kwargs):
        kept[Path(path).name] = fig
        return save(fig, path, *args, **kwargs)
    mp.setattr(Figure, "savefig", keep)
    return kept


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    """The report stage on a copy of the reference run's records: its figures, its decisions and its results."""
    work = tmp_path_factory.mktemp("reference")
    results = work / "results"
    shutil.copytree(REFERENCE, results)
    params = work / "params.yaml"
    params.write_text(yaml.safe_dump(rerender_params(REFERENCE, REPO / "params.yaml"), sort_keys=False))
    with pytest.MonkeyPatch.context() as mp:
        figures = _keeping(mp)
        run_stage("report", params, results)
    yield figures, json.loads((results / "report" / "decisions.json").read_text())["questions"], results
    for fig in figures.values():
        plt.close(fig)


@pytest.fixture
def kept(monkeypatch):
    figures = _keeping(monkeypatch)
    yield figures
    for fig in figures.values():
        plt.close(fig)


def _intervals(ax) -> list[tuple[float, float, float]]:
    """The error bars drawn: (position, low, high) each, a vertical bar's position its x, a horizontal one's its y."""
    out = []
    for container in (c for c in ax.containers if isinstance(c, ErrorbarContainer)):
        for (x0, y0), (x1, y1) in container.lines[2][0].get_segments():
            out.append((x0, y0, y1) if x0 == x1 else (y0, x0, x1))
    return sorted(out)


def _row_verdicts(ax) -> dict[str, str]:
    """A ratio plot's verdict per row (report.plotting.ratio_rows): its tick label's first line (the row's name; a
    second line says where its ratio comes from) -> the words beside it."""
    rows = {round(t.get_position()[1]): t.get_text().split("\n")[0] for t in ax.get_yticklabels()}
    return {rows[round(a.xy[1])]: a.get_text().replace("\n", " ") for a in ax.texts if getattr(a, "xy", (0,))[0] > 1}


def _points(ax) -> list:
    """The scatter plots drawn (not the error bars' line collections)."""
    return [c for c in ax.collections if isinstance(c, PathCollection)]


def _row_points(ax) -> dict[str, float]:
    labels = [t.get_text().split("\n")[0] for t in ax.get_yticklabels()]
    return {label: x for label, (x, _) in zip(labels, _points(ax)[0].get_offsets())}


def _option(question: dict, name: str) -> dict:
    return next(o for o in question["options"] if o["name"] == name)


def _close(a: tuple, b: tuple) -> bool:
    return all(abs(x - y) < 1e-9 for x, y in zip(a, b, strict=True))


def test_qat_draws_each_paired_interval_and_labels_each_point_with_the_decisions_verdict(report):
    figures, questions, _ = report
    ax, question = figures["qat.png"].axes[0], questions["qat"]
    labels = {t.get_text().split(":")[0]: t.get_text() for t in ax.texts}
    for o in question["options"]:
        q = o["axes"]["quality"]
        label = labels[f"{o['method'].upper()} {o['bits']} bits"]
        assert label.endswith(f": {o['verdict']}"), (label, o["verdict"])
        assert any(abs(lo - q["lo"]) < 1e-9 and abs(hi - q["hi"]) < 1e-9 for _, lo, hi in _intervals(ax)), o["name"]
    assert labels["QAT 4 bits"].endswith(": not decided at this size"), "4 bits QAT straddles the tolerance"
    assert not [t for t in labels.values() if "fail" in t]
    assert len(_intervals(ax)) == len(question["options"])
    assert any(list(line.get_ydata()) == [5.0, 5.0] for line in ax.get_lines()), "the tolerance line"
    assert "QAT not decided at this size from 4 bits" in ax.get_title() and "PTQ 8 bits" in ax.get_title()


def _qat_option(method, bits, verdict, quality=None):
    return {"name": f"{method} {bits} bits", "method": method, "bits": bits, "verdict": verdict,
            "axes": {"quality": quality and {"value": quality[0], "lo": quality[1], "hi": quality[2], "n": 16,
                                             "verdict": verdict}}}


def test_qat_draws_a_record_without_per_row_losses_as_a_point_and_a_broken_width_on_a_symlog_axis(kept, tmp_path):
    question = {"answer": {"ptq": 8, "qat": 8}, "undecided_at": {"ptq": None, "qat": None}, "options": [
        _qat_option("ptq", 2, "beyond", (900.0, 700.0, 1100.0)), _qat_option("ptq", 8, "within", (0.1, -0.5, 0.7)),
        _qat_option("qat", 2, "beyond", (60.0, 50.0, 70.0)), _qat_option("qat", 8, "not decided at this size")]}
    job = {"reference_perplexity": 20.0, "variants": [{"method": "qat", "bits": 8, "perplexity": 21.0}]}
    plots.plot_qat(question, job, tmp_path / "qat.png", 5.0)
    ax = kept["qat.png"].axes[0]
    assert ax.get_yscale() == "symlog" and "log beyond ±10%" in ax.get_ylabel()
    assert sorted(t.get_text() for t in ax.texts) == [
        "PTQ 2 bits: +900.0% [+700.0%, +1100.0%]: beyond", "PTQ 8 bits: +0.1% [-0.5%, +0.7%]: within",
        "QAT 2 bits: +60.0% [+50.0%, +70.0%]: beyond", "QAT 8 bits: +5.0%: not decided at this size"]
    assert len(_intervals(ax)) == 3, "the unpaired width is a point without a bar"
    assert "PTQ 8 bits, QAT 8 bits" in ax.get_title()


def test_the_inference_frontier_drawn_is_the_one_decisions_json_gives(report):
    figures, questions, _ = report
    ax, question = figures["inference_pareto.png"].axes[0], questions["inference"]
    said = {t.get_text().split(":")[0]: t.get_text() for t in ax.texts}
    assert {name for name, text in said.items() if ": on the frontier" in text} == set(question["frontier"])
    for name, text in said.items():
        option = _option(question, name)
        if not option["baseline"]:
            assert f"speed {option['axes']['speed']['verdict']}" in text.replace("\n    ", " ")
    assert {to_hex(c.get_facecolor()[0]) for c in _points(ax)} == {to_hex("tab:green")}, "all on it: filled"


def test_a_dominated_option_is_drawn_dominated_where_decisions_json_says_so_whatever_its_point_says(kept, tmp_path):
    """The frontier plot follows the decision's frontier, not the `dominated` flag its points were built with, and
    draws the spread of either axis (a memory peak's measured error too)."""
    points = [{"name": "baseline", "baseline": True, "x": spread(513.0), "y": spread(1.0), "quality": spread(0.0),
               "quality_point": None, "dominated": False},
              {"name": "adapter", "baseline": False, "x": spread(515.0, 505.0, 525.0, "measured error"),
               "y": spread(0.85, 0.73, 1.0, CI, 6),
               "quality": spread(-6.9, -9.3, -4.5, CI, 8), "quality_point": None, "dominated": False}]
    question = {"frontier": ["baseline"], "options": [
        {"name": "baseline", "baseline": True, "axes": {"speed": {"verdict": "baseline"}}},
        {"name": "adapter", "baseline": False, "axes": {"speed": {"verdict": "not decided at this size"},
                                                        "quality": {"verdict": "within"}}}]}
    plots.plot_inference_pareto(points, tmp_path / "front.png", question)
    ax = kept["front.png"].axes[0]
    said = {t.get_text().split(":")[0]: t.get_text() for t in ax.texts}
    assert said["adapter"].startswith("adapter: dominated; perplexity -6.9% [-9.3%, -4.5%]")
    assert "speed not decided at this size; perplexity within" in said["adapter"]
    assert said["baseline"].startswith("baseline: on the frontier")
    faces = {tuple(c.get_offsets()[0]): to_hex(c.get_facecolor()[0]) for c in _points(ax)}
    assert faces[(515.0, 0.85)] == to_hex("white") and faces[(513.0, 1.0)] == to_hex("tab:green")
    assert _intervals(ax) == [(0.85, 505.0, 525.0), (515.0, 0.73, 1.0)], "both axes' spreads, whatever their kind"
    assert "dotted bars: measured error" in ax.get_xlabel()


def test_bench_inference_plots_the_interleaved_ratio_with_the_verdicts_and_a_legend_of_what_it_draws(report):
    figures, questions, _ = report
    fig, question = figures["bench_inference.png"], questions["inference"]
    ax = fig.axes[0]
    verdicts, points = _row_verdicts(ax), _row_points(ax)
    for o in question["options"]:
        speed, row = o["axes"]["speed"], f"{o['name']}, batch 1"
        if o["baseline"]:
            assert verdicts[row] == "the reference" and points[row] == 1.0
            continue
        assert verdicts[row] == speed["verdict"] and abs(points[row] - speed["value"]) < 1e-9
        assert any(_close(b, (b[0], speed["lo"], speed["hi"])) for b in _intervals(ax)), row
    assert any(list(line.get_xdata()) == [1, 1] for line in ax.get_lines()), "the line at 1"
    legend = fig.legends[0]
    drawn = {to_hex(c) for c in _points(ax)[0].get_facecolors()}
    assert {to_hex(h.get_color()) for h in legend.legend_handles} == drawn
    # the reference run's generation modes (prompt lookup, a quantized cache) are against the same model's dynamic cache
    assert sorted(t.get_text() for t in legend.get_texts()) == sorted([
        "the base model itself: the reference (exactly 1)", "× the base model's (interleaved, same process)",
        "× the same model's dynamic KV cache (interleaved)"])


def _speedup(median, lo, hi) -> dict:
    return {"generation_speedup": {"median": median, "ci95": [lo, hi], "rounds": 6}}


def test_bench_inference_cells_beyond_the_decision_carry_their_records_verdicts(kept, tmp_path):
    """A variant's batch-1 KV-cache cell carries the decision's words (planted unlike its record's, to tell them
    apart); another batch its record's; another mode its ratio over the same model's dynamic cache."""
    base = {"variant": "baseline", "kind": "base", "cells": [
        {"kv_cache": True, "batch_size": 1}, {"kv_cache": True, "batch_size": 4},
        {"kv_cache": True, "batch_size": 1, "generation": "static",
         "vs_dynamic": {"against": "dynamic", **_speedup(1.5, 1.3, 1.7)}}]}
    int8 = {"variant": "int8", "kind": "quantized", "cells": [
        {"kv_cache": True, "batch_size": 1, "vs_base": _speedup(0.5, 0.4, 0.6)},
        {"kv_cache": True, "batch_size": 4, "vs_base": _speedup(0.9, 0.7, 1.2)},
        {"kv_cache": True, "batch_size": 8, "status": "oom"}]}
    question = {"options": [{"name": "baseline", "axes": {"speed": {"verdict": "baseline"}}},
                            {"name": "int8", "axes": {"speed": {"verdict": "planted: the decision's words"}}}]}
    bench_plots.plot_inference([base, int8], tmp_path / "inference.png", question)
    fig = kept["inference.png"]
    ax = fig.axes[0]
    assert _row_verdicts(ax) == {"baseline, batch 1": "the reference", "baseline, batch 4": "the reference",
                                 "baseline (static), batch 1": "faster",
                                 "int8, batch 1": "planted: the decision's words",
                                 "int8, batch 4": "not decided at this size (about n=38 would decide it; n=6 here)"}
    assert _intervals(ax) == [(2, 1.3, 1.7), (3, 0.4, 0.6), (4, 0.7, 1.2)]
    colours = [to_hex(c) for c in _points(ax)[0].get_facecolors()]
    assert colours[2] == to_hex("tab:purple") and colours[3] == to_hex("tab:blue")
    assert len(fig.legends[0].get_texts()) == 3


def test_quantize_draws_the_tolerance_that_decides_it_and_the_decisions_verdicts(report):
    figures, questions, _ = report
    ax = figures["quantize.png"].axes[1]
    assert any(list(line.get_ydata()) == [5.0, 5.0] for line in ax.get_lines()), "tolerance.perplexity_pct"
    said = [t.get_text() for t in ax.texts]
    assert said == [o["axes"]["quality"]["verdict"] for o in questions["quantize"]["options"]]
    assert said == ["baseline", "not decided at this size", "beyond"]
    drawn = {round(x): (lo, hi) for x, lo, hi in _intervals(ax)}
    for i, o in enumerate(questions["quantize"]["options"]):
        assert _close(drawn[i], (o["axes"]["quality"]["lo"], o["axes"]["quality"]["hi"])), o["name"]


def test_finetune_plots_step_ratios_with_the_decisions_and_the_knob_tables_verdicts(report):
    figures, questions, results = report
    run_ax, knob_ax = figures["finetune.png"].axes
    question = questions["finetune"]
    assert _row_verdicts(run_ax) == {o["name"]: o["axes"]["step_ratio"]["verdict"] for o in question["options"]}
    sources = {t.get_text().split("\n")[0]: t.get_text().split("\n")[1:] for t in run_ax.get_yticklabels()}
    assert all(sources[o["name"]] == ([] if o["baseline"] else [f"({plots.SOURCES[o['axes']['step_ratio']['source']]})"])
               for o in question["options"]), sources
    for o in question["options"]:
        ratio = o["axes"]["step_ratio"]
        assert abs(_row_points(run_ax)[o["name"]] - ratio["value"]) < 1e-9
    with_interval = [o for o in question["options"] if not o["baseline"] and o["axes"]["step_ratio"]["lo"]]
    assert len(_intervals(run_ax)) == len(with_interval) >= 2
    finetune = [json.loads(p.read_text()) for p in sorted((results / "finetune").glob("*/metrics.json"))]
    table = knobs.knob_table(finetune, [json.loads((results / "bench_finetune" / "metrics.json").read_text())])
    assert sorted(_row_verdicts(knob_ax).values()) == sorted(table["step time verdict"])
    assert len(_intervals(knob_ax)) == len(table)


def test_the_loss_plot_smooths_the_training_loss_and_marks_the_validation_loss(report):
    figures, _, results = report
    ax = figures["finetune_loss.png"].axes[0]
    labels = ax.get_legend_handles_labels()[1]
    assert "validation loss, before training" in labels and "validation loss, after training" in labels
    full = json.loads((results / "finetune" / "full" / "metrics.json").read_text())
    curve = pd.read_csv(results / "finetune" / "full" / "loss.csv")
    lines = {line.get_label(): line for line in ax.get_lines()}
    smoothed = curve["loss"].rolling(3, center=True, min_periods=1).mean()
    assert list(lines["full"].get_ydata()) == pytest.approx(list(smoothed))
    assert any(list(line.get_ydata()) == list(curve["loss"]) and (line.get_alpha() or 1) < 0.5 for line in ax.get_lines())
    marked = {tuple(p) for c in _points(ax) for p in c.get_offsets()}
    assert (0, full["validation_before"]["loss"]) in marked
    assert (curve["step"].iloc[-1], full["validation_after"]["loss"]) in marked
    assert "centred running mean of 3 steps" in ax.get_ylabel()


@pytest.mark.parametrize(("steps", "width"), [(1, 1), (2, 1), (7, 3), (30, 3), (100, 11), (240, 25)])
def test_the_running_mean_is_odd_about_a_tenth_of_the_run_and_at_least_three_steps(steps, width):
    assert plots.smoothing_window(steps) == width


@pytest.mark.parametrize("name", ["qat.png", "quantize.png", "bench_inference.png", "finetune.png",
                                  "finetune_loss.png", "finetune_pareto.png", "inference_pareto.png"])
def test_no_text_of_a_plot_is_cut_off_by_its_edges(report, name):
    fig = report[0][name]
    FigureCanvasAgg(fig).draw()  # as saved: pyplot left the closed figure a bare canvas, which measures text apart
    edge = fig.bbox
    texts = [t for t in fig.findobj(lambda a: hasattr(a, "get_text") and hasattr(a, "get_window_extent"))
             if t.get_text() and t.get_visible()]
    cut = [t.get_text() for t in texts if (box := t.get_window_extent()).x0 < edge.x0 - 1 or box.x1 > edge.x1 + 1
           or box.y0 < edge.y0 - 1 or box.y1 > edge.y1 + 1]
    assert not cut, cut
