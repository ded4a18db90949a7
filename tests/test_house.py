"""The house's shape, by check (docs/architecture.md): the imports between src/entmtp's files form no circle; no
module outside backends/ compares a backend's name, none outside accept.py an acceptance rule's (they ask the
backend registry and the `Rule` instead); build/'s modules stay small; no function runs past 60 lines (ruff also
holds their statements and branches)."""

import ast
import re
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "entmtp"


def _target(root: Path, module: str) -> Path | None:
    """The file of a dotted module name under `root` (a package's __init__.py), None outside it."""
    parts = module.split(".")
    if parts[0] != root.name:
        return None
    base = root.parent.joinpath(*parts)
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.exists():
            return path
    return None


def import_graph(root: Path = SRC) -> dict[Path, set[Path]]:
    """file -> the files it imports, at any level (function-local and TYPE_CHECKING imports too): `from a.b
    import c` names a/b/c.py where that is a module, else a/b's own file."""
    graph = {}
    for path in sorted(root.rglob("*.py")):
        package = path.parent.relative_to(root.parent).parts
        edges = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                up = package[: len(package) - node.level + 1] if node.level else ()
                base = ".".join([*up, node.module] if node.module else up)
                names = [f"{base}.{a.name}" for a in node.names if _target(root, f"{base}.{a.name}")] or [
                    base
                ]
            else:
                continue
            edges |= {t for t in map(lambda n: _target(root, n), names) if t is not None and t != path}
        graph[path] = edges
    return graph


def circles(graph: dict[Path, set[Path]]) -> list[list[Path]]:
    """The strongly connected groups of more than one file (Tarjan's algorithm)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                out.append(sorted(group))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_the_imports_form_no_circle():
    found = [[str(p.relative_to(SRC)) for p in group] for group in circles(import_graph())]
    assert found == []


def test_a_circle_through_a_function_local_import_is_found(tmp_path):
    pkg = tmp_path / "entmtp"
    (pkg / "costs").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "costs" / "__init__.py").write_text("from .probe import Probe\n")
    (pkg / "costs" / "probe.py").write_text("def f():\n    from .. import engine\n")
    (pkg / "engine.py").write_text("from .costs import Probe\n")
    (pkg / "leaf.py").write_text("from .engine import x\n")
    names = [[p.relative_to(pkg).as_posix() for p in g] for g in circles(import_graph(pkg))]
    assert names == [["costs/__init__.py", "costs/probe.py", "engine.py"]]


BACKEND_NAMES = ("transformers", "llama-cpp")
RULE_NAMES = ("greedy", "sample", "typical", "gumbel")


def compared(names: tuple[str, ...], text: str) -> list[str]:
    """The comparisons in `text` of a string among `names` (==, !=, in a literal tuple or list)."""
    word = "|".join(map(re.escape, names))
    pattern = rf"""[=!]=\s*["'](?:{word})["']|["'](?:{word})["']\s*[=!]=|\bin\s*[(\[]\s*["'](?:{word})["']"""
    return re.findall(pattern, text)


def compared_outside(names: tuple[str, ...], home) -> dict[str, list[str]]:
    """file -> its comparisons of `names`, for the files of src/entmtp that `home` (a relative path) is not."""
    out = {}
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC)
        if not home(rel) and (found := compared(names, path.read_text())):
            out[rel.as_posix()] = found
    return out


def test_no_backend_name_is_compared_outside_the_backends():
    assert compared_outside(BACKEND_NAMES, lambda rel: rel.parts[0] == "backends") == {}


def test_no_acceptance_rule_is_compared_outside_accept_py():
    assert compared_outside(RULE_NAMES, lambda rel: rel.as_posix() == "accept.py") == {}


def test_the_graph_holds_the_engine_s_imports():
    graph = import_graph()
    assert SRC / "costs" / "curves.py" in graph[SRC / "engine.py"]
    assert SRC / "engine.py" in graph[SRC / "costs" / "probe.py"]  # a function-local import counts


def test_a_comparison_of_a_name_is_found():
    text = (
        'if spec.backend == "llama-cpp" or rule != "typical" or r in ("greedy", "x"): pass\nname = "gumbel"'
    )
    assert compared(BACKEND_NAMES, text) == ['== "llama-cpp"']
    assert compared(RULE_NAMES, text) == ['!= "typical"', 'in ("greedy"']


def test_build_is_a_package_of_small_modules():
    sizes = {p.name: len(p.read_text().splitlines()) for p in (SRC / "build").glob("*.py")}
    assert {"spec.py", "loaded.py", "composed.py", "choose.py", "plan.py"} <= set(sizes)
    assert max(sizes.values()) < 300, sizes


def long_functions(root: Path = SRC, most: int = 60) -> list[str]:
    """file:function of every function (methods and nested ones too) longer than `most` lines."""
    out = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                if node.end_lineno - node.lineno + 1 > most:
                    out.append(f"{path.relative_to(root)}:{node.name}")
    return out


def test_no_function_in_src_is_longer_than_60_lines(tmp_path):
    assert long_functions() == []
    (tmp_path / "entmtp").mkdir()
    body = "\n".join(f"    x{i} = {i}" for i in range(60))
    (tmp_path / "entmtp" / "long.py").write_text(f"def ok():\n    pass\n\n\ndef long():\n{body}\n")
    assert long_functions(tmp_path / "entmtp") == ["long.py:long"]  # 61 lines: found
