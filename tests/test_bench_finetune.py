from efflab.measure import stats
from tests.helpers import run_stage


def test_a_knob_pair_is_timed_interleaved_and_its_verdict_follows_from_its_rounds(results, write_params):
    """A pair's steps are timed interleaved and its verdict is the one its own stable rounds give (how the
    rule reads known ratios: tests/test_measure.py, on a simulated clock; here the machine may be busy, so
    the timing itself is not asserted); a process-wide knob cannot be interleaved and says why."""
    def edit(cfg):
        cfg["finetune"]["runs"] = {"lora-r8": {"method": "lora"}, "lora-r8-b16": {"method": "lora", "batch_size": 16},
                                   "lora-r8-det": {"method": "lora", "deterministic": True}}
        cfg["bench_finetune"] |= {"rounds": 6, "sentinel_tolerance": 0.5}  # the sentinel itself: test_measure
    metrics = run_stage("bench_finetune", write_params(edit), results)
    pairs = {(p["a"], p["b"]): p for p in metrics["pairs"]}
    assert set(pairs) == {("lora-r8", "lora-r8-b16"), ("lora-r8", "lora-r8-det")}, "b16 vs det differ in two knobs"
    det = pairs["lora-r8", "lora-r8-det"]
    assert det["status"] == "unavailable" and "process-wide" in det["reason"]
    big = pairs["lora-r8", "lora-r8-b16"]
    assert big["status"] == "ok" and (big["knob"], big["from"], big["to"]) == ("batch_size", 4, 16)
    ratio, timed = big["step_time_ratio"], big["interleaved"]
    assert [r["order"] for r in timed["rounds"][:2]] == [["lora-r8", "lora-r8-b16"], ["lora-r8-b16", "lora-r8"]]
    if "unstable" in timed:  # a busy machine: no verdict, and it says why
        assert ratio["verdict"].startswith("not a verdict: the machine's speed changed")
    else:
        kept = [r["seconds"] for r in timed["rounds"] if r["stable"]]
        assert len(kept) == timed["stable_rounds"] >= 6
        assert ratio == stats.ratio_verdict([s["lora-r8-b16"] / s["lora-r8"] for s in kept])
    runs = big["runs"]
    assert runs["lora-r8-b16"]["tokens_per_s"] > 0 and runs["lora-r8"]["tokens_per_s"] > 0
    assert timed["sentinel_s"] > 0 and timed["probe"]["n"] == 2 * len(timed["rounds"])


def test_every_run_is_paired_with_the_reference_too_where_it_is_not_a_knob_pair_of_it():
    from efflab.stages.bench_finetune import timed_pairs

    configured = [{"run": "full", "settings": {"method": "full", "learning_rate": 1e-5}},
                  {"run": "lora-r8", "settings": {"method": "lora", "learning_rate": 2e-4}},
                  {"run": "lora-r8-gc", "settings": {"method": "lora", "learning_rate": 2e-4,
                                                     "gradient_checkpointing": True}}]
    cfg = {"bench_finetune": {"against_reference": True}}
    pairs = [(knob, a["run"], b["run"]) for knob, _, _, a, b in timed_pairs(cfg, configured)]
    assert pairs == [("gradient_checkpointing", "lora-r8", "lora-r8-gc"), (None, "full", "lora-r8"),
                     (None, "full", "lora-r8-gc")]
    cfg["bench_finetune"]["against_reference"] = False
    assert [p[0] for p in timed_pairs(cfg, configured)] == ["gradient_checkpointing"]
