"""Time to quality (finetune.target): the first step at or below the target on a planted loss log, the time to it
with its interval, the run that gets there first (named only where the intervals separate and the runs were timed
at one machine speed), the learning rate chosen per method, and the report's line, table and decision agreeing."""
from __future__ import annotations

import pytest

from efflab import quality
from efflab.stages.report import annotate, glance, target
from efflab.stages.report.tables.finetune import target_table

STEP = {"median": 2.0, "ci95_median": [1.8, 2.4], "n": 6}


def test_the_first_point_at_or_below_the_target_gives_the_steps_and_the_time():
    points = [{"step": 0, "loss": 3.4, "train_s": 0.0}, {"step": 2, "loss": 3.36, "train_s": 4.6},
              {"step": 4, "loss": 3.30, "train_s": 8.7}, {"step": 6, "loss": 3.25, "train_s": 12.9}]
    t = quality.time_to_target(points, 3.30, STEP)
    assert t["reached"] and t["steps"] == 4 and t["loss"] == 3.30, "at or below: 3.30 reaches 3.30"
    assert (t["time_s"], t["lo"], t["hi"]) == pytest.approx((8.0, 7.2, 9.6)), "4 steps × the median [its interval]"
    assert t["measured_s"] == 8.7
    assert quality.time_to_target(points, 3.40, STEP)["steps"] == 0, "the start already meets it"
    never = quality.time_to_target(points, 3.0, STEP)
    assert not never["reached"] and never["why"] == "not reached in 6 steps"
    assert never["lo"] == pytest.approx(6 * 1.8) and never["hi"] is None, "more than its 6 steps' time"


def test_a_first_is_named_only_where_its_interval_ends_before_every_other_begins():
    def t(steps, lo, hi, reached=True):
        return {"reached": reached, "time_s": None if not reached else (lo + hi) / 2 if lo else 4.0, "lo": lo,
                "hi": hi}
    assert quality.first_to_target({"a": t(3, 5, 7), "b": t(5, 8, 11)}) == (
        "a", "its interval ends before every other run's begins")
    assert quality.first_to_target({"a": t(3, 5, 9), "b": t(5, 8, 11)})[0] is None
    assert quality.first_to_target({"a": t(3, 5, 7), "b": t(None, 7.5, None, reached=False)})[0] == "a", \
        "a run that never reached it needed more than all its steps"
    assert quality.first_to_target({"a": t(3, 5, 8), "b": t(None, 7.5, None, reached=False)})[0] is None
    assert quality.first_to_target({"b": t(None, 7.5, None, reached=False)}) == (None, "no run reached the target")
    assert "without a 95% interval" in quality.first_to_target({"a": t(3, None, None), "b": t(5, 8, 11)})[1]


def _run(name, method, losses, lr, step=STEP, ceiling=1.0, peak=1000.0, from_base=True):
    points = [{"step": 2 * i, "loss": v, "train_s": 4.0 * i} for i, v in enumerate(losses)]
    return {"stage": "finetune", "status": "ok", "run": name, "method": method, "step_time": step,
            "settings": {"method": method, "learning_rate": lr, "seed": 0, "lora": {"r": 8}},
            "validation_curve": {"every": 2, "points": points, "starts_from_base": from_base},
            "train_memory": {"peak_mib": peak, "kind": "cpu_peak_rss"}, "optimizer": "adamw_torch",
            "throughput": {"matmul_ceiling": {"tflops": ceiling}}, "environment": {"fingerprint": "e"},
            "lora_init": None if method == "full" else
            {"init": "default", "seconds": 0.01, "rows": 0}}


CFG = {"finetune": {"target": {"loss": "auto", "below_base_pct": 1.0, "every": 2}}}


def _decide(runs, cfg=CFG):
    timed = target.with_targets(cfg, runs)
    return timed, target.question(cfg, timed)


def test_the_auto_target_the_first_run_and_a_run_that_never_reaches_it_in_every_place():
    runs = [_run("full", "full", [3.40, 3.37, 3.36, 3.20], 5e-5, peak=3200),
            _run("lora-r8", "lora", [3.40, 3.39, 3.38, 3.37], 1e-3, step={"median": 1.0, "ci95_median": [0.9, 1.2],
                                                                           "n": 6}, peak=1600),
            _run("qlora-r8", "qlora", [3.58, 3.55, 3.50, 3.48], 1e-3, peak=1700, from_base=False)]
    timed, q = _decide(runs)
    assert q["target"]["loss"] == pytest.approx(3.40 * 0.99) and q["target"]["base_loss"] == 3.40
    times = {o["name"]: o["time"] for o in q["options"]}
    assert times["full"]["steps"] == 4 and not times["lora-r8"]["reached"] and not times["qlora-r8"]["reached"]
    # full: 4 steps × [1.8, 2.4] = [7.2, 9.6]; lora-r8 ran 6 steps at >= 0.9 s: > 5.4 s, so they overlap
    # lora-r8's step over full's (the runs' own medians: [0.9/2.4, 1.2/1.8]) × its 6+ steps over full's 4 reaches 1
    assert q["answer"] is None and q["why"] == ("not decided at this size: lora-r8's steps to it (6+) × its step time "
                                                "over full's (0.375–0.667) reach full's 4")
    line = glance.finetune_target(q)
    assert "validation loss ≤ 3.366: the base model's 3.4 −1%" in line
    assert "full: 4 steps, 8 s [7.2, 9.6], 3,200 MiB" in line and "lora-r8: not reached in 6 steps (> 5.4 s)" in line
    assert "first not decided at this size: lora-r8's steps" in line
    table = target_table(timed).set_index("run")
    assert table.loc["full", "steps to target"] == 4 and table.loc["qlora-r8", "steps to target"] == \
        "not reached in 6 steps"
    assert table.loc["full", "time to target (s) [95%]"] == "8 [7.2, 9.6]"
    fast = [runs[0] | {"step_time": {"median": 1.0, "ci95_median": [0.9, 1.1], "n": 6}}] + runs[1:]
    _, q = _decide(fast)  # full: [3.6, 4.4] ends before lora-r8's > 5.4 and qlora-r8's > 10.8
    assert q["answer"] == "full" and "first **full**" in glance.finetune_target(q)


def test_a_first_needs_one_machine_speed_and_the_learning_rate_is_chosen_per_method():
    runs = [_run("full", "full", [3.40, 3.30, 3.20, 3.10], 5e-5, step={"median": 0.5, "ci95_median": [0.45, 0.55],
                                                                         "n": 6}),
            _run("lora-r8", "lora", [3.40, 3.39, 3.38, 3.37], 1e-3),
            _run("lora-r8-lr3e-3", "lora", [3.40, 3.36, 3.34, 3.30], 3e-3)]
    _, q = _decide(runs)
    lora = next(o for o in q["options"] if o["method"] == "lora")
    assert len(q["options"]) == 2 and lora["name"] == "lora-r8-lr3e-3", "the sweep's first run stands for LoRA"
    assert lora["swept"] == {"lora-r8-lr3e-3": 3e-3, "lora-r8": 1e-3}
    assert q["answer"] == "full"
    assert "lora-r8-lr3e-3 (lr 0.003, best of 2): 2 steps" in glance.finetune_target(q)
    runs[1]["throughput"] = runs[2]["throughput"] = {"matmul_ceiling": {"tflops": 0.5}}
    _, q = _decide(runs)
    assert q["answer"] is None and q["why"].startswith("not decided: lora-r8-lr3e-3 against full: the machine's "
                                                        "speed changed between the runs")


def test_seeds_of_one_learning_rate_give_the_median_seed_and_the_range_of_their_intervals():
    seeded = [_run(f"lora-s{i}", "lora", losses, 1e-3) for i, losses in
              enumerate([[3.40, 3.36, 3.30], [3.40, 3.39, 3.36], [3.40, 3.35, 3.30]])]
    for i, r in enumerate(seeded):
        r["settings"] = r["settings"] | {"seed": i}
    _, q = _decide(seeded)
    (o,) = q["options"]
    assert o["seeds"] == ["lora-s0", "lora-s1", "lora-s2"] and o["time"]["steps_each"] == [2, 4, 2]
    assert o["time"]["steps"] == 2 and o["time"]["n"] == 3, "the median seed's 2 steps"
    assert (o["time"]["lo"], o["time"]["hi"]) == pytest.approx((2 * 1.8, 4 * 2.4)), "fastest's low to slowest's high"
    assert "(median of 3 seeds, steps 2, 4, 2)" in glance.finetune_target(q)
    seeded[0]["validation_curve"]["points"][-1]["loss"] = seeded[0]["validation_curve"]["points"][1]["loss"] = 3.39
    _, q = _decide(seeded)
    assert q["options"][0]["time"]["steps"] == 4 and q["options"][0]["time"]["hi"] is None, "a seed never got there"


def test_without_a_run_from_the_base_the_auto_target_says_which_key_to_set():
    _, q = _decide([_run("qlora-r8", "qlora", [3.58, 3.50], 1e-3, from_base=False)])
    assert q["answer"] is None and q["options"] == [] and "set finetune.target.loss" in q["why"]
    assert glance.finetune_target(q).startswith("- **Time to target**: not measured: no run starts from the base")
    _, q = _decide([_run("qlora-r8", "qlora", [3.58, 3.50], 1e-3, from_base=False)],
                   {"finetune": {"target": {"loss": 3.5, "below_base_pct": 1.0, "every": 2}}})
    assert q["options"][0]["time"]["steps"] == 2 and q["target"]["source"] == "finetune.target.loss"


def test_the_decision_is_in_decisions_json_once(test_cfg):
    """decisions.build puts the question beside the others, from the records annotate.against_tolerance timed once."""
    runs = [_run("full", "full", [3.40, 3.30, 3.20, 3.10], 5e-5)]
    metrics = annotate.against_tolerance(test_cfg, {"finetune": runs, "qat": [], "evaluate": []})
    assert metrics["finetune"][0]["time_to_target"]["steps"] == 2
    assert target.question(test_cfg, metrics["finetune"])["answer"] == "full"


def test_the_time_covers_the_first_step_and_the_ranking_follows_the_interleaved_step_pair():
    """Two runs 4 steps to the target. Their own medians put lora-r8-gc's step at 1.5x lora-r8's; the interleaved
    pair (bench_finetune) measured it faster, 0.8 [0.75, 0.85]: the two measurements disagree, and no run is named
    first. Each time counts its first step as measured (6 s) and the other 3 at the median."""
    slow = {"median": 3.0, "ci95_median": [2.8, 3.3], "n": 6, "first_step_s": 6.0, "excluded": "the first 1 step(s)"}
    runs = [_run("lora-r8", "lora", [3.40, 3.37, 3.30], 1e-3, step=STEP | {"first_step_s": 6.0, "excluded": "1"}),
            _run("lora-r8-gc", "lora", [3.40, 3.37, 3.30], 1e-3, step=slow)]
    runs[1]["settings"] = runs[1]["settings"] | {"gradient_checkpointing": True}
    timed = target.with_targets(CFG, runs)
    t = timed[0]["time_to_target"]
    assert (t["time_s"], t["lo"], t["hi"]) == pytest.approx((6 + 3 * 2.0, 6 + 3 * 1.8, 6 + 3 * 2.4))
    assert target.question(CFG, timed)["answer"] == "lora-r8", "on the runs' own medians"
    pair = {"status": "ok", "a": "lora-r8", "b": "lora-r8-gc",
            "step_time_ratio": {"median": 0.8, "ci95": [0.75, 0.85], "rounds": 6, "verdict": "faster"}}
    bench = [{"status": "ok", "pairs": [pair]}]
    q = target.question(CFG, timed, bench)
    assert q["answer"] is None and q["why"] == ("not decided: lora-r8-gc is ahead on the paired steady steps, lora-r8 "
                                                "on the time with its warm-up step (one measurement per run)")
    pair["step_time_ratio"] |= {"median": 1.3, "ci95": [1.2, 1.4], "verdict": "slower"}
    assert target.question(CFG, timed, bench)["answer"] == "lora-r8", "gc's steps measured 1.2x or more, paired"
