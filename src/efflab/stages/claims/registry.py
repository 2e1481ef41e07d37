"""The claims registry (workflow/claims.yaml): the seed texts, their claims and the numbers that are not claims.

Each seed records one unit convention for its KB/MB/GB, with the evidence; every byte claim of that seed carries
it. Every number of a seed text is either a claim's figure (its reported value, an input it is computed from, or
a figure its value is derived from) inside the claim's quote, or inside a passage listed as not a claim, with
the reason: `uncovered` finds the numbers that are neither.
"""
from __future__ import annotations

import re
from pathlib import Path

import jsonschema
import yaml

from ...config import REPO_ROOT, UserError, schema_message
from .quantities import QUANTITIES
from .verdict import PREFIX_POWER

REGISTRY = REPO_ROOT / "workflow" / "claims.yaml"
SCHEMA = REPO_ROOT / "workflow" / "schemas" / "claims.schema.yaml"
# A number as a reader sees one: not a digit inside a name (fp16, Llama-2, cuda:0 stays one) nor a decimal's tail.
NUMBER = re.compile(r"(?<![\w.])(?<!\w-)\d[\d,]*(?:\.\d+)?")


def default_tolerance() -> dict:
    """params.yaml's `tolerance` section: the quality tolerances of a registry read outside a run."""
    return yaml.safe_load((REPO_ROOT / "params.yaml").read_text())["tolerance"]


def with_tolerance(claim: dict, tolerance: dict) -> dict:
    """A claim whose figure is a quality tolerance (`reported.tolerance`) gets that tolerance's value; `band_of`
    says where its band comes from."""
    metric = claim["reported"].get("tolerance")
    if metric is None:
        return claim
    return {**claim, "reported": {"value": tolerance[metric], "unit": claim["reported"]["unit"]},
            "band_of": f"tolerance.{metric}"}


def load(path: Path = REGISTRY, tolerance: dict | None = None) -> dict:
    """Read and validate the registry: {"seeds", "claims", "not_claims"}, each claim with its seed's unit
    convention (`units`) where its figure is in bytes, and a quality tolerance's value where the figure is one
    (`tolerance`: the run's tolerance section, else params.yaml's). UserError names the first bad key."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"{path}: claims registry not found")
    doc = yaml.safe_load(path.read_text())
    errors = sorted(jsonschema.Draft202012Validator(yaml.safe_load(SCHEMA.read_text())).iter_errors(doc),
                    key=lambda e: list(map(str, e.absolute_path)))
    if errors:
        raise UserError(f"{path}: {schema_message(errors[0])}")
    seeds, seen, claims = doc["seeds"], set(), []
    tolerance = tolerance or default_tolerance()
    for claim in doc["claims"]:
        if claim["id"] in seen:
            raise UserError(f"{path}: claim id {claim['id']!r} appears twice")
        seen.add(claim["id"])
        for quantity in (claim.get("quantity"), claim.get("estimate", {}).get("quantity")):
            if quantity and quantity not in QUANTITIES:
                raise UserError(f"{path}: {claim['id']}.quantity: {quantity!r} is not one of {sorted(QUANTITIES)}")
        if claim["source"] not in seeds:
            raise UserError(f"{path}: {claim['id']}.source: {claim['source']!r} is not one of the seeds "
                            f"({', '.join(seeds)})")
        claims.append(_with_units(path, with_tolerance(claim, tolerance), seeds[claim["source"]]))
    for entry in doc.get("not_claims", []):
        if entry["source"] not in seeds:
            raise UserError(f"{path}: not_claims.source: {entry['source']!r} is not one of the seeds")
    return {"seeds": seeds, "claims": claims, "not_claims": doc.get("not_claims", [])}


def _with_units(path: Path, claim: dict, seed: dict) -> dict:
    if claim["reported"]["unit"] not in PREFIX_POWER:
        return claim
    if "units" not in seed:
        raise UserError(f"{path}: seeds.{claim['source']}.units: missing, and claim {claim['id']} reports "
                        f"{claim['reported']['unit']} (say whether the seed's byte prefixes are decimal or binary)")
    return {**claim, "units": seed["units"]}


def load_registry(path: Path = REGISTRY) -> list[dict]:
    """The registry's claims, validated (see `load`)."""
    return load(path)["claims"]


def _number(token: str) -> float:
    return float(token.rstrip(",").replace(",", ""))


def _numbers(value) -> list[float]:
    """Every number in a claim's value or inputs, nested lists and mappings included (a flag as 0 or 1, as a seed
    prints zero_init=1)."""
    if isinstance(value, (int, float)):
        return [float(value)]
    if isinstance(value, dict):
        return [n for v in value.values() for n in _numbers(v)]
    if isinstance(value, list):
        return [n for v in value for n in _numbers(v)]
    return []


def figures(claim: dict) -> list[float]:
    """The numbers of its quote a claim accounts for: its reported value, its inputs, and `figures` (those its
    value is derived from)."""
    return _numbers([claim["reported"]["value"], claim.get("inputs"), claim.get("estimate", {}).get("inputs"),
                     claim.get("figures")])


def _occurrences(text: str, quote: str) -> list[tuple[int, int]]:
    spans, at = [], text.find(quote)
    while at >= 0:
        spans.append((at, at + len(quote)))
        at = text.find(quote, at + 1)
    return spans


def passages(text: str, entry: dict) -> list[tuple[int, int]]:
    """Where a not-claims entry lies in a seed text: each quote wherever it occurs, each [from, to] span from the
    first `from` to the end of the first `to` after it."""
    spans = [s for quote in entry.get("quotes", []) for s in _occurrences(text, quote)]
    for first, last in entry.get("spans", []):
        start = text.find(first)
        end = text.find(last, start) if start >= 0 else -1
        if end >= 0:
            spans.append((start, end + len(last)))
    return spans


def uncovered(text: str, source: str, registry: dict) -> list[tuple[int, str]]:
    """The numbers of a seed text that are neither a claim's figure inside its quote nor inside a passage listed
    as not a claim: (line number from 1, the number)."""
    def near(token: str, wanted: list[float]) -> bool:
        return any(abs(_number(token) - w) <= 1e-9 * max(1.0, abs(w)) for w in wanted)

    claimed = [(span, figures(c)) for c in registry["claims"] if c["source"] == source
               for span in _occurrences(text, c["quote"])]
    excused = [span for e in registry["not_claims"] if e["source"] == source for span in passages(text, e)]
    out = []
    for m in NUMBER.finditer(text):
        at = m.start()
        if any(a <= at < b for a, b in excused) or any(a <= at < b and near(m.group(), wanted)
                                                      for (a, b), wanted in claimed):
            continue
        out.append((text.count("\n", 0, at) + 1, m.group().rstrip(",")))
    return out
