"""The package layout as a test (issue #30): no import cycles, imports only downwards, small modules.

Every module of opd_cache is parsed (`ast`, nothing is imported) and every import in it counts: at module
level, inside functions, and under `if TYPE_CHECKING:` (a type-only import is still a dependency a reader
has to follow, and the cycle it closes comes back the day the annotation is evaluated).

Layers, bottom up. A module imports from its own package and from lower layers, never from a higher one:

    0  core        config (+ config_sources), engine, models, tokenizer, vllm_common, target_flags (and the package root, _moved)
    1  storage     storage/            the store: layout, atomic files, shards, manifest, retention
    2  libraries   losses/, flow/, observe/, tasks/, and testing.py (synthetic shards, for tests and benchmarks)
    3  stages      rollout/, annotate/, train/, and their peers evaluate.py, evaluate_agent.py and export.py
    4  launch      launch/             `opd run`, Ray, `opd demo`
    5  cli         cli/

Within one layer packages are independent (core modules may import each other, without cycles): above all,
the stages never import each other, they meet only in the store. A few imports between peers are allowed,
each named in PEER_IMPORTS with its reason; a new one is a design decision, not a line to add here.

Modules stay readable: at most MAX_LINES lines. OVERSIZED lists the modules being split (temporarily).
Only opd_cache/storage/ knows whether a store is a local directory (`is_local`): everyone else asks the
store what they need (`appends_in_place`, `local_dir(rel)`, `atomic_create`, `on_this_machine`, ...).
"""

from __future__ import annotations

import ast
from pathlib import Path

from tests.conftest import REPO

PACKAGE = REPO / "opd_cache"
MAX_LINES = 500

CORE = ("config", "config_sources", "engine", "models", "tokenizer", "vllm_common", "target_flags", "_moved")
LAYERS = {  # the first name under opd_cache -> layer (CORE modules: 0)
    "storage": 1,
    "losses": 2,
    "flow": 2,
    "observe": 2,
    "tasks": 2,
    "testing": 2,
    "rollout": 3,
    "annotate": 3,
    "train": 3,
    "evaluate": 3,
    "evaluate_agent": 3,
    "export": 3,
    "launch": 4,
    "cli": 5,
}
LAYER_NAMES = ("core", "storage", "libraries", "stages", "launch", "cli")

# (importer, imported) between two packages of one layer, and why it is allowed.
PEER_IMPORTS = {
    ("opd_cache.evaluate", "opd_cache.rollout.hf_generate"): "the evaluator samples with rollout's HF engine",
    ("opd_cache.export", "opd_cache.train.shard_data"): "export reads shards through the trainer's validated reader",
    ("opd_cache.evaluate_agent", "opd_cache.evaluate"): "the agent evaluator reuses the evaluator's engine and KL",
    ("opd_cache.evaluate_agent", "opd_cache.rollout.agent"): "the agent evaluator runs rollout's conversation loop",
    (
        "opd_cache.annotate.recover",
        "opd_cache.rollout.conversation",
    ): "annotate reads rows back with rollout's renderer",
    ("opd_cache.annotate.recover", "opd_cache.rollout.messages"): "... into rollout's messages",
    ("opd_cache.annotate.rerender", "opd_cache.rollout.conversation"): "annotate re-renders them for the teacher",
    ("opd_cache.annotate.rerender", "opd_cache.rollout.messages"): "... and refuses what cannot be rendered",
    ("opd_cache.annotate.rerender", "opd_cache.rollout.agent"): "... with the tools rollout's environment declared",
}

# (package root, imported): the public names `opd_cache` hands on, imported on first use (a module
# __getattr__), so `import opd_cache` loads none of them and nothing below imports through the root.
ROOT_EXPORTS = {
    ("opd_cache", "opd_cache.rollout.writer"): "opd_cache.RolloutWriter, the producers' API (docs/agents.md)",
}

# Modules over MAX_LINES while they are being split (none now: the stage modules were split in issue #30).
OVERSIZED: set[str] = set()


def module_files() -> dict[str, Path]:
    """Every module of opd_cache by dotted name (a package by its own name: its __init__.py)."""
    modules = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(REPO).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = path
    return modules


MODULES = module_files()


def _known(name: str) -> str | None:
    """The module `name` names, or the package it lies in (`opd_cache.storage.store.Store` -> ...store)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def parse_imports(source: str, module: str, is_package: bool = False) -> list[tuple[str, int]]:
    """(imported opd_cache module, line) of every import statement in `source`, wherever it stands."""
    package = module if is_package else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(_known(alias.name), node.lineno) for alias in node.names if alias.name.startswith("opd_cache")]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package, `level - 1` packages up
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            if not base.startswith("opd_cache"):
                continue
            for alias in node.names:  # `from pkg import submodule` imports the submodule
                submodule = f"{base}.{alias.name}"
                found.append((submodule if submodule in MODULES else _known(base), node.lineno))
    return [(name, line) for name, line in found if name is not None and name != module]


def imports_of(module: str) -> list[tuple[str, int]]:
    path = MODULES[module]
    return parse_imports(path.read_text(), module, is_package=path.name == "__init__.py")


GRAPH = {module: imports_of(module) for module in MODULES}


def where(module: str, line: int | None = None) -> str:
    text = str(MODULES[module].relative_to(REPO))
    return f"{text}:{line}" if line else text


def layer_of(module: str) -> tuple[int, str]:
    """(layer, group): the group is the package under opd_cache (a core module is a group of its own)."""
    parts = module.split(".")
    if len(parts) == 1 or parts[1] in CORE:
        return 0, ".".join(parts[:2])
    if parts[1] not in LAYERS:
        raise AssertionError(f"{where(module)}: a new top-level module or package; give it a layer in LAYERS")
    return LAYERS[parts[1]], parts[1]


def strongly_connected(graph: dict[str, list[str]]) -> list[list[str]]:
    """The groups of modules that import each other, directly or not (Tarjan; iterative)."""
    index, low, on_stack, stack, groups, counter = {}, {}, set(), [], [], [0]
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(graph[root]))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter[0]
                    counter[0] += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(graph[child])))
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
                    groups.append(sorted(group))
    return groups


def cycle_through(start: str, members: set[str]) -> list[str]:
    """One import cycle start -> ... -> start inside a strongly connected group (breadth first: a short one)."""
    paths = {start: [start]}
    queue = [start]
    while queue:
        node = queue.pop(0)
        for child, _ in GRAPH[node]:
            if child == start:
                return paths[node] + [start]
            if child in members and child not in paths:
                paths[child] = paths[node] + [child]
                queue.append(child)
    raise AssertionError(f"no cycle through {start}")


def describe_cycle(cycle: list[str]) -> str:
    steps = []
    for importer, imported in zip(cycle, cycle[1:]):
        line = next(line for name, line in GRAPH[importer] if name == imported)
        steps.append(f"{where(importer, line)} imports {imported}")
    return "; ".join(steps)


def test_every_kind_of_import_is_seen():
    """The checks below see the imports that exist: a parser that missed some would pass them all."""
    source = """
import opd_cache.storage.store
from opd_cache.storage import layout, StoreError
from . import schema
from .listing import ShardWatch
import numpy

def load():
    from opd_cache.cli import common

if TYPE_CHECKING:
    from opd_cache.launch.run import Supervisor
"""
    assert sorted(parse_imports(source, "opd_cache.storage.retention"), key=lambda edge: edge[1]) == [
        ("opd_cache.storage.store", 2),
        ("opd_cache.storage.layout", 3),
        ("opd_cache.storage", 3),  # StoreError: a name of the package itself
        ("opd_cache.storage.schema", 4),
        ("opd_cache.storage.listing", 5),
        ("opd_cache.cli.common", 9),
        ("opd_cache.launch.run", 12),
    ]
    assert sum(len(edges) for edges in GRAPH.values()) > 300, "fewer imports than opd_cache has: the parser broke"


def test_no_import_cycles():
    graph = {module: [name for name, _ in edges] for module, edges in GRAPH.items()}
    cycles = [describe_cycle(cycle_through(group[0], set(group))) for group in strongly_connected(graph)]
    assert not cycles, "import cycles (break them by direction, see docs/design.md §1):\n" + "\n".join(cycles)


def layering_problem(module: str, imported: str) -> str | None:
    """Why `module` may not import `imported` (module docstring), or None when it may."""
    layer, group = layer_of(module)
    their_layer, their_group = layer_of(imported)
    if their_group == group or their_layer < layer or layer == their_layer == 0 or (module, imported) in PEER_IMPORTS:
        return None
    if (module, imported) in ROOT_EXPORTS:
        return None
    how = "a higher layer" if their_layer > layer else "a peer of the same layer"
    return f"{how} ({LAYER_NAMES[layer]} {group} -> {LAYER_NAMES[their_layer]} {their_group})"


def test_the_layering_rule_refuses_what_it_should():
    assert layering_problem("opd_cache.rollout.worker", "opd_cache.train.stream") == (
        "a peer of the same layer (stages rollout -> stages train)"
    )
    assert layering_problem("opd_cache.storage.store", "opd_cache.observe.metrics") == (
        "a higher layer (storage storage -> libraries observe)"
    )
    assert (
        layering_problem("opd_cache.config", "opd_cache.losses")
        == "a higher layer (core opd_cache.config -> libraries losses)"
    )
    assert layering_problem("opd_cache.observe.metrics", "opd_cache.flow.staleness") is not None
    assert layering_problem("opd_cache", "opd_cache.train.trainer") == "a higher layer (core opd_cache -> stages train)"
    for allowed in [
        ("opd_cache.train.trainer", "opd_cache.train.stream"),  # its own package
        ("opd_cache.engine", "opd_cache.config"),  # core modules import each other
        ("opd_cache.losses.config", "opd_cache.config"),  # downwards
        ("opd_cache.cli.run", "opd_cache.launch.run"),
        ("opd_cache.export", "opd_cache.train.shard_data"),  # a PEER_IMPORTS exception
        ("opd_cache", "opd_cache.rollout.writer"),  # a ROOT_EXPORTS re-export
    ]:
        assert layering_problem(*allowed) is None, allowed


def test_imports_follow_the_layers():
    problems = [
        f"{where(module, line)} imports {imported}: {problem}"
        for module, edges in GRAPH.items()
        for imported, line in edges
        if (problem := layering_problem(module, imported))
    ]
    assert not problems, "imports against the layering (module docstring):\n" + "\n".join(problems)


def test_peer_imports_still_exist():
    """An allowed exception that is gone (the import was removed) leaves the list: it must not allow a new one."""
    stale = [f"{a} -> {b}" for a, b in PEER_IMPORTS if b not in {name for name, _ in GRAPH[a]}]
    assert not stale, f"PEER_IMPORTS lists imports that no longer exist: {stale}"


def test_modules_are_at_most_500_lines():
    sizes = {str(path.relative_to(REPO)): len(path.read_text().splitlines()) for path in MODULES.values()}
    too_long = [f"{name}: {lines} lines" for name, lines in sorted(sizes.items()) if lines > MAX_LINES]
    unexpected = [line for line in too_long if line.split(":")[0] not in OVERSIZED]
    assert not unexpected, f"modules over {MAX_LINES} lines (split along a concept):\n" + "\n".join(unexpected)
    done = sorted(name for name in OVERSIZED if sizes.get(name, 0) <= MAX_LINES)
    assert not done, f"{done} are split (or gone): remove them from OVERSIZED"


def test_only_storage_knows_whether_a_store_is_local():
    found = []
    for module, path in MODULES.items():
        if module.startswith("opd_cache.storage"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            name = node.attr if isinstance(node, ast.Attribute) else node.id if isinstance(node, ast.Name) else None
            if name == "is_local":
                found.append(f"{where(module, node.lineno)}")
    assert not found, (
        "`is_local` outside opd_cache/storage/: ask the store what you need (appends_in_place, local_dir(rel), "
        "atomic_create, on_this_machine, move_file, open_atomic_output, ...):\n" + "\n".join(found)
    )
