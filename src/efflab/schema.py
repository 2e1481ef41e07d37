"""The params schema (workflow/schemas/params.schema.yaml) as efflab reads it: loaded, and walked key by key for what
each key means (`dvc exp run -S` rewrites params.yaml without its comments, the schema keeps them) and which
mappings are settings and which are grids of named entries (an overlay merges the one, replaces the other)."""
from __future__ import annotations

import functools
from pathlib import Path

import yaml

SCHEMA_PATH = Path(__file__).resolve().parents[2] / "workflow" / "schemas" / "params.schema.yaml"


class UnknownKey(ValueError):
    """A dotted key the schema has no place for."""


def load_schema() -> dict:
    return yaml.safe_load(SCHEMA_PATH.read_text())


@functools.lru_cache(maxsize=1)
def parsed() -> dict:
    """The schema, parsed once per process (read only)."""
    return load_schema()


def _schemas(schema: dict, nodes: list, branches: tuple[str, ...]) -> list[dict]:
    """`nodes` and the schemas their $ref and `branches` keywords (allOf, oneOf, ...) lead to, depth first."""
    seen: list[dict] = []

    def visit(node) -> None:
        if not isinstance(node, dict) or any(node is s for s in seen):
            return
        seen.append(node)
        if "$ref" in node:
            target = schema
            for part in node["$ref"].removeprefix("#/").split("/"):
                target = target[part]
            visit(target)
        for keyword in branches:
            for sub in node.get(keyword, []):
                visit(sub)

    for node in nodes:
        visit(node)
    return seen


def children(schema: dict, nodes: list) -> dict[str, list]:
    """The keys a value of `nodes` may have, each with its schemas; "<name>" stands for any other key."""
    nodes = _schemas(schema, nodes, ("allOf", "oneOf", "anyOf"))
    children: dict[str, list] = {}
    for node in nodes:
        for key, sub in node.get("properties", {}).items():
            children.setdefault(key, []).append(sub)
    extra = [n["additionalProperties"] for n in nodes if isinstance(n.get("additionalProperties"), dict)]
    return children | ({"<name>": extra} if extra else {})


def description(schema: dict, nodes: list) -> str:
    """The key's own description, else that of the schema it refers to ($ref, allOf)."""
    return next((n["description"] for n in nodes + _schemas(schema, nodes, ("allOf",)) if "description" in n), "")


def describe(key: str) -> str:
    """The description of a dotted params key, e.g. finetune.defaults.packing or finetune.runs.<any name>.method."""
    schema = parsed()
    nodes, parts = [schema], key.split(".")
    for i, part in enumerate(parts):
        keys = children(schema, nodes)
        nodes = keys.get(part) or keys.get("<name>")
        if not nodes:
            where = ".".join(parts[:i]) or "the top level"
            expected = f"expected one of: {', '.join(keys)}" if keys else "a value, with no keys under it"
            raise UnknownKey(f"{key!r} is not a params key: {where} has no key {part!r} ({expected})")
    return description(schema, nodes)


def descriptions() -> dict[str, str]:
    """Every key path of the schema (<name> for a named entry of a grid), with its description."""
    schema, out = parsed(), {}

    def walk(nodes: list, path: list[str]) -> None:
        for key, subs in children(schema, nodes).items():
            out[".".join(path + [key])] = description(schema, subs)
            walk(subs, path + [key])

    walk([schema], [])
    return out
