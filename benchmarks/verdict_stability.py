"""Do efflab's verdicts hold on a rerun? Compare two results folders of the same params, verdict by verdict.

Every verdict efflab states: each knob pair's step time (bench_finetune, interleaved), each attention
implementation's speed against eager per cell, each inference variant's against the base model per cell,
and each seed claim's (claims.csv). A verdict *flips* when both runs gave one and they differ (slower vs no
significant difference counts); a comparison that gave "not a verdict" in either run (the machine's speed
changed) is listed apart, as it claims nothing.

    python benchmarks/verdict_stability.py /tmp/run1/results /tmp/run2/results [--out results/benchmarks]

Prints a Markdown table and writes verdict_stability.{json,md} to --out; exits 1 if any verdict flipped.
"""
from __future__ import annotations

import argparse
import csv
import json
import sys
from pathlib import Path


def _load(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.is_file() else None


def _fmt(ratio: dict) -> str:
    if ratio.get("median") is None:
        return "-"
    return f"{ratio['median']:.3f} [{ratio['ci95'][0]:.3f}, {ratio['ci95'][1]:.3f}]"


def verdicts(results: Path) -> dict[str, tuple[str, str]]:
    """{what: (verdict, figure)} for every verdict in one results folder."""
    out = {}
    bench = _load(results / "bench_finetune" / "metrics.json") or {}
    for pair in bench.get("pairs", []):
        if pair.get("status") == "ok":
            ratio = pair["step_time_ratio"]
            out[f"knob {pair['knob']}: {pair['b']} vs {pair['a']} step time"] = (ratio["verdict"], _fmt(ratio))
    for path in sorted((results / "bench_attention").glob("*/metrics.json")):
        for row in (_load(path) or {}).get("rows", []):
            speedup = ((row.get("vs_eager") or {}).get("speedup")) or {}
            if row.get("status") == "ok" and speedup.get("verdict"):
                key = f"attention {row['implementation']} vs eager, {row['mode']} seq {row['seq_len']} batch {row['batch_size']}"
                out[key] = (speedup["verdict"], _fmt(speedup))
    for path in sorted((results / "bench_inference").glob("*/metrics.json")):
        variant = _load(path) or {}
        for cell in variant.get("cells", []):
            speedup = ((cell.get("vs_base") or {}).get("generation_speedup")) or {}
            if cell.get("status") == "ok" and speedup.get("verdict"):
                key = (f"inference {variant['variant']} vs base, KV cache {'on' if cell['kv_cache'] else 'off'} "
                       f"batch {cell['batch_size']}")
                out[key] = (speedup["verdict"], _fmt(speedup))
    claims = results / "claims" / "claims.csv"
    if claims.is_file():
        with open(claims, newline="") as f:
            for row in csv.DictReader(f):
                out[f"claim {row['id']}"] = (row["verdict"], row["reproduced"])
    return out


def compare(a: dict, b: dict) -> list[dict]:
    rows = []
    for key in sorted(a.keys() | b.keys()):
        (va, fa), (vb, fb) = a.get(key, ("absent", "")), b.get(key, ("absent", ""))
        if va.startswith("not a verdict") or vb.startswith("not a verdict"):
            outcome = "no verdict in a run"
        elif "absent" in (va, vb):
            outcome = "in one run only"
        else:
            outcome = "same" if va == vb else "FLIPPED"
        rows.append({"what": key, "run 1": va, "run 1 figure": fa, "run 2": vb, "run 2 figure": fb,
                     "outcome": outcome})
    return rows


def markdown(rows: list[dict]) -> str:
    counts = {}
    for r in rows:
        counts[r["outcome"]] = counts.get(r["outcome"], 0) + 1
    lines = [f"{len(rows)} verdicts: " + ", ".join(f"{n} {k}" for k, n in sorted(counts.items())), "",
             "| what | run 1 | run 1 figure | run 2 | run 2 figure | outcome |", "|---|---|---|---|---|---|"]
    shown = [r for r in rows if not r["what"].startswith("claim ") or r["outcome"] != "same"]
    lines += [f"| {r['what']} | {r['run 1']} | {r['run 1 figure']} | {r['run 2']} | {r['run 2 figure']} | "
              f"{r['outcome']} |" for r in shown]
    if len(shown) < len(rows):
        lines += ["", f"({len(rows) - len(shown)} claims with the same verdict in both runs not shown)"]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run1", type=Path)
    parser.add_argument("run2", type=Path)
    parser.add_argument("--out", type=Path, default=Path("results/benchmarks"))
    args = parser.parse_args()
    rows = compare(verdicts(args.run1), verdicts(args.run2))
    text = markdown(rows)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "verdict_stability.json").write_text(json.dumps(rows, indent=2) + "\n")
    (args.out / "verdict_stability.md").write_text(text)
    print(text)
    sys.exit(1 if any(r["outcome"] == "FLIPPED" for r in rows) else 0)


if __name__ == "__main__":
    main()
