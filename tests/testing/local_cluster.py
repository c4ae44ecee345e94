"""A shardserve-local cluster for the Python end-to-end tests and benchmarks: a coordinator and
workers as separate processes on 127.0.0.1, running until stop(). Standard library only, so that
both the system Python and the SDK test's venv can import it:

    sys.path.insert(0, os.path.join(REPO, "tests", "testing"))
    from local_cluster import LocalCluster
"""
import os
import signal
import subprocess
import threading
import time

# The trained test model, relative to the repository root (where the tests run).
STORIES = "../shared/models/stories260K"


class LocalCluster:
    """shardserve-local --model=MODEL --workers=N --devices_per_worker=DEVICES EXTRA...

    Once the constructor returns, the cluster serves and these are set from what shardserve-local
    printed: `address` (the coordinator's gRPC HOST:PORT), `http` (the OpenAI API's URL, with
    --http_listen in `extra`, else None), `worker_metrics` (one URL per worker) and
    `coordinator_metrics` (a URL; both empty/None with --metrics=false), `tls_ca` (with
    --public_tls: the CA file the public API's certificate chains to; cli() passes it). `stderr` collects the
    processes' log lines as they come (shardserve-local passes its children's stderr through).
    Raises AssertionError, with the log's tail, when the cluster does not become ready in time.
    """

    def __init__(self, bin_dir, model=STORIES, workers=1, devices="cpu:1", extra=(), env=None, timeout=240):
        self.bin_dir = bin_dir
        extra = list(extra)
        self.proc = subprocess.Popen(
            [os.path.join(bin_dir, "shardserve-local"), f"--model={model}", f"--workers={workers}",
             f"--devices_per_worker={devices}", *extra],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env=None if env is None else dict(os.environ, **env))
        self.address = self.http = self.coordinator_metrics = self.tls_ca = None
        self.worker_metrics = []
        self._lock = threading.Lock()
        self._stderr = []
        self._stdout = []
        self._changed = threading.Condition(self._lock)
        self._threads = [threading.Thread(target=self._drain, args=(self.proc.stderr, self._stderr), daemon=True),
                         threading.Thread(target=self._drain, args=(self.proc.stdout, self._stdout), daemon=True)]
        for t in self._threads:
            t.start()
        # The lines shardserve-local prints once ready: the ready line, the HTTP URL, then one metrics
        # URL per worker and the coordinator's.
        metrics = "--metrics=false" not in extra
        want = (1 + any(a.startswith("--http_listen") for a in extra) + ("--public_tls" in extra) +
                (workers + 1 if metrics else 0))
        deadline = time.time() + timeout
        with self._lock:
            while len(self._stdout) < want and self.proc.poll() is None and time.time() < deadline:
                self._changed.wait(timeout=0.2)
            lines = list(self._stdout)
        for line in lines:
            if line.startswith("ready: coordinator at "):
                self.address = line.split()[-1]
            elif line.startswith("http: "):
                self.http = line.split()[-1]
            elif line.startswith("tls ca: "):
                self.tls_ca = line.split()[-1]
            elif line.startswith("metrics: "):
                self.worker_metrics.append(line.split()[-1])
            elif line.startswith("coordinator metrics: "):
                self.coordinator_metrics = line.split()[-1]
        if len(lines) < want or self.address is None:
            self.stop()
            raise AssertionError(f"shardserve-local did not become ready: {''.join(self.stderr[-30:])}")

    def _drain(self, stream, lines):
        for line in stream:
            with self._lock:
                lines.append(line)
                self._changed.notify_all()

    @property
    def stderr(self):
        """The log lines so far (a copy)."""
        with self._lock:
            return list(self._stderr)

    def log(self):
        """The log so far, as one string."""
        return "".join(self.stderr)

    def cli(self, *args, check=True, timeout=300):
        """Runs `shardserve ARGS --server=ADDRESS`; the CompletedProcess (which must succeed with check)."""
        tls = []
        if self.tls_ca:  # the client certificate shardserve-local made beside the CA (roles client, admin)
            client = os.path.join(os.path.dirname(os.path.dirname(self.tls_ca)), "client")
            tls = [f"--tls_ca_file={self.tls_ca}", "--tls_server_name=localhost",
                   f"--tls_cert_file={client}/tls.crt", f"--tls_key_file={client}/tls.key"]
        p = subprocess.run([os.path.join(self.bin_dir, "shardserve"), *args, f"--server={self.address}", *tls],
                           capture_output=True, text=True, timeout=timeout)
        if check:
            assert p.returncode == 0, f"shardserve {' '.join(args)} failed: {p.stderr}"
        return p

    def stop(self):
        """SIGTERM (SIGKILL after 30 s); returns shardserve-local's exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        for t in self._threads:
            t.join(timeout=10)
        self.proc.stdout.close()
        self.proc.stderr.close()
        return self.proc.returncode
