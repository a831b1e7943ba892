"""Part 3's quantization arm (FLUX.1-sized; docs/quantization.md): the real-size denoiser's weights in ``int8-weight``
and ``fp8``, each on a freshly drawn pipeline (quantizing changes it in place): the denoiser's bytes against the
unquantized ones in the same dtype (bfloat16 on the GPU), and a step tick of one request against the unquantized
tick. ``fp8`` on a GPU without FP8 matmuls (compute capability < 8.9) is a ``skip`` row with the runtime's refusal.
"""

from __future__ import annotations

import statistics

QUANTIZED = ("flux",)
METHODS = ("int8-weight", "fp8")


def quantization_arm(folder, spec, shape, target, dtype, args, eager_s: float, emit, config, tick_times,
                     build) -> None:
    from gpucheck.prebuilt import PIPES
    from gpucheck.target import gib
    from stage_runtime.errors import ConfigError
    from stage_runtime.worker.model_runner import DiffusionModelRunner

    for method in METHODS:
        check = f"{spec.name} quantization {method}, step"
        PIPES[folder] = build(spec.name, target)
        runner = DiffusionModelRunner(config(folder, spec, target, "step", dtype, quantization={"method": method}),
                                      target.torch_device)
        try:
            try:
                runner.load_model()
            except ConfigError as exc:
                emit(check, "skip", "", str(exc), model=spec.name, method=method)
                continue
            weights = runner.weights.components[spec.denoiser]
            target.reset_peak()
            times = tick_times(runner, spec, shape, target, 1, args.ticks, f"q-{method}-")
            peak = target.peak_bytes()
        finally:
            runner.close()
            PIPES.pop(folder, None)
            target.free()
        median = statistics.median(times)
        ratio = weights["bytes"] / weights["bytes_as_loaded"]
        emit(check, "info", f"{median / eager_s:.2f}x the unquantized step",
             f"{median * 1e3:.1f} ms (n={len(times)}); denoiser {gib(weights['bytes'])} = {ratio:.2f}x "
             f"{gib(weights['bytes_as_loaded'])} in {dtype}; peak {gib(peak)} [quantization]", model=spec.name,
             method=method, tick_s=times, ratio=median / eager_s, weight_bytes=weights["bytes"],
             weight_bytes_as_loaded=weights["bytes_as_loaded"], peak_bytes=peak, anchor="quantization")
