"""Imports run one way: each module imports only from its own layer or the layers below it, and no
modules import each other in a circle.

Every import counts, also one inside a function or under TYPE_CHECKING (a lazy import is still a
dependency).
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Top to bottom. A module may import its own layer and any layer below it, never one above.
LAYERS: list[tuple[str, ...]] = [
    ("batchllm", "batchllm.cli"),  # the package's lazy exports and the command line
    ("batchllm.job", "batchllm.resume", "batchllm.plan_report", "batchllm.collector",
     "batchllm.error_log"),  # run, plan; the error log of an unexpected failure
    ("batchllm.scale",),  # many workers: Ray
    ("batchllm.llm", "batchllm.progress"),  # the Python API; the progress line of a run
    ("batchllm.engine",),  # runtime, step loop, scheduler, pages, sampler
    ("batchllm.model",),  # weights and the forward pass
    ("batchllm_kernels",),  # Triton, C and torch kernels (the kernels/ folder)
    ("batchllm.plan",),  # prefix tree, planner, shards (numpy only)
    ("batchllm.rows",),  # rows in and out (pyarrow)
    ("batchllm.config", "batchllm.sampling_params", "batchllm.constraints"),  # the job file;
    # sampling settings; structured output's grammars
    ("batchllm_kernels.atomic_write",),  # the one write-then-rename helper: imports nothing
]


def layer_of(module: str) -> int | None:
    """The layer of a module of ours (the longest matching prefix), else None."""
    best, depth = None, -1
    for i, names in enumerate(LAYERS):
        for name in names:
            if (module == name or module.startswith(name + ".")) and len(name) > depth:
                best, depth = i, len(name)
    return best


def module_name(path: Path) -> str:
    """The import name of a file of ours: the kernels/ folder is the package batchllm_kernels
    (pyproject.toml's package-dir)."""
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    if parts[0] == "kernels":
        parts[0] = "batchllm_kernels"
    return ".".join(parts)


def import_statements(path: Path) -> list[tuple[str, list[str]]]:
    """Every import in `path`, anywhere in the file, as (absolute module, names): `import a.b` is
    ("a.b", []), `from .x import y, z` is ("pkg.x", ["y", "z"])."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.extend((a.name, []) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            found.append((base, [a.name for a in node.names]))
    return found


def imports_of(path: Path) -> set[str]:
    """Every module `path` imports: each statement's module, and for `from pkg import x` also
    pkg.x (which may be a module)."""
    return {target for base, names in import_statements(path)
            for target in (base, *(f"{base}.{x}" for x in names))}


def sources() -> list[Path]:
    return sorted(p for d in ("batchllm", "kernels") for p in (ROOT / d).rglob("*.py"))


def import_graph() -> dict[str, set[str]]:
    """Module -> the modules of ours it imports, anywhere in the file. `from pkg import x` is an
    arrow to pkg.x when that is a module, else to pkg (its __init__)."""
    ours = {module_name(p): p for p in sources()}
    graph = {}
    for name, path in ours.items():
        targets = set()
        for base, names in import_statements(path):
            targets.update([f"{base}.{x}" if f"{base}.{x}" in ours else base for x in names]
                           or [base])
        graph[name] = {t for t in targets if t in ours and t != name}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def test_every_module_has_a_layer():
    assert [module_name(p) for p in sources() if layer_of(module_name(p)) is None] == []


def test_no_module_imports_a_layer_above_it():
    upward = []
    for path in sources():
        mine = layer_of(module_name(path))
        for target in imports_of(path):
            theirs = layer_of(target)
            if theirs is not None and theirs < mine and target != "batchllm":
                upward.append(f"{module_name(path)} imports {target}")
    assert upward == []


def test_nothing_imports_the_job_module():
    users = sorted(module_name(p) for p in sources()
                   if "batchllm.job" in imports_of(p) and module_name(p) not in LAYERS[0])
    assert users == []


def test_plan_and_rows_import_without_torch_or_transformers():
    low = ("batchllm.plan", "batchllm.rows", "batchllm.config")
    modules = [m for m in map(module_name, sources())
               if any(m == name or m.startswith(name + ".") for name in low)]
    code = ("import sys\n" + "".join(f"import {m}\n" for m in modules)
            + "print(sorted(m for m in ('torch', 'transformers', 'ray') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                         check=True)
    assert out.stdout.strip() == "[]"


def test_nothing_names_the_kernels_folder_as_a_module():
    """Our kernels import as batchllm_kernels; `kernels` is Hugging Face's package. (A branch
    written before the rename: the rename commit's message holds the script that rewrites it.)"""
    files = [p for d in ("batchllm", "kernels", "tests", "scripts")
             for p in (ROOT / d).rglob("*.py")]
    found = [f"{p.relative_to(ROOT)}: {base}" for p in files for base, _ in import_statements(p)
             if base == "kernels" or base.startswith("kernels.")]
    found += [f"{p.relative_to(ROOT)}: {m.group()}" for p in files
              for m in re.finditer(r"[\"']kernels\.\w+", p.read_text())]
    assert found == []


def test_no_modules_import_each_other_in_a_circle():
    assert circles(import_graph()) == []


def test_the_circle_finder_finds_a_lazy_circle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert circles(graph) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []
