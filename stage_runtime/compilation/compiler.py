"""The rank's compiler: one compiled function per region, its graphs counted, every way out of it eager and said.

    install    right after loading, before parallelism, offload and LoRA wrap anything: each region's modules get
               their CompiledForward (compilation.regions); nothing compiles yet (torch.compile is lazy)
    warm-up    the engine runs small requests at every compile shape, rows 1 and 2+ (the batch dimension is
               dynamic: one graph serves every batch of 2 rows or more; a batch of 1 is its own graph), then
               ``warmed()``: from here on a new graph is a recompile, counted
    serving    a call runs the compiled function, except (a) inside ``eager(reason)`` (LoRA rows, the block cache
               under full compile), (b) after a fallback, (c) when a call needs a new graph and ``max_graphs`` are
               compiled (the dynamo stance eager_on_recompile: cached graphs still serve)

A fallback is never silent and never a crash: a compile error, or a warm-up that ran past ``timeout_s`` (checked
before each new graph is compiled; one graph's compile is not interrupted, so regional keeps the overshoot to one
block's compile), turns the rank eager for good with the reason in ``stats()`` (``mode_effective: none``), and the
call that failed is computed eagerly. An error the eager call raises too is the input's: it is raised as it is.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections import Counter
from typing import Any

import torch

from stage_runtime.compilation.crash_guard import CrashGuard
from stage_runtime.compilation.regions import Region, uninstall
from stage_runtime.config import CompileConfig
from stage_runtime.errors import WorkerFatalError

log = logging.getLogger(__name__)


class CompileTimeout(RuntimeError):
    """The warm-up compile ran past ``compile.timeout_s``: raised in the backend, before a graph is compiled."""


def _inductor_counts() -> Counter:
    from torch._dynamo.utils import counters

    return Counter(counters["inductor"])


class Compiler:
    def __init__(self, config: CompileConfig, mode: str, regions: list[Region], device: torch.device,
                 auto_reason: str | None = None, holders: frozenset[str] = frozenset(), guard_key: str = ""):
        self.config = config
        self.mode = mode                      # the effective mode asked for (auto resolved): regional | full
        self.regions = regions
        self.device = device
        self.auto_reason = auto_reason
        self._holders = holders               # the pipeline components compiled (the denoiser, or its parts)
        self.reason: str | None = None        # why this rank fell back to eager (None: compiled)
        self.graphs = 0                       # graphs compiled by this rank's backend
        self.recompiles = 0                   # … of them after warm-up
        self.compile_s = 0.0                  # seconds spent in calls that compiled a graph
        self.warm_compile_s: float | None = None   # compile_s when warm-up ended
        self.warm = False
        self.limited = False                  # max_graphs reached: new shapes run eagerly
        self.eager_calls: Counter[str] = Counter()   # runner calls (waves, ticks) run eagerly, by reason
        self._eager_reason: list[str] = []    # a stack (nested eager() contexts)
        self._deadline: float | None = None  # the warm-up's compile bound (monotonic), from begin_warmup
        self._bound = config.timeout_s
        self._baseline = _inductor_counts()
        self._cache_counts: Counter | None = None
        # inductor's defaults: its cpp_wrapper was faster on CPU for tiny graphs, but segfaults on ops without a C shim
        # (crash_guard.py), so it is not used
        self._inductor_options: dict = {}
        for region in regions:
            region.compiled = torch.compile(region.function, backend=self._backend, dynamic=True)
        self._guard = CrashGuard(config.cache_dir, guard_key) if config.cache_dir and regions else None
        configure_dynamo(config)

    # -- the backend: counts, bounds, then inductor ----------------------------------------------------------
    def _backend(self, gm: torch.fx.GraphModule, example_inputs: list) -> Any:
        if not self.warm and time.monotonic() > self._deadline:
            raise CompileTimeout(self._timeout_words())
        from torch._inductor.compile_fx import compile_fx

        compiled = compile_fx(gm, example_inputs, config_patches=self._inductor_options)
        self.graphs += 1
        if self.warm:
            self.recompiles += 1
            log.warning("compile: a new graph after warm-up (%d so far; max_graphs=%d)", self.recompiles,
                        self.config.max_graphs)
        return compiled

    # -- a call ----------------------------------------------------------------------------------------------
    def call(self, region: Region, module: torch.nn.Module, args: tuple, kwargs: dict) -> Any:
        if self._deadline is None:
            self.begin_warmup()                         # no warm-up said it began: from the first compiled call
        elif self.reason is None and not self.warm and time.monotonic() > self._deadline:
            self.fall_back(self._timeout_words())
        if self.reason is not None or self._eager_reason:
            return region.function(module, *args, **kwargs)
        graphs, start = self.graphs, time.perf_counter()
        try:
            out = region.compiled(module, *args, **kwargs)
        except WorkerFatalError:
            raise
        except Exception as exc:        # the compiler's, unless the eager call fails the same way (then the input's)
            out = region.function(module, *args, **kwargs)
            self.fall_back(f"{region.name}: {_describe(exc)}")
            return out
        if self.graphs != graphs:
            self.compile_s += time.perf_counter() - start
            if self.graphs >= self.config.max_graphs and not self.limited:
                self._limit()
        return out

    @contextlib.contextmanager
    def eager(self, reason: str):
        """While inside, every region runs its eager forward (a call that needs hooks inside the blocks to act)."""
        self._eager_reason.append(reason)
        self.eager_calls[reason] += 1
        try:
            yield
        finally:
            self._eager_reason.pop()

    def eager_reason(self, requests, loras, cached: bool) -> str | None:
        """Why a call of these requests must run eagerly: LoRA rows on a compiled component (the per-row hooks inside
        the blocks act only eagerly), or block-cache rows under full compile (the skip is per block, inside the
        graph); None: compiled."""
        if loras is not None and self._holders:
            touched = {component for r in requests for ref in r.sampling.loras
                       if (weights := loras.adapters.get(ref.name)) is not None for component in weights.modules}
            if touched & self._holders:
                return "lora"
        if cached and self.mode == "full":
            return "block_cache"
        return None

    def _timeout_words(self) -> str:
        if self._bound < self.config.timeout_s:
            return (f"the warm-up compile ran past {self._bound:g} s, what the startup budget left "
                    f"(compile.timeout_s={self.config.timeout_s:g})")
        return f"the warm-up compile ran past compile.timeout_s={self.config.timeout_s:g}"

    def fall_back(self, reason: str) -> None:
        """This rank serves eagerly from now on, and says why."""
        if self.reason is None:
            self.reason = reason
            log.warning("compile: falling back to eager (%s)", reason)

    def _limit(self) -> None:
        """max_graphs compiled: a call that would need another graph runs eagerly (compiled graphs still serve)."""
        self.limited = True
        torch.compiler.set_stance("eager_on_recompile")
        log.warning("compile: max_graphs=%d reached; shapes without a graph now run eagerly", self.config.max_graphs)

    # -- warm-up and what it says ------------------------------------------------------------------------------
    def begin_warmup(self, budget_s: float | None = None) -> dict:
        """The engine's warm-up starts: compiling may go on for ``timeout_s``, or ``budget_s`` when that is shorter
        (what the stage's startup budget leaves: past it the process would be restarted, compiled or not)."""
        bound = self.config.timeout_s if budget_s is None else min(self.config.timeout_s, max(0.0, budget_s))
        self._deadline = time.monotonic() + bound
        self._bound = bound
        if self._guard is not None and not self.warm and self.reason is None:
            if self._guard.previous_died():
                self.fall_back(f"a previous warm-up of this model compiling {self.mode} died with its process "
                               f"(its marker {self._guard.path} was left): serving eagerly; delete it to compile again")
            else:
                self._guard.hold()
        return self.stats()

    def warmed(self) -> dict:
        """Warm-up is over: later graphs are recompiles; the cache outcome is fixed. This rank's stats."""
        if not self.warm:
            self.warm = True
            self.warm_compile_s = self.compile_s
            if self._guard is not None:
                self._guard.release()
            self._cache_counts = _inductor_counts() - self._baseline
            if self.graphs >= self.config.max_graphs and not self.limited:
                self._limit()
        return self.stats()

    def cache_outcome(self) -> str | None:
        counts = self._cache_counts if self._cache_counts is not None else _inductor_counts() - self._baseline
        hits, misses = counts.get("fxgraph_cache_hit", 0), counts.get("fxgraph_cache_miss", 0)
        if not hits and not misses:
            return None
        return "hit" if not misses else "miss" if not hits else "partial"

    def stats(self) -> dict:
        return {"mode": self.config.mode, "mode_effective": "none" if self.reason else self.mode,
                "reason": self.reason, "auto": self.auto_reason, "warm": self.warm, "graphs": self.graphs,
                "recompiles": self.recompiles, "max_graphs": self.config.max_graphs,
                "graph_limit_reached": self.limited,
                "cold_compile_s": round(self.warm_compile_s if self.warm_compile_s is not None else self.compile_s, 3),
                "compile_s": round(self.compile_s, 3), "cache": self.cache_outcome(),
                "cache_dir": self.config.cache_dir, "eager_calls": dict(self.eager_calls),
                "regions": [r.describe() for r in self.regions]}

    def close(self) -> None:
        """The modules get their eager forwards back; dynamo's stance is the default again."""
        uninstall(self.regions)
        if self._guard is not None:
            self._guard.release()
        if self.limited:
            torch.compiler.set_stance("default")
            self.limited = False


def configure_dynamo(config: CompileConfig) -> None:
    """Process-wide settings the compile needs: where artifacts go (inductor's and AOTAutograd's on-disk caches, so a
    restarted process compiles warm) and dynamo's own per-function graph limit raised to ours (ours decides)."""
    if config.cache_dir:
        os.makedirs(config.cache_dir, exist_ok=True)
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = config.cache_dir
    import torch._dynamo.config as dynamo_config

    dynamo_config.recompile_limit = max(dynamo_config.recompile_limit, config.max_graphs + 1)
    dynamo_config.accumulated_recompile_limit = max(dynamo_config.accumulated_recompile_limit, config.max_graphs + 1)


def _describe(exc: BaseException) -> str:
    """The cause a compile failure names: the timeout's own words, else the innermost exception (dynamo wraps the
    backend's error in BackendCompilerFailed, inductor's in InductorError)."""
    chain: list[BaseException] = []
    while exc is not None and len(chain) < 8:
        chain.append(exc)
        exc = getattr(exc, "inner_exception", None) or exc.__cause__
    timeout = next((e for e in chain if isinstance(e, CompileTimeout)), None)
    if timeout is not None:
        return str(timeout)
    return f"{type(chain[-1]).__name__}: {_first_line(chain[-1])}"


def _first_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split("\n", 1)[0].split())
    return text[:300] or type(exc).__name__
