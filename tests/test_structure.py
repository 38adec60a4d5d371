"""The shape of the code itself (docs/DESIGN.md, "Layers"): checks that keep Stax readable.

- every import among `stax/` modules (subpackages `stax/nn`, `stax/optim` included), lazy ones inside functions included, points down: the
  import graph has no cycle;
- no module passes 800 lines of code (blank lines, comments and docstrings not counted);
- no class name is defined twice (one name, one meaning);
- no function passes 60 lines of code unless it is listed in LONG_FUNCTIONS with the reason it
  still reads top to bottom.

These read the source with `ast`; nothing is imported or run.
"""
from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "stax"
MAX_MODULE_LINES = 800
MAX_FUNCTION_LINES = 60

# function (module:qualname) -> why it may be longer than MAX_FUNCTION_LINES
LONG_FUNCTIONS: dict[str, str] = {}


def _module_name(p: Path) -> str:
    """`tensor`, `nn.functional`; a package's `__init__.py` is the package (`nn`), the root's is `__init__`."""
    parts = list(p.relative_to(PACKAGE).with_suffix("").parts)
    if parts[-1] == "__init__" and len(parts) > 1:
        parts.pop()
    return ".".join(parts)


def _files() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def _modules() -> dict[str, ast.Module]:
    return {_module_name(p): ast.parse(p.read_text(), filename=str(p)) for p in _files()}


def _package_of(here: str, is_package: bool) -> list[str]:
    """The package a module's relative imports start from: `nn.functional` -> [nn], `nn` -> [nn]."""
    if here == "__init__":
        return []
    parts = here.split(".")
    return parts if is_package else parts[:-1]


def _target(parts: list[str], names: set) -> str:
    """The module a dotted path inside stax names: the longest prefix that is a module."""
    for k in range(len(parts), 0, -1):
        if ".".join(parts[:k]) in names:
            return ".".join(parts[:k])
    return "__init__"


def _imported(node, here: str, names: set, is_package: bool = False) -> set:
    """The stax modules one import statement (or importlib.import_module call) reaches."""
    found = set()
    base = _package_of(here, is_package)
    if isinstance(node, ast.ImportFrom):
        if node.level == 0 and node.module and (node.module == "stax" or node.module.startswith("stax.")):
            parts = node.module.split(".")[1:]
        elif node.level >= 1:
            up = base[:len(base) - (node.level - 1)] if node.level - 1 <= len(base) else []
            parts = up + (node.module.split(".") if node.module else [])
        else:
            return found
        for alias in node.names:              # `from . import a` / `from stax.nn import functional`
            sub = ".".join(parts + [alias.name])
            found.add(sub if sub in names else _target(parts, names))
    elif isinstance(node, ast.Import):
        for alias in node.names:
            parts = alias.name.split(".")
            if parts[0] == "stax":
                found.add(_target(parts[1:], names))
    elif (isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", None)) == "import_module"
          and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
        name = node.args[0].value
        if name.startswith("."):
            found.add(_target(base + name.lstrip(".").split("."), names))
        elif name == "stax" or name.startswith("stax."):
            found.add(_target(name.split(".")[1:], names))
    return {m for m in found if m in names and m != here}


def import_graph() -> dict[str, set]:
    names = {_module_name(p) for p in _files()}
    graph = {}
    for p in _files():
        name, tree = _module_name(p), ast.parse(p.read_text(), filename=str(p))
        # the root's lazy re-export of the subpackages above it (`stax.nn`, `stax.optim` on first
        # use, in its `__getattr__`) is a name for users, not a dependency of the root's own code
        skip = {id(n) for f in tree.body if name == "__init__" and isinstance(f, ast.FunctionDef)
                and f.name == "__getattr__" for n in ast.walk(f)}
        edges = set()
        for node in ast.walk(tree):
            if id(node) not in skip:
                edges |= _imported(node, name, names, is_package=p.name == "__init__.py")
        # every submodule implicitly imports its package (__init__) first; that edge is Python's,
        # not the author's, so only explicit imports of `stax` count
        graph[name] = edges
    return graph


def cycles(graph: dict[str, set]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, on_stack, stack, out = {}, {}, set(), [], []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v), on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def _docstring_lines(tree) -> set:
    lines = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
                    and isinstance(body[0].value.value, str):
                lines.update(range(body[0].lineno, body[0].end_lineno + 1))
    return lines


def code_lines(source: str, tree, first: int = 1, last: int | None = None) -> int:
    """Lines of code in [first, last]: not blank, not a comment, not part of a docstring."""
    skip = _docstring_lines(tree)
    text = source.splitlines()
    last = len(text) if last is None else last
    return sum(1 for i in range(first, last + 1)
               if i not in skip and text[i - 1].strip() and not text[i - 1].strip().startswith("#"))


def test_imports_point_down():
    found = cycles(import_graph())
    assert not found, ("import cycles among stax/ modules (every import, lazy ones too, must point to a "
                       f"lower layer; docs/DESIGN.md lists the layers): {found}")


def test_module_size():
    over = {}
    for p in _files():
        source = p.read_text()
        n = code_lines(source, ast.parse(source))
        if n > MAX_MODULE_LINES:
            over[_module_name(p)] = n
    assert not over, f"modules over {MAX_MODULE_LINES} lines of code (split along the chapter's subsections): {over}"


def test_class_names_are_unique():
    where = defaultdict(list)
    for name, tree in _modules().items():
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                where[node.name].append(name)
    twice = {c: mods for c, mods in where.items() if len(mods) > 1}
    assert not twice, f"class names defined more than once (one name, one meaning): {twice}"


def long_functions() -> dict[str, int]:
    out = {}
    for p in _files():
        source, stem = p.read_text(), _module_name(p)
        tree = ast.parse(source)

        def walk(node, prefix):
            for child in ast.iter_child_nodes(node):
                if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    qual = f"{prefix}{child.name}"
                    n = code_lines(source, tree, child.lineno, child.end_lineno)
                    if n > MAX_FUNCTION_LINES:
                        out[f"{stem}:{qual}"] = n
                    walk(child, qual + ".")
                elif isinstance(child, ast.ClassDef):
                    walk(child, f"{prefix}{child.name}.")
        walk(tree, "")
    return out


def test_function_size():
    over = {f: n for f, n in long_functions().items() if f not in LONG_FUNCTIONS}
    assert not over, (f"functions over {MAX_FUNCTION_LINES} lines of code; split them into named steps, "
                      f"or list them in LONG_FUNCTIONS with the reason they read top to bottom: {over}")


def test_the_checks_see_a_cycle_and_a_long_module():
    """The checks themselves can fail."""
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []
    source = '"""doc\nstring"""\n# comment\n\nx = 1\ndef f():\n    """d"""\n    return x\n'
    assert code_lines(source, ast.parse(source)) == 3
    tree = ast.parse("from . import lower\nfrom .cache import x\nimport stax.cuda\n"
                     "def f():\n    importlib.import_module('.tensor', __package__)\n")
    names = {"lower", "cache", "cuda", "tensor", "here"}
    edges = set()
    for node in ast.walk(tree):
        edges |= _imported(node, "here", names)
    assert edges == {"lower", "cache", "cuda", "tensor"}
    # a subpackage's module: `from .. import x` reaches the flat package, `from . import y` its sibling
    tree = ast.parse("from .. import autograd\nfrom ..tensor import Tensor\nfrom . import functional\n"
                     "import stax.nn.functional\n")
    names = {"autograd", "tensor", "nn", "nn.functional", "nn.attention"}
    edges = set()
    for node in ast.walk(tree):
        edges |= _imported(node, "nn.attention", names)
    assert edges == {"autograd", "tensor", "nn.functional"}


def test_subpackages_are_scanned():
    assert {"nn", "nn.functional", "optim", "__init__", "tensor"} <= set(_modules())
