"""The house's floors, kept: `./dev lint` fails on an import from a higher floor or a circle.

Floors, from the ground up (a module belongs to the floor of the longest name that prefixes
it). A module may import from its own floor or any floor below; an import that runs up is an
error, and so is any import circle between modules, on one floor or across floors. A floor in
STANDS_ON may import only the floors it names (the trainer: the wire and the client). Every
import counts: at the top of a file, inside a function, under TYPE_CHECKING.

    python dev-extras/layers.py [ROOT]      # ROOT: the repository (default: this one)
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

FLOORS: list[tuple[str, str]] = [
    ("wire", "what crosses a process: protocol, batch schema, step layout, Arrow IPC"),
    ("client", "finding and joining what runs: which Ray and its auth, the services' records"),
    ("pipeline.config", "the run's configuration"),
    ("pipeline.tokenize", "a tokenizer loaded and proven exact"),
    ("pipeline.read", "files, formats, records, tokenized blocks"),
    ("pipeline.stages", "documents, shuffle, mixing, packing"),
    ("pipeline.state", "resume states, run summaries"),
    ("pipeline.feed", "the stages chained into global steps"),
    ("pipeline.lanes", "K feeds joined into global steps"),
    ("pipeline.inspect", "stats and provenance over a config"),
    ("pipeline", "the package's face"),
    ("service", "export, serve, the control plane, the CLI"),
    ("trainer", "the trainer side: feeds, adapters, the demo model"),
    ("bench", "benchmarks"),
]
PACKAGES = ("wire", "client", "pipeline", "service", "trainer", "bench")
# Floors that stand on a few floors only, not on everything below them: a trainer rank needs
# the wire and the client, never the data plane or the control plane (a thin client).
STANDS_ON: dict[str, tuple[str, ...]] = {"trainer": ("wire", "client", "trainer")}


def modules(root: Path) -> dict[str, Path]:
    """Every module of the house by dotted name (a package by its own name)."""
    out = {}
    for top in PACKAGES:
        for path in sorted((root / top).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = path
    return out


def floor_of(name: str) -> int:
    best, floor = -1, -1
    for i, (prefix, _) in enumerate(FLOORS):
        if (name == prefix or name.startswith(prefix + ".")) and len(prefix) > best:
            best, floor = len(prefix), i
    return floor


def imports(path: Path, name: str, known: dict[str, Path]) -> list[tuple[str, int]]:
    """(module imported, line) for every import of a house module in `path`."""
    tree = ast.parse(path.read_text(), str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            # `from pkg import mod` imports the module pkg.mod when there is one
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base
                       for a in node.names]  # fmt: skip
        else:
            continue
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.append((target, node.lineno))
    return found


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out = []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on.add(start)
        while work:
            node, it = work[-1]
            nxt = next(it, None)
            if nxt is not None:
                if nxt not in index:
                    index[nxt] = low[nxt] = counter
                    counter += 1
                    stack.append(nxt)
                    on.add(nxt)
                    work.append((nxt, iter(sorted(graph.get(nxt, ())))))
                elif nxt in on:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                comp = []
                while True:
                    m = stack.pop()
                    on.discard(m)
                    comp.append(m)
                    if m == node:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def check(root: Path) -> list[str]:
    known = modules(root)
    graph: dict[str, set[str]] = {m: set() for m in known}
    errors = []
    for name, path in known.items():
        mine = floor_of(name)
        if mine < 0:
            errors.append(f"{path.relative_to(root)}: on no floor (add it to FLOORS)")
            continue
        for target, line in imports(path, name, known):
            graph[name].add(target)
            theirs = floor_of(target)
            allowed = STANDS_ON.get(FLOORS[mine][0])
            if allowed is not None and FLOORS[theirs][0].split(".")[0] not in allowed:
                errors.append(
                    f"{path.relative_to(root)}:{line}: imports {target}, but {FLOORS[mine][0]} "
                    f"stands on {', '.join(allowed)} only"
                )
            if theirs > mine:
                errors.append(
                    f"{path.relative_to(root)}:{line}: imports {target} from a higher floor "
                    f"({FLOORS[theirs][0]}, above {FLOORS[mine][0]})"
                )
    for comp in circles(graph):
        ties = [f"{a} -> {b}" for a in comp for b in sorted(graph[a]) if b in comp]
        errors.append(f"import circle of {len(comp)} modules: {'; '.join(ties)}")
    return errors


def main() -> int:
    root = Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).resolve().parent.parent)
    errors = check(root)
    for e in errors:
        print(e)
    if errors:
        print(f"layers: {len(errors)} error(s); the floors are in dev-extras/layers.py")
        return 1
    print(f"layers: {len(modules(root))} modules on {len(FLOORS)} floors, no upward import, "
          "no circle")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
