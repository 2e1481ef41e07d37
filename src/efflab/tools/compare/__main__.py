"""`efflab compare RUN_A RUN_B [--out results/compare]` (also `python -m efflab.tools.compare`)."""
from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from ...config import UserError
from . import findings, page, runs


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="efflab compare", description="What changed between two runs, finding by "
                                "finding: B against A.")
    p.add_argument("run_a", metavar="RUN_A", help="a results folder, or the name of a kept reference "
                   "(results/reference/<name>)")
    p.add_argument("run_b", metavar="RUN_B", help="the same, for the run compared against A")
    p.add_argument("--out", default="results/compare", help="where the page goes: <out>/<A>-vs-<B>/")
    return p


def summary(paired: dict, answers: list[dict], where: Path) -> str:
    moved = [r for r in paired["rows"] if findings.changed(r["verdict"])]
    apart = sum(findings.not_comparable(r["verdict"]) for r in paired["rows"])
    lines = [f"{len(moved)} of {len(paired['rows'])} findings changed, {apart} not comparable, "
             f"{len(answers)} answer{'s' if len(answers) != 1 else ''} changed: {where / 'compare.md'}"]
    lines += [f"  {r['finding']} {r['subject']} {r['metric']}: {r['verdict']}" for r in moved[:10]]
    return "\n".join(lines + ([f"  ... and {len(moved) - 10} more"] if len(moved) > 10 else []))


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        a, b = runs.read(args.run_a, "RUN_A"), runs.read(args.run_b, "RUN_B")
    except UserError as err:
        print(f"efflab compare: error: {err}", file=sys.stderr)
        return 2
    paired, answers = findings.pair(a, b), findings.answers_changed(a, b)
    name = re.sub(r"[^A-Za-z0-9._@-]+", "-", f"{a.label}-vs-{b.label}")
    where = page.write(a, b, paired, answers, Path(args.out) / name)
    print(summary(paired, answers, where))
    return 0


if __name__ == "__main__":
    sys.exit(main())
