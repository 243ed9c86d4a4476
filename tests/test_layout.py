"""The package's layout: each layer imports only the layers under it, every module's first line says what it is, and
each public export comes from the module the package's table names."""

import ast
import importlib
import re
from pathlib import Path

import pytest

import trl_rpp

PACKAGE = Path(trl_rpp.__file__).parent
ROOT = PACKAGE.parent

# Bottom to top. A module may import (at any depth: module level or inside a function) only modules of its own
# layer or of the layers under it; `trl_rpp.patches` is the one module that touches other libraries' internals.
PURE = {"core", "score_centering", "truncation", "lm_head"}
LAYERS = [
    ("pure tensor functions", lambda m: m in PURE),
    ("the one room for foreign internals", lambda m: m in ("patches", "errors")),
    ("the sampler's records", lambda m: m.startswith("records")),
    ("faults", lambda m: m.startswith("faults")),
    ("engines", lambda m: m.startswith("engines")),
    ("on top", lambda m: True),
]


def _layer(module: str) -> int:
    return next(i for i, (_, member) in enumerate(LAYERS) if member(module))


def _package_imports(path: Path) -> set[str]:
    """The `trl_rpp` modules `path` imports, relative to the package (``records.capture``)."""
    package = path.relative_to(PACKAGE).parent.parts
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = list(package[: len(package) - node.level + 1])
            elif (node.module or "").startswith("trl_rpp"):
                base = []
            else:
                continue
            module = [*base, *(node.module or "").removeprefix("trl_rpp").lstrip(".").split(".")] if node.module else base
            module = [p for p in module if p]
            for alias in node.names:  # `from . import x` / `from .records import settings` name modules too
                candidate = [*module, alias.name]
                is_module = (PACKAGE.joinpath(*candidate).with_suffix(".py").exists()
                             or PACKAGE.joinpath(*candidate).is_dir())
                out.add(".".join(candidate if is_module else module) or "__init__")
        elif isinstance(node, ast.Import):
            out |= {a.name.removeprefix("trl_rpp.") for a in node.names if a.name.startswith("trl_rpp.")}
    return out


def _modules():
    for path in sorted(PACKAGE.rglob("*.py")):
        name = ".".join(path.relative_to(PACKAGE).with_suffix("").parts).removesuffix(".__init__")
        if name != "__init__" and not name.startswith(("testing", "recipes")):
            yield name, path


@pytest.mark.parametrize("name,path", list(_modules()), ids=[n for n, _ in _modules()])
def test_a_module_imports_only_its_layer_and_those_under_it(name, path):
    above = {m for m in _package_imports(path) if m != "__init__" and _layer(m) > _layer(name)}
    assert not above, f"trl_rpp.{name} ({LAYERS[_layer(name)][0]}) imports {sorted(above)} from a layer above it"


def _import_graph():
    """Every module of the package (as `_modules` lists them) -> the package modules it imports, at any depth."""
    names = {name for name, _ in _modules()}
    return {name: {m for m in _package_imports(path) if m in names and m != name} for name, path in _modules()}


def _cycle(graph):
    """One import circle of `graph` as a list of modules ending where it starts, or None."""
    state, stack = {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = "done"
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_no_two_modules_import_each_other_even_through_others():
    """No import circle inside the package, within a layer included (at any depth, function-level imports too)."""
    found = _cycle(_import_graph())
    assert found is None, "import circle: " + " -> ".join(f"trl_rpp.{m}" for m in found)


def test_the_circle_check_finds_a_circle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_the_pure_modules_import_no_other_library_at_load():
    for name in PURE:
        tree = ast.parse((PACKAGE / f"{name}.py").read_text())
        top = [n for n in tree.body if isinstance(n, ast.Import) or isinstance(n, ast.ImportFrom) and not n.level]
        libraries = {(n.module or "") if isinstance(n, ast.ImportFrom) else a.name for n in top
                     for a in (n.names if isinstance(n, ast.Import) else [None])}
        assert {lib.split(".")[0] for lib in libraries} <= {
            "__future__", "dataclasses", "math", "numbers", "torch"}, (name, libraries)


def test_every_module_opens_with_what_it_is():
    for path in sorted(PACKAGE.rglob("*.py")):
        doc = ast.get_docstring(ast.parse(path.read_text()))
        assert doc and len(doc.split("\n")[0]) > 20, f"{path.relative_to(ROOT)} has no opening line saying what it is"


def test_no_two_modules_open_with_the_same_sentence():
    first = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        line = ast.get_docstring(ast.parse(path.read_text())).split("\n")[0]
        assert line not in first, f"{path.relative_to(ROOT)} and {first[line]} open alike: {line!r}"
        first[line] = path.relative_to(ROOT)


def test_each_public_export_is_defined_where_the_package_says():
    """`trl_rpp.<name>` loads the name from the module of `trl_rpp._LAZY` that defines it (not a re-export from elsewhere), and
    `dir(trl_rpp)` lists it."""
    for name in trl_rpp.__all__:
        value = getattr(trl_rpp, name)
        assert value.__module__ == "trl_rpp" + trl_rpp._LAZY[name], (name, value.__module__)
        assert value.__name__ == name and name in dir(trl_rpp)


# --- Names that exist -----------------------------------------------------------------------------------------------

# A dotted path from `trl_rpp` anywhere, or a path relative to the package in backticks (`records.settings`,
# `faults.preemption.parse_preemption_signals`), and a repository file (`trl_rpp/...`, `tests/...`, `benchmarks/...`, `examples/...`, `docs/...`).
_DOTTED = re.compile(r"(?<![\w./])trl_rpp(?:\.[A-Za-z_]\w*)+")
_RELATIVE = re.compile(r"`([a-z_]+(?:\.[A-Za-z_]\w*)+)(?:\(\))?`")
_FILE = re.compile(r"(?<![\w./-])((?:trl_rpp|tests|benchmarks|examples|docs)/[\w./-]*\.(?:py|jsonl|json|md|yaml|sh|png))")
# Module names that are also the names of ordinary objects (`trainer.save_model`, `config.max_position_embeddings`):
# a backticked `trainer.x` names the object, not the module.
_OBJECT_NAMES = {"trainer", "config", "engine", "metrics", "vllm", "lm_head", "batch", "core"}
_SUBPACKAGES = ("", "records.", "faults.", "engines.", "testing.", "recipes.")


def _prose(path: Path) -> str:
    """What a file says in words: a page whole; of a Python file, its docstrings and comments (code strings name
    things that do not exist on purpose, e.g. a test of an unknown name)."""
    text = path.read_text()
    if path.suffix != ".py":
        return text
    import io
    import tokenize

    said = [tok.string for tok in tokenize.generate_tokens(io.StringIO(text).readline) if tok.type == tokenize.COMMENT]
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            said.append(ast.get_docstring(node, clean=False) or "")
    return "\n".join(said)


def _resolves(dotted: str) -> bool:
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ModuleNotFoundError:
            continue
        for attr in parts[i:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


def test_every_module_and_file_named_in_docstrings_comments_and_docs_exists():
    import pkgutil

    modules = {m.name.rsplit(".", 1)[-1] for m in pkgutil.walk_packages(trl_rpp.__path__, "trl_rpp.")} - _OBJECT_NAMES
    pages = [ROOT / "README.md", ROOT / "setup.py", ROOT / "Makefile", *sorted((ROOT / "docs").glob("*.md"))]
    for folder in ("trl_rpp", "tests", "benchmarks", "examples"):
        pages += sorted((ROOT / folder).rglob("*.py")) + sorted((ROOT / folder).rglob("*.md"))
    missing = []
    for path in pages:
        said = _prose(path)
        where = path.relative_to(ROOT)
        missing += [(where, name) for name in _DOTTED.findall(said) if not _resolves(name)]
        for name in _RELATIVE.findall(said):
            if name.split(".")[0] in modules and not any(_resolves(f"trl_rpp.{p}{name}") for p in _SUBPACKAGES):
                missing.append((where, name))
        missing += [(where, f) for f in _FILE.findall(said) if not (ROOT / f).exists()]
    assert not missing, f"names of modules, members or files that do not exist: {missing}"


# The functions under the trainer that take TRL's whole trainer, each because it calls a TRL trainer method (its
# docstring names it); everything else below `trainer.py` takes the accelerator, the args or the values it reads.
# `trl_rpp.patches` is not counted: its accessors read TRL's trainer on purpose.
TAKES_THE_TRAINER = {"faults.checkpoint.save_checkpoint", "faults.engine.generate_vllm_with_topk",
                     "faults.preemption.Preemption.__init__"}


def _functions_taking_the_trainer():
    found = {}
    for name, path in _modules():
        if name in ("trainer", "patches"):
            continue
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                for item in node.body:
                    if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                        item.rpp_owner = node.name
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                params = [a.arg for a in node.args.args]
                if params[:1] == ["self"]:
                    params = params[1:]
                if params[:1] == ["trainer"]:
                    owner = getattr(node, "rpp_owner", None)
                    doc = ast.get_docstring(node) or ast.get_docstring(
                        next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == owner)) or ""
                    found[".".join(p for p in (name, owner, node.name) if p)] = doc
    return found


def test_at_most_five_functions_under_the_trainer_take_it_each_naming_the_trl_method_it_calls():
    found = _functions_taking_the_trainer()
    assert set(found) == TAKES_THE_TRAINER, sorted(set(found) ^ TAKES_THE_TRAINER)
    assert len(found) <= 5
    for name, doc in found.items():
        assert re.search(r"takes TRL's trainer because it (calls|wraps) [^.]*`[A-Za-z]+\.\w+`", " ".join(doc.split())), \
            (name, doc)
