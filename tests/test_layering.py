"""The package map's floors (docs/ARCHITECTURE.md): every import inside ``pdserve`` goes
to the same package or a lower floor, and there is no import cycle. Imports are read
statically from the source (``ast``), including imports inside functions and under
``TYPE_CHECKING``, so a lazy import cannot hide an upward dependency.

Process walls on top of the floors: the API server's process (every module the
``serving.api`` modules reach, directly or through others, and every ``frontend`` module
but the offline ``LLM``, which runs an engine in-process) loads no module that does model
work (:data:`MODEL_WORK`); it starts the engine-core process by the entry point's name
(``frontend.async_client.ENGINE_CORE_ENTRY``). ``bench`` speaks only HTTP: besides
itself it imports ``core_types`` and ``heap`` (the start-up GC freeze, standard library
only)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"

# lowest floor first; a module may import its own top-level package and anything listed
# before it, nothing after it
FLOORS = [
    ("config", "heap"),
    ("core_types",),
    ("distributed",),
    ("forward_context",),
    ("kernels",),
    ("layers",),
    ("models",),
    ("spec_decode",),
    ("runner",),
    ("profiling",),
    ("kv_transfer",),
    ("engine",),
    ("frontend",),
    ("metrics",),
    ("serving",),
    ("bench",),
    ("testing",),
    ("cli", "__main__", "__init__"),
]
FLOOR = {pkg: i for i, names in enumerate(FLOORS) for pkg in names}
# the three serving roles share serving's own modules and never import each other
SERVING_ROLES = ("api", "proxy", "launch")
# packages that do model work: never loaded by the API server's process
MODEL_WORK = (
    "distributed",
    "forward_context",
    "kernels",
    "layers",
    "models",
    "spec_decode",
    "runner",
    "profiling",
    "kv_transfer",
    "engine",
)
# frontend modules that run in-process with an engine, not in the API server's process
NOT_API_PROCESS = ("pdserve.frontend.llm",)
BENCH_MAY_IMPORT = ("bench", "core_types", "heap")


def _modules() -> dict[str, Path]:
    out = {}
    for p in (SRC / "pdserve").rglob("*.py"):
        name = ".".join(p.relative_to(SRC).with_suffix("").parts)
        out[name.removesuffix(".__init__")] = p
    return out


def _imports(name: str, path: Path, mods: dict[str, Path]) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module is not None:
            base = node.module
            if node.level:
                pkg = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
                base = ".".join(pkg[: len(pkg) - node.level + 1] + [node.module])
            for alias in node.names:
                cand = f"{base}.{alias.name}"
                found.add(cand if cand in mods else base)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
    return {m for m in found if m in mods and m not in (name, "pdserve")}


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    return {m: _imports(m, p, mods) for m, p in mods.items()}


def _top(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def test_every_package_has_a_floor() -> None:
    missing = {_top(m) for m in _graph()} - set(FLOOR)
    assert not missing, f"add {sorted(missing)} to FLOORS (and to docs/ARCHITECTURE.md)"


def test_imports_only_go_down() -> None:
    bad = []
    for mod, deps in _graph().items():
        for dep in deps:
            if FLOOR[_top(dep)] > FLOOR[_top(mod)]:
                bad.append(f"{mod} -> {dep}")
    assert not bad, "imports that go up a floor:\n" + "\n".join(sorted(bad))


def test_serving_roles_do_not_import_each_other() -> None:
    bad = []
    for mod, deps in _graph().items():
        parts = mod.split(".")
        if len(parts) < 2 or parts[1] != "serving":
            continue
        role = parts[2] if len(parts) > 2 else None  # None: a shared serving module
        for dep in deps:
            dparts = dep.split(".")
            drole = dparts[2] if len(dparts) > 2 and dparts[1] == "serving" else None
            if drole in SERVING_ROLES and drole != role:
                bad.append(f"{mod} -> {dep}")
    assert not bad, "\n".join(sorted(bad))


def _reachable(graph: dict[str, set[str]], roots: list[str]) -> dict[str, str]:
    """Every module ``roots`` import, directly or not: module -> the module importing it."""
    via: dict[str, str] = {}
    stack = list(roots)
    while stack:
        mod = stack.pop()
        for dep in graph[mod]:
            if dep not in via and dep not in roots:
                via[dep] = mod
                stack.append(dep)
    return via


def test_api_process_loads_no_model_work() -> None:
    graph = _graph()
    roots = [
        m
        for m in graph
        if m.startswith(("pdserve.serving.api", "pdserve.frontend")) and m not in NOT_API_PROCESS
    ]
    via = _reachable(graph, roots)
    bad = []
    for mod in sorted(list(via) + roots):
        if _top(mod) in MODEL_WORK:
            chain = [mod]
            while chain[-1] in via:
                chain.append(via[chain[-1]])
            bad.append(" <- ".join(chain))
    assert not bad, "the API process would load model work:\n" + "\n".join(bad)


def test_engine_core_entry_point_exists() -> None:
    """The API process names the engine-core entry point instead of importing it: the
    name must stay a function of that module."""
    from pdserve.frontend.async_client import ENGINE_CORE_ENTRY

    module, name = ENGINE_CORE_ENTRY
    path = _modules()[module]
    defs = {n.name for n in ast.parse(path.read_text()).body if isinstance(n, ast.FunctionDef)}
    assert name in defs, f"{module} defines no function {name}"


def test_bench_imports_only_core_types() -> None:
    bad = [
        f"{mod} -> {dep}"
        for mod, deps in _graph().items()
        if _top(mod) == "bench"
        for dep in deps
        if _top(dep) not in BENCH_MAY_IMPORT
    ]
    assert not bad, "bench speaks HTTP only:\n" + "\n".join(sorted(bad))


def test_no_import_cycles() -> None:
    graph = _graph()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
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
                cycles.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    assert not cycles, "\n".join(" <-> ".join(c) for c in cycles)


def test_no_source_file_over_600_lines() -> None:
    long = {
        str(p.relative_to(SRC)): n
        for p in (SRC / "pdserve").rglob("*.py")
        if (n := len(p.read_text().splitlines())) > 600
    }
    assert not long, long


def test_no_triton_function_is_decorated_on_import_outside_kernel_use() -> None:
    """``@triton.jit`` reads ``TRITON_INTERPRET`` when it decorates, at its module's
    import, and the kernel tests set it first (tests/kernels/conftest.py): the engine,
    runner, models and layers may import a kernel module with Triton functions only where
    they launch it (inside a function), never at their own import."""
    code = (
        "import sys\n"
        "import pdserve.cli, pdserve.frontend.llm, pdserve.engine.engine_core\n"
        "import pdserve.runner.model_runner, pdserve.runner.step_pipeline\n"
        "import pdserve.models.llama, pdserve.models.glm_moe_dsa\n"
        "from triton.runtime.jit import JITFunction\n"
        "print([m for m, mod in list(sys.modules.items()) if m.startswith('pdserve.kernels')"
        " and any(isinstance(v, JITFunction) for v in vars(mod).values())])\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", out.stdout
