"""Video jobs that live beside the replicas, not inside one (docs/http-api.md "Video jobs").

    record.py   a job's record (the JSON the store keeps) and the OpenAI ``Video`` object it answers as
    store.py    the shared-folder store: records, inputs, outputs and the step checkpoint of each job in one folder,
                written atomically
    lease.py    which replica runs a job: a lease it renews; another replica claims it once it expires

Plain data and files only: no torch, no engine. The stage process runs jobs through its own engine
(``stage_runtime.jobs.runner``, ``stage_runtime.jobs.run``) and answers the routes (``stage_runtime.jobs.routes``).
"""
