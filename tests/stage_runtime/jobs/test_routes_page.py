"""``GET /v1/videos`` pages without a scan (jobs.routes.read_page): only the ids are listed, and only the page's
records (and one more, for ``has_more``) are read; expired jobs are passed over; both orders, ``after``."""

from __future__ import annotations

import time

from stage_runtime.jobs.record import JobRecord, new_job_id
from stage_runtime.jobs.store.filesystem import FileJobStore
from stage_runtime.jobs.routes import read_page


class CountingStore(FileJobStore):
    def __init__(self, root):
        super().__init__(root)
        self.reads = 0

    def get(self, job_id: str):
        self.reads += 1
        return super().get(job_id)


def make_jobs(store: FileJobStore, n: int, expired: set[int] = frozenset()) -> list[str]:
    ids, start = [], time.time() - 1000
    for i in range(n):
        now = start + i
        record = JobRecord(id=new_job_id(now), model="m", prompt="p", size="16x16", num_frames=9, fps=8, num_steps=2,
                           created_at=now, params={"prompt": "p"},
                           **({"status": "completed", "expires_at": now} if i in expired else {}))
        store.create(record)
        ids.append(record.id)
    return ids


def test_a_page_reads_its_records_and_one_more_not_the_store(tmp_path):
    store = CountingStore(tmp_path / "s").open()
    ids = make_jobs(store, 40, expired={38})
    page, more = read_page(store, None, 5, "desc", time.time())
    assert [r.id for r in page] == [ids[39], *ids[37:33:-1]] and more          # the expired 38 passed over
    assert store.reads == 7                                                     # 5, the expired one, one more
    store.reads = 0
    page, more = read_page(store, ids[35], 10, "asc", time.time())
    assert [r.id for r in page] == [ids[36], ids[37], ids[39]] and not more and store.reads == 4


def test_a_store_failure_answers_503_with_retry_after():
    """Nothing was stored: the client may send the same request again (the OpenAI SDK retries on it)."""
    from stage_runtime.errors import JobStoreError
    from stage_runtime.serve.app import error_response

    class Service:
        def retry_after(self) -> int:
            raise AssertionError("a store failure is not a full queue")

    resp = error_response(JobStoreError("job store 's3://b/p': unreachable"), Service())
    assert resp.status == 503 and resp.headers["Retry-After"] == "5"
