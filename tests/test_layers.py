"""The layer rules of the tree, held as a table and checked by walking every import (``ast``, no dependency).

    edge      cli, cli_serve, cli_output, client, demo, __main__   may import anything of the runtime
    serve     HTTP + ZMQ stage process               core, engine, fetch (the cache's in-use lock), jobs, jobs.service,
                                                     playground
    playground  the page at / and its static files   core                 (never torch / diffusers)
    jobs.service  the job runner, runs and routes    core, engine, serve, jobs   (jobs/ but for store/, record, lease)
    fetch     model delivery (fetch-model, cache)    core                 (never torch / diffusers)
    jobs      video job store, records, leases       core                 (never torch / diffusers)
    engine    admission, the step, output delivery   core, sched, executor
    executor  ranks, IPC, async output               core, worker, distributed
    worker    device, groups, model runner           core, models, distributed, offload, compilation, quantization
    models    adapters, step contract, tiny builds   core, distributed
              (families/: one module per family, its sequence-parallel installer beside its facts)
    train     the tiny digits model's training       core, models
    offload   weight residency                       core, distributed (DLO's gathers)
    compilation  the compiled denoiser (torch.compile)  core
    quantization  quantized weights (torchao, fp8, GGUF)  core
    sched     scheduling policy                      core                 (never torch / diffusers)
    distributed  groups, collectives, CFG/Ulysses    core
    core      config, errors, request, outputs, scheduler_output, model_info, plugins, imageio, control,
              lora_spec, model_catalog, video_request, true_cfg, videoio, audioio, checkpoint, atomic_file,
              process_tree, weight_layout
                                                     core only            (never torch / diffusers)

The operator imports nothing of the runtime but ``stage_runtime.config`` (one source of truth for the
topology rules) and ``stage_runtime.model_catalog`` (the families, hence the tiny ``builtin`` models), and
never torch; inside it only ``kube.py`` talks to the API server (imports ``kubernetes``).
No source file is over 400 lines. Every import counts, also those inside functions and under TYPE_CHECKING.
No two modules of the runtime or the operator import each other, directly or around a loop (a strongly connected
component of the module graph; a ``from package import name`` is an edge to the package's ``__init__``).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CORE = {"config", "errors", "request", "outputs", "scheduler_output", "model_info", "plugins", "imageio", "control",
        "lora_spec", "model_catalog", "video_request", "true_cfg", "videoio", "audioio", "checkpoint", "atomic_file",
        "process_tree", "weight_layout"}
OPERATOR_MAY_IMPORT = ("stage_runtime.config", "stage_runtime.model_catalog")
EDGE = {"cli", "cli_serve", "cli_output", "client", "demo", "__main__", "__init__"}
# the modules of the jobs package that run jobs on the stage's engine and answer /v1/videos: the stage process wires
# them in (serve imports them) and they use its service (they import serve's), module by module without a loop
JOB_SERVICE = {"run", "run_checkpoints", "runner", "routes", "form", "content", "checkpoint_writer"}

# package → the packages it may import (its own package is always allowed)
RUNTIME_ALLOWED: dict[str, set[str]] = {
    "core": {"core"},
    "sched": {"core"},
    "distributed": {"core"},
    "offload": {"core", "distributed"},
    "compilation": {"core"},
    "quantization": {"core"},
    "models": {"core", "distributed"},
    "train": {"core", "models"},
    "worker": {"core", "models", "distributed", "offload", "compilation", "quantization"},
    "executor": {"core", "worker", "distributed"},
    "engine": {"core", "sched", "executor"},
    "serve": {"core", "engine", "fetch", "jobs", "jobs.service", "playground"},
    "playground": {"core"},
    "jobs.service": {"core", "engine", "serve", "jobs"},
    "fetch": {"core"},
    "jobs": {"core"},
}
HEAVY = ("torch", "diffusers", "transformers")
TORCH_FREE = {"core", "sched", "fetch", "jobs", "playground"}
MAX_LINES = 400
SOURCE_DIRS = ("stage_runtime", "operator", "e2e", "bench", "tests")


def runtime_layer(module: str) -> str:
    """``stage_runtime.engine.step`` → ``engine``; a top-level core module → ``core``; edge modules → ``edge``."""
    parts = module.split(".")
    if len(parts) == 1:
        return "edge"
    head = parts[1]
    if head in CORE:
        return "core"
    if len(parts) == 2 and head in EDGE:
        return "edge"
    if head == "jobs" and len(parts) > 2 and parts[2] in JOB_SERVICE:
        return "jobs.service"
    return head


def imports_of(path: Path) -> list[tuple[int, str]]:
    """(line, imported module) for every import in the file (``from a import b`` gives ``a``)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.lineno, node.module))
    return found


def module_name(path: Path, root: Path) -> str:
    rel = path.relative_to(root / "operator" if path.is_relative_to(root / "operator") else root)
    return ".".join(rel.with_suffix("").parts)


def module_graph(root: Path) -> dict[str, dict[str, str]]:
    """module → {module it imports: ``file:line``}, over ``stage_runtime/`` and ``operator/`` (a package is its
    ``__init__``; ``from a import b`` is an edge to ``a.b`` when that is a module, else to ``a``)."""
    files = {}
    for path in [*sorted((root / "stage_runtime").rglob("*.py")), *sorted((root / "operator").rglob("*.py"))]:
        files[module_name(path, root).removesuffix(".__init__")] = path
    graph: dict[str, dict[str, str]] = {}
    for module, path in files.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        edges = graph[module] = {}
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[:len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([base] if base else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in files else base for a in node.names]
            else:
                continue
            for target in targets:
                if target in files and target != module:
                    edges.setdefault(target, f"{path.relative_to(root)}:{node.lineno}")
    return graph


def strongly_connected(graph: dict[str, dict[str, str]]) -> list[list[str]]:
    """Tarjan's components with more than one module, iteratively (each sorted)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def import_cycles(root: Path) -> list[str]:
    """Each component as one loop through it, with the import line of every edge."""
    graph, out = module_graph(root), []
    for component in strongly_connected(graph):
        members, first = set(component), component[0]
        paths = {first: [first]}
        queue = [first]
        while queue:                              # the shortest way back to the first module
            node = queue.pop(0)
            for child in sorted(graph[node]):
                if child == first:
                    loop = paths[node] + [first]
                    queue = []
                    break
                if child in members and child not in paths:
                    paths[child] = paths[node] + [child]
                    queue.append(child)
        where = "; ".join(f"{graph[a][b]} imports {b}" for a, b in zip(loop, loop[1:]))
        out.append(f"import cycle {' → '.join(loop)} ({where})" +
                   (f"; the component also holds {', '.join(sorted(members - set(loop)))}" if members - set(loop) else ""))
    return out


def violations(root: Path) -> list[str]:
    """Every broken rule under ``root``, as ``file:line imports X (why)``."""
    out = []
    for path in sorted((root / "stage_runtime").rglob("*.py")):
        layer = runtime_layer(module_name(path, root))
        allowed = RUNTIME_ALLOWED.get(layer)
        for line, target in imports_of(path):
            where = f"{path.relative_to(root)}:{line} imports {target}"
            if target.split(".")[0] in HEAVY and layer in TORCH_FREE:
                out.append(f"{where} ({layer} never imports {target.split('.')[0]})")
            if allowed is None or not target.startswith("stage_runtime."):
                continue
            to = runtime_layer(target)
            if to != layer and to not in allowed:
                out.append(f"{where} ({layer} → {to} is not allowed; {layer} may import: "
                           f"{', '.join(sorted(allowed))})")
    for path in sorted((root / "operator").rglob("*.py")):
        for line, target in imports_of(path):
            where = f"{path.relative_to(root)}:{line} imports {target}"
            top = target.split(".")[0]
            if top == "stage_runtime" and target not in OPERATOR_MAY_IMPORT:
                out.append(f"{where} (the operator imports only {' and '.join(OPERATOR_MAY_IMPORT)} of the runtime)")
            if top in HEAVY:
                out.append(f"{where} (the operator never imports {top})")
            if top == "kubernetes" and path.name != "kube.py":
                out.append(f"{where} (only stage_operator/kube.py talks to the API server)")
    for folder in SOURCE_DIRS:
        for path in sorted((root / folder).rglob("*.py")):
            lines = len(path.read_text().splitlines())
            if lines > MAX_LINES:
                out.append(f"{path.relative_to(root)} has {lines} lines (at most {MAX_LINES})")
    return out + import_cycles(root)


def test_the_tree_keeps_the_layer_rules():
    assert violations(ROOT) == []


@pytest.mark.parametrize(("module", "source", "expected"), [
    ("stage_runtime/executor/bad.py", "from stage_runtime.sched import RequestScheduler\n",
     "stage_runtime/executor/bad.py:1 imports stage_runtime.sched (executor → sched is not allowed"),
    ("stage_runtime/models/bad.py", "def f():\n    from stage_runtime.worker.worker import DiffusionWorker\n",
     "stage_runtime/models/bad.py:2 imports stage_runtime.worker.worker (models → worker is not allowed"),
    ("stage_runtime/distributed/bad.py", "from stage_runtime.models.families.wan import WanAdapter\n",
     "stage_runtime/distributed/bad.py:1 imports stage_runtime.models.families.wan (distributed → models is not allowed"),
    ("stage_runtime/models/families/bad.py", "from stage_runtime.engine import DiffusionEngine\n",
     "stage_runtime/models/families/bad.py:1 imports stage_runtime.engine (models → engine is not allowed"),
    ("stage_runtime/request.py", "import torch\n", "stage_runtime/request.py:1 imports torch (core never imports torch)"),
    ("stage_runtime/sched/bad.py", "from diffusers import DDIMScheduler\n",
     "stage_runtime/sched/bad.py:1 imports diffusers (sched never imports diffusers)"),
    ("stage_runtime/outputs.py", "from stage_runtime.engine import DiffusionEngine\n",
     "stage_runtime/outputs.py:1 imports stage_runtime.engine (core → engine is not allowed"),
    ("operator/stage_operator/bad.py", "from stage_runtime.request import SamplingParams\n",
     "operator/stage_operator/bad.py:1 imports stage_runtime.request (the operator imports only stage_runtime.config"),
    ("operator/stage_operator/reconcile.py", "import kubernetes\n",
     "operator/stage_operator/reconcile.py:1 imports kubernetes (only stage_operator/kube.py talks to the API server)"),
    ("stage_runtime/serve/big.py", "x = 1\n" * 401, "stage_runtime/serve/big.py has 401 lines (at most 400)"),
])
def test_a_broken_rule_is_named(tmp_path, module, source, expected):
    for folder in SOURCE_DIRS:
        (tmp_path / folder).mkdir()
    (tmp_path / "operator" / "stage_operator" / "kube.py").parent.mkdir(parents=True)
    (tmp_path / "operator" / "stage_operator" / "kube.py").write_text("import kubernetes\n")
    path = tmp_path / module
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(source)
    found = violations(tmp_path)
    assert len(found) == 1 and found[0].startswith(expected), found


def test_allowed_imports_pass(tmp_path):
    for folder in SOURCE_DIRS:
        (tmp_path / folder).mkdir()
    (tmp_path / "stage_runtime" / "engine").mkdir()
    (tmp_path / "stage_runtime" / "engine" / "ok.py").write_text(
        "from stage_runtime.sched import RequestScheduler\nfrom stage_runtime.executor.abstract import X\n"
        "from stage_runtime.request import DiffusionRequest\nimport torch\n")
    (tmp_path / "stage_runtime" / "cli.py").write_text("from stage_runtime.serve.app import make_app\n")
    assert violations(tmp_path) == []


def test_an_import_cycle_is_named_also_when_one_side_only_imports_for_type_checking(tmp_path):
    for folder in SOURCE_DIRS:
        (tmp_path / folder).mkdir()
    sched = tmp_path / "stage_runtime" / "sched"
    sched.mkdir()
    (sched / "__init__.py").write_text("")
    (sched / "base.py").write_text("from stage_runtime.sched.policy import make_policy\n")
    (sched / "policy.py").write_text("from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n"
                                     "    from stage_runtime.sched import base\n")
    (sched / "other.py").write_text("from stage_runtime.sched.base import X\n")
    assert violations(tmp_path) == [
        "import cycle stage_runtime.sched.base → stage_runtime.sched.policy → stage_runtime.sched.base "
        "(stage_runtime/sched/base.py:1 imports stage_runtime.sched.policy; "
        "stage_runtime/sched/policy.py:4 imports stage_runtime.sched.base)"]
