"""The import graph of `minite/`: no cycles, and every import stays in its layer or goes down.

Every `.py` file under minite/ is parsed with `ast` (nothing is imported); each import counts, at
module level, inside a function (a lazy import is still a dependency) or under `TYPE_CHECKING` (a
type is one too). `from a import b` imports module `a.b` where that is a module and `a` otherwise;
relative imports are resolved against the importing module's package. Running a package's
`__init__` before its submodule is not counted as an edge: a package that re-exports its
submodules would otherwise form a cycle with each of them.

The layers, lowest first (`LAYERS`); a module may import its own layer and the ones below:

- root:        `minite/__init__.py` (the version), `devices` (the compute device check), `files`
               (atomic writes, write errors naming the path) and `distributed` (the process group
               of a run across processes); they import only torch and the standard library;
- format:      the NVFP4 container, its decode and argument checks (`nvfp4_format`), and the RHT that
               its `dequantize` undoes (`ref/hadamard.py`, a leaf that ref and kernels use too);
- ref:         the numerics contract in plain PyTorch;
- kernels:     Triton kernels, tested against ref;
- api:         the public `minite.nvfp4` (dispatches to ref or kernels), `minite.recipe` and the
               execution value it carries (`minite.execution`);
- nn:          autograd Functions and modules;
- models:      Qwen3 built from nn, checkpoints, presets;
- contracts:   what the engines agree on: `sampling` (the distribution tokens are drawn from, which
               the learner recomputes) and `loss_batch` (what the learner hands an RL loss);
- engines:     sampler and learner, which never import each other (`INDEPENDENT`);
- rl, diagnostics: the RL algorithm and the measurements, which use each other;
- config:      the run config, made of the model, recipe and rl configs;
- runs:        `rl/trainer.py`, the loop a resolved config drives (hence above config, unlike the
               rest of rl), and `experiment` (several training runs side by side);
- commands, cli.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "minite"
ROOT = "minite"

# (name, modules): a module named here and every module below it, except that the root names itself only
LAYERS = (
    ("root", ("minite", "minite.devices", "minite.distributed", "minite.files")),
    ("format", ("minite.nvfp4_format", "minite.ref.hadamard")),
    ("ref", ("minite.ref",)),
    ("kernels", ("minite.kernels",)),
    ("api", ("minite.nvfp4", "minite.recipe", "minite.execution")),
    ("nn", ("minite.nn",)),
    ("models", ("minite.models",)),
    ("contracts", ("minite.sampling", "minite.loss_batch")),
    ("engines", ("minite.sampler", "minite.learner")),
    ("rl, diagnostics", ("minite.rl", "minite.diagnostics")),
    ("config", ("minite.config",)),
    ("runs", ("minite.rl.trainer", "minite.experiment")),
    ("commands", ("minite.commands",)),
    ("cli", ("minite.cli",)),
)

# pairs in one layer that import neither each other nor each other's modules
INDEPENDENT = (("minite.sampler", "minite.learner"),)

# cycles still to be cut: {frozenset of modules: why it is there}; remove the entry when the cycle is gone
KNOWN_CYCLES: dict[frozenset, str] = {}


def module_files(package: Path = PACKAGE) -> dict[str, tuple[Path, bool]]:
    """{dotted module name: (file, is a package's __init__)} for every .py file of the package."""
    out = {}
    for path in sorted(package.rglob("*.py")):
        parts = list(path.relative_to(package.parent).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        out[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
    return out


def imported_names(source: str, module: str, is_package: bool) -> set[str]:
    """Dotted names the source imports, anywhere in it, relative ones made absolute; `from a import b`
    gives `a.b`, which `owner` maps to module `a.b` or, where `b` is a name in `a`, to `a`."""
    package = module if is_package else module.rpartition(".")[0]
    names = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            names.update(base if alias.name == "*" else f"{base}.{alias.name}" for alias in node.names)
    return names


def owner(name: str, modules) -> str | None:
    """The module that importing `name` reads: `name` itself, or its longest prefix that is a module
    (`minite.kernels.lazy` -> `minite.kernels`); None outside the package."""
    while name:
        if name in modules:
            return name
        name = name.rpartition(".")[0]
    return None


def import_graph(package: Path = PACKAGE) -> dict[str, set[str]]:
    """{module: the other modules of the package it imports}."""
    files = module_files(package)
    graph = {}
    for module, (path, is_package) in files.items():
        names = imported_names(path.read_text(), module, is_package)
        targets = {owner(n, files) for n in names}
        graph[module] = {t for t in targets if t is not None and t != module}
    return graph


def covers(entry: str, module: str) -> bool:
    return module == entry or (entry != ROOT and module.startswith(entry + "."))


def layer_of(module: str) -> int | None:
    """Index in LAYERS of the layer whose most specific entry covers `module`."""
    best = None
    for i, (_, entries) in enumerate(LAYERS):
        for entry in entries:
            if covers(entry, module) and (best is None or len(entry) > len(best[1])):
                best = (i, entry)
    return None if best is None else best[0]


def strongly_connected(graph: dict[str, set[str]]) -> list[set[str]]:
    """Tarjan's strongly connected components with more than one module (import cycles)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(component)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_imports_are_read_from_functions_and_relative_forms():
    source = ("import minite.kernels.nvfp4 as k\nfrom . import sibling\nfrom ..ref import gemm\n"
              "def f():\n    from minite.nvfp4 import quantize\n")
    names = imported_names(source, "minite.nn.linear", is_package=False)
    assert {"minite.kernels.nvfp4", "minite.nn.sibling", "minite.ref.gemm", "minite.nvfp4.quantize"} <= names
    assert imported_names("from .sibling import x", "minite.nn", is_package=True) == {"minite.nn.sibling.x"}
    modules = {"minite.nvfp4", "minite.ref.gemm"}
    assert owner("minite.nvfp4.quantize", modules) == "minite.nvfp4"
    assert owner("minite.ref.gemm", modules) == "minite.ref.gemm"
    assert owner("torch.nn", modules) is None


def test_every_module_has_a_layer_and_every_entry_a_module():
    modules = module_files()
    unplaced = sorted(m for m in modules if layer_of(m) is None)
    assert not unplaced, f"add these modules to a layer in LAYERS: {unplaced}"
    entries = [e for _, group in LAYERS for e in group]
    stale = sorted(e for e in entries if not any(covers(e, m) for m in modules))
    assert not stale, f"LAYERS names modules that do not exist: {stale}"
    pairs = [p for pair in INDEPENDENT for p in pair]
    assert all(any(covers(p, m) for m in modules) for p in pairs), INDEPENDENT


def test_no_import_cycles():
    cycles = [c for c in strongly_connected(import_graph()) if frozenset(c) not in KNOWN_CYCLES]
    assert not cycles, "import cycles: " + "; ".join(" <-> ".join(sorted(c)) for c in cycles)


def test_known_cycles_are_still_there():
    current = {frozenset(c) for c in strongly_connected(import_graph())}
    gone = [sorted(c) for c in KNOWN_CYCLES if c not in current]
    assert not gone, f"these cycles are gone (or changed): update KNOWN_CYCLES: {gone}"


def test_imports_go_down_the_layers():
    names = [name for name, _ in LAYERS]
    upward = []
    for module, targets in sorted(import_graph().items()):
        for target in sorted(targets):
            low, high = layer_of(module), layer_of(target)
            # an unplaced module fails test_every_module_has_a_layer_and_every_entry_a_module
            if low is not None and high is not None and high > low:
                upward.append(f"{module} ({names[low]}) imports {target} ({names[high]})")
    assert not upward, "imports from a higher layer:\n" + "\n".join(upward)


def test_independent_packages_do_not_import_each_other():
    crossing = []
    for module, targets in sorted(import_graph().items()):
        for a, b in INDEPENDENT:
            for src, dst in ((a, b), (b, a)):
                if covers(src, module):
                    crossing += [f"{module} imports {t}" for t in sorted(targets) if covers(dst, t)]
    assert not crossing, "\n".join(crossing)
