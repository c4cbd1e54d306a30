"""The package's folders follow the data: imports point down the layers, never up, never sideways.

Read from the tree: cli -> doctor -> watch -> jobs (prepare, send, record, target) -> node -> preflight / train -> checkpoint / slurm -> plan -> spec -> base.
Every import inside swiftslurm (top-level and inside functions) is checked, so a lazy import cannot
sneak a cycle back in.
"""

from __future__ import annotations

import ast
from pathlib import Path

import swiftslurm

PKG = Path(swiftslurm.__file__).parent

# unit -> layer; a unit may import its own modules and units of a strictly lower layer.
LAYERS = {
    "__init__": 0, "errors": 0, "fsutil": 0, "taskdir": 0, "quoting": 0, "resources": 0, "tasks": 0,
    "dsconfig": 1, "sizing": 1, "records": 1,
    "spec": 2,
    "plan": 3,
    "slurm": 4, "checkpoint": 4, "ledger": 4,
    "preflight": 5, "train": 5,
    "node": 6,
    "jobs": 7,
    "export": 8,
    "watch": 9,
    "doctor": 10,
    "cli": 11,
    "__main__": 12,
}


def unit_of(module: str) -> str:
    parts = module.split(".")
    assert parts[0] == "swiftslurm", module
    return parts[1] if len(parts) > 1 else "__init__"


def module_name(path: Path) -> str:
    rel = path.relative_to(PKG.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__" and len(parts) > 1:
        parts = parts[:-1]
    return ".".join(parts)


def imports_of(path: Path) -> list[tuple[int, str]]:
    mod = module_name(path)
    package = mod if path.name == "__init__.py" else mod.rsplit(".", 1)[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if not target.startswith("swiftslurm"):
                continue
            if node.module is None or target in ("swiftslurm",):
                out += [(node.lineno, f"{target}.{a.name}") for a in node.names]
            else:
                out.append((node.lineno, target))
        elif isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names if a.name.startswith("swiftslurm")]
    return out


def test_every_unit_has_a_layer_and_every_folder_says_its_role():
    for path in PKG.iterdir():
        if path.name.startswith((".", "_")) and path.name not in ("__init__.py", "__main__.py"):
            continue
        if path.is_dir() and (path / "__init__.py").exists():
            assert path.name in LAYERS, f"folder {path.name}/ has no layer in tests/test_layout.py"
            doc = ast.get_docstring(ast.parse((path / "__init__.py").read_text()))
            assert doc and len(doc.splitlines()[0]) > 20, f"{path.name}/__init__.py needs a docstring saying its role"
        elif path.suffix == ".py":
            assert path.stem in LAYERS, f"top-level module {path.name} has no layer in tests/test_layout.py"


def test_top_level_stays_small():
    modules = [p.name for p in PKG.glob("*.py") if p.name not in ("__init__.py", "__main__.py")]
    assert len(modules) <= 8, f"{len(modules)} top-level modules: {sorted(modules)}; move some into a folder"


def test_imports_point_down_the_layers():
    wrong = []
    for path in sorted(PKG.rglob("*.py")):
        src = unit_of(module_name(path))
        for line, target in imports_of(path):
            dst = unit_of(target)
            if dst == src or (dst == "__init__" and target in ("swiftslurm", "swiftslurm.__version__")):
                continue
            if dst not in LAYERS:  # "from swiftslurm import slurm": the unit is the name imported
                continue
            if LAYERS[dst] >= LAYERS[src]:
                wrong.append(f"{path.relative_to(PKG.parent)}:{line} ({src}, layer {LAYERS[src]}) imports {target} "
                             f"({dst}, layer {LAYERS[dst]})")
    assert not wrong, "imports that point up or sideways:\n" + "\n".join(wrong)


def test_no_cycles_inside_a_folder():
    """Within one folder, module imports form a DAG (checkpoint/commit and verify once imported each other)."""
    for folder in [p for p in PKG.iterdir() if p.is_dir() and (p / "__init__.py").exists()]:
        graph: dict[str, set[str]] = {}
        for path in folder.glob("*.py"):
            if path.name == "__init__.py":
                continue
            mod = module_name(path)
            graph[mod] = {t for _, t in imports_of(path) if t.startswith(module_name(folder) + ".") and t != mod}
        seen: dict[str, int] = {}

        def visit(node: str, stack: list[str], seen: dict[str, int] = seen, graph: dict[str, set[str]] = graph) -> None:
            if seen.get(node) == 1:
                raise AssertionError("import cycle: " + " -> ".join(stack[stack.index(node):] + [node]))
            if seen.get(node) == 2:
                return
            seen[node] = 1
            for nxt in graph.get(node, ()):
                visit(nxt, stack + [node])
            seen[node] = 2

        for mod in graph:
            visit(mod, [])


def _module_graph() -> dict[str, set[str]]:
    """Every module of the package -> the modules it imports (top-level and inside functions)."""
    raw = {module_name(path): {t for _, t in imports_of(path)} for path in PKG.rglob("*.py")}

    def resolve(target: str) -> str:  # "swiftslurm.fsutil.read_json" -> "swiftslurm.fsutil"
        while target and target not in raw:
            target = target.rsplit(".", 1)[0] if "." in target else ""
        return target

    return {mod: {resolve(t) for t in targets if resolve(t) not in ("", mod)} for mod, targets in raw.items()}


def test_no_import_cycles_anywhere():
    """No two modules import each other, however far apart and however lazily (tasks/pt and tasks/sft once did)."""
    graph = _module_graph()
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                raise AssertionError("import cycle: " + " -> ".join(path[path.index(nxt):] + [nxt]))
            if nxt not in state:
                visit(nxt)
        path.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)


# the modules that write a run's records while it trains, and what only reads them afterwards
WRITERS = ("swiftslurm.train.run", "swiftslurm.train.tasks", "swiftslurm.train.trainer", "swiftslurm.jobs.send", "swiftslurm.node")
READERS = ("swiftslurm.watch", "swiftslurm.doctor", "swiftslurm.jobs.record", "swiftslurm.jobs.target")
TRAINER = WRITERS[:3]  # the login-side commands (cli) read a run's summary through train/result.py, never these


def test_readers_do_not_import_the_modules_that_write():
    """The record names and formats readers need live in taskdir and the record modules (train/result.py), not in
    the trainer or the submitter: a reader never imports a writer."""
    wrong = [f"{mod} imports {t}" for mod, targets in _module_graph().items() for t in targets
             if (mod.startswith(READERS) and t.startswith(WRITERS)) or (mod.startswith("swiftslurm.cli") and t.startswith(TRAINER))]
    assert not wrong, "\n".join(wrong)


def test_the_two_task_registries_name_the_same_tasks_and_the_spec_takes_exactly_those():
    """A task is a row in spec/tasks.py (what the spec, rules, sizing and validate's scan read) and a row in
    train/tasks/__init__.py (the class that trains); the spec's `task` takes the names of the first, and each row's
    data module has the scan validate calls."""
    import importlib
    import typing

    from swiftslurm import tasks as spec_tasks
    from swiftslurm.spec.model import TrainTable
    from swiftslurm.train.tasks import TASKS, task_for

    assert list(spec_tasks.TASKS) == list(TASKS)
    assert typing.get_args(TrainTable.model_fields["task"].annotation) == tuple(TASKS)
    for name, row in spec_tasks.TASKS.items():
        assert task_for(name).name == name == row.name
        assert callable(importlib.import_module(f"swiftslurm.train.data.{row.data}").count_records), row
