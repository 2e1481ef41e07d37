"""efflab compare: two runs' findings side by side, from the kept references (their ledgers and records), with
planted changes: exactly the planted change is reported, a run against itself reports nothing, and an absolute
figure of another machine is not comparable while the within-run ratios are compared."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from efflab.tools.compare import findings, runs
from efflab.tools.compare.__main__ import main

REFERENCE = Path(__file__).resolve().parents[1] / "results" / "reference"
BF16, AVX2 = REFERENCE / "amd-epyc-avx512-bf16", REFERENCE / "amd-epyc-avx2"


def _copy(run: Path, to: Path) -> Path:
    """The files compare reads of a run: its report's ledger and decisions, every job's record."""
    for path in [run / runs.LEDGER, run / runs.DECISIONS, *run.glob("*/metrics.json"), *run.glob("*/*/metrics.json")]:
        (to / path.relative_to(run)).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(path, to / path.relative_to(run))
    return to


def _plant(run: Path, where, scale: float) -> None:
    """Scale the value and interval of the ledger's statements `where` picks."""
    path = run / runs.LEDGER
    out = []
    for line in path.read_text().splitlines():
        s = json.loads(line)
        if where(s):
            s |= {k: s[k] * scale for k in ("value", "lo", "hi")}
        out.append(json.dumps(s))
    path.write_text("\n".join(out) + "\n")


def _compare(a: Path, b: Path) -> dict:
    return findings.pair(runs.read(str(a), "RUN_A"), runs.read(str(b), "RUN_B"))


def _changed(paired: dict) -> list[tuple]:
    return [(r["finding"], r["subject"], r["metric"], r["verdict"]) for r in paired["rows"]
            if findings.changed(r["verdict"])]


def test_a_run_against_itself_changes_nothing():
    paired = _compare(BF16, BF16)
    assert paired["rows"] and _changed(paired) == [] and not paired["only_a"] and not paired["only_b"]
    assert {r["verdict"] for r in paired["rows"]} == {findings.SAME_FIGURE}
    a = runs.read(str(BF16), "RUN_A")
    assert findings.answers_changed(a, a) == []


def test_one_planted_change_is_the_one_change_reported(tmp_path):
    b = _copy(BF16, tmp_path / "b")
    _plant(b, lambda s: (s["finding"], s["subject"], s["metric"]) == ("inference", "int8", "speed"), 0.5)
    paired = _compare(BF16, b)
    assert _changed(paired) == [("inference", "int8", "speed", "regressed")]
    row = next(r for r in paired["rows"] if findings.changed(r["verdict"]))
    assert row["ratio"] == pytest.approx(0.5) and row["hi"] < 1  # the whole interval below 1: decided
    # the same change within the band's noise is not called a change
    c = _copy(BF16, tmp_path / "c")
    _plant(c, lambda s: (s["finding"], s["subject"], s["metric"]) == ("inference", "int8", "speed"), 1.01)
    assert _changed(_compare(BF16, c)) == []


def test_an_absolute_figure_of_another_machine_is_not_comparable_but_ratios_are():
    paired = _compare(AVX2, BF16)
    rows = {(r["finding"], r["subject"], r["metric"]): r for r in paired["rows"]}
    step = rows[("finetune", "lora-r8", "step")]
    assert step["verdict"].startswith("not comparable: another machine") and step["ratio"] is None
    assert all(r["verdict"].startswith("not comparable") for k, r in rows.items() if k[2] in ("step", "memory")
               and r["verdict"] != findings.SAME_FIGURE)
    speed = rows[("inference", "int8", "speed")]  # a ratio over the run's own baseline: compared
    assert speed["ratio"] is not None and not speed["verdict"].startswith("not comparable")


def test_a_stage_run_with_other_params_is_not_comparable(tmp_path):
    b = _copy(BF16, tmp_path / "b")
    _plant(b, lambda s: (s["finding"], s["subject"], s["metric"]) == ("quantize", "int8", "speed"), 0.5)
    for path in (b / "quantize").rglob("metrics.json"):
        record = json.loads(path.read_text())
        record["environment"]["params_sha256"] = "another-section"
        path.write_text(json.dumps(record))
    rows = {(r["finding"], r["subject"], r["metric"]): r for r in _compare(BF16, b)["rows"]}
    assert rows[("quantize", "int8", "speed")]["verdict"].startswith("not comparable: quantize's params differ")
    assert rows[("inference", "int8", "speed")]["verdict"] == findings.SAME_FIGURE


def test_the_settings_that_differ_are_named(tmp_path):
    a, b = _copy(BF16, tmp_path / "a"), _copy(BF16, tmp_path / "b")
    for run, steps in ((a, 3), (b, 6)):
        for path in (run / "qat").rglob("metrics.json"):
            record = json.loads(path.read_text())
            record["provenance"]["params"] = {"settings": {"qat": {"train": {"steps": steps}}}}
            path.write_text(json.dumps(record))
    assert findings.params_differ(runs.read(str(a), "RUN_A"), runs.read(str(b), "RUN_B"), "qat") == \
        "qat.train.steps: 3 → 6"


def test_the_command_writes_its_page_or_fails_in_one_line(tmp_path, capsys):
    assert main([str(BF16), str(BF16), "--out", str(tmp_path / "out")]) == 0
    page = tmp_path / "out" / "amd-epyc-avx512-bf16-vs-amd-epyc-avx512-bf16" / "compare.md"
    assert "## Findings that changed (0 of" in page.read_text()
    assert json.loads(page.with_name("compare.json").read_text())["answers_changed"] == []
    assert main([str(tmp_path / "nowhere"), str(BF16), "--out", str(tmp_path / "bad")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("efflab compare: error: RUN_A:") and not (tmp_path / "bad").exists()


def test_the_efflab_command_runs_compare(tmp_path):
    done = subprocess.run([sys.executable, "-m", "efflab.tools.command", "compare", "amd-epyc-avx2",
                           "amd-epyc-avx512-bf16", "--out", str(tmp_path)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "not comparable" in done.stdout and (tmp_path / "amd-epyc-avx2-vs-amd-epyc-avx512-bf16" / "compare.md").is_file()


def test_a_machine_is_named_by_its_cpu_kind():
    from efflab.measure.env import cpu_kind

    assert [cpu_kind(isa) for isa in (["avx2"], ["avx2", "avx512f", "avx512_vnni"],
                                      ["avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16"],
                                      ["avx2", "avx512f", "avx512_bf16", "avx512_vnni"], [])] == \
        ["AVX2 only", "AVX512 without BF16", "AVX512-BF16 with AMX", "AVX512-BF16 without AMX", "no AVX2"]
    assert findings.machine_text({"gpu": "NVIDIA H200", "cpu": "x"}) == "NVIDIA H200"
