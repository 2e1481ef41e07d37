from conftest import TEST_PARAMS, run_stage


def test_attention_implementations_agree_with_eager_and_flash_is_unavailable_on_cpu(results, test_cfg):
    sdpa = run_stage("bench_attention", TEST_PARAMS, results, "sdpa")
    flash = run_stage("bench_attention", TEST_PARAMS, results, "flash_attention_2")
    seq_lens = test_cfg["bench_attention"]["seq_lens"]
    assert [r["seq_len"] for r in sdpa["rows"]] == seq_lens
    for row in sdpa["rows"]:
        assert row["status"] == "ok" and row["max_abs_diff_vs_eager"] < 1e-4
        assert row["latency"]["n"] == test_cfg["bench_attention"]["repeats"]
        assert row["latency"]["p90"] >= row["latency"]["median"] > 0
        assert row["memory"]["kind"] == "cpu_peak_rss"
    assert flash["status"] == "unavailable"
    assert all(r["status"] == "unavailable" and "CUDA" in r["reason"] for r in flash["rows"])


def test_inference_separates_prefill_from_decode_at_a_fixed_length(results, test_cfg):
    b = test_cfg["bench_inference"]
    m = run_stage("bench_inference", TEST_PARAMS, results, "baseline")
    assert m["new_tokens"] == b["max_new_tokens"]
    assert m["ttft"]["n"] == m["decode_tokens_per_s"]["n"] == len(b["prompts"]) * b["repeats"]
    assert m["ttft"]["median"] > 0 and m["decode_tokens_per_s"]["median"] > 0
    assert m["per_token_latency"]["n"] == len(b["prompts"]) * b["repeats"] * (b["max_new_tokens"] - 1)
    assert m["memory"]["kind"] == "cpu_peak_rss"
