"""The base model's perplexity by validation slice (report.slices): reconciled from the largest slice's per-row
losses, to the rounding of the dtype they were computed in; a second measurement that disagrees is said."""
import math

from efflab.stages.report import slices

ROWS = [[50 + i, (50 + i) * (3.0 + 0.1 * (i % 5))] for i in range(16)]  # (tokens, summed NLL) per row


def _ppl(rows):
    return math.exp(sum(r[1] for r in rows) / sum(r[0] for r in rows))


def _metrics(prune_ppl=None, qat_ppl=None, dtype="float32"):
    return {"quantize": [{"status": "ok", "name": "baseline", "compute_dtype": dtype,
                          "validation": {"rows": 16, "perplexity": _ppl(ROWS), "per_row": ROWS}}],
            "prune": [{"status": "ok", "dtype": dtype, "base": {"validation": {
                "rows": 8, "perplexity": prune_ppl or _ppl(ROWS[:8]), "per_row": ROWS[:8]}}}],
            "qat": [{"status": "ok", "dtype": dtype, "eval_rows": 12, "base_perplexity": qat_ppl or _ppl(ROWS[:12])}]}


CFG = {"report": {"baseline_scheme": "baseline"}}


def test_slices_of_the_same_first_rows_reconcile_and_the_line_says_they_differ_by_the_rows_read():
    said = slices.text(CFG, _metrics())
    assert f"{_ppl(ROWS[:8]):.2f} on 8 (prune), {_ppl(ROWS[:12]):.2f} on 12 (qat)" in said
    assert "differ by the rows read, not by the model" in said and "do not reconcile" not in said


def test_a_second_measurement_of_the_same_rows_beyond_its_dtype_s_rounding_is_said_not_to_reconcile():
    off = _ppl(ROWS[:12]) * math.exp(3.3 * 2e-3)  # mean loss 0.2% off: within bfloat16's rounding, not float32's
    assert "do not reconcile: qat's" in slices.text(CFG, _metrics(qat_ppl=off))
    assert "do not reconcile" not in slices.text(CFG, _metrics(qat_ppl=off, dtype="bfloat16"))
    worse = _ppl(ROWS[:8]) * 1.05
    assert "prune's" in slices.text(CFG, _metrics(prune_ppl=worse, dtype="bfloat16"))
