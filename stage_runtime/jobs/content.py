"""``GET /v1/videos/{id}/content``: a completed job's file, as players and download tools fetch it.

One byte range (``Range: bytes=a-b``, ``a-``, ``-n``) answers 206 with ``Content-Range`` (a player seeks in the
MP4); a range past the end answers 416 with ``Content-Range: bytes */SIZE``; several ranges, or a header that is not
a byte range, get the whole file (RFC 9110 lets a server ignore ``Range``). Every answer says
``Accept-Ranges: bytes``. With ``jobs.presigned_content`` and a store that signs URLs (the object store), the answer
is a 307 redirect to a presigned URL valid ``jobs.presign_expiry_s`` seconds, and the bytes never pass through the
stage; a folder store always streams.
"""

from __future__ import annotations

import asyncio
import re

from aiohttp import web

from stage_runtime.errors import JobNotFoundError
from stage_runtime.jobs.store import OUTPUTS, JobStore

CONTENT_TYPES = {"video": "video/mp4", "thumbnail": "image/png", "frames": "application/zip", "audio": "audio/wav"}
CHUNK = 1 << 20
BYTE_RANGE = re.compile(r"^bytes=(\d*)-(\d*)$")


def byte_range(header: str | None, size: int) -> tuple[int, int] | None | bool:
    """(first, last) byte of the one range asked for; None: the whole file; False: not satisfiable."""
    match = BYTE_RANGE.match((header or "").strip())
    if match is None or (not match[1] and not match[2]):
        return None
    if not match[1]:                                   # the last n bytes
        suffix = int(match[2])
        return (max(0, size - suffix), size - 1) if suffix and size else False
    first = int(match[1])
    last = min(int(match[2]), size - 1) if match[2] else size - 1
    if match[2] and int(match[2]) < first:
        return None                                    # malformed: ignored, the whole file
    return (first, last) if first < size else False


async def send_content(request: web.Request, store: JobStore, video_id: str, variant: str, headers: dict[str, str],
                       presigned: bool, expires_s: int) -> web.StreamResponse:
    name = OUTPUTS[variant]
    filename = f"{video_id}.{name.rsplit('.', 1)[1]}"
    headers = {**headers, "Content-Type": CONTENT_TYPES[variant], "Accept-Ranges": "bytes",
               "Content-Disposition": f'attachment; filename="{filename}"'}
    if presigned:
        url = await asyncio.to_thread(store.presign, video_id, name, expires_s, filename, CONTENT_TYPES[variant])
        if url is not None:
            raise web.HTTPTemporaryRedirect(url, headers={"openai-poll-after-ms": headers["openai-poll-after-ms"]})
    try:
        size = await asyncio.to_thread(store.file_size, video_id, name)
    except JobNotFoundError:
        raise JobNotFoundError(f"no video job {video_id!r} (deleted meanwhile)") from None
    wanted = byte_range(request.headers.get("Range"), size)
    if wanted is False:
        return web.Response(status=416, headers={**headers, "Content-Range": f"bytes */{size}"})
    first, last = wanted if wanted else (0, size - 1)
    status = 206 if wanted else 200
    if wanted:
        headers["Content-Range"] = f"bytes {first}-{last}/{size}"
    try:
        handle = await asyncio.to_thread(store.open_file, video_id, name, first)
    except JobNotFoundError:
        raise JobNotFoundError(f"no video job {video_id!r} (deleted meanwhile)") from None
    try:
        response = web.StreamResponse(status=status, headers=headers)
        response.content_length = max(0, last - first + 1)
        await response.prepare(request)
        left = response.content_length
        while left > 0 and (chunk := await asyncio.to_thread(handle.read, min(CHUNK, left))):
            await response.write(chunk)
            left -= len(chunk)
    finally:
        await asyncio.to_thread(handle.close)
    await response.write_eof()
    return response
