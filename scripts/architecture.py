"""Draw the package's layers from its import graph: docs/_static/architecture.png and its edge list.

The layers are the import-linter contract in ``pyproject.toml`` (top to bottom); the arrows are
the imports between folders that exist in the code now (``grimp``, the graph import-linter
checks). ``make architecture`` rewrites both files; ``--check`` (run by ``make lint``) fails when
the committed edge list is not the current graph, so the picture in docs/architecture.md cannot
go stale without CI saying so, and when two modules import each other (directly or through others,
imports inside functions included).

    python scripts/architecture.py            # write docs/_static/architecture.{png,txt}
    python scripts/architecture.py --check    # exit 1 when the committed edge list is stale
"""

from __future__ import annotations

import argparse
import re
import sys
import tomllib
from pathlib import Path

import grimp

ROOT = Path(__file__).resolve().parent.parent
STATIC = ROOT / "docs" / "_static"
EDGES = STATIC / "architecture.txt"
PICTURE = STATIC / "architecture.png"
PACKAGE = "numpyro_pc"


def contract_layers() -> list[list[str]]:
    """The layers contract's layers, top to bottom, each a list of module names."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    contracts = config["tool"]["importlinter"]["contracts"]
    layers = next(c["layers"] for c in contracts if c["type"] == "layers")
    return [[name.strip() for name in re.split(r"[:|]", layer)] for layer in layers]


def folder_edges(graph, layers: list[list[str]]) -> list[tuple[str, str]]:
    """``(importer, imported)`` for every pair of layer members with a direct import between them."""
    names = [name for layer in layers for name in layer]
    edges = []
    for a in names:
        for b in names:
            if a != b and graph.direct_import_exists(importer=a, imported=b, as_packages=True):
                edges.append((a, b))
    return sorted(edges)


def module_cycles(graph) -> list[list[str]]:
    """Groups of modules that import each other, directly or through others (strongly connected
    components of the module graph, function-level imports included): the layers contract allows them
    inside a folder, the package wants none."""
    succ = {m: sorted(i for i in graph.find_modules_directly_imported_by(m) if i != PACKAGE) for m in graph.modules}
    index, low, stack, on_stack, cycles = {}, {}, [], set(), []
    for root in sorted(succ):
        if root in index:
            continue
        work = [(root, iter(succ[root]))]
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
                    work.append((child, iter(succ.get(child, ()))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                group = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    group.append(member)
                    if member == node:
                        break
                if len(group) > 1:
                    cycles.append(sorted(group))
    return cycles


def edge_list_text(layers, edges) -> str:
    short = lambda name: name.removeprefix(PACKAGE + ".")  # noqa: E731
    lines = ["# written by scripts/architecture.py from the import graph; do not edit", "# layers, top to bottom"]
    lines += ["  " + " : ".join(short(n) for n in layer) for layer in layers]
    lines.append("# imports between them (importer -> imported)")
    lines += [f"  {short(a)} -> {short(b)}" for a, b in edges]
    return "\n".join(lines) + "\n"


def transitive_reduction(edges):
    """The edges not implied by a longer path (the graph is acyclic: the contract holds)."""
    succ = {}
    for a, b in edges:
        succ.setdefault(a, set()).add(b)

    def reachable(start, skip_edge):
        seen, stack = set(), [n for n in succ.get(start, ()) if (start, n) != skip_edge]
        while stack:
            n = stack.pop()
            if n not in seen:
                seen.add(n)
                stack.extend(succ.get(n, ()))
        return seen

    return [(a, b) for a, b in edges if b not in reachable(a, (a, b))]


def draw(layers, edges, path: Path) -> None:
    """Boxes per layer (top to bottom), an arrow for each import between folders that no longer
    path implies."""
    edges = transitive_reduction(edges)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import FancyArrowPatch, FancyBboxPatch

    short = lambda name: name.removeprefix(PACKAGE + ".")  # noqa: E731
    row_height, box_h, width = 1.0, 0.42, 12.0
    where = {}
    for row, layer in enumerate(layers):
        y = -row * row_height
        for k, name in enumerate(layer):
            x = width * (k + 0.5) / len(layer)
            where[name] = (x, y)
    fig, ax = plt.subplots(figsize=(9.5, 0.62 * len(layers)))
    for a, b in edges:
        (xa, ya), (xb, yb) = where[a], where[b]
        arrow = FancyArrowPatch((xa, ya - box_h / 2), (xb, yb + box_h / 2), arrowstyle="-|>", mutation_scale=7,
                                color="tab:blue", alpha=0.55, lw=0.9, connectionstyle="arc3,rad=0.06")
        ax.add_patch(arrow)
    for name, (x, y) in where.items():
        label = short(name) + ("/" if (ROOT / PACKAGE / short(name)).is_dir() else ".py")
        w = 0.13 * len(label) + 0.35
        ax.add_patch(FancyBboxPatch((x - w / 2, y - box_h / 2), w, box_h, boxstyle="round,pad=0.02",
                                    fc="white", ec="0.25", lw=0.9, zorder=3))
        ax.text(x, y, label, ha="center", va="center", fontsize=8.5, family="monospace", zorder=4)
    ax.set_xlim(0, width)
    ax.set_ylim(-(len(layers) - 1) * row_height - 0.5, 0.5)
    ax.axis("off")
    ax.set_title("numpyro_pc: layers top to bottom; an arrow is an import between folders\n"
                 "(from the import graph; an import implied by a chain of arrows is not drawn)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=80, metadata={"Software": None})
    plt.close(fig)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail when the committed edge list is stale")
    args = parser.parse_args(argv)
    layers = contract_layers()
    graph = grimp.build_graph(PACKAGE)
    edges = folder_edges(graph, layers)
    text = edge_list_text(layers, edges)
    if args.check:
        cycles = module_cycles(graph)
        if cycles:
            print("modules that import each other (a cycle): " + "; ".join(" <-> ".join(c) for c in cycles),
                  file=sys.stderr)
            return 1
        committed = EDGES.read_text() if EDGES.exists() else ""
        if committed != text:
            print(f"{EDGES.relative_to(ROOT)} is stale: the import graph or the layers changed; run `make architecture` "
                  "and commit docs/_static/architecture.{txt,png}", file=sys.stderr)
            return 1
        print(f"{EDGES.relative_to(ROOT)}: current")
        return 0
    STATIC.mkdir(parents=True, exist_ok=True)
    EDGES.write_text(text)
    draw(layers, edges, PICTURE)
    print(f"wrote {EDGES.relative_to(ROOT)} and {PICTURE.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
