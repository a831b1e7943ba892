"""The layer rules of the tree, held as a table and checked by walking every import (``ast``, no dependency).

    edge      cli, client, demo, __main__           may import anything of the runtime
    serve     HTTP + ZMQ stage process               core, engine, fetch (the cache's in-use lock)
    fetch     model delivery (fetch-model, cache)    core                 (never torch / diffusers)
    engine    admission, the step, output delivery   core, sched, executor
    executor  ranks, IPC, async output               core, worker, distributed
    worker    device, groups, model runner           core, models, distributed, offload
    models    adapters, step contract, tiny builds   core, distributed
    offload   weight residency                       core
    sched     scheduling policy                      core                 (never torch / diffusers)
    distributed  groups, collectives, CFG/Ulysses    core
    core      config, errors, request, outputs, scheduler_output, model_info, plugins, imageio, control
                                                     core only            (never torch / diffusers)

The operator imports nothing of the runtime but ``stage_runtime.config`` (one source of truth for the
topology rules) and ``stage_runtime.model_catalog`` (the families, hence the tiny ``builtin`` models) and never torch; inside it only ``kube.py`` talks to the API server (imports ``kubernetes``).
No source file is over 400 lines. Every import counts, also those inside functions and under TYPE_CHECKING.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CORE = {"config", "errors", "request", "outputs", "scheduler_output", "model_info", "plugins", "imageio", "control",
        "lora_spec", "model_catalog"}
OPERATOR_MAY_IMPORT = ("stage_runtime.config", "stage_runtime.model_catalog")
EDGE = {"cli", "client", "demo", "__main__", "__init__"}

# package → the packages it may import (its own package is always allowed)
RUNTIME_ALLOWED: dict[str, set[str]] = {
    "core": {"core"},
    "sched": {"core"},
    "distributed": {"core"},
    "offload": {"core"},
    "models": {"core", "distributed"},
    "worker": {"core", "models", "distributed", "offload"},
    "executor": {"core", "worker", "distributed"},
    "engine": {"core", "sched", "executor"},
    "serve": {"core", "engine", "fetch"},
    "fetch": {"core"},
}
HEAVY = ("torch", "diffusers", "transformers")
TORCH_FREE = {"core", "sched", "fetch"}
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
    return out


def test_the_tree_keeps_the_layer_rules():
    assert violations(ROOT) == []


@pytest.mark.parametrize(("module", "source", "expected"), [
    ("stage_runtime/executor/bad.py", "from stage_runtime.sched import RequestScheduler\n",
     "stage_runtime/executor/bad.py:1 imports stage_runtime.sched (executor → sched is not allowed"),
    ("stage_runtime/models/bad.py", "def f():\n    from stage_runtime.worker.worker import DiffusionWorker\n",
     "stage_runtime/models/bad.py:2 imports stage_runtime.worker.worker (models → worker is not allowed"),
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
