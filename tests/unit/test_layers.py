"""The import contract of STYLE.md section 3: imports point down the layers, and nothing imports in a circle.

Every import is read from the source with ``ast``, function-level (lazy) ones included, so a lazy
import cannot hide an upward arrow or a cycle. The layers, bottom to top:

======  ==============================================================================
rank    modules
======  ==============================================================================
0       ``slimspec_convert.{version, dtypes, devices, atomic}``
1       ``slimspec_convert.lowrank``: the paper's math
2       ``slimspec_convert.targets``: the verifier model
3       ``slimspec_convert.model``: nn.Modules of the drafter
4       ``slimspec_convert.checkpoint``: drafter files
5       ``slimspec_convert.data``: conversation files -> token ids (training, calibration, counting)
6       ``slimspec_convert.decoding``: speculative decoding
7       ``slimspec_convert.measure``: timing and metrics
8       ``finetune.config``, 9 ``finetune.train``, 10 the rest of ``finetune``
11      ``slimspec_convert.workflows``: paths in, reports out
12      ``slimspec_convert.cli``; 13 ``slimspec_convert`` (the public API)
14      ``slimspec_convert.engines``: serving-engine plugins (vLLM), nothing imports them
======  ==============================================================================

A module may import its own subpackage's modules and anything of a lower rank, never a higher one.
An import that crosses from one top-level package into the other also runs that package's
``__init__`` (``slimspec_convert/__init__.py`` re-exports workflows), so for the cycle check it
counts as an import of that package too: that is what makes ``import finetune.run`` safe.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("slimspec_convert", "finetune")
LAYERS = (
    (
        "slimspec_convert.version",
        "slimspec_convert.dtypes",
        "slimspec_convert.devices",
        "slimspec_convert.atomic",
    ),
    ("slimspec_convert.lowrank",),
    ("slimspec_convert.targets",),
    ("slimspec_convert.model",),
    ("slimspec_convert.checkpoint",),
    ("slimspec_convert.data",),
    ("slimspec_convert.decoding",),
    ("slimspec_convert.measure",),
    ("finetune.config",),
    ("finetune.train",),
    ("finetune",),
    ("slimspec_convert.workflows",),
    ("slimspec_convert.cli",),
    ("slimspec_convert",),
    ("slimspec_convert.engines",),
)


def module_name(path: Path, root: Path = REPO) -> str:
    """``slimspec_convert/model/head.py`` -> ``slimspec_convert.model.head`` (``__init__`` -> the package)."""
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path, root: Path = REPO) -> set[str]:
    """Every package-internal module ``path`` imports, at any depth of its code (lazy imports included).

    ``from a.b import c`` counts as ``a.b.c`` when ``c`` is a module, else as ``a.b``; relative imports
    are resolved against the file's package.
    """
    name = module_name(path, root)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{base}.{node.module}" if node.module else base
            else:
                base = node.module or ""
            for a in node.names:
                sub = f"{base}.{a.name}"
                is_module = (root / Path(*sub.split("."))).with_suffix(".py").is_file() or (
                    root / Path(*sub.split(".")) / "__init__.py"
                ).is_file()
                found.add(sub if is_module else base)
    found = {m for m in found if m.split(".")[0] in PACKAGES and m != name}
    return found | {m.split(".")[0] for m in found if m.split(".")[0] != name.split(".")[0]}


def rank_of(module: str) -> tuple[int, str]:
    """(layer rank, the layer's prefix) of a module: the longest matching prefix in :data:`LAYERS`."""
    best = None
    for rank, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            if module == prefix or module.startswith(prefix + "."):
                if best is None or len(prefix) > len(best[1]):
                    best = (rank, prefix)
    if best is None:
        raise AssertionError(f"{module}: in no layer of tests/unit/test_layers.py; add it to LAYERS")
    return best


def import_graph(root: Path = REPO) -> dict[str, set[str]]:
    """module -> the package modules it imports, for every ``.py`` file of :data:`PACKAGES`."""
    return {
        module_name(p, root): imports_of(p, root)
        for pkg in PACKAGES
        for p in sorted((root / pkg).rglob("*.py"))
    }


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """``"a imports b (layer x above layer y)"`` for every import of a higher layer."""
    bad = []
    for mod, deps in sorted(graph.items()):
        rank, prefix = rank_of(mod)
        for dep in sorted(deps):
            if dep in PACKAGES and dep.split(".")[0] != mod.split(".")[0]:
                continue  # the other package's __init__, run by a cross-package import (cycle check only)
            dep_rank, dep_prefix = rank_of(dep)
            if dep_rank > rank:
                bad.append(
                    f"{mod} imports {dep} ({dep_prefix}, layer {dep_rank}, is above {prefix}, layer {rank})"
                )
    return bad


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as ``[a, b, ..., a]``, or None (depth-first search)."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for dep in sorted(graph.get(m, ())):
            if state.get(dep) == 1:
                return stack[stack.index(dep) :] + [dep]
            if dep not in state and (cycle := visit(dep)):
                return cycle
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (cycle := visit(m)):
            return cycle
    return None


def test_no_upward_import():
    assert upward_imports(import_graph()) == []


def test_no_import_cycle():
    assert find_cycle(import_graph()) is None


def test_finetune_never_imports_the_cli_or_workflows():
    graph = import_graph()
    bad = [
        f"{m} imports {d}"
        for m, deps in graph.items()
        if m.split(".")[0] == "finetune"
        for d in deps
        if d.startswith(("slimspec_convert.cli", "slimspec_convert.workflows"))
    ]
    assert bad == []


def test_house_rules_at_most_four_loose_modules_none_over_550_lines():
    loose = sorted(p.name for p in (REPO / "slimspec_convert").glob("*.py") if p.name != "__init__.py")
    assert len(loose) <= 4, loose
    long = [
        f"{p.relative_to(REPO)}: {n} lines"
        for pkg in PACKAGES
        for p in (REPO / pkg).rglob("*.py")
        if (n := len(p.read_text().splitlines())) > 550
    ]
    assert long == []


def _scratch_package(tmp_path: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        p = tmp_path / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    return tmp_path


def test_checker_names_an_upward_lazy_import(tmp_path):
    """A lazy import from the math layer up to the CLI is caught and named (the checker can fail)."""
    root = _scratch_package(
        tmp_path,
        {
            "slimspec_convert/__init__.py": "",
            "slimspec_convert/lowrank/__init__.py": "",
            "slimspec_convert/lowrank/svd.py": "def f():\n    from slimspec_convert.cli import app\n",
            "slimspec_convert/cli/__init__.py": "app = 1\n",
            "finetune/__init__.py": "",
        },
    )
    assert upward_imports(import_graph(root)) == [
        "slimspec_convert.lowrank.svd imports slimspec_convert.cli (slimspec_convert.cli, layer 12, "
        "is above slimspec_convert.lowrank, layer 1)"
    ]


def test_checker_finds_a_cycle_through_relative_imports(tmp_path):
    root = _scratch_package(
        tmp_path,
        {
            "slimspec_convert/__init__.py": "",
            "slimspec_convert/lowrank/__init__.py": "",
            "slimspec_convert/lowrank/a.py": "from .b import x\n",
            "slimspec_convert/lowrank/b.py": "def x():\n    from . import a\n",
            "finetune/__init__.py": "",
        },
    )
    assert find_cycle(import_graph(root)) == [
        "slimspec_convert.lowrank.a",
        "slimspec_convert.lowrank.b",
        "slimspec_convert.lowrank.a",
    ]


def test_checker_finds_the_cycle_through_a_package_init(tmp_path):
    """finetune -> slimspec_convert.model (runs slimspec_convert/__init__) -> workflows -> finetune."""
    root = _scratch_package(
        tmp_path,
        {
            "slimspec_convert/__init__.py": "from slimspec_convert.workflows.convert import convert\n",
            "slimspec_convert/model/__init__.py": "",
            "slimspec_convert/model/head.py": "",
            "slimspec_convert/workflows/__init__.py": "",
            "slimspec_convert/workflows/convert.py": "from finetune.run import finetune\n",
            "finetune/__init__.py": "",
            "finetune/run.py": "from slimspec_convert.model.head import x\n",
        },
    )
    cycle = find_cycle(import_graph(root))
    assert cycle is not None and "finetune.run" in cycle and "slimspec_convert" in cycle


def test_only_the_engine_room_imports_an_engine():
    """STYLE.md section 2: vLLM is imported only under slimspec_convert/engines/ (the plugin's room)."""
    bad = []
    for pkg in PACKAGES:
        for p in sorted((REPO / pkg).rglob("*.py")):
            if p.is_relative_to(REPO / "slimspec_convert" / "engines"):
                continue
            for node in ast.walk(ast.parse(p.read_text(), str(p))):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
                if isinstance(node, ast.ImportFrom) and not node.level:
                    names = [node.module or ""]
                bad += [f"{p.relative_to(REPO)} imports {n}" for n in names if n.split(".")[0] == "vllm"]
    assert bad == []
