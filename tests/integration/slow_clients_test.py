#!/usr/bin/env python3
"""Slow or hostile HTTP clients against a real shardserve-coordinator process (issue 20, item 6):
64 slow connections (sending a request one byte per second, or silent) do not delay a
normal request to the OpenAI API or to /metrics beyond 1 s, and a 100 MB chunked request body is
refused (413) without the coordinator's RSS growing past 2x its idle size. No workers: the routes
used here answer without a cluster. Prints the figures it measures.

    python3 tests/integration/slow_clients_test.py build/bin
"""
import os
import socket
import subprocess
import sys
import threading
import time
import unittest
import urllib.request

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "testing"))
from ports import free_port  # noqa: E402
from local_cluster import STORIES  # noqa: E402

BIN = None  # directory with shardserve-coordinator
SLOW = 64


def rss_kib(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return -1


class SlowClients:
    """SLOW connections to port, sending `request` a byte per second (silent when it is empty)."""

    def __init__(self, port, request):
        self.socks = [socket.create_connection(("127.0.0.1", port)) for _ in range(SLOW)]
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._dribble, args=(request,), daemon=True)
        self.thread.start()
        time.sleep(0.3)  # let the server accept them all

    def _dribble(self, request):
        i = 0
        while not self.stop.is_set():
            for s in self.socks if request else []:
                try:
                    s.send(request[i % len(request):i % len(request) + 1])
                except OSError:
                    pass
            i += 1
            self.stop.wait(1.0)

    def close(self):
        self.stop.set()
        self.thread.join()
        for s in self.socks:
            s.close()


def timed_get(url):
    start = time.monotonic()
    with urllib.request.urlopen(url, timeout=30) as r:
        body = r.read()
        status = r.status
    return time.monotonic() - start, status, body


def chunked_post(port, path, total, pid):
    """POSTs `total` bytes chunked; returns (reply head, peak RSS KiB of pid while sending)."""
    s = socket.create_connection(("127.0.0.1", port))
    s.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              "Transfer-Encoding: chunked\r\n\r\n".encode())
    peak = [rss_kib(pid)]
    chunk = b"10000\r\n" + b" " * 0x10000 + b"\r\n"

    def send():
        try:
            for _ in range(total // 0x10000):
                s.sendall(chunk)
            s.sendall(b"0\r\n\r\n")
        except OSError:
            pass  # the server closed the connection

    sender = threading.Thread(target=send, daemon=True)
    sender.start()
    reply = b""
    s.settimeout(0.05)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        peak[0] = max(peak[0], rss_kib(pid))
        try:
            data = s.recv(65536)
        except socket.timeout:
            continue
        except OSError:
            break
        if not data:
            break
        reply += data
    s.close()
    sender.join(timeout=10)
    peak[0] = max(peak[0], rss_kib(pid))
    return reply, peak[0]


class SlowClientsTest(unittest.TestCase):
    # Numbered so that they run in this order (unittest sorts by name): the API first, on a fresh server.

    @classmethod
    def setUpClass(cls):
        cls.http_port, cls.metrics_port = free_port(), free_port()
        cls.proc = subprocess.Popen(
            [os.path.join(BIN, "shardserve-coordinator"), "--listen=127.0.0.1:0", "--control_listen=127.0.0.1:0",
             f"--model={STORIES}", "--expected_workers=1", f"--http_listen=127.0.0.1:{cls.http_port}",
             f"--metrics_listen=127.0.0.1:{cls.metrics_port}"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 60
        while True:
            try:
                timed_get(f"http://127.0.0.1:{cls.http_port}/v1/models")
                timed_get(f"http://127.0.0.1:{cls.metrics_port}/metrics")
                break
            except OSError:
                if time.monotonic() > deadline or cls.proc.poll() is not None:
                    raise
                time.sleep(0.1)

    @classmethod
    def tearDownClass(cls):
        cls.proc.terminate()
        cls.proc.wait(timeout=30)

    def check_not_delayed(self, port, path, silent=False):
        request = b"" if silent else f"GET {path} HTTP/1.1\r\nHost: x\r\nX-Pad: {'a' * 4000}".encode()
        slow = SlowClients(port, request)
        try:
            worst = 0.0
            for _ in range(4):  # over 3 s: past the silent connections' idle timeout too
                took, status, _ = timed_get(f"http://127.0.0.1:{port}{path}")
                self.assertEqual(status, 200)
                worst = max(worst, took)
                time.sleep(0.8)
            kind = "silent" if silent else "dribbling"
            print(f"\n{path} with {SLOW} {kind} connections: slowest of 4 requests {worst * 1000:.1f} ms", flush=True)
            self.assertLess(worst, 1.0)
        finally:
            slow.close()

    def test_1_dribbling_connections_do_not_delay_the_api(self):
        self.check_not_delayed(self.http_port, "/v1/models")

    def test_2_silent_connections_do_not_delay_the_api(self):
        self.check_not_delayed(self.http_port, "/v1/models", silent=True)

    def test_3_dribbling_connections_do_not_delay_metrics(self):
        self.check_not_delayed(self.metrics_port, "/metrics")

    def test_4_chunked_body_is_refused_without_buffering(self):
        idle = rss_kib(self.proc.pid)
        reply, peak = chunked_post(self.http_port, "/v1/completions", 100 << 20, self.proc.pid)
        print(f"\n100 MB chunked body: reply {reply[:12]!r}, coordinator RSS idle {idle} KiB, peak {peak} KiB",
              flush=True)
        self.assertTrue(reply.startswith(b"HTTP/1.1 413"), reply[:200])
        self.assertIn(b"request_too_large", reply)
        self.assertLess(peak, 2 * idle)


if __name__ == "__main__":
    BIN = sys.argv.pop(1) if len(sys.argv) > 1 else "build/bin"
    unittest.main(verbosity=2)
