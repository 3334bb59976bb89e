"""The module maps held against the code (issue 27.5): pure parsing, nothing of the package is imported.

* **Package docstrings.** Every sub-package's `__init__.py` docstring has one "Module map:" block that names exactly
  the package's modules and sub-packages, one entry a line:

      Module map:
        name.py     what it is
                    (a continuation, indented deeper)
        sub/        a sub-package (its own map in sub/__init__.py)

  The block ends at the first empty line. A module added, removed or renamed without its map following fails,
  naming the package and the module. (The package root's map is docs/architecture.md, held by test_layers.py.)

* **docs/architecture.md's "depends on" column.** A row covers the modules of its paths (a `dir/` row its package and
  everything below it that no deeper row covers; a `file.py` row that module); every module of the package is
  covered, except the package root (`trainingrun/__init__.py`: only `__version__`, below every layer). The cell
  names, separated by `,` or `;`, with notes in parentheses:
    - the package's own modules the row imports (read by test_layers.py's reader: module level, inside functions,
      `TYPE_CHECKING` blocks): a room (`contract`), a part of one (`modeling.architecture`), or — for a row inside a
      room — a sibling of the row (`models` in `trainingrun/api/`) or a part of the row's own package (`vllm` in
      `trainingrun/engines/`). Checked both ways: each module imported from outside the row is covered by a name,
      and each name is imported;
    - libraries (`torch`, `megatron-core`, `pyyaml`, ...), checked loosely: a library the cell names is imported by
      the row's modules, but the cell need not name every library it imports (it names the ones worth knowing: what
      the row costs to import or install); `stdlib` may be named;
    - `—` for nothing.
  A name that is neither a module of the package nor a known library fails (a misspelt room is no library).
  Each row also sits under the heading of its layer (test_layers.LAYERS).
The checkers are tested on small made-up packages and docs, so a rule that stopped biting would show.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.unit.test_layers import HEAVY, LAYERS, ROOT, Imports, make_package, map_rows, read_imports, room

# ------------------------------------------------------------------------------------ package docstrings' maps
MAP_HEADER = "Module map:"
MAP_ENTRY = re.compile(r"  ([a-z0-9_]+(?:\.py|/))  +\S")  # two spaces, the name, two or more spaces, what it is


def docstring_map(init: Path) -> list[str] | str:
    """The names in the "Module map:" block of a package's docstring, in order, or why it cannot be read."""
    doc = ast.get_docstring(ast.parse(init.read_text()), clean=False)
    if not doc:
        return "no docstring (it needs a 'Module map:' block)"
    lines = doc.splitlines()
    starts = [i for i, line in enumerate(lines) if line.strip() == MAP_HEADER]
    if len(starts) != 1:
        return f"{len(starts)} '{MAP_HEADER}' lines in the docstring (one expected)"
    names: list[str] = []
    for line in lines[starts[0] + 1:]:
        if not line.strip():
            break
        entry = MAP_ENTRY.match(line)
        if entry:
            names.append(entry.group(1))
        elif not line.startswith("   "):
            return (f"cannot read the module map's line {line.strip()!r}: expected '  name.py  what it is' "
                    "(or 'name/' for a sub-package), or a deeper-indented continuation")
    if not names:
        return f"an empty '{MAP_HEADER}' block"
    return names


def docstring_map_problems(pkg_root: Path, package: str = "trainingrun") -> list[str]:
    out: list[str] = []
    top = pkg_root / package
    for init in sorted(top.rglob("__init__.py")):
        if init.parent == top:
            continue  # the root's map is docs/architecture.md (test_layers.test_the_module_map_matches_the_tree)
        where = f"{'.'.join(init.parent.relative_to(pkg_root).parts)} ({init.relative_to(pkg_root)})"
        names = docstring_map(init)
        if isinstance(names, str):
            out.append(f"{where}: {names}")
            continue
        actual = {p.name for p in init.parent.glob("*.py") if p.name != "__init__.py"}
        actual |= {f"{p.name}/" for p in init.parent.iterdir() if (p / "__init__.py").is_file()}
        twice = sorted({n for n in names if names.count(n) > 1})
        missing = sorted(actual - set(names))
        extra = sorted(set(names) - actual)
        if missing:
            out.append(f"{where}: the module map does not name {', '.join(missing)}")
        if extra:
            out.append(f"{where}: the module map names {', '.join(extra)}, not a module of the package")
        if twice:
            out.append(f"{where}: the module map names {', '.join(twice)} more than once")
    return out


def test_each_package_docstring_maps_exactly_its_modules():
    found = docstring_map_problems(ROOT)
    assert not found, "\n".join(found)


# ------------------------------------------------------------------------------------ the "depends on" column
CORE = frozenset({"numpy", "pydantic", "yaml"})  # the core dependencies, imported at module level everywhere
DIST_TO_IMPORT = {"pyyaml": "yaml", "megatron-core": "megatron", "cel-python": "celpy"}


def import_name(library: str) -> str:
    """`prometheus-client` -> `prometheus_client`: the name a library named in the doc is imported by."""
    return DIST_TO_IMPORT.get(library, library.lower().replace("-", "_"))


@dataclass
class Row:
    paths: list[str]  # as the first cell writes them: trainingrun/x/ or trainingrun/x.py
    layer: int | None  # the "### Layer N" heading it sits under
    depends: str  # the "depends on" cell

    @property
    def name(self) -> str:
        return ", ".join(f"`{p}`" for p in self.paths)

    @property
    def parent(self) -> str:
        """The package a name of the cell is first looked up in (the row's siblings)."""
        return str(Path(self.paths[0].rstrip("/")).parent).replace("/", ".")


def doc_rows(doc: str) -> list[Row]:
    return [Row(paths, layer, rest.strip().removesuffix("|").split("|")[-1].strip())
            for layer, paths, rest in map_rows(doc)]


def cell_names(cell: str) -> list[str] | str:
    """The names a "depends on" cell lists (notes in parentheses dropped), or why it cannot be read."""
    text = cell.strip()
    if text in ("—", ""):
        return []
    while (dropped := re.sub(r"\([^()]*\)", "", text)) != text:
        text = dropped
    if "(" in text or ")" in text:
        return f"unbalanced parentheses in {cell!r}"
    names = [item.strip().strip("`") for item in re.split(r"[,;]", text)]
    bad = [n for n in names if not re.fullmatch(r"[A-Za-z0-9_.\-]+", n)]
    if bad:
        return f"cannot read {bad[0]!r} (expected names separated by ',' or ';', notes in parentheses)"
    return names


def owned(rows: list[Row], mod: str) -> Row | None:
    """The row covering a module: a file row its module; the deepest directory row above it otherwise."""
    best: tuple[int, Row] | None = None
    for row in rows:
        for path in row.paths:
            if path.endswith(".py"):
                if mod == path.removesuffix(".py").removesuffix("/__init__").replace("/", "."):
                    return row
            else:
                top = path.rstrip("/").replace("/", ".")
                if (mod == top or mod.startswith(top + ".")) and (best is None or len(top) > best[0]):
                    best = (len(top), row)
    return best[1] if best else None


def depends_problems(doc: str, imports: Imports, package: str = "trainingrun") -> list[str]:
    out: list[str] = []
    rows = doc_rows(doc)
    scope: dict[int, set[str]] = {id(r): set() for r in rows}
    for mod in imports.edges:
        row = owned(rows, mod)
        if row is not None:
            scope[id(row)].add(mod)
        elif mod != package:
            out.append(f"docs/architecture.md, Module map: no row covers {mod} ({imports.paths[mod]})")
    for row in rows:
        where = f"docs/architecture.md, Module map, row {row.name}"
        mods = scope[id(row)]
        for r in {room(m) for m in mods}:
            if row.layer is None or r not in LAYERS.get(row.layer, ()):
                out.append(f"{where}: sits under Layer {row.layer}, but room {r} is in another layer (LAYERS)")
        names = cell_names(row.depends)
        if isinstance(names, str):
            out.append(f"{where}: 'depends on' {names}")
            continue
        own = [row.paths[0].rstrip("/").replace("/", ".")] if row.paths[0].endswith("/") else []
        bases = [*own, row.parent, package]
        internal: dict[str, str] = {}
        libraries: list[str] = []
        for name in names:
            # a module of the row itself is no dependency: `redis` in the store's row is the library
            found = next((f"{b}.{name}" for b in bases if f"{b}.{name}" in imports.paths
                          and f"{b}.{name}" not in mods), None)
            if found:
                internal[name] = found
            elif name == "stdlib":
                continue
            elif import_name(name) in HEAVY | CORE:
                libraries.append(name)
            else:
                out.append(f"{where}: 'depends on' names {name!r}: not a module of the package (from {bases}) nor "
                           "a known library (test_layers.HEAVY, or a core dependency)")
        imported: dict[str, str] = {}  # module of the package -> a module of the row importing it
        for m in sorted(mods):
            for target in sorted(imports.edges[m]):
                if target not in mods and target != package:
                    imported.setdefault(target, m)
        unnamed: dict[str, list[str]] = {}
        for target, by in imported.items():
            if not any(target == t or target.startswith(t + ".") for t in internal.values()):
                base = next(b for b in bases if target.startswith(b + ".") or b == package)
                unnamed.setdefault(target.removeprefix(base + ".").split(".")[0], []).append(f"{by} → {target}")
        for name, edges in sorted(unnamed.items()):
            out.append(f"{where}: imports {name!r} ({'; '.join(edges[:3])}), which 'depends on' does not name")
        for name, target in internal.items():
            if not any(t == target or t.startswith(target + ".") for t in imported):
                out.append(f"{where}: 'depends on' names {name!r}, which none of its modules imports")
        third = set().union(*(imports.third[m] for m in mods)) if mods else set()
        for name in libraries:
            if import_name(name) not in third:
                out.append(f"{where}: 'depends on' names the library {name!r}, which none of its modules imports")
    return out


def test_the_depends_on_column_matches_the_imports():
    found = depends_problems((ROOT / "docs" / "architecture.md").read_text(), read_imports(ROOT))
    assert not found, "\n".join(found)


# ------------------------------------------------------------------------------------ the checkers on made-up houses
GOOD_MAP = '"""The store.\n\nModule map:\n  base.py  the protocol\n           and its errors\n  sub/     a part\n"""\n'
GOOD_TREE = {"store/__init__.py": GOOD_MAP, "store/base.py": "",
             "store/sub/__init__.py": '"""Module map:\n  a.py  A\n"""', "store/sub/a.py": ""}


@pytest.mark.parametrize("change, expected", [
    ({"store/new.py": ""}, "trainingrun.store (trainingrun/store/__init__.py): the module map does not name new.py"),
    ({"store/base.py": None}, "names base.py, not a module of the package"),
    ({"store/sub/a.py": None, "store/sub/b.py": ""}, "trainingrun.store.sub (trainingrun/store/sub/__init__.py): "
     "the module map does not name b.py"),
    ({"store/sub/__init__.py": None, "store/sub/a.py": None}, "names sub/, not a module"),
    ({"store/__init__.py": GOOD_MAP.replace("  sub/", "  base.py  again\n  sub/")}, "base.py more than once"),
    ({"store/__init__.py": '"""The store: base.py"""'}, "0 'Module map:' lines"),
    ({"store/__init__.py": "x = 1\n"}, "no docstring"),
    ({"store/__init__.py": GOOD_MAP.replace("  sub/", " sub/")}, "cannot read"),
])
def test_the_docstring_map_checker_catches(tmp_path, change, expected):
    files = {name: text for name, text in {**GOOD_TREE, **change}.items() if text is not None}
    found = docstring_map_problems(make_package(tmp_path, files))
    assert any(expected in p for p in found), found


def test_the_docstring_map_checker_lets_a_good_map_pass(tmp_path):
    assert docstring_map_problems(make_package(tmp_path, GOOD_TREE)) == []


HOUSE = {
    "contract/__init__.py": "", "contract/a.py": "import numpy\n",
    "api/__init__.py": "from trainingrun.api.models import M\n",
    "api/models.py": "import pydantic\nfrom trainingrun.api.constants import K\nM = K = 1\n",
    "api/constants.py": "K = 1\n",
    "store/__init__.py": "from trainingrun.contract import a\n\ndef f():\n    import redis  # deferred: optional\n",
    "store/redis.py": "",  # a module named as a library: the cell's `redis` is the library
    "engines/__init__.py": "", "engines/table.py": "from trainingrun.engines.vllm import b\n",
    "engines/vllm/__init__.py": "", "engines/vllm/b.py": "from trainingrun.engines import pool\n",
    "engines/pool.py": "from trainingrun import store\n",
}
DOC = """# The house
## Module map
### Layer 1
| module | what | depends on |
|---|---|---|
| `trainingrun/contract/` | contracts | numpy |
| `trainingrun/api/__init__.py` | the front | models |
| `trainingrun/api/models.py` | models | constants; pydantic (the models) |
| `trainingrun/api/constants.py` | names | — |
### Layer 2
| `trainingrun/store/` | the store | contract; redis |
### Layer 3
| `trainingrun/engines/` | the engines | store, vllm (the table's entry) |
| `trainingrun/engines/vllm/` | vLLM | pool; stdlib |
## Next
"""


def test_the_depends_on_checker_lets_a_true_column_pass(tmp_path):
    assert depends_problems(DOC, read_imports(make_package(tmp_path, HOUSE))) == []


@pytest.mark.parametrize("change, expected", [
    (("contract; redis", "redis"), "row `trainingrun/store/`: imports 'contract' (trainingrun.store → "
     "trainingrun.contract.a), which 'depends on' does not name"),
    (("constants; pydantic", "pydantic"), "row `trainingrun/api/models.py`: imports 'constants'"),
    (("store, vllm", "vllm"), "row `trainingrun/engines/`: imports 'store'"),
    (("| numpy |", "| numpy, schedule |"), "'depends on' names 'schedule': not a module of the package"),
    (("| numpy |", "| numpy, store |"), "row `trainingrun/contract/`: 'depends on' names 'store', which none"),
    (("| numpy |", "| numpy, torch |"), "names the library 'torch', which none of its modules imports"),
    (("pool; stdlib", "pool, contract"), "row `trainingrun/engines/vllm/`: 'depends on' names 'contract', which"),
    (("| — |", "| (nothing |"), "unbalanced parentheses"),
    (("| — |", "| nothing at all |"), "cannot read 'nothing at all'"),
    (("| `trainingrun/api/constants.py` | names | — |\n", ""), "no row covers trainingrun.api.constants"),
    (("### Layer 2\n", ""), "sits under Layer 1, but room store is in another layer"),
])
def test_the_depends_on_checker_catches(tmp_path, change, expected):
    assert change[0] in DOC
    found = depends_problems(DOC.replace(*change), read_imports(make_package(tmp_path, HOUSE)))
    assert any(expected in p for p in found), found
