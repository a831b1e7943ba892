"""The GPU check's parts (``bench/gpu_check.py``; docs/testing.md, "The GPU check"), one idea per module.

    target      where a part runs (CUDA with half precision, or the CPU dry run in float32), timed calls, peak memory
    report      a row of the table and its JSON, the environment (GPU, driver, torch, CUDA)
    supervise   each part in a child process of its own: a time budget, its processes and /dev/shm segments swept
    families    part 1: every served family in request and step mode against the bare diffusers call
    residency   part 1: offload tiers bitwise against no offload; a preempted request resumed from host memory
    forkstart   part 1: an ``mp`` engine's rank forked from the fork server initialises the device
    ranks       rank processes on one or more devices over gloo or NCCL (shared with ``bench/gpu_smoke.py``)
    parallel    part 2: CFG, Ulysses, ring and TP on 2 and 4 ranks sharing one device, against one rank
    sizes       part 3's models: FLUX.1-dev-, Wan-2.1-1.3B- and SDXL-sized denoisers with random weights
    prebuilt    an adapter plug-in serving a pipeline built in this process (no save, no load)
    throughput  part 3: engine vs bare, step-mode batches vs sequential, peak memory, offload tiers' step time
    anchors     the published numbers part 3's figures are printed next to
"""
