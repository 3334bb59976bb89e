"""The house's layers (docs/architecture.md, "Layers"), held against every import of the package.

Every `import` / `from ... import` of a `trainingrun` module is read from the source (at module level and inside
functions; `if TYPE_CHECKING:` blocks too, since a picture of the house counts them), and the test fails on:
  * an import that runs from a lower layer to a higher one;
  * a cycle between modules, or between two rooms (sub-packages / top-level modules) of the package;
  * an import inside a function that defers nothing heavy (a third-party package outside the core dependencies, or a
    package module that imports one at module level), or that carries no one-line reason (a comment on its line or on
    the line above).
The checker itself is tested on small made-up packages, so a rule that stopped biting would show.
"""

from __future__ import annotations

import ast
import re
import textwrap
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# Bottom to top. A module imports only from its own layer (no cycle, also none between rooms) or below.
LAYERS: dict[int, tuple[str, ...]] = {
    1: ("contract", "schedule", "modeling", "api", "failure_policy", "diskspace", "cliargs", "childlog", "childproc"),
    2: ("store", "metrics", "plan", "tracking"),
    3: ("rollout", "engines", "trainer", "operator"),
    4: ("local", "cli", "__main__"),
}
# Third-party packages whose import is worth deferring: optional extras and slow imports. The core dependencies
# (pydantic, pyyaml, numpy) and the standard library are imported at module level.
HEAVY = frozenset({
    "torch", "megatron", "vllm", "transformer_engine", "flash_attn", "apex", "kubernetes", "kopf", "transformers",
    "safetensors", "tokenizers", "jinja2", "matplotlib", "tensorboard", "wandb", "redis", "prometheus_client",
    "jsonschema", "celpy", "reasoning_gym", "math_verify", "tqdm", "gguf", "psutil", "accelerate", "huggingface_hub",
    "tiktoken",
})


def room(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def layer_of(module: str) -> int | None:
    r = room(module)
    if r == "__init__":
        return 0
    return next((n for n, rooms in LAYERS.items() if r in rooms), None)


@dataclass
class Imports:
    edges: dict[str, set[str]] = field(default_factory=dict)  # module -> package modules it imports
    heavy_at_top: dict[str, bool] = field(default_factory=dict)  # imports a HEAVY package at module level
    local: list[tuple[str, int, list[str], bool, str]] = field(default_factory=list)  # in-function imports
    third: dict[str, set[str]] = field(default_factory=dict)  # module -> top-level names it imports from outside
    paths: dict[str, Path] = field(default_factory=dict)


def read_imports(pkg_root: Path, package: str = "trainingrun") -> Imports:
    out = Imports()
    for path in sorted((pkg_root / package).rglob("*.py")):
        parts = list(path.relative_to(pkg_root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out.paths[".".join(parts)] = path

    def resolve(name: str) -> str | None:
        while name and name not in out.paths:
            name = name.rpartition(".")[0]
        return name or None

    for mod, path in out.paths.items():
        source = path.read_text()
        lines = source.splitlines()
        is_pkg = path.name == "__init__.py"
        out.edges[mod] = set()
        out.heavy_at_top[mod] = False
        out.third[mod] = set()

        def visit(node: ast.AST, in_func: bool, mod=mod, lines=lines, is_pkg=is_pkg) -> None:
            for child in ast.iter_child_nodes(node):
                func = in_func or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
                if isinstance(child, (ast.Import, ast.ImportFrom)):
                    if isinstance(child, ast.Import):
                        names = [a.name for a in child.names]
                        own = {resolve(n) for n in names if n.split(".")[0] == package}
                    else:
                        base = child.module or ""
                        if child.level:
                            anchor = mod.split(".") if is_pkg else mod.split(".")[:-1]
                            anchor = anchor[: len(anchor) - (child.level - 1)]
                            base = ".".join([*anchor, base] if base else anchor)
                        names = [base]
                        own = set()
                        if base.split(".")[0] == package:
                            # `from a.b import c`: c is a module of the package or a name defined in a.b
                            own = {resolve(f"{base}.{a.name}") for a in child.names}
                    own.discard(None)
                    own.discard(mod)
                    out.edges[mod] |= own  # type: ignore[arg-type]
                    third = [n.split(".")[0] for n in names if n and n.split(".")[0] != package]
                    out.third[mod].update(third)
                    if not func and any(t in HEAVY for t in third):
                        out.heavy_at_top[mod] = True
                    if func:
                        line = child.lineno
                        reason = "#" in lines[line - 1] or (line >= 2 and lines[line - 2].strip().startswith("#"))
                        out.local.append((mod, line, sorted(own) + third, reason, ast.unparse(child)))
                visit(child, func)

        visit(ast.parse(source), False)
    return out


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one member (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[list[str]] = []
    for start in edges:
        if start in index:
            continue
        work = [(start, iter(sorted(edges[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in edges:
                    continue
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(edges[w]))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    x = stack.pop()
                    on_stack.discard(x)
                    comp.append(x)
                    if x == v:
                        break
                if len(comp) > 1:
                    found.append(sorted(comp))
    return found


def problems(imports: Imports) -> list[str]:
    out: list[str] = []
    heavy = dict(imports.heavy_at_top)
    changed = True
    while changed:  # a module is heavy when it imports (at module level) a heavy one
        changed = False
        for m, targets in imports.edges.items():
            if not heavy[m] and any(heavy.get(t) for t in targets):
                heavy[m] = changed = True
    for mod, targets in sorted(imports.edges.items()):
        lm = layer_of(mod)
        if lm is None:
            out.append(f"{mod}: room {room(mod)!r} is in no layer (add it to LAYERS and docs/architecture.md)")
            continue
        for t in sorted(targets):
            lt = layer_of(t)
            if lt is not None and lt > lm:
                out.append(f"{mod} (layer {lm}) imports {t} (layer {lt}): an import that runs up")
    for comp in cycles(imports.edges):
        out.append("module cycle: " + ", ".join(comp))
    rooms: dict[str, set[str]] = {}
    for m, targets in imports.edges.items():
        for t in targets:
            if room(m) != room(t) and "__init__" not in (room(m), room(t)):
                rooms.setdefault(room(m), set()).add(room(t))
    for comp in cycles({r: rooms.get(r, set()) for r in {*rooms, *(x for v in rooms.values() for x in v)}}):
        out.append("room cycle: " + ", ".join(comp))
    for mod, line, targets, reason, text in imports.local:
        where = f"{imports.paths[mod]}:{line}"
        own = [t for t in targets if t in imports.edges]
        third = [t for t in targets if t not in imports.edges]
        if not (any(t in HEAVY for t in third) or any(heavy.get(t) for t in own)):
            out.append(f"{where}: an import inside a function that defers nothing heavy: {text}")
        elif not reason:
            out.append(f"{where}: an import inside a function without a one-line reason: {text}")
    return out


def test_the_package_keeps_its_layers():
    found = problems(read_imports(ROOT))
    assert not found, "\n".join(found)


def test_the_architecture_doc_names_every_room_of_every_layer():
    doc = (ROOT / "docs" / "architecture.md").read_text()
    section = doc.split("## Layers", 1)[1].split("\n## ", 1)[0]
    for rooms in LAYERS.values():
        for r in rooms:
            assert f"`{r}" in section, f"docs/architecture.md, Layers: room {r} is not named"


# ------------------------------------------------------------------------------------ the checker on made-up houses
def make_package(tmp_path: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = tmp_path / "trainingrun" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    (tmp_path / "trainingrun" / "__init__.py").touch()
    return tmp_path


@pytest.mark.parametrize("files, expected", [
    ({"schedule/__init__.py": "from trainingrun.store import x\n", "store/__init__.py": "x = 1\n"}, "runs up"),
    ({"schedule/__init__.py": "def f():\n    # deferred\n    from trainingrun.trainer import y\n",
      "trainer/__init__.py": "y = 1\n"}, "runs up"),
    ({"store/a.py": "from trainingrun.metrics import b\n", "metrics/b.py": "from trainingrun.store import a\n"},
     "module cycle"),
    ({"rollout/a.py": "from trainingrun.trainer import b\n", "trainer/b.py": "x = 1\n",
      "trainer/c.py": "from trainingrun.rollout import d\n", "rollout/d.py": "x = 1\n"}, "room cycle"),
    ({"store/a.py": "def f():\n    import json  # no reason to defer\n"}, "defers nothing heavy"),
    ({"store/a.py": "def f():\n    from trainingrun.metrics import b\n", "metrics/b.py": "x = 1\n"},
     "defers nothing heavy"),
    ({"store/a.py": "def f():\n    import torch\n"}, "without a one-line reason"),
    ({"nowhere.py": "x = 1\n"}, "is in no layer"),
])
def test_the_checker_catches(tmp_path, files, expected):
    found = problems(read_imports(make_package(tmp_path, files)))
    assert any(expected in p for p in found), found


def test_the_checker_lets_a_well_built_house_pass(tmp_path):
    files = {
        "schedule/__init__.py": "import numpy\n",
        "store/a.py": "from trainingrun.schedule import numpy\n\ndef f():\n    import redis  # deferred: optional\n",
        "trainer/heavy.py": "import torch\n",
        "trainer/b.py": "from trainingrun.store import a\n\ndef g():\n    # deferred: torch\n"
                        "    from trainingrun.trainer import heavy\n",
        "local/c.py": "from trainingrun.trainer import b\n",
    }
    assert problems(read_imports(make_package(tmp_path, files))) == []


def map_rows(doc: str) -> list[tuple[int | None, list[str], str]]:
    """docs/architecture.md's module map, row by row: the "### Layer N" heading above the row, the paths in its first
    cell, and its text after the first cell."""
    section = doc.split("## Module map", 1)[1].split("\n## ", 1)[0]
    rows: list[tuple[int | None, list[str], str]] = []
    layer = None
    for line in section.splitlines():
        if heading := re.match(r"### Layer (\d+)", line):
            layer = int(heading.group(1))
        if line.startswith("| `trainingrun/"):
            first, rest = line.split("|")[1], "|".join(line.split("|")[2:])
            rows.append((layer, re.findall(r"`(trainingrun/[^`]*)`", first), rest))
    return rows


def module_map() -> dict[str, str]:
    """docs/architecture.md's module map: the path in a row's first cell (each path, when it names several) -> the
    row's text."""
    doc = (ROOT / "docs" / "architecture.md").read_text()
    return {path: rest for _, paths, rest in map_rows(doc) for path in paths}


def test_the_module_map_matches_the_tree():
    rows = module_map()
    missing = [p for p in rows if not (ROOT / p).exists()]
    assert not missing, f"docs/architecture.md names modules that do not exist: {missing}"
    pkg = ROOT / "trainingrun"
    for path in sorted(pkg.iterdir()):
        if path.name.startswith("_") or path.name == "py.typed" or path.suffix not in (".py", ""):
            continue
        rel = f"trainingrun/{path.name}" + ("/" if path.is_dir() else "")
        subs = [p for p in rows if p.startswith(rel)]
        assert subs, f"docs/architecture.md, Module map: no row for {rel}"
        if path.is_dir():
            text = " ".join(rows[p] + p for p in subs)
            named = set(re.findall(r"`([a-z0-9_]+\.py)`", text)) | {Path(p).name for p in subs}
            unnamed = sorted(f.name for f in path.glob("*.py") if f.name != "__init__.py" and f.name not in named)
            assert not unnamed, f"docs/architecture.md, Module map: {rel} does not name {unnamed}"
            strangers = sorted(n for n in set(re.findall(r"`([a-z0-9_]+\.py)`", " ".join(rows[p] for p in subs)))
                               if not (path / n).exists() and not list(pkg.rglob(n)))
            assert not strangers, f"docs/architecture.md, Module map: {rel} names files that do not exist: {strangers}"
