"""The package's dependency direction, read from the source: stages -> shared core -> libraries. The module import
graph (imports inside functions included) has no cycle, the core never imports a stage, no stage imports another
stage, and no module takes another's private names."""
import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = SRC / "efflab"


def module_name(path: Path) -> str:
    parts = path.relative_to(SRC).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in PACKAGE.rglob("*.py")}


def imports(name: str) -> list[tuple[str, list[str]]]:
    """(efflab module, names taken from it) for every import statement of module `name`, at any depth."""
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [(alias.name, []) for alias in node.names if alias.name.split(".")[0] == "efflab"]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != "efflab":
                continue
            names = [alias.name for alias in node.names]
            submodules = [f"{target}.{n}" for n in names if f"{target}.{n}" in MODULES]
            out += [(sub, []) for sub in submodules]
            if len(submodules) < len(names):
                out.append((target, [n for n in names if f"{target}.{n}" not in MODULES]))
    return [(target, names) for target, names in out if target in MODULES and target != name]


GRAPH = {name: {target for target, _ in imports(name)} for name in MODULES}


def test_the_module_import_graph_has_no_cycle():
    state: dict[str, str] = {}
    cycles = []

    def visit(node: str, trail: list[str]) -> None:
        state[node] = "open"
        for nxt in sorted(GRAPH[node]):
            if state.get(nxt) == "open":
                cycles.append(" -> ".join(trail[trail.index(nxt):] + [node, nxt]) if nxt in trail
                              else f"{node} -> {nxt}")
            elif nxt not in state:
                visit(nxt, trail + [node])
        state[node] = "done"

    for name in sorted(GRAPH):
        if name not in state:
            visit(name, [])
    assert not cycles, cycles


def test_no_module_imports_another_modules_private_names():
    private = [f"{name} imports {target}.{n}" for name in MODULES for target, names in imports(name)
               for n in names if n.startswith("_") and not n.startswith("__")]
    assert not private, private


STAGE_PACKAGE = "efflab.stages"


def stage_of(module: str) -> str | None:
    """The stage a module belongs to (efflab.stages.report.writing -> report), or None for the shared core."""
    parts = module.split(".")
    return parts[2] if module.startswith(STAGE_PACKAGE + ".") else None


def test_the_core_never_imports_a_stage():
    up = [f"{name} imports {target}" for name, targets in GRAPH.items() if not name.startswith(STAGE_PACKAGE)
          for target in targets if target.startswith(STAGE_PACKAGE)]
    assert not up, up


def test_no_stage_imports_another_stage():
    across = [f"{name} imports {target}" for name, targets in GRAPH.items() if stage_of(name)
              for target in targets if stage_of(target) and stage_of(target) != stage_of(name)]
    assert not across, across


def test_every_registered_stage_is_a_module_under_stages():
    from efflab.registry import STAGES, module

    assert {stage_of(name) for name in MODULES if stage_of(name)} == set(STAGES)
    assert all(module(stage) in MODULES for stage in STAGES)
