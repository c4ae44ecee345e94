#!/usr/bin/env python3
"""shardserve-run end to end: greedy ids against the committed Hugging Face references, and clear
errors (exit code 1 or 2, a message naming the problem, no crash) for bad flags and inputs."""
import json
import subprocess
import sys
import unittest

BINARY = None


def load_json(path):
    with open(path) as f:
        return json.load(f)


def run(*args):
    p = subprocess.run([BINARY, *args], capture_output=True, text=True, timeout=120)
    return p.returncode, p.stdout, p.stderr


class GreedyIds(unittest.TestCase):
    def test_golden_models_match_transformers(self):
        for name in ["llama", "mixtral", "qwen2_moe", "llama_bf16_sharded", "llama_fp8_block", "llama_fp8_tensor",
                     "deepseek_v3", "deepseek_v3_noqlora", "deepseek_v2_lite", "deepseek_v2", "glm4_moe", "glm4_moe_lite"]:
            ref = load_json(f"tests/golden/models/{name}/reference.json")
            case = ref["cases"][2]
            code, out, err = run("--model", f"tests/golden/models/{name}",
                                 "--prompt_ids", ",".join(map(str, case["prompt_ids"])),
                                 "--max_tokens", "32", "--temperature", "0", "--print_ids",
                                 "--stop_at_eos=false")
            self.assertEqual(code, 0, err)
            self.assertEqual(out.strip(), ",".join(map(str, case["greedy_ids"])), name)

    def test_stories260k_from_bos(self):
        ref = load_json("tests/golden/stories260K_reference.json")
        case = ref["cases"][0]
        self.assertEqual(case["prompt_ids"], [1])
        code, out, err = run("--model", "../shared/models/stories260K", "--prompt_ids", "1",
                             "--max_tokens", str(len(case["greedy_ids"])), "--print_ids")
        self.assertEqual(code, 0, err)
        self.assertEqual(out.strip(), ",".join(map(str, case["greedy_ids"])))


    def test_stories260k_text_prompts(self):
        ref = load_json("tests/golden/stories260K_reference.json")
        for case in ref["cases"]:
            if not case["prompt_text"]:
                continue
            n = str(len(case["greedy_ids"]))
            code, out, err = run("--model", "../shared/models/stories260K", "--prompt", case["prompt_text"],
                                 "--max_tokens", n, "--print_ids")
            self.assertEqual(code, 0, err)
            self.assertEqual(out.strip(), ",".join(map(str, case["greedy_ids"])), case["prompt_text"])
            code, out, err = run("--model", "../shared/models/stories260K", "--prompt", case["prompt_text"],
                                 "--max_tokens", n)
            self.assertEqual(code, 0, err)
            self.assertTrue(out.strip(), case["prompt_text"])
            self.assertIn(out.strip(), case["text"], case["prompt_text"])
            for ranks in ["cpu:2", "cpu:4"]:
                code, out2, err = run("--model", "../shared/models/stories260K", "--prompt", case["prompt_text"],
                                      "--max_tokens", n, "--devices", ranks)
                self.assertEqual(code, 0, err)
                self.assertEqual(out2, out, ranks)


    def test_text_prompts_on_every_golden_model(self):
        for name in ["llama", "llama_tied_llama3rope_bias", "mistral", "qwen2", "mixtral", "qwen2_moe",
                     "llama_bf16_sharded", "llama_fp8_block", "llama_fp8_tensor"]:
            model = f"tests/golden/models/{name}"
            ref = load_json(f"{model}/tokenizer_reference.json")
            for case in ref["cases"]:
                if not case["text"]:
                    continue
                code, by_text, err = run("--model", model, "--prompt", case["text"], "--max_tokens", "6",
                                         "--print_ids", "--stop_at_eos=false")
                self.assertEqual(code, 0, err)
                code, by_ids, err = run("--model", model, "--prompt_ids", ",".join(map(str, case["ids"])),
                                        "--max_tokens", "6", "--print_ids", "--stop_at_eos=false")
                self.assertEqual(code, 0, err)
                self.assertEqual(by_text, by_ids, f"{name}: {case['text']!r}")
                code, text, err = run("--model", model, "--prompt", case["text"], "--max_tokens", "6",
                                      "--stop_at_eos=false")
                self.assertEqual(code, 0, err)
                self.assertIn("finish_reason: length, 6 tokens", err)


class BadInput(unittest.TestCase):
    def expect_error(self, args, message, codes=(1, 2)):
        code, out, err = run(*args)
        self.assertIn(code, codes, f"{args}: exit {code}, stderr {err!r}")
        self.assertIn(message, err, f"{args}: stderr {err!r}")

    def test_errors(self):
        m = "tests/golden/models/llama"
        self.expect_error(["--prompt_ids", "1"], "--model is required")
        self.expect_error(["--model", "/nonexistent", "--prompt_ids", "1"], "/nonexistent/config.json")
        self.expect_error(["--model", m], "exactly one of --prompt and --prompt_ids")
        self.expect_error(["--model", m, "--prompt_ids", "1,300"], "token 1 has id 300")
        self.expect_error(["--model", m, "--prompt_ids", "1,a"], "\"a\"")
        self.expect_error(["--model", m, "--prompt_ids", "1", "--temperature", "-1"], "temperature")
        self.expect_error(["--model", m, "--prompt_ids", "1", "--top_p", "1.5"], "top_p")
        self.expect_error(["--model", m, "--prompt_ids", "1", "--max_tokens", "0"], "--max_tokens")
        self.expect_error(["--model", m, "--prompt_ids", ",".join(["5"] * 128)], "context length is 128")
        self.expect_error(["--model", m, "--prompt_ids", "1", "--devices", "cuda"], "CUDA")
        self.expect_error(["--model", m, "--prompt_ids", "1", "--devices", "gpu"], "not a device")
        self.expect_error(["--model", m, "--prompt_ids", "1", "--bogus_flag"], "bogus_flag")
        self.expect_error(["--model", "/tmp", "--prompt", "hello"], "/tmp/config.json")
        self.expect_error(["--model", "../shared/models/stories260K", "--prompt", "caf\udcc3"], "UTF-8")


if __name__ == "__main__":
    BINARY = sys.argv.pop(1)
    unittest.main(verbosity=2)
