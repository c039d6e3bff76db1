"""Dependencies point downwards (ARCHITECTURE.md, "Layers"): no module imports one in a layer above its own,
at the top of the file or inside a function (a lazy import hides the same upward dependency).

The layers below are ARCHITECTURE.md's table in dependency order, lowest first (a module may import its own
layer and the ones before it). Lazy imports of lower layers stay allowed: they defer heavy dependencies
(numba, triton) or keep the command line quick to start.
"""

from __future__ import annotations

import ast
import pathlib

import zfunc

ROOT = pathlib.Path(zfunc.__file__).parent

LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("version and trace-time context", ("_version", "compiled")),
    ("pytrees", ("tree",)),
    ("functional model: values and checks", ("materialize", "params_check", "data_access", "reparametrize")),
    # The interpreter, in the order a call flows down through it: the stack and the call (interpret) ->
    # a primitive through the stack's handlers (primitives) -> the call's context (step_context) -> what
    # the stack declares (facts), what a state is and what a step reports at its next use.
    ("the interpreter: facts, states and donation", ("facts", "state_check", "donation")),
    ("the interpreter: the step context", ("step_context",)),
    ("the interpreter: primitives and dispatch", ("primitives",)),
    ("the interpreter: transforms and stacks", ("interpret",)),
    ("autodiff", ("autodiff", "recompute_eager", "recompute")),
    ("functional model: the call", ("model_structure", "model_call", "blocks", "functional")),
    ("kernels, tiers and collectives", ("kernels", "tiers", "dist", "mesh")),
    ("state and optimizers", ("optim", "state")),
    # The parts of a transform that import no transform (a call flows from the transform down into them).
    ("a transform's parts: mixed precision's policy", ("transforms.mixed_precision_policy",)),
    ("a transform's parts", ("transforms.loss_scale", "transforms.mixed_precision_cast")),
    ("transforms", ("transforms",)),
    ("planner", ("plan_activations", "plan")),
    ("checkpoints and migration", ("io", "deepspeed", "launch")),
    ("entry points", ("compile_step", "cli", "__main__", "testing", "__init__")),
    # Built on the public API (``import zfunc as zf``) like a user's code; optional dependencies.
    ("trainer integrations", ("hf", "lightning")),
]


def _layer(module: str) -> int:
    """The layer index of ``module`` ("zfunc.transforms.shard" -> the transforms' layer): the layer naming
    the longest leading part of its name ("transforms.loss_scale" before "transforms")."""
    parts = module.split(".")[1:] or ["__init__"]
    if parts[-1] == "__main__":  # (``python -m zfunc.io``: an entry point wherever it lives)
        parts = ["__main__"]
    for depth in range(len(parts), 0, -1):
        prefix = ".".join(parts[:depth])
        for index, (_, names) in enumerate(LAYERS):
            if prefix in names:
                return index
    raise AssertionError(f"{module} is in no layer: add it to LAYERS (and to ARCHITECTURE.md's table)")


def _modules() -> dict[str, pathlib.Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__" and len(parts) > 1:
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _imports(path: pathlib.Path, modules: dict) -> list[tuple[int, str, bool]]:
    """``(line, imported module, lazy)`` for each zfunc import of the file (TYPE_CHECKING blocks left out)."""
    tree = ast.parse(path.read_text())
    typing_only = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
                   and "TYPE_CHECKING" in ast.unparse(node.test) for n in ast.walk(node)}
    top = {id(node) for node in tree.body}
    found = []
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "zfunc" \
                and not node.level:
            names = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module
                     for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names if a.name.split(".")[0] == "zfunc"]
        else:
            continue
        found += [(node.lineno, name, id(node) not in top) for name in dict.fromkeys(names)]
    return found


def test_no_module_imports_a_layer_above_its_own():
    modules = _modules()
    upward = []
    for module, path in sorted(modules.items()):
        mine = _layer(module)
        for line, imported, lazy in _imports(path, modules):
            if _layer(imported) > mine:
                upward.append(f"{path.relative_to(ROOT.parent)}:{line} ({LAYERS[mine][0]}) imports {imported} "
                              f"({LAYERS[_layer(imported)][0]}){' lazily' if lazy else ''}")
    assert not upward, "imports of a layer above:\n" + "\n".join(upward)


def test_the_check_sees_lazy_and_upward_imports(tmp_path):  # (the test above can fail)
    source = tmp_path / "m.py"
    source.write_text("from zfunc.tree import tree_map\n\ndef f():\n    from zfunc.plan import plan\n")
    assert [(name, lazy) for _, name, lazy in _imports(source, _modules())] == [("zfunc.tree", False),
                                                                               ("zfunc.plan", True)]
    assert _layer("zfunc.plan") > _layer("zfunc.interpret") > _layer("zfunc.primitives") > _layer("zfunc.step_context")
    assert _layer("zfunc.transforms.mixed_precision") > _layer("zfunc.transforms.loss_scale") \
        > _layer("zfunc.transforms.mixed_precision_policy") > _layer("zfunc.optim.fused")
