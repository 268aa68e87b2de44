"""The package's structure, drawn from its own imports (module level and inside functions alike): no
import cycle, and no module imports from a layer above its own."""
from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "flexgen"

# Layers, lowest first; a module belongs to the layer of its longest matching prefix.
LAYERS = {
    # settings and target facts that every layer reads; the cache package module imports nothing
    "flexgen": 0, "flexgen.cache": 0, "flexgen.cache.paths": 0, "flexgen.arch": 0, "flexgen.dropout": 0,
    "flexgen.warnings_once": 0,
    "flexgen.dsl": 1, "flexgen.blockmask": 1, "flexgen.blockmask_validate": 1, "flexgen.blockmask_cache": 1,
    "flexgen.codegen": 2,
    "flexgen.cache.errors": 3, "flexgen.cache.jit": 3, "flexgen.cache.kernel": 3, "flexgen.cache.lock": 3,
    "flexgen.cache.ninja": 3, "flexgen.cache.nvcc": 3, "flexgen.cache.nvrtc": 3, "flexgen.cache.nvrtc_child": 3,
    "flexgen.cache.ptxas": 3,
    "flexgen.cache.store": 3, "flexgen.cache.events": 3, "flexgen.cache.safefs": 3, "flexgen.cache.layout": 3,
    "flexgen.cache.maintenance": 3,
    "flexgen.runtime": 4,
    # the public API: flex_attention and its custom ops, emit / compile, `flexgen build`, the command line
    "flexgen.attention": 5, "flexgen.eager_plans": 5, "flexgen.ops": 5, "flexgen.variant": 5, "flexgen.captures": 5, "flexgen.compiled_mods": 5, "flexgen.make_block_mask": 5, "flexgen.blockmask_follow": 5, "flexgen.codegen.api": 5, "flexgen.torch_names": 5,
    "flexgen.cache.build": 5, "flexgen.cli": 5, "flexgen.__main__": 5,
    # adapters for other libraries, on top of the public API
    "flexgen.integrations": 6,
}


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([node.module] if node.module else []))
            targets = [base] + [f"{base}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        else:
            continue
        for target in targets:
            while target and target not in modules:
                target = target.rpartition(".")[0]
            # A package's own __init__ seen from inside it is not a dependency of the layering.
            if target.startswith("flexgen") and target != name and not name.startswith(target + "."):
                found.add(target)
    return found


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def _layer(module: str) -> int:
    prefix = max((p for p in LAYERS if module == p or module.startswith(p + ".")), key=len)
    return LAYERS[prefix]


def test_no_import_cycles():
    graph = _graph()
    finished: set[str] = set()

    def visit(module: str, path: list[str]) -> None:
        if module in path:
            raise AssertionError("import cycle: " + " -> ".join(path[path.index(module):] + [module]))
        if module not in finished:
            for target in sorted(graph[module]):
                visit(target, path + [module])
            finished.add(module)

    for module in sorted(graph):
        visit(module, [])


def test_no_import_from_a_higher_layer():
    upward = [f"{a} (layer {_layer(a)}) imports {b} (layer {_layer(b)})"
              for a, targets in sorted(_graph().items()) for b in sorted(targets) if _layer(b) > _layer(a)]
    assert not upward, "\n".join(upward)


def test_the_checks_see_the_imports():
    """The graph holds what the source says: function-level imports count too."""
    graph = _graph()
    assert "flexgen.runtime.forward" in graph["flexgen.ops"]
    assert "flexgen.cache.jit" in graph["flexgen.runtime.backward"]  # imported inside a function
    assert "flexgen.runtime.plan" in graph["flexgen.codegen.api"]
    assert _layer("flexgen.codegen.render") == 2 and _layer("flexgen.codegen.api") == 5
