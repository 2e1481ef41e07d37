"""Do efflab's verdicts hold on a rerun? Compare two results folders of the same params, verdict by verdict.

Every verdict efflab states: each knob pair's step time (bench_finetune, interleaved), each attention
implementation's speed against eager per cell, each inference variant's against the base model per cell,
and each seed claim's (claims.csv). A verdict *flips* when both runs gave one and they differ (slower vs no
significant difference counts); a comparison that gave no verdict in a run ("not a verdict": the machine's
speed changed; "inconclusive": too few rounds, or an interval too wide to rule a 10% difference in or out)
claims nothing there, and is listed apart.

    python benchmarks/verdict_stability.py /tmp/run1/results /tmp/run2/results [--out results/benchmarks]

Verdicts are recomputed from each record's per-round data with the current rule (measure.stats.ratio_verdict),
so results recorded under an earlier rule compare as they would read today; claims are compared as stored.
Prints a Markdown table and writes verdict_stability.{json,md} to --out; exits 1 if any verdict flipped.
"""
from __future__ import annotations

import argparse
import csv
import json
import sys
from pathlib import Path

from efflab.measure.stats import format_ratio, ratio_verdict, said_of_faster_side


def _load(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.is_file() else None


def _fmt(ratio: dict) -> str:
    return format_ratio(ratio, 3)


def _recomputed(stored: dict, ratios: list[float] | None, speedup: bool = False) -> dict:
    """The stored ratio, or, from the per-round ratios where the record keeps them, the verdict the current
    rule (measure.stats.ratio_verdict) gives; without them, the current rule's verdict from the round count alone
    where that count is too small for any interval."""
    if stored.get("median") is None or str(stored.get("verdict", "")).startswith("not a verdict"):
        return stored
    if ratios:
        ratio = ratio_verdict(ratios)
    elif stored.get("rounds", 0) < 6:
        ratio = ratio_verdict([stored["median"]] * stored.get("rounds", 0)) | {"median": stored["median"]}
    else:
        return stored
    return said_of_faster_side(ratio) if speedup else ratio


def verdicts(results: Path) -> dict[str, tuple[str, str]]:
    """{what: (verdict, figure)} for every verdict in one results folder."""
    out = {}
    bench = _load(results / "bench_finetune" / "metrics.json") or {}
    for pair in bench.get("pairs", []):
        if pair.get("status") == "ok":
            ratio = _recomputed(pair["step_time_ratio"], [
                r["seconds"][pair["b"]] / r["seconds"][pair["a"]] for r in pair["interleaved"]["rounds"] if r["stable"]])
            out[f"knob {pair['knob']}: {pair['b']} vs {pair['a']} step time"] = (ratio["verdict"], _fmt(ratio))
    for path in sorted((results / "bench_attention").glob("*/metrics.json")):
        for row in (_load(path) or {}).get("rows", []):
            vs = row.get("vs_eager") or {}
            speedup = vs.get("speedup") or {}
            if row.get("status") == "ok" and speedup.get("verdict"):
                eager, mine = vs["eager_latency"].get("samples"), row["latency"].get("samples")
                speedup = _recomputed(speedup, [e / m for e, m in zip(eager, mine)] if eager and mine else None, True)
                key = f"attention {row['implementation']} vs eager, {row['mode']} seq {row['seq_len']} batch {row['batch_size']}"
                out[key] = (speedup["verdict"], _fmt(speedup))
    for path in sorted((results / "bench_inference").glob("*/metrics.json")):
        variant = _load(path) or {}
        for cell in variant.get("cells", []):
            vs = cell.get("vs_base") or {}
            speedup = vs.get("generation_speedup") or {}
            if cell.get("status") == "ok" and speedup.get("verdict"):
                rounds = [r for r in vs.get("rounds", []) if r["stable"]]
                speedup = _recomputed(speedup, [r["seconds"]["base"] / r["seconds"][variant["variant"]]
                                                for r in rounds] or None, True)
                key = (f"inference {variant['variant']} vs base, KV cache {'on' if cell['kv_cache'] else 'off'} "
                       f"batch {cell['batch_size']}")
                out[key] = (speedup["verdict"], _fmt(speedup))
    for path in sorted((results / "prune").glob("*/metrics.json")):
        m = _load(path) or {}
        if m.get("status") == "ok":
            base, pruned = m["base"]["generation_s"].get("samples"), m["pruned"]["generation_s"].get("samples")
            speedup = _recomputed(m["generation_speedup"],
                                  [b / p for b, p in zip(base, pruned)] if base and pruned else None, True)
            out[f"prune {m['strategy']} vs base generation"] = (speedup["verdict"], _fmt(speedup))
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
        if any(v.startswith(("not a verdict", "inconclusive")) for v in (va, vb)):
            outcome = "same" if va.split(":")[0] == vb.split(":")[0] else "stated in one run only"
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
