"""The layering of voice_out, read from the source (parsed with ``ast``, nothing imported).

Arrows point down only: server -> engine -> fast -> model; fast/ reaches nothing of the engine
or the server. model/ is plain eager PyTorch: it imports no Triton, nothing of the fast path,
the engine, the server, the text or voice layers, and no threads, logging, asyncio,
contextvars or environment switches, directly or through another voice_out module. Every
import counts: module level, inside a function, under ``if TYPE_CHECKING:``; a circle through
any of them is a circle a reader has to untangle.

The checker is tested on a small synthetic package first, so that a rule that could never fail
would show.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

from tests.conftest import REPO_ROOT

PACKAGE = "voice_out"

#: What model/ may import of voice_out besides itself.
MODEL_MAY_IMPORT = ("voice_out.model", "voice_out.errors")
#: What fast/ may import of voice_out besides itself: the model it is applied to.
FAST_MAY_IMPORT = ("voice_out.fast", "voice_out.model", "voice_out.errors")
#: Standard or third-party modules that model/ (and whatever voice_out module it imports) may
#: not import: kernels, concurrency, logging and environment switches belong above it.
MODEL_FORBIDDEN_EXTERNAL = frozenset({"triton", "threading", "logging", "asyncio", "contextvars", "concurrent", "os"})


@dataclass(frozen=True)
class Imports:
    """What each module of a package imports: ``internal`` maps a module to the package's
    modules it imports, ``external`` to the top-level names of the others."""

    internal: dict[str, set[str]]
    external: dict[str, set[str]]


def module_name(root: Path, path: Path) -> str:
    """``root/pkg/a/b.py`` -> ``pkg.a.b``; ``root/pkg/a/__init__.py`` -> ``pkg.a``."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def scan(root: Path, package: str) -> Imports:
    """Every import of every module of ``root/package`` (any depth in the file: functions and
    ``TYPE_CHECKING`` blocks included). An import of a package's member that is not a module
    counts as an import of the package (its ``__init__``)."""
    files = {module_name(root, p): p for p in sorted((root / package).rglob("*.py"))}
    modules = set(files)

    def known(name: str) -> str | None:
        """The longest prefix of the dotted ``name`` that is a module of the package."""
        parts = name.split(".")
        for n in range(len(parts), 0, -1):
            candidate = ".".join(parts[:n])
            if candidate in modules:
                return candidate
        return None

    internal: dict[str, set[str]] = {m: set() for m in modules}
    external: dict[str, set[str]] = {m: set() for m in modules}
    for mod, path in files.items():
        is_package = path.name == "__init__.py"
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    target = known(alias.name)
                    if target is not None:
                        internal[mod].add(target)
                    elif alias.name.split(".")[0] != package:
                        external[mod].add(alias.name.split(".")[0])
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = mod.split(".") if is_package else mod.split(".")[:-1]
                    base = base[: len(base) - (node.level - 1)]
                    source = ".".join(base + ([node.module] if node.module else []))
                else:
                    source = node.module or ""
                if source.split(".")[0] != package:
                    external[mod].add(source.split(".")[0])
                    continue
                for alias in node.names:
                    target = known(f"{source}.{alias.name}") or known(source)
                    if target is not None:
                        internal[mod].add(target)
    for mod in modules:
        internal[mod].discard(mod)
    return Imports(internal, external)


def cycles(internal: dict[str, set[str]]) -> list[list[str]]:
    """The import circles: each strongly connected set of two or more modules (Tarjan),
    sorted, the largest first."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(internal.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group: list[str] = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for v in sorted(internal):
        if v not in index:
            visit(v)
    return sorted(found, key=lambda g: (-len(g), g))


def reachable(internal: dict[str, set[str]], start: str) -> dict[str, str]:
    """Every module ``start`` imports directly or through others, each with the module that
    imports it on one such path (for the messages)."""
    seen: dict[str, str] = {}
    todo = [start]
    while todo:
        v = todo.pop()
        for w in sorted(internal.get(v, ())):
            if w not in seen and w != start:
                seen[w] = v
                todo.append(w)
    return seen


def _under(module: str, prefixes: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def layer_violations(
    imports: Imports, layer: str, may_import: tuple[str, ...], forbidden_external: frozenset[str]
) -> list[str]:
    """Each module of ``layer`` (a dotted prefix) that imports, directly or through other
    modules of the package, a package module outside ``may_import`` or a module of
    ``forbidden_external``; one message per (module, offending import)."""
    problems: list[str] = []
    for mod in sorted(m for m in imports.internal if _under(m, (layer,))):
        via = reachable(imports.internal, mod)
        for target in sorted(via):
            if not _under(target, may_import):
                where = "" if via[target] == mod else f" (through {via[target]})"
                problems.append(f"{mod} imports {target}{where}")
        for source in [mod, *sorted(via)]:
            for name in sorted(imports.external.get(source, set()) & forbidden_external):
                where = "" if source == mod else f" (through {source})"
                problems.append(f"{mod} imports {name}{where}")
    return problems


# -- the checker, on a package made for it -----------------------------------------------------


def _write(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")


def test_the_checker_finds_a_circle_through_type_checking_and_function_imports(tmp_path: Path) -> None:
    _write(
        tmp_path,
        {
            "pkg/__init__.py": "",
            "pkg/model/__init__.py": "",
            "pkg/model/a.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.model.b import B\n",
            "pkg/model/b.py": "def f():\n    from . import c\n    return c\n",
            "pkg/model/c.py": "from .a import A\n",
            "pkg/model/d.py": "import pkg.model.a\n",
            "pkg/other.py": "import json\n",
        },
    )
    imports = scan(tmp_path, "pkg")
    assert imports.internal["pkg.model.a"] == {"pkg.model.b"}
    assert imports.internal["pkg.model.b"] == {"pkg.model.c"}
    assert imports.internal["pkg.model.c"] == {"pkg.model.a"}
    assert imports.external["pkg.other"] == {"json"}
    assert cycles(imports.internal) == [["pkg.model.a", "pkg.model.b", "pkg.model.c"]]
    # d imports into the circle but is not part of it; without c -> a there is no circle
    (tmp_path / "pkg/model/c.py").write_text("import json\n", encoding="utf-8")
    assert cycles(scan(tmp_path, "pkg").internal) == []


def test_the_checker_finds_forbidden_imports_direct_and_through_another_module(tmp_path: Path) -> None:
    _write(
        tmp_path,
        {
            "pkg/__init__.py": "",
            "pkg/errors.py": "",
            "pkg/fast/__init__.py": "",
            "pkg/fast/kern.py": "import triton\n",
            "pkg/model/__init__.py": "",
            "pkg/model/net.py": "import torch\nfrom pkg.errors import E\nfrom pkg.model import util\n",
            "pkg/model/util.py": "def f():\n    import logging\n",
            "pkg/model/fused.py": "from pkg.fast import kern\n",
            "pkg/model/clean.py": "import math\nfrom pkg.model.net import Net\n",
        },
    )
    imports = scan(tmp_path, "pkg")
    found = layer_violations(imports, "pkg.model", ("pkg.model", "pkg.errors"), frozenset({"triton", "logging"}))
    assert found == [
        "pkg.model.clean imports logging (through pkg.model.util)",
        "pkg.model.fused imports pkg.fast.kern",
        "pkg.model.fused imports triton (through pkg.fast.kern)",
        "pkg.model.net imports logging (through pkg.model.util)",
        "pkg.model.util imports logging",
    ]
    (tmp_path / "pkg/model/util.py").write_text("import math\n", encoding="utf-8")
    (tmp_path / "pkg/model/fused.py").write_text("import torch\n", encoding="utf-8")
    allowed = ("pkg.model", "pkg.errors")
    assert layer_violations(scan(tmp_path, "pkg"), "pkg.model", allowed, frozenset({"triton", "logging"})) == []


# -- voice_out --------------------------------------------------------------------------------


def test_voice_out_is_read_whole() -> None:
    """The scan sees the package as it is (a guard against a checker that reads nothing)."""
    imports = scan(REPO_ROOT, PACKAGE)
    assert "voice_out.model.llm" in imports.internal
    assert "torch" in imports.external["voice_out.model.llm"]
    assert imports.internal["voice_out.model.flow"] >= {"voice_out.model.flow_estimator"}


def test_voice_out_has_no_import_cycle() -> None:
    """No circle among voice_out's modules, function-level and TYPE_CHECKING imports counted."""
    assert cycles(scan(REPO_ROOT, PACKAGE).internal) == []


def test_model_imports_no_kernel_and_nothing_above_it() -> None:
    """model/ is plain eager PyTorch: it reaches no module of voice_out outside model/ and
    errors.py, and no Triton, threads, logging, asyncio, contextvars or environment."""
    imports = scan(REPO_ROOT, PACKAGE)
    assert layer_violations(imports, "voice_out.model", MODEL_MAY_IMPORT, MODEL_FORBIDDEN_EXTERNAL) == []


def test_fast_imports_nothing_of_the_engine_or_the_server() -> None:
    """fast/ is applied to a built model by the engine, never the other way round: it reaches
    model/, errors.py and itself only (the engine passes in what it needs, e.g. the runner
    whose kernels start-up compiles)."""
    imports = scan(REPO_ROOT, PACKAGE)
    assert layer_violations(imports, "voice_out.fast", FAST_MAY_IMPORT, frozenset()) == []


def test_the_scheduler_leaves_launches_to_the_runner_side() -> None:
    """The scheduler plans requests; what goes to the device in one step is the launch policy's,
    which the worker owns and joins to it: the scheduler reaches no launch policy, runner or
    worker, directly or through another module."""
    imports = scan(REPO_ROOT, PACKAGE)
    reached = set(reachable(imports.internal, "voice_out.engine.scheduler"))
    assert reached & {"voice_out.engine.launch", "voice_out.engine.runner", "voice_out.engine.worker"} == set()
    # the other way round is the design (and shows the scan reads these modules)
    assert "voice_out.engine.scheduler" in imports.internal["voice_out.engine.launch"]
    assert "voice_out.engine.launch" in imports.internal["voice_out.engine.worker"]
