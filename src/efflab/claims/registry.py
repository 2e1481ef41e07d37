"""The claims registry (workflow/claims.yaml): read and validated against its schema."""
from __future__ import annotations

from pathlib import Path

import jsonschema
import yaml

from ..config import REPO_ROOT, UserError, _schema_message
from .quantities import QUANTITIES
from .verdict import PREFIX_POWER

REGISTRY = REPO_ROOT / "workflow" / "claims.yaml"
SCHEMA = REPO_ROOT / "workflow" / "schemas" / "claims.schema.yaml"


def load_registry(path: Path = REGISTRY) -> list[dict]:
    """Read and validate the claims registry; UserError names the first bad key."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"{path}: claims registry not found")
    doc = yaml.safe_load(path.read_text())
    errors = sorted(jsonschema.Draft202012Validator(yaml.safe_load(SCHEMA.read_text())).iter_errors(doc),
                    key=lambda e: list(map(str, e.absolute_path)))
    if errors:
        raise UserError(f"{path}: {_schema_message(errors[0])}")
    seen = set()
    for claim in doc["claims"]:
        if claim["id"] in seen:
            raise UserError(f"{path}: claim id {claim['id']!r} appears twice")
        seen.add(claim["id"])
        if "quantity" in claim and claim["quantity"] not in QUANTITIES:
            raise UserError(f"{path}: {claim['id']}.quantity: {claim['quantity']!r} is not one of "
                            f"{sorted(QUANTITIES)}")
        if "units" in claim and claim["reported"]["unit"] not in PREFIX_POWER:
            raise UserError(f"{path}: {claim['id']}.units: a unit convention applies to {', '.join(PREFIX_POWER)}, "
                            f"not {claim['reported']['unit']!r}")
    return doc["claims"]

