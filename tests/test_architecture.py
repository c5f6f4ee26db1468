"""The house rules of docs/architecture.md that code can check (issue 42): every registry reaches the CLI, imports
point one way with no cycle, ``opsched --help`` stays light, and no function or module outgrows a reader."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import REPO
from opsched.baselines import METHODS
from opsched.cli import build_parser
from opsched.cost.cluster import PRESETS
from opsched.export.gantt import GANTT_FORMATS
from opsched.export.runtimes import ANY, RUNTIMES
from opsched.schedule.placement import PLACEMENTS

PACKAGE = REPO / "opsched"

#: the layers, lowest first; a module may import its own layer and those listed as below it
BELOW = {
    "model": {"errors", "units", "fileio", "model"},
    "cost": {"errors", "units", "fileio", "model", "cost"},
    "schedule": {"errors", "units", "cost", "schedule"},
    "baselines": {"errors", "units", "cost", "schedule", "baselines"},
    "lower": {"errors", "units", "cost", "schedule", "solving", "lower", "fileio"},
    "upper": {"errors", "units", "cost", "schedule", "solving", "model", "upper"},
}


def _module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> list[tuple[str, bool]]:
    """(imported opsched module, at the module's top level) for every import in ``path``, in functions too."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    top = {id(n) for n in tree.body}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("opsched"):
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            found += [(n, id(node) in top) for n in names]
        elif isinstance(node, ast.Import):
            found += [(a.name, id(node) in top) for a in node.names if a.name.startswith("opsched")]
    return found


MODULES = {_module_name(p): p for p in PACKAGE.rglob("*.py")}


def _resolved(name: str) -> str | None:
    """The module an import names (``opsched.schedule.Job`` is ``opsched.schedule``), or None."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _layer(module: str) -> str:
    return module.split(".")[1] if module.count(".") else ""


@pytest.mark.parametrize("layer", sorted(BELOW))
def test_a_layer_imports_nothing_above_it(layer):
    wrong = []
    for name, path in MODULES.items():
        if _layer(name) != layer:
            continue
        for imported, _ in _imports(path):
            target = _resolved(imported)
            if target and target != "opsched" and _layer(target) not in BELOW[layer]:
                wrong.append(f"{name} imports {target}")
    assert not wrong, wrong


def test_no_import_cycles():
    import networkx as nx

    graph = nx.DiGraph()
    for name, path in MODULES.items():
        for imported, at_top in _imports(path):
            target = _resolved(imported)
            # a package's __init__ re-exporting its own modules is no cycle; an import inside a function is
            # a cycle only if made at import time, which a top-level import is
            if target and target != name and at_top and not name.startswith(target + "."):
                graph.add_edge(name, target)
    cycles = list(nx.simple_cycles(graph))
    assert not cycles, cycles[:5]


def _choices(command: str, flag: str) -> tuple:
    parser = build_parser(only=command)
    sub = next(a for a in parser._actions if a.dest == "command").choices[command]
    return next(a for a in sub._actions if flag in a.option_strings)


def test_every_registry_reaches_the_cli():
    assert tuple(_choices("plan", "--runtime").choices) == (ANY, *RUNTIMES)
    assert set(PLACEMENTS) <= set(_choices("compare", "--placement").choices)
    assert all(name in _choices("compare", "--placement").help for name in PLACEMENTS)
    # mip re-places a chain by the rule of a baseline so placed: every placement needs one
    assert {METHODS[m].PLACEMENT for m in METHODS} >= set(PLACEMENTS)
    gantt_help = _choices("gantt", "--output").help
    assert all(suffix in gantt_help for fmt in GANTT_FORMATS for suffix in fmt.suffixes)
    preset = _choices("plan", "--preset")
    assert all(name in (preset.choices or ()) or name in preset.help for name in PRESETS), preset.help
    from opsched.cost.cluster import ZERO_LEVELS

    zero = _choices("plan", "--zero")
    assert tuple(zero.choices) == tuple(ZERO_LEVELS) and all(what in " ".join(zero.help.split())
                                                             for what in ZERO_LEVELS.values())
    assert all(runtime.export_flags in _choices("plan", "--runtime").help for runtime in RUNTIMES.values())
    assert "Only with any" in _choices("plan", "--runtime").help or any(r.overlaps_pairs for r in RUNTIMES.values())
    from opsched.commands.compare import method_names

    class Args:
        methods = ",".join(METHODS)

    assert [m for m in method_names(Args) if m != "mip"] == list(METHODS)
    export = build_parser(only="export")
    export_help = next(a for a in export._actions if a.dest == "command").choices["export"].format_help()
    no_torch_schedule = [name for name, module in METHODS.items() if module.TORCH_SCHEDULE is None]
    assert f"({', '.join(['mip', *no_torch_schedule])})" in export_help, "export --help lists them from METHODS"


def test_the_plan_schema_names_what_the_registries_hold():
    """plan.json's schema lists the runtimes, passes and training modes by name: a runtime added to RUNTIMES (or a
    mode to its tuple) must reach docs/plan.schema.json too, or the plans that name it fail their validation."""
    import json

    from opsched.cost.cluster import ATTENTION_MODES, OPTIMIZER_STATE_BYTES, RECOMPUTE_MODES, ZERO_LEVELS
    from opsched.model.recompute_modules import RECOMPUTE_MODULES
    from opsched.schedule.actions import PASSES

    schema = json.loads((REPO / "docs" / "plan.schema.json").read_text())
    props = schema["properties"]
    assert set(props["runtimes"]["items"]["enum"]) == set(RUNTIMES)
    assert set(props["runtimes_refused"]["propertyNames"]["enum"]) == set(RUNTIMES)
    assert set(props["recompute"]["enum"]) == set(RECOMPUTE_MODES)
    assert set(props["recompute_modules"]["items"]["enum"]) == set(RECOMPUTE_MODULES)
    assert set(props["attention"]["enum"]) == set(ATTENTION_MODES)
    assert set(props["optimizer_state"]["enum"]) == set(OPTIMIZER_STATE_BYTES)
    assert set(props["zero"]["enum"]) == set(ZERO_LEVELS)
    passes = [d["enum"] for d in _schema_nodes(schema) if isinstance(d, dict) and "F" in d.get("enum", ())]
    assert passes and all(set(e) == set(PASSES) for e in passes)


def _schema_nodes(node):
    """Every dict and list inside a JSON schema, depth first."""
    yield node
    children = node.values() if isinstance(node, dict) else node if isinstance(node, list) else ()
    for child in children:
        yield from _schema_nodes(child)


def test_help_imports_neither_the_solver_nor_torch():
    code = ("import sys, contextlib, io\nfrom opsched.cli import main\n"
            "with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):\n    main(['--help'])\n"
            "print(sorted(m for m in ('mip', 'torch', 'networkx', 'onnx') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]", done.stdout


def test_functions_and_modules_stay_readable():
    long_functions, long_modules = [], []
    for name, path in MODULES.items():
        text = path.read_text(encoding="utf-8")
        if text.count("\n") > 700:
            long_modules.append(f"{name}: {text.count(chr(10))} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= 80:
                long_functions.append(f"{name}.{node.name}: {node.end_lineno - node.lineno + 1} lines")
    assert not long_modules, long_modules
    assert not long_functions, long_functions
    commands = sum(p.read_text(encoding="utf-8").count("\n") for p in (PACKAGE / "commands").glob("*.py"))
    assert commands < 1500, commands


def test_the_context_parallel_refusal_names_the_runtimes_that_run_it():
    """export/plan_layout.py cannot import the runtime registry (the registry imports its checks), so its list of
    the exports that run context parallelism is checked against the registry here."""
    from opsched.export.plan_layout import _CONTEXT_PARALLEL_EXPORTS
    from opsched.export.runtimes import RUNTIMES

    runtimes = RUNTIMES.values() if isinstance(RUNTIMES, dict) else RUNTIMES
    assert _CONTEXT_PARALLEL_EXPORTS == {r.name: r.export_flags for r in runtimes if r.context_parallel}
