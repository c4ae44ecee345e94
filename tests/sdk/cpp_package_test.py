#!/usr/bin/env python3
"""The installed C++ SDK package: `cmake --install BUILD --component sdk` into a temporary prefix,
then sdk/cpp/examples configured and built as a separate CMake project with
find_package(shardserve), run against a bad address (a clear UNAVAILABLE error) and against a
local cluster (the same text as the CLI for the same greedy request).
    python3 tests/sdk/cpp_package_test.py BUILD_DIR"""
import os
import re
import shutil
import subprocess
import sys
import tempfile
import unittest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "testing"))
from local_cluster import LocalCluster  # noqa: E402

BUILD = None
PROMPT = "Once upon a time"


def cache_value(name):
    with open(os.path.join(BUILD, "CMakeCache.txt")) as f:
        for line in f:
            m = re.match(rf"{name}:[A-Z]+=(.*)", line.strip())
            if m:
                return m.group(1)
    return ""


def run(*cmd, **kw):
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600, **kw)
    assert p.returncode == 0, f"{' '.join(cmd)} failed:\n{p.stdout}\n{p.stderr}"
    return p


class InstalledPackage(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.mkdtemp(prefix="shardserve-sdk-")
        prefix = os.path.join(cls.tmp, "prefix")
        run("cmake", "--install", BUILD, "--component", "sdk", "--prefix", prefix)
        cls.prefix = prefix
        args = ["cmake", "-S", "sdk/cpp/examples", "-B", os.path.join(cls.tmp, "build"), "-G", "Ninja",
                f"-DCMAKE_PREFIX_PATH={prefix}", "-DCMAKE_BUILD_TYPE=Release",
                f"-DCMAKE_CXX_COMPILER={cache_value('CMAKE_CXX_COMPILER')}"]
        launcher = cache_value("CMAKE_CXX_COMPILER_LAUNCHER")
        if launcher:
            args.append(f"-DCMAKE_CXX_COMPILER_LAUNCHER={launcher}")
        run(*args)
        run("cmake", "--build", os.path.join(cls.tmp, "build"))
        cls.example = os.path.join(cls.tmp, "build", "shardserve_client_example")

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.tmp, ignore_errors=True)

    def test_package_holds_the_header_and_no_generated_code(self):
        self.assertTrue(os.path.isfile(os.path.join(self.prefix, "include", "shardserve", "client.h")))
        headers = [f for _, _, files in os.walk(self.prefix) for f in files if f.endswith(".pb.h")]
        self.assertEqual(headers, [])
        for name in ("shardserveConfig.cmake", "shardserveConfigVersion.cmake", "shardserveTargets.cmake"):
            found = [d for d, _, files in os.walk(self.prefix) if name in files]
            self.assertTrue(found, name)

    def test_bad_address_gives_a_clear_error(self):
        p = subprocess.run([self.example, "127.0.0.1:1", PROMPT], capture_output=True, text=True, timeout=60)
        self.assertEqual(p.returncode, 1, p.stderr)
        self.assertIn("UNAVAILABLE", p.stderr)
        self.assertIn("127.0.0.1:1", p.stderr)
        p = subprocess.run([self.example, "no-port", PROMPT], capture_output=True, text=True, timeout=60)
        self.assertEqual(p.returncode, 2)
        self.assertIn("INVALID_ARGUMENT", p.stderr)
        self.assertIn("HOST:PORT", p.stderr)

    def test_example_matches_the_cli_on_a_local_cluster(self):
        cluster = LocalCluster(os.path.join(BUILD, "bin"))
        try:
            p = subprocess.run([self.example, cluster.address, PROMPT, "24"], capture_output=True, text=True,
                               timeout=120)
            self.assertEqual(p.returncode, 0, p.stderr)
            cli = cluster.cli("generate", "--prompt", PROMPT, "--max_tokens", "24")
            self.assertEqual(p.stdout, cli.stdout)
            self.assertGreater(len(p.stdout.strip()), 10)
            self.assertIn("model: LlamaForCausalLM, 5 layers, vocabulary 512", p.stderr)
            self.assertIn("finish_reason: length", p.stderr)
            self.assertIn("+ 24 completion tokens", p.stderr)
        finally:
            self.assertEqual(cluster.stop(), 0)


if __name__ == "__main__":
    BUILD = os.path.abspath(sys.argv.pop(1))
    unittest.main(verbosity=2)
