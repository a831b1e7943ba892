"""The stage process (``stage-runtime serve``): one engine served over HTTP and ZMQ, with health,
metrics, a graceful drain on SIGTERM and fail-closed exit codes (docs/stage-process.md).

    proc.StageDiffusionProc   lifecycle: start, signals, drain, death, exit code, termination log
    service.StageService      what both frontends share: admission, outcomes, abort, stats, drain
    app / images              aiohttp routes (control routes; image generation incl. SSE)
    zmq_server.ZmqServer      ROUTER endpoint speaking msgpack (stage_runtime.client is its client)
    schemas / wire            edge validation (pydantic) and the msgpack message shapes
    metrics.StageMetrics      Prometheus families on a per-process registry
"""
