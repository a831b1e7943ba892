"""The engine's warm-up before it reports ready: one request at the model's default size, then (compile on) each
compile shape at 1 row and 2+ rows (engine.compile_warmup), bounded by the stage's startup budget. A part of
:class:`~stage_runtime.engine.engine.DiffusionEngine` (its mixin)."""

from __future__ import annotations

from stage_runtime.engine.compile_warmup import compile_warmup_requests
from stage_runtime.engine.output_table import warmup_request
from stage_runtime.errors import ConfigError, EngineStartupError, InvalidRequestError


class EngineWarmup:
    def run_warmup(self, compile_budget_s: float | None = None) -> None:
        """The warm-up request, then (compile on) the compile warm-up, its compiling bounded by compile.timeout_s
        or ``compile_budget_s`` (what the stage's startup budget leaves) when shorter."""
        try:
            if self.config.compile.enabled:
                self.collective_rpc("compile_warmup", (compile_budget_s,))
            self.add_request(warmup_request(self.model_info)).result(timeout=600)
            if self.config.compile.enabled:
                self._compile_warmup()
        except ConfigError:
            raise
        except Exception as exc:
            raise EngineStartupError(f"Warmup failed: {type(exc).__name__}: {exc}") from exc

    def _compile_warmup(self) -> None:
        """Every compile shape at 1 row and 2+ rows (engine.compile_warmup), then every rank told that warm-up is
        over (``compile_warmed``: a later graph is a recompile). Each rank bounds its own compiling (timeout_s)."""
        wait = self.config.compile.timeout_s + 600
        for label, request in compile_warmup_requests(self.config.compile, self.model_info):
            try:
                self.add_request(request).result(timeout=wait)
            except InvalidRequestError as exc:
                raise ConfigError(f"compile.shapes: {label} cannot be served by {self.model_info.pipeline_class}: "
                                  f"{exc}") from None
        self.compile_warmup_stats = self.collective_rpc("compile_warmed")
