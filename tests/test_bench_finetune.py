from conftest import run_stage


def test_a_knob_pair_is_timed_interleaved_and_a_known_slowdown_gets_its_verdict(results, write_params):
    """Four times the rows per step is a slower step, seen through the per-round ratios; a process-wide knob
    cannot be interleaved and says why; everything else about the pair is measured, not assumed."""
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
    assert ratio["verdict"] == "slower" and ratio["ci95"][0] > 1.5, ratio
    assert timed["stable_rounds"] >= 6 and [r["order"] for r in timed["rounds"][:2]] == [
        ["lora-r8", "lora-r8-b16"], ["lora-r8-b16", "lora-r8"]]
    runs = big["runs"]
    assert runs["lora-r8-b16"]["step_time"]["median"] > runs["lora-r8"]["step_time"]["median"]
    assert runs["lora-r8-b16"]["tokens_per_s"] > 0 and runs["lora-r8"]["tokens_per_s"] > 0
    assert timed["sentinel_s"] > 0 and timed["probe"]["n"] == 2 * len(timed["rounds"])
