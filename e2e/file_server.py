"""A small HTTP file server on loopback for model-delivery tests: serves files from a folder, honours
`Range: bytes=N-` (206), keeps an access log (method, path, Range header, status), and can break the
first response of a path after N bytes (to exercise a resume).

    with FileServer(folder) as server:
        url = server.url('tiny.tar.gz')
        ...
        server.gets('tiny.tar.gz')   # how many GETs that file got
"""
from __future__ import annotations

import http.server
import threading
from pathlib import Path


class _Handler(http.server.BaseHTTPRequestHandler):
    server: _Server

    def log_message(self, *args: object) -> None:  # the access log below, not stderr
        return

    def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
        name = self.path.lstrip('/')
        path = self.server.folder / name
        rng = self.headers.get('Range')
        if '..' in name or not path.is_file():
            self._log(rng, 404)
            self.send_error(404)
            return
        data = path.read_bytes()
        start = int(rng.removeprefix('bytes=').split('-')[0]) if rng and rng.startswith('bytes=') else 0
        if start >= len(data) and rng:
            self._log(rng, 416)
            self.send_error(416)
            return
        status = 206 if rng else 200
        self._log(rng, status)
        self.send_response(status)
        self.send_header('Content-Length', str(len(data) - start))
        if rng:
            self.send_header('Content-Range', f'bytes {start}-{len(data) - 1}/{len(data)}')
        self.end_headers()
        body = data[start:]
        if (cut := self.server.break_after.pop(name, None)) is not None:
            self.wfile.write(body[:cut])
            self.wfile.flush()
            self.connection.shutdown(2)  # the client sees the transfer break mid-way
            return
        self.wfile.write(body)

    def _log(self, rng: str | None, status: int) -> None:
        with self.server.lock:
            self.server.access_log.append(('GET', self.path, rng, status))


class _Server(http.server.ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, folder: Path):
        super().__init__(('127.0.0.1', 0), _Handler)
        self.folder = folder
        self.access_log: list[tuple[str, str, str | None, int]] = []
        self.break_after: dict[str, int] = {}
        self.lock = threading.Lock()


class FileServer:
    def __init__(self, folder: Path):
        self._server = _Server(Path(folder))
        self._thread = threading.Thread(target=self._server.serve_forever, name='file-server', daemon=True)

    def __enter__(self) -> FileServer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(10)

    def url(self, name: str) -> str:
        host, port = self._server.server_address[:2]
        return f'http://{host}:{port}/{name}'

    @property
    def access_log(self) -> list[tuple[str, str, str | None, int]]:
        with self._server.lock:
            return list(self._server.access_log)

    def gets(self, name: str) -> int:
        return sum(1 for _, path, _, _ in self.access_log if path == f'/{name}')

    def break_first_response(self, name: str, after_bytes: int) -> None:
        self._server.break_after[name] = after_bytes
