"""No import cycles anywhere in the package (grimp: every import, function-local ones included): the
layers say which way imports go between subpackages, this says it for the modules inside each."""

from __future__ import annotations

import grimp

KNOWN_CYCLES: list[set[str]] = []
"""Cycles tolerated for now, each with why (none today)."""


def cycles(graph: grimp.ImportGraph) -> list[set[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[set[str]] = []
    for root in sorted(graph.modules):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.find_modules_directly_imported_by(root))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            module, imported = work[-1]
            step = next(imported, None)
            if step is not None:
                if step not in index:
                    index[step] = low[step] = len(index)
                    stack.append(step)
                    on_stack.add(step)
                    work.append((step, iter(sorted(graph.find_modules_directly_imported_by(step)))))
                elif step in on_stack:
                    low[module] = min(low[module], index[step])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[module])
            if low[module] == index[module]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == module:
                        break
                if len(component) > 1:
                    found.append(component)
    return found


def test_the_cycle_finder_finds_a_cycle() -> None:
    graph = grimp.ImportGraph()
    for a, b in (("p.a", "p.b"), ("p.b", "p.c"), ("p.c", "p.a"), ("p.c", "p.d")):
        graph.add_import(importer=a, imported=b)
    assert cycles(graph) == [{"p.a", "p.b", "p.c"}]


def test_no_module_of_the_package_imports_itself_through_others() -> None:
    graph = grimp.build_graph("swarmnode")
    assert [c for c in cycles(graph) if c not in KNOWN_CYCLES] == []
