"""The package's shape in numbers anyone can recompute: `python tools/house_check.py [--strict]`.

Read with `ast` from src/h5feed (nothing is imported or run), it reports:

- modules over `MAX_LINES` lines;
- public functions and methods that take more than `MAX_PARAMETERS` parameters (self and cls
  not counted; a `**kwargs` counts as one);
- private names (a leading underscore) imported from another module of the package;
- import cycles between the package's modules (imports inside functions included: they
  still tie the modules together, only later).

With `--strict` it exits 1 when any is found, for use in CI once the house is in order.
"""

from __future__ import annotations

import argparse
import ast
import sys
from dataclasses import dataclass, field
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "h5feed"
MAX_LINES = 600
MAX_PARAMETERS = 10


@dataclass
class Findings:
    """What the check found, each as a line a person reads."""

    long_modules: list[str] = field(default_factory=list)
    long_signatures: list[str] = field(default_factory=list)
    private_imports: list[str] = field(default_factory=list)
    cycles: list[str] = field(default_factory=list)

    def sections(self) -> dict[str, list[str]]:
        return {f"modules over {MAX_LINES} lines": self.long_modules,
                f"public functions over {MAX_PARAMETERS} parameters": self.long_signatures,
                "private names imported across modules": self.private_imports,
                "import cycles": self.cycles}

    @property
    def count(self) -> int:
        return sum(len(lines) for lines in self.sections().values())


def module_name(path: Path, package: Path = PACKAGE) -> str:
    parts = path.relative_to(package.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def check(package: Path = PACKAGE) -> Findings:
    """Every module of `package`, read and measured."""
    findings = Findings()
    imports: dict[str, set[str]] = {}
    top = package.name
    modules = {module_name(p, package): p for p in sorted(package.rglob("*.py"))}
    for name, path in modules.items():
        text = path.read_text()
        tree = ast.parse(text, str(path))
        where = path.relative_to(package.parent)
        lines = text.count("\n")
        if lines > MAX_LINES:
            findings.long_modules.append(f"{where}: {lines} lines")
        findings.long_signatures += [f"{where}:{node.lineno} {node.name}: {n} parameters"
                                     for node, n in _signatures(tree) if n > MAX_PARAMETERS]
        imports[name] = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 and node.module.startswith(top):
                # `from h5feed import tracing` ties this module to h5feed.tracing, not to the package's __init__
                imports[name] |= {f"{node.module}.{alias.name}" if f"{node.module}.{alias.name}" in modules
                                  else node.module for alias in node.names}
                findings.private_imports += [f"{where}:{node.lineno} {alias.name} from {node.module}"
                                             for alias in node.names
                                             if alias.name.startswith("_") and not alias.name.startswith("__")
                                             and node.module != name]
            elif isinstance(node, ast.Import):
                imports[name] |= {alias.name for alias in node.names if alias.name.startswith(top)}
    findings.cycles = _cycles({m: {i for i in targets if i in modules and i != m} for m, targets in imports.items()})
    return findings


def _signatures(tree: ast.Module) -> list[tuple[ast.FunctionDef | ast.AsyncFunctionDef, int]]:
    """Each public function or method (not `_private`, dunders counted) with its number of parameters."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not (
                node.name.startswith("_") and not node.name.startswith("__")):
            a = node.args
            named = [p.arg for p in (*a.posonlyargs, *a.args, *a.kwonlyargs) if p.arg not in ("self", "cls")]
            found.append((node, len(named) + (a.vararg is not None) + (a.kwarg is not None)))
    return found


def _cycles(graph: dict[str, set[str]]) -> list[str]:
    """The strongly connected groups of more than one module (Tarjan's algorithm), each as a line."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[str] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph.get(node, ())):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                groups.append(" <-> ".join(sorted(group)))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10 * len(graph) + 100))
    for node in sorted(graph):
        if node not in index:
            visit(node)
    return groups


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--strict", action="store_true", help="exit 1 when anything is found")
    args = parser.parse_args(argv)
    findings = check()
    for title, lines in findings.sections().items():
        print(f"{title}: {len(lines)}")
        for line in lines:
            print(f"  {line}")
    return 1 if args.strict and findings.count else 0


if __name__ == "__main__":
    sys.exit(main())
