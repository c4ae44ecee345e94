#!/usr/bin/env python3
"""Prints again, at the end of a failed ctest run, the last lines of what each failed test printed.

ctest --output-on-failure prints a failed test's output when it ends, and its summary (every
skipped GPU test, then the failures) comes long after; whoever reads only the tail of the CI log
then sees which test failed but not why. This reads the run's own record
(BUILD/Testing/Temporary/LastTestsFailed.log and LastTest.log).

Usage: failed_output.py BUILD_DIR [LINES]"""
import os
import sys


def main():
    build = sys.argv[1]
    keep = int(sys.argv[2]) if len(sys.argv) > 2 else 80
    tmp = os.path.join(build, "Testing", "Temporary")
    try:
        with open(os.path.join(tmp, "LastTestsFailed.log")) as f:
            failed = [line.strip().split(":", 1)[1] for line in f if ":" in line]
        with open(os.path.join(tmp, "LastTest.log"), errors="replace") as f:
            log = f.read().splitlines()
    except OSError as e:
        print(f"failed_output: no record of the run in {tmp}: {e}")
        return
    for name in failed:
        start = None
        for i, line in enumerate(log):
            if line.endswith(f"Test: {name}"):
                start = i
        if start is None:
            print(f"=== {name}: not in {tmp}/LastTest.log")
            continue
        body = []
        inside = False
        for line in log[start:]:
            if line == "<end of output>":
                break
            if inside:
                body.append(line)
            elif line == "Output:":
                inside = True
        body = body[1:]  # the dashes under "Output:"
        print(f"=== {name}: the last {min(keep, len(body))} of {len(body)} lines it printed")
        print("\n".join(body[-keep:]))


if __name__ == "__main__":
    main()
