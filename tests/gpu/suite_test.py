#!/usr/bin/env python3
"""CPU-side check of the GPU suite (ctest gpu_suite_scripts_test), so that its scripts keep working
between the rare runs on GPU machines. Never builds the bundle (too slow for CI).

  python3 tests/gpu/suite_test.py [--bench PATH/shardserve-bench-gpu]

Checks: bash -n on bundle.sh and run.sh; suite.py's part and report logic on made-up GoogleTest and
benchmark outputs; run.sh end to end on a fake bundle (stand-in binaries, no GPU: every GPU part
skips and the report is written); with --bench, that the benchmark skips cleanly without a device.
"""
import argparse
import contextlib
import io
import json
import os
import shutil
import stat
import subprocess
import sys
import tarfile
import tempfile
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import suite  # noqa: E402

BENCH = None
PIPELINE_BENCH = None  # --pipeline_bench: the built shardserve-bench-pipeline, for hop.sh


def has_gpu():
    try:
        p = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return p.returncode == 0 and "GPU " in p.stdout


def write(path, text, executable=False):
    with open(path, "w") as f:
        f.write(text)
    if executable:
        os.chmod(path, os.stat(path).st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)


def gtest_doc(results):
    """A --gtest_output JSON document with one case per (name, result, failed) entry."""
    cases = []
    for name, result, failed in results:
        c = {"name": name, "status": "RUN", "result": result}
        if failed:
            c["failures"] = [{"failure": "x.cc:1\nExpected equality", "type": ""}]
        cases.append(c)
    return {"tests": len(cases), "testsuites": [{"name": "S", "testsuite": cases}]}


class KernelTimes(unittest.TestCase):
    """kernels.py on a made-up ncu raw CSV: steps split at the embedding kernel, runs grouped."""

    def test_steps_and_runs(self):
        sys.path.insert(0, HERE)
        import kernels  # noqa: E402
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "ncu.csv")
            rows = ['"==PROF== Connected to process"',
                    '"ID","Kernel Name","Grid Size","Block Size","gpu__time_duration.sum"',
                    '"","","","","nsecond"']
            seq = [("EmbeddingKernel", 1000), ("void ns::Gemv16Kernel<(DType)2, true>(const float *)", 5000),
                   ("ns::Gemv16Kernel<(DType)2, true>(const float *)", 7000)]
            i = 0
            for _ in range(3):
                for name, ns in seq:
                    rows.append(f'"{i}","{name}","(1, 1, 1)","(128, 1, 1)","{ns:,}"')
                    i += 1
            rows.append(f'"{i}","EmbeddingKernel","(1, 1, 1)","(128, 1, 1)","2000"')
            with open(path, "w") as f:
                f.write("\n".join(rows) + "\n")
            ks = kernels.read_kernels(path)
            self.assertEqual(len(ks), 10)
            self.assertAlmostEqual(ks[1][3], 5.0)
            self.assertEqual(kernels.short(ks[1][0]), "Gemv16Kernel")
            steps = kernels.split_steps(ks)
            self.assertEqual([len(s) for s in steps], [3, 3, 3, 1])
            out = os.path.join(d, "k.json")
            with contextlib.redirect_stdout(io.StringIO()):
                self.assertEqual(kernels.main([path, "--json", out]), 0)
            with open(out) as f:
                runs = json.load(f)["runs"]
            self.assertEqual([r["steps"] for r in runs], [3, 1])
            self.assertAlmostEqual(runs[0]["median_us_per_step"], 13.0)
            self.assertEqual(runs[0]["top"][0], {"kernel": "Gemv16Kernel", "count": 2, "us": 12.0,
                                                 "grid": "(1, 1, 1)", "block": "(128, 1, 1)"})


class Scripts(unittest.TestCase):
    def test_bash_syntax(self):
        for name in ("bundle.sh", "run.sh", "env.sh", "profile.sh", "variants.sh", "hop.sh"):
            p = subprocess.run(["bash", "-n", os.path.join(HERE, name)], capture_output=True, text=True)
            self.assertEqual(p.returncode, 0, f"{name}: {p.stderr}")


class GtestParts(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.mkdtemp()
        self.addCleanup(shutil.rmtree, self.dir)

    def part(self, doc, rc, log=""):
        js = os.path.join(self.dir, "t.json")
        if doc is not None:
            with open(js, "w") as f:
                json.dump(doc, f)
        lp = os.path.join(self.dir, "t.log")
        write(lp, log)
        return suite.gtest_part("test:t", js, rc, 1.0, lp)

    def test_all_pass(self):
        p = self.part(gtest_doc([("A", "COMPLETED", False), ("B", "COMPLETED", False)]), 0)
        self.assertEqual((p["status"], p["passed"], p["failed"], p["skipped"]), ("passed", 2, 0, 0))

    def test_a_failure_fails_the_part(self):
        p = self.part(gtest_doc([("A", "COMPLETED", False), ("B", "COMPLETED", True)]), 1)
        self.assertEqual((p["status"], p["passed"], p["failed"]), ("failed", 1, 1))
        self.assertEqual(p["failures"][0]["test"], "S.B")

    def test_every_case_skipped_is_skipped_with_the_message(self):
        log = "[ RUN      ] S.A\nx.cc:23: Skipped\nneeds 2 CUDA devices, found 0\n[  SKIPPED ] S.A (0 ms)\n"
        p = self.part(gtest_doc([("A", "SKIPPED", False)]), 0, log)
        self.assertEqual(p["status"], "skipped")
        self.assertEqual(p["reason"], "needs 2 CUDA devices, found 0")

    def test_a_crash_without_output_fails(self):
        p = self.part(None, 139)
        self.assertEqual(p["status"], "failed")
        self.assertIn("139", p["reason"])

    def test_nonzero_exit_with_no_failed_case_fails(self):
        p = self.part(gtest_doc([("A", "COMPLETED", False)]), 3)  # e.g. compute-sanitizer's error exit code
        self.assertEqual(p["status"], "failed")

    def test_timeout(self):
        p = self.part(None, 124)
        self.assertEqual(p["status"], "timeout")


class BenchParts(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.mkdtemp()
        self.addCleanup(shutil.rmtree, self.dir)

    def part(self, text, rc):
        path = os.path.join(self.dir, "bench.json")
        write(path, text)
        return suite.bench_part(path, rc, 2.0)

    def test_skip(self):
        p = self.part('{"skipped": "no CUDA device"}\n', 0)
        self.assertEqual((p["status"], p["reason"]), ("skipped", "no CUDA device"))

    def test_figures_are_kept(self):
        p = self.part("writing the model ...\n" + json.dumps({"ceilings": {"copy_bandwidth_gbps": 2900}, "models": []}), 0)
        self.assertEqual(p["status"], "passed")
        self.assertEqual(p["figures"]["ceilings"]["copy_bandwidth_gbps"], 2900)

    def test_error(self):
        p = self.part('{"error": "llama: INTERNAL: cudaMalloc"}', 1)
        self.assertEqual((p["status"], p["reason"]), ("failed", "llama: INTERNAL: cudaMalloc"))

    def test_no_json(self):
        self.assertEqual(self.part("Segmentation fault", 139)["status"], "failed")


class Report(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.mkdtemp()
        self.addCleanup(shutil.rmtree, self.dir)

    def report(self, statuses):
        for i, s in enumerate(statuses):
            suite.main(["part", "--name", f"p{i}", "--status", s, "--out", os.path.join(self.dir, f"p{i}.json")])
        out = os.path.join(self.dir, "report.json")
        rc = suite.main(["report", "--parts", self.dir, "--out", out, "--meta", "gpus=0"])
        with open(out) as f:
            return rc, json.load(f)

    def test_skips_are_ok(self):
        rc, r = self.report(["passed", "skipped"])
        self.assertEqual(rc, 0)
        self.assertTrue(r["ok"])
        self.assertEqual(r["gpus"], 0)
        self.assertEqual(r["summary"]["parts"]["skipped"], 1)

    def test_a_failure_or_timeout_is_not_ok(self):
        for bad in ("failed", "timeout"):
            for name in os.listdir(self.dir):
                os.remove(os.path.join(self.dir, name))
            rc, r = self.report(["passed", bad])
            self.assertEqual(rc, 1, bad)
            self.assertFalse(r["ok"], bad)


class RunShOnAFakeBundle(unittest.TestCase):
    """run.sh end to end without a GPU: stand-in binaries, the report written, GPU parts skipped."""

    def test_no_gpu_run(self):
        self.run_fake_bundle(packed=False)

    def test_no_gpu_run_of_a_packed_bundle(self):
        """bundle.sh packs bin/ and tests/ into bin.tar.xz; env.sh unpacks them into the bundle."""
        bundle = self.run_fake_bundle(packed=True)
        self.assertTrue(os.access(os.path.join(bundle, "tests", "cuda_parity_test"), os.X_OK))
        self.assertTrue(os.path.exists(os.path.join(bundle, "bin", ".unpacked")))

    def run_fake_bundle(self, packed):
        if has_gpu():
            self.skipTest("this machine has a GPU; run the real bundle instead")
        d = tempfile.mkdtemp()
        self.addCleanup(shutil.rmtree, d)
        bundle = os.path.join(d, "bundle")
        for sub in ("bin", "tests", "root/tests/testing", "shared/models"):
            os.makedirs(os.path.join(bundle, sub))
        for name in ("run.sh", "env.sh", "suite.py"):
            shutil.copy(os.path.join(HERE, name), bundle)
        fake_test = """#!/bin/bash
for a in "$@"; do case "$a" in --gtest_output=json:*) out="${a#--gtest_output=json:}";; esac; done
echo "x.cc:1: Skipped"; echo "no CUDA device"; echo "[  SKIPPED ] S.A (0 ms)"
echo '{"testsuites": [{"name": "S", "testsuite": [{"name": "A", "status": "RUN", "result": "SKIPPED"}]}]}' > "$out"
"""
        write(os.path.join(bundle, "tests", "cuda_parity_test"), fake_test, executable=True)
        write(os.path.join(bundle, "bin", "shardserve-bench-gpu"),
              "#!/bin/bash\necho '{\"skipped\": \"no CUDA device\"}'\n", executable=True)
        if packed:
            with tarfile.open(os.path.join(bundle, "bin.tar.xz"), "w:xz") as t:
                for sub in ("bin", "tests"):
                    t.add(os.path.join(bundle, sub), arcname=sub)
            for sub in ("bin", "tests"):
                shutil.rmtree(os.path.join(bundle, sub))
        report = os.path.join(d, "out", "gpu_report.json")
        env = dict(os.environ, PATH="/usr/bin:/bin")  # no nvidia-smi, no compute-sanitizer
        p = subprocess.run(["bash", os.path.join(bundle, "run.sh"), report], capture_output=True, text=True,
                           timeout=120, env=env)
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        self.assertIn("no GPU", p.stdout)
        with open(report) as f:
            r = json.load(f)
        self.assertTrue(r["ok"])
        parts = r["parts"]
        self.assertEqual(parts["test:cuda_parity_test"]["status"], "skipped")
        self.assertEqual(parts["test:cuda_parity_test"]["reason"], "no CUDA device")
        for name in ("memcheck", "racecheck", "synccheck", "cluster", "bench"):
            self.assertEqual(parts[name]["status"], "skipped", name)
        self.assertEqual(parts["env"]["gpus"], 0)
        return bundle


class HopSh(unittest.TestCase):
    """hop.sh from a fake bundle: the pipeline benchmark's JSON becomes the "hop" part."""

    def bundle(self, bench_script=None):
        d = tempfile.mkdtemp()
        self.addCleanup(shutil.rmtree, d)
        bundle = os.path.join(d, "bundle")
        for sub in ("bin", "root", "shared/models"):
            os.makedirs(os.path.join(bundle, sub))
        for name in ("hop.sh", "env.sh", "suite.py"):
            shutil.copy(os.path.join(HERE, name), bundle)
        # What root/../shared/models/stories260K finds, as bundle.sh lays it out.
        os.symlink(os.path.abspath(os.path.join(HERE, "..", "..", "..", "shared", "models", "stories260K")),
                   os.path.join(bundle, "shared", "models", "stories260K"))
        target = os.path.join(bundle, "bin", "shardserve-bench-pipeline")
        if bench_script is None:
            os.symlink(PIPELINE_BENCH, target)
        else:
            write(target, bench_script, executable=True)
        return d, bundle

    def run_hop(self, bundle, out, *flags):
        env = dict(os.environ, PATH="/usr/bin:/bin")
        return subprocess.run(["bash", os.path.join(bundle, "hop.sh"), out, *flags], capture_output=True, text=True,
                              timeout=100, env=env)

    def test_the_real_benchmark_on_stories260k(self):
        if PIPELINE_BENCH is None:
            self.skipTest("no shardserve-bench-pipeline given (--pipeline_bench)")
        d, bundle = self.bundle()
        out = os.path.join(d, "out")
        p = self.run_hop(bundle, out, "--model=../shared/models/stories260K", "--tokens=4")
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        with open(os.path.join(out, "hop.json")) as f:
            part = json.load(f)
        self.assertEqual((part["name"], part["status"]), ("hop", "passed"))
        figures = part["figures"]
        self.assertEqual(figures["model"], "../shared/models/stories260K")
        self.assertEqual(figures["tokens"], 4)
        for name in ("plaintext", "mTLS"):
            t = figures["transports"][name]
            self.assertGreater(t["round_trip_us"], 0)
            self.assertAlmostEqual(t["hop_over_round_trip"], t["hop_us"] / t["round_trip_us"], places=6)
            self.assertIn(f"[{name}] per hop {t['hop_us']:.1f} us", p.stdout)

    def test_a_failing_benchmark_fails_with_its_log(self):
        d, bundle = self.bundle("#!/bin/bash\necho 'cannot bind 127.0.0.1:0' >&2\nexit 3\n")
        out = os.path.join(d, "out")
        p = self.run_hop(bundle, out)
        self.assertEqual(p.returncode, 1, p.stdout + p.stderr)
        with open(os.path.join(out, "hop.json")) as f:
            part = json.load(f)
        self.assertEqual(part["status"], "failed")
        self.assertIn("cannot bind", part["log_tail"])
        self.assertIn("hop: failed", p.stdout)


class Bench(unittest.TestCase):
    def test_skips_cleanly_without_a_device(self):
        if BENCH is None:
            self.skipTest("no shardserve-bench-gpu in this build (CUDA off)")
        if has_gpu():
            self.skipTest("this machine has a GPU")
        p = subprocess.run([BENCH, "--json"], capture_output=True, text=True, timeout=60)
        self.assertEqual(p.returncode, 0, p.stderr)
        self.assertEqual(json.loads(p.stdout), {"skipped": "no CUDA device"})
        p = subprocess.run([BENCH], capture_output=True, text=True, timeout=60)
        self.assertEqual(p.returncode, 0, p.stderr)
        self.assertIn("no CUDA device", p.stdout)


class BenchFlags(unittest.TestCase):
    def test_a_mixed_chunk_that_does_not_fit_is_refused_before_the_device(self):
        if BENCH is None:
            self.skipTest("no shardserve-bench-gpu in this build (CUDA off)")
        for flags in (["--mixed_prefill=600"], ["--mixed_prefill=-1"], ["--batch=32", "--context=8", "--prefill=256",
                                                                          "--mixed_prefill=256"]):
            p = subprocess.run([BENCH, "--json", *flags], capture_output=True, text=True, timeout=60)
            self.assertEqual(p.returncode, 1, flags)
            self.assertIn("--mixed_prefill=", p.stderr, flags)
        p = subprocess.run([BENCH, "--json", "--mixed_prefill=0"], capture_output=True, text=True, timeout=60)
        self.assertEqual(p.returncode, 0, p.stderr)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--bench")
    ap.add_argument("--pipeline_bench")
    args, rest = ap.parse_known_args()
    BENCH = args.bench
    PIPELINE_BENCH = args.pipeline_bench and os.path.abspath(args.pipeline_bench)
    unittest.main(argv=[sys.argv[0], *rest])
