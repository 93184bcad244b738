"""The product's layering, kept by an AST walk over every product module (runtime imports at any depth;
``if TYPE_CHECKING:`` blocks excluded, since they never run).

Layers, low to high: ``kernels`` < ``shared.model`` < ``shared.engine`` < ``services`` < ``simulator`` < ``cli``;
``shared.kv`` (hashing, packing, transports) sits below the wire protocol (``shared.protocol*`` imports it, never
the reverse); each service package imports ``services.worker`` (the worker base) at most, never a sibling
service (``services.switchable`` is the one service made of two). Nothing in the product imports
``benchmarks`` or ``tests``. And no import cycle anywhere.
"""
from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]
PRODUCT = ("kernels", "shared", "services", "simulator", "cli")
OUTSIDE = ("benchmarks", "tests")
SERVICES = ("cache_tier", "decode", "draft", "prefill", "router", "worker", "switchable")

# importer prefix -> prefixes it must not import (a prefix matches the module and its submodules)
RULES: dict[str, tuple[str, ...]] = {
    "kernels": ("shared", "services", "simulator", "cli"),
    "shared": ("services", "simulator", "cli"),
    "shared.model": ("shared.engine", "shared.spec"),
    "shared.spec": ("shared.engine",),
    "shared.kv": ("shared.protocol", "shared.protocol_cache", "shared.protocol_control", "shared.protocol_draft",
                  "shared.protocol_work", "shared.engine", "shared.model"),
    "services": ("simulator", "cli"),
    "simulator": ("cli",),
    **{f"services.{s}": tuple(f"services.{o}" for o in SERVICES if o not in (s, "worker"))
       for s in SERVICES if s != "switchable"},
    "services.switchable": tuple(f"services.{o}" for o in ("cache_tier", "draft", "router")),
}


def _under(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def runtime_imports(source: str, module: str, is_package: bool) -> set[str]:
    """Modules ``source`` imports when it runs (relative imports resolved; TYPE_CHECKING blocks left out)."""
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                for other in child.orelse:
                    visit(other)
                continue
            if isinstance(child, ast.Import):
                found.update(a.name for a in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    parts = module.split(".")
                    parts = parts[:len(parts) - child.level + (1 if is_package else 0)]
                    base = ".".join(parts + ([base] if base else []))
                found.add(base)
                found.update(f"{base}.{a.name}" for a in child.names)
            visit(child)

    visit(ast.parse(source))
    return found


def violations(sources: dict[str, tuple[str, bool]]) -> list[str]:
    """``module -> (source, is_package)``: one line per upward import and per import cycle."""
    graph: dict[str, set[str]] = {}
    problems = []
    for module, (source, is_package) in sources.items():
        imported = runtime_imports(source, module, is_package)
        graph[module] = {m for m in imported if m in sources and m != module}
        for target in sorted(imported):
            if any(_under(target, o) for o in OUTSIDE):
                problems.append(f"{module} imports {target} (outside the product)")
            for prefix, banned in RULES.items():
                if _under(module, prefix) and any(_under(target, b) for b in banned):
                    problems.append(f"{module} imports {target} (upward: {prefix} may not import it)")
                    break
    problems += [f"import cycle: {' -> '.join(c)}" for c in _cycles(graph)]
    return problems


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def product_sources() -> dict[str, tuple[str, bool]]:
    sources = {}
    for top in PRODUCT:
        for path in sorted((ROOT / top).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            is_package = parts[-1] == "__init__"
            module = ".".join(parts[:-1] if is_package else parts)
            sources[module] = (path.read_text(), is_package)
    return sources


def test_the_product_keeps_its_layers_and_has_no_import_cycle():
    sources = product_sources()
    assert len(sources) > 100 and "shared.engine.llm_engine" in sources   # the walk saw the product
    assert violations(sources) == []


def test_the_checker_finds_upward_imports_and_cycles():
    sources = {
        "shared.model.m": ("from shared.engine import e\n", False),
        "shared.engine.e": ("import shared.model.m\n", False),                   # a cycle with the line above
        "shared.kv.k": ("def f():\n    from shared.protocol import X\n", False),  # function level counts
        "services.router.r": ("from services.prefill import service\n", False),
        "services.prefill.service": ("from ..worker import base\n", False),        # relative, allowed
        "services.worker.base": ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                 "    from cli import main\n", False),              # never runs: allowed
        "cli.main": ("import benchmarks.bench\n", False),
    }
    found = violations(sources)
    assert "shared.model.m imports shared.engine (upward: shared.model may not import it)" in found
    assert "shared.kv.k imports shared.protocol (upward: shared.kv may not import it)" in found
    assert "services.router.r imports services.prefill (upward: services.router may not import it)" in found
    assert "cli.main imports benchmarks.bench (outside the product)" in found
    assert "import cycle: shared.engine.e -> shared.model.m" in found
    assert not any(line.startswith(("services.prefill", "services.worker")) for line in found)
