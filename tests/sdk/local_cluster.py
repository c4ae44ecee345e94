"""A shardserve-local cluster for the SDK tests (standard library only, so that both the system
Python and the SDK's venv can import it)."""
import os
import signal
import subprocess
import threading
import time

STORIES = "../shared/models/stories260K"  # relative to the repository root, where the tests run


class LocalCluster:
    """shardserve-local with one CPU worker serving `model`, running until stop()."""

    def __init__(self, bin_dir, model=STORIES, timeout=240):
        self.bin_dir = bin_dir
        self.proc = subprocess.Popen(
            [os.path.join(bin_dir, "shardserve-local"), f"--model={model}", "--workers=1"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.stderr = []
        self._threads = [threading.Thread(target=self._drain_stderr, daemon=True)]
        self._threads[0].start()
        self.address = None
        deadline = time.time() + timeout
        while time.time() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                break
            if line.startswith("ready: coordinator at "):
                self.address = line.split()[-1]
                self._threads.append(threading.Thread(target=self.proc.stdout.read, daemon=True))
                self._threads[-1].start()
                return
        self.stop()
        raise AssertionError("shardserve-local did not become ready: " + "".join(self.stderr[-30:]))

    def _drain_stderr(self):
        for line in self.proc.stderr:
            self.stderr.append(line)

    def cli(self, *args):
        """Runs `shardserve ARGS --server=ADDRESS` and returns the CompletedProcess (it must succeed)."""
        p = subprocess.run([os.path.join(self.bin_dir, "shardserve"), *args, f"--server={self.address}"],
                           capture_output=True, text=True, timeout=120)
        assert p.returncode == 0, f"shardserve {' '.join(args)} failed: {p.stderr}"
        return p

    def stop(self):
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
