"""Log files for the processes an integration test starts: one file per process in the test's
temporary folder, and the last lines of each for a failure message."""
import os


class ProcessLogs:
    """Mixin for a test case with `self.tmp` (a folder) and `self.logs` (a list, [] in setUp)."""

    def _log(self, name):
        f = open(os.path.join(self.tmp, name), "w")
        self.logs.append(f)
        return f

    def _log_tail(self, lines=15):
        out = []
        for f in self.logs:
            f.flush()
            with open(f.name) as r:
                out.append(f"--- {os.path.basename(f.name)}\n" + "".join(r.readlines()[-lines:]))
        return "\n".join(out)
