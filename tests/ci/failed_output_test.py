#!/usr/bin/env python3
""".ci/failed_output.py against a ctest record made here: it prints the failed test's last output
lines (and no passing test's), keeps only the last LINES, and says so when there is no record."""
import os
import subprocess
import sys
import tempfile
import unittest

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", ".ci", "failed_output.py")


def block(index, name, lines, passed):
    out = [f"{index}/2 Testing: {name}", f"{index}/2 Test: {name}", "Command: \"/bin/true\"", "Directory: /tmp",
           f"\"{name}\" start time: Dec 02 00:54 UTC", "Output:", "-" * 58, *lines, "<end of output>",
           "Test time =   0.01 sec", "-" * 58, "Test Passed." if passed else "Test Failed.", ""]
    return out


class FailedOutput(unittest.TestCase):
    def run_script(self, build, *args):
        return subprocess.run([sys.executable, SCRIPT, build, *args], capture_output=True, text=True, check=True)

    def test_prints_the_failed_tests_last_lines_only(self):
        with tempfile.TemporaryDirectory() as build:
            tmp = os.path.join(build, "Testing", "Temporary")
            os.makedirs(tmp)
            log = ["Start testing: Dec 02 00:54 UTC", "-" * 58]
            log += block(1, "good_test", ["all fine"], True)
            log += block(2, "bad_test", [f"line {i}" for i in range(100)], False)
            with open(os.path.join(tmp, "LastTest.log"), "w") as f:
                f.write("\n".join(log) + "\n")
            with open(os.path.join(tmp, "LastTestsFailed.log"), "w") as f:
                f.write("2:bad_test\n")
            out = self.run_script(build).stdout
            self.assertIn("=== bad_test: the last 80 of 100 lines it printed", out)
            self.assertIn("line 99", out)
            self.assertIn("line 20\n", out)
            self.assertNotIn("line 19\n", out)
            self.assertNotIn("all fine", out)
            self.assertNotIn("-" * 58, out)
            out = self.run_script(build, "3").stdout
            self.assertIn("=== bad_test: the last 3 of 100 lines it printed\nline 97\nline 98\nline 99", out)

    def test_without_a_record_it_says_so(self):
        with tempfile.TemporaryDirectory() as build:
            out = self.run_script(build).stdout
            self.assertIn("failed_output: no record of the run in", out)


if __name__ == "__main__":
    unittest.main(verbosity=2)
