"""Did a change keep the records' shape? Compare the metrics key sets of two results folders, job by job.

A refactor that should not change behaviour must leave every job's record with the same keys: the report,
the claims, `dvc metrics` and users' own scripts read them. For every `metrics.json` under either folder
(the reference runs under results/reference/ are passed over), the record is flattened to its key paths
(`cells[].vs_base.generation_speedup.median`: list items share one path) and the two sets are compared.

    python benchmarks/key_sets.py /tmp/before/results /tmp/after/results

Prints each job that is in one folder only, and each job's keys added and removed. Exits 1 if a job or a key
went missing (added keys are listed, and do not fail it unless --strict).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def key_paths(node, prefix: str = "") -> set[str]:
    """Every key path of a JSON value; list items share their list's path (`name[]`)."""
    if isinstance(node, dict):
        out = set()
        for key, value in node.items():
            path = f"{prefix}.{key}" if prefix else str(key)
            out |= {path} | key_paths(value, path)
        return out
    if isinstance(node, list):
        return set().union(*(key_paths(item, f"{prefix}[]") for item in node)) if node else set()
    return set()


def records_of(results: Path) -> dict[str, set[str]]:
    """{job (stage/name): its record's key paths} for every metrics.json under `results`."""
    return {str(path.parent.relative_to(results)): key_paths(json.loads(path.read_text()))
            for path in sorted(results.rglob("metrics.json")) if "reference" not in path.relative_to(results).parts}


# Keys whose presence depends on the machine or on how the run went, not on the code: a profile, a GPU's figures,
# a comparison's unstable rounds
VOLATILE = ("profile.", "gpu_", "cuda_", ".unstable", "unstable")


def compare(before: dict[str, set[str]], after: dict[str, set[str]]) -> list[dict]:
    """One row per job that differs: what it lost and gained, or that it is in one folder only."""
    rows = []
    for job in sorted(before.keys() | after.keys()):
        if job not in after or job not in before:
            rows.append({"job": job, "only_in": "before" if job not in after else "after"})
            continue
        lost = {k for k in before[job] - after[job] if not any(v in k for v in VOLATILE)}
        gained = {k for k in after[job] - before[job] if not any(v in k for v in VOLATILE)}
        if lost or gained:
            rows.append({"job": job, "removed": sorted(lost), "added": sorted(gained)})
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("before", type=Path, help="results folder of the run before the change")
    parser.add_argument("after", type=Path, help="results folder of the run after it")
    parser.add_argument("--strict", action="store_true", help="added keys fail too")
    args = parser.parse_args(argv)
    for folder in (args.before, args.after):
        if not folder.is_dir():
            print(f"key_sets: error: {folder}: not a results folder", file=sys.stderr)
            return 2
    before, after = records_of(args.before), records_of(args.after)
    rows = compare(before, after)
    for row in rows:
        if "only_in" in row:
            print(f"{row['job']}: only in the {row['only_in']} run")
            continue
        for key in row["removed"]:
            print(f"{row['job']}: - {key}")
        for key in row["added"]:
            print(f"{row['job']}: + {key}")
    failed = [r for r in rows if r.get("only_in") or r.get("removed") or (args.strict and r.get("added"))]
    print(f"{len(before.keys() & after.keys())} jobs in both runs, {len(rows)} differ, "
          f"{'FAILED' if failed else 'same key sets'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
