"""Where a part runs: one CUDA device in half precision, or the CPU dry run (float32, toy sizes, gloo).

Every timed call goes through :meth:`Target.timed`, which synchronises the device before and after (a CUDA call
returns before its kernels finish); peak memory is ``torch.cuda.max_memory_allocated`` since the last
:meth:`Target.reset_peak` (None on the CPU: no allocator statistics there).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

DTYPES = ("float16", "bfloat16", "float32")


@dataclass(frozen=True)
class Target:
    device: str                       # "cuda" (the one device, cuda:0) or "cpu" (the dry run)
    dtypes: tuple[str, ...]           # part 1's dtypes, each family checked in every one
    sizes: str                        # "real" (part 3 at published sizes) or "toy"

    @classmethod
    def cuda(cls, dtypes: tuple[str, ...] = ("bfloat16", "float16")) -> Target:
        return cls("cuda", dtypes, "real")

    @classmethod
    def dry_run(cls) -> Target:
        return cls("cpu", ("float32",), "toy")

    @property
    def dry(self) -> bool:
        return self.device == "cpu"

    @property
    def torch_device(self):
        import torch

        return torch.device("cuda", 0) if self.device == "cuda" else torch.device("cpu")

    def dtype(self, preferred: str) -> str:
        """The dtype a part uses where the GPU would use ``preferred``: float32 in the dry run."""
        if preferred not in DTYPES:
            raise ValueError(f"dtype={preferred!r}: expected one of {', '.join(DTYPES)}")
        return "float32" if self.dry else preferred

    def sync(self) -> None:
        if self.device == "cuda":
            import torch

            torch.cuda.synchronize(self.torch_device)

    def timed(self, fn, *args, **kwargs) -> tuple[object, float]:
        """(fn's result, seconds it took on the device: synchronised before and after)."""
        self.sync()
        start = time.perf_counter()
        out = fn(*args, **kwargs)
        self.sync()
        return out, time.perf_counter() - start

    def reset_peak(self) -> None:
        if self.device == "cuda":
            import torch

            self.sync()
            torch.cuda.reset_peak_memory_stats(self.torch_device)

    def peak_bytes(self) -> int | None:
        if self.device != "cuda":
            return None
        import torch

        self.sync()
        return int(torch.cuda.max_memory_allocated(self.torch_device))

    def allocated_bytes(self) -> int | None:
        """The device memory tensors hold now (None on the CPU)."""
        if self.device != "cuda":
            return None
        import torch

        self.sync()
        return int(torch.cuda.memory_allocated(self.torch_device))

    def free(self) -> None:
        """Return what the part dropped to the device (between models: the next one needs the room)."""
        import gc

        gc.collect()
        if self.device == "cuda":
            import torch

            torch.cuda.empty_cache()


def gib(nbytes: int | None) -> str:
    return "n/a (cpu)" if nbytes is None else f"{nbytes / 2**30:.2f} GiB"
