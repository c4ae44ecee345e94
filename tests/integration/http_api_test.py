#!/usr/bin/env python3
"""End-to-end tests of the coordinator's OpenAI-compatible HTTP API: shardserve-local with
--http_listen=127.0.0.1:0 on ../shared/models/stories260K (a real SentencePiece-style tokenizer),
driven with curl and with the `openai` Python package (installed from PyPI into a venv that this
test creates under the build directory). Greedy text over HTTP must equal the gRPC path's
(`shardserve generate --temperature 0`).

    python3 tests/integration/http_api_test.py build/bin
"""
import json
import os
import shutil
import subprocess
import sys
import tempfile
import unittest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "testing"))
from local_cluster import STORIES, LocalCluster  # noqa: E402

BIN = None  # directory with shardserve-local and shardserve
OPENAI_VERSION = "3.54.0"  # pinned: the client the test was written against
PROMPT = "Once upon a time"


def venv_python():
    """A venv with the openai package (made once per build directory)."""
    venv = os.path.join(os.path.dirname(os.path.abspath(BIN)), "http_test_venv")
    python = os.path.join(venv, "bin", "python")
    marker = os.path.join(venv, f"openai-{OPENAI_VERSION}.installed")
    if not os.path.exists(marker):
        shutil.rmtree(venv, ignore_errors=True)
        subprocess.run([sys.executable, "-m", "venv", venv], check=True)
        subprocess.run([python, "-m", "pip", "install", "-q", f"openai=={OPENAI_VERSION}"], check=True, timeout=600)
        open(marker, "w").close()
    return python


class Cluster(LocalCluster):
    """shardserve-local with the HTTP API (one worker, no metrics), running until stop()."""

    def __init__(self, model, extra=(), timeout=240):
        super().__init__(BIN, model, 1, "cpu:1", ["--http_listen=127.0.0.1:0", "--metrics=false", *extra],
                         timeout=timeout)


def curl(url, *args, data=None):
    """(HTTP status, body) of a curl call."""
    cmd = ["curl", "-sS", "-o", "-", "-w", "\n%{http_code}", "--max-time", "120", url, *args]
    if data is not None:
        cmd += ["-H", "Content-Type: application/json", "--data-binary", "@-"]
    p = subprocess.run(cmd, input=data, capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    body, _, code = p.stdout.rpartition("\n")
    return int(code), body


def sse_events(body):
    """The data payloads of a server-sent-event stream, in order."""
    events = []
    for block in body.split("\n\n"):
        for line in block.split("\n"):
            if line.startswith("data: "):
                events.append(line[len("data: "):])
    return events


class HttpApiTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.python = venv_python()
        cls.cluster = Cluster(STORIES)
        cls.url = cls.cluster.http

    @classmethod
    def tearDownClass(cls):
        cls.cluster.stop()

    def grpc_text(self, prompt, max_tokens, *flags):
        p = subprocess.run([os.path.join(BIN, "shardserve"), "generate", f"--server={self.cluster.address}",
                            "--prompt", prompt, "--max_tokens", str(max_tokens), "--temperature", "0", *flags],
                           capture_output=True, text=True, timeout=120)
        self.assertEqual(p.returncode, 0, p.stderr)
        return p.stdout[:-1] if p.stdout.endswith("\n") else p.stdout

    def completion(self, **fields):
        code, body = curl(self.url + "/v1/completions", data=json.dumps(fields))
        self.assertEqual(code, 200, body)
        return json.loads(body)

    def openai_texts(self, **create):
        """The choices' texts, by index, of the openai package's completions.create(**create)."""
        script = f"""
import json, openai
c = openai.OpenAI(base_url={self.url + '/v1'!r}, api_key="unused", max_retries=0)
r = c.completions.create(model="stories260K", **json.loads({json.dumps(create)!r}))
print(json.dumps([ch.text for ch in sorted(r.choices, key=lambda ch: ch.index)]))
"""
        p = subprocess.run([self.python, "-c", script], capture_output=True, text=True, timeout=120)
        self.assertEqual(p.returncode, 0, p.stderr)
        return json.loads(p.stdout)

    def test_models(self):
        code, body = curl(self.url + "/v1/models")
        self.assertEqual(code, 200, body)
        models = json.loads(body)
        self.assertEqual(models["object"], "list")
        self.assertEqual([m["id"] for m in models["data"]], ["stories260K"])
        code, body = curl(self.url + "/v1/models/stories260K")
        self.assertEqual(code, 200, body)
        self.assertEqual(json.loads(body)["id"], "stories260K")
        code, body = curl(self.url + "/v1/models/gpt-9")
        self.assertEqual(code, 404, body)
        self.assertEqual(json.loads(body)["error"]["code"], "model_not_found")
        code, body = curl(self.url + "/health")
        self.assertEqual((code, body), (200, ""))

    def test_tokenize_and_detokenize(self):
        code, body = curl(self.url + "/tokenize", data=json.dumps({"prompt": PROMPT}))
        self.assertEqual(code, 200, body)
        r = json.loads(body)
        self.assertEqual(r["count"], len(r["tokens"]))
        self.assertEqual(r["tokens"][0], 1)  # BOS, as vLLM adds special tokens by default
        code, body = curl(self.url + "/tokenize", data=json.dumps({"prompt": PROMPT, "add_special_tokens": False}))
        self.assertEqual(json.loads(body)["tokens"], r["tokens"][1:])
        code, body = curl(self.url + "/detokenize", data=json.dumps({"tokens": r["tokens"][1:]}))
        self.assertEqual(code, 200, body)
        self.assertEqual(json.loads(body)["prompt"], PROMPT)
        # Messages need the model's chat template, which this one lacks.
        code, body = curl(self.url + "/tokenize", data=json.dumps({"messages": [{"role": "user", "content": "Hi"}]}))
        self.assertEqual(code, 400, body)
        self.assertIn("chat_template", json.loads(body)["error"]["message"])
        for path, data, param in [("/tokenize", {}, "prompt"), ("/detokenize", {"tokens": [9999]}, "tokens"),
                                  ("/tokenize", {"prompt": "a", "model": "gpt-9"}, "model"),
                                  ("/tokenize", {"prompt": "a", "messages": []}, "messages"),
                                  ("/tokenize", {"messages": [{"role": "robot", "content": "a"}]}, "messages[0].role"),
                                  ("/tokenize", {"prompt": "a", "add_generation_prompt": True}, "add_generation_prompt")]:
            code, body = curl(self.url + path, data=json.dumps(data))
            self.assertIn(code, (400, 404), body)
            self.assertEqual(json.loads(body)["error"]["param"], param, body)

    def test_completion_matches_grpc(self):
        r = self.completion(model="stories260K", prompt=PROMPT, max_tokens=24, temperature=0)
        self.assertEqual(r["object"], "text_completion")
        choice = r["choices"][0]
        self.assertEqual(choice["text"], self.grpc_text(PROMPT, 24))
        self.assertEqual(choice["finish_reason"], "length")
        self.assertEqual(r["usage"]["completion_tokens"], 24)
        self.assertEqual(r["usage"]["total_tokens"], r["usage"]["prompt_tokens"] + 24)

    def test_streamed_completion_equals_unstreamed(self):
        whole = self.completion(prompt=PROMPT, max_tokens=24, temperature=0)
        code, body = curl(self.url + "/v1/completions", "-N", data=json.dumps(
            {"prompt": PROMPT, "max_tokens": 24, "temperature": 0, "stream": True,
             "stream_options": {"include_usage": True}}))
        self.assertEqual(code, 200, body)
        events = sse_events(body)
        self.assertEqual(events[-1], "[DONE]")
        chunks = [json.loads(e) for e in events[:-1]]
        text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
        self.assertEqual(text, whole["choices"][0]["text"])
        # At least one text chunk, the finish chunk and the usage chunk (how many text chunks depends
        # on how fast the tokens come compared with the writes: not asserted).
        self.assertGreaterEqual(len(chunks), 3)
        finals = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
        self.assertEqual(finals[-1], "length")
        self.assertTrue(all(f is None for f in finals[:-1]))
        self.assertEqual(chunks[-1]["usage"], whole["usage"])

    def test_stop_string_truncates_with_finish_reason_stop(self):
        full = self.completion(prompt=PROMPT, max_tokens=40, temperature=0)["choices"][0]["text"]
        stop = full[len(full) // 2: len(full) // 2 + 4]  # some text from the middle, likely across tokens
        r = self.completion(prompt=PROMPT, max_tokens=40, temperature=0, stop=["@@never@@", stop])
        self.assertEqual(r["choices"][0]["text"], full[:full.index(stop)])
        self.assertEqual(r["choices"][0]["finish_reason"], "stop")
        self.assertLess(r["usage"]["completion_tokens"], 40)

    def test_text_options(self):
        # vLLM's include_stop_str_in_output (the text ends with the stop string) and
        # skip_special_tokens (false: special tokens are spelled), whole and streamed.
        full = self.completion(prompt=PROMPT, max_tokens=24, temperature=0)["choices"][0]["text"]
        stop = full[10:14]
        r = self.completion(prompt=PROMPT, max_tokens=24, temperature=0, stop=[stop], include_stop_str_in_output=True)
        self.assertEqual(r["choices"][0]["text"], full[:full.index(stop) + len(stop)])
        self.assertEqual(r["choices"][0]["finish_reason"], "stop")
        eos = {"prompt": PROMPT, "max_tokens": 3, "temperature": 0, "ignore_eos": True, "logit_bias": {"2": 100}}
        self.assertEqual(self.completion(**eos)["choices"][0]["text"], "")
        self.assertEqual(self.completion(**eos, skip_special_tokens=False)["choices"][0]["text"], "</s>" * 3)
        code, body = curl(self.url + "/v1/completions", "-N",
                          data=json.dumps({**eos, "skip_special_tokens": False, "stream": True}))
        self.assertEqual(code, 200, body)
        chunks = [json.loads(e) for e in sse_events(body)[:-1]]
        self.assertEqual("".join(c["choices"][0]["text"] for c in chunks if c["choices"]), "</s>" * 3)
        # truncate_prompt_tokens: the prompt's last tokens, echoed as computed.
        code, body = curl(self.url + "/tokenize", data=json.dumps({"prompt": PROMPT}))
        ids = json.loads(body)["tokens"]
        r = self.completion(prompt=PROMPT, max_tokens=4, temperature=0, truncate_prompt_tokens=3, echo=True)
        alone = self.completion(prompt=ids[-3:], max_tokens=4, temperature=0, echo=True)
        self.assertEqual(r["usage"]["prompt_tokens"], 3)
        self.assertEqual(r["choices"][0]["text"], alone["choices"][0]["text"])
        # priority: this cluster schedules first come, first served, so only 0 is taken.
        self.assertEqual(self.completion(prompt=PROMPT, max_tokens=2, priority=0)["usage"]["completion_tokens"], 2)
        code, body = curl(self.url + "/v1/completions", data=json.dumps({"prompt": PROMPT, "priority": 2}))
        self.assertEqual(code, 400, body)
        self.assertEqual(json.loads(body)["error"]["param"], "priority")
        self.assertIn("--scheduling_policy=priority", json.loads(body)["error"]["message"])
        # OpenAI's stored-completion fields at their neutral values are accepted; store=true is not.
        r = self.completion(prompt=PROMPT, max_tokens=2, store=False, metadata={"team": "a"}, service_tier="auto")
        self.assertEqual(r["usage"]["completion_tokens"], 2)
        code, body = curl(self.url + "/v1/completions", data=json.dumps({"prompt": PROMPT, "store": True}))
        self.assertEqual(code, 400, body)
        self.assertEqual(json.loads(body)["error"]["param"], "store")

    def test_sampling_extensions(self):
        # logit_bias -100 on the greedy first token changes it; stop_token_ids ends at a token,
        # and min_tokens holds that stop back; bad values are 400 naming the field.
        greedy = self.completion(prompt=[1, 403, 407], max_tokens=3, temperature=0)["choices"][0]["text"]
        biased = self.completion(prompt=[1, 403, 407], max_tokens=3, temperature=0,
                                 logit_bias={"261": -100, "378": -100})
        self.assertNotEqual(biased["choices"][0]["text"], greedy)
        r = self.completion(prompt=[1, 403, 407], max_tokens=8, temperature=0, stop_token_ids=[261])
        self.assertEqual(r["choices"][0]["finish_reason"], "stop")
        self.assertEqual(r["usage"]["completion_tokens"], 1)  # stories260K's greedy answer starts with 261
        r = self.completion(prompt=[1, 403, 407], max_tokens=8, temperature=0, stop_token_ids=[261], min_tokens=4)
        self.assertGreaterEqual(r["usage"]["completion_tokens"], 4)
        r = self.completion(prompt=PROMPT, max_tokens=4, temperature=0.8, seed=3, min_p=0.2, ignore_eos=True)
        self.assertEqual(r["usage"]["completion_tokens"], 4)
        for body, param in [({"logit_bias": {"512": 1}}, "logit_bias"), ({"min_p": 2}, "min_p"),
                            ({"min_tokens": 9, "max_tokens": 3}, "min_tokens")]:
            code, out = curl(self.url + "/v1/completions", data=json.dumps({"prompt": "a", **body}))
            self.assertEqual(code, 400, out)
            self.assertIn(param, json.loads(out)["error"]["message"])

    def test_allowed_token_ids(self):
        # Only EOS (id 2) allowed: it is sampled at once and stops the request, or, with ignore_eos,
        # fills max_tokens (EOS is not spelled in the text).
        r = self.completion(prompt=PROMPT, max_tokens=5, temperature=0, allowed_token_ids=[2])
        self.assertEqual((r["choices"][0]["finish_reason"], r["usage"]["completion_tokens"]), ("stop", 1))
        r = self.completion(prompt=PROMPT, max_tokens=5, temperature=0.9, seed=4, allowed_token_ids=[2],
                            ignore_eos=True)
        self.assertEqual((r["choices"][0]["finish_reason"], r["usage"]["completion_tokens"]), ("length", 5))
        self.assertEqual(r["choices"][0]["text"], "")
        # Two word pieces: the greedy text is made of them only, and differs from the free one.
        free = self.completion(prompt=PROMPT, max_tokens=6, temperature=0, ignore_eos=True)["choices"][0]["text"]
        r = self.completion(prompt=PROMPT, max_tokens=6, temperature=0, ignore_eos=True, allowed_token_ids=[378, 403])
        code, body = curl(self.url + "/detokenize", data=json.dumps({"tokens": [378, 403]}))
        pieces = json.loads(body)["prompt"]
        self.assertNotEqual(r["choices"][0]["text"], free)
        self.assertTrue(set(r["choices"][0]["text"].replace(" ", "")) <= set(pieces.replace(" ", "")),
                        (r["choices"][0]["text"], pieces))
        for extra, param, message in [
                ({"allowed_token_ids": []}, "allowed_token_ids", "must not be empty"),
                ({"allowed_token_ids": [5, 9999]}, "allowed_token_ids[1]", "outside the vocabulary"),
                ({"allowed_token_ids": [2], "min_tokens": 2}, "allowed_token_ids", "min_tokens"),
                ({"allowed_token_ids": [5], "response_format": {"type": "json_object"}}, "allowed_token_ids",
                 "response_format")]:
            code, body = curl(self.url + "/v1/completions", data=json.dumps({"prompt": PROMPT, **extra}))
            self.assertEqual(code, 400, body)
            self.assertEqual(json.loads(body)["error"]["param"], param, body)
            self.assertIn(message, json.loads(body)["error"]["message"], body)

    def test_bad_words(self):
        # The greedy text's second word banned: the answer changes and drops it (each of its
        # spellings is checked token by token in tests/sdk/python_sdk_test.py); bad values are 400s.
        free = self.completion(prompt=PROMPT, max_tokens=16, temperature=0, ignore_eos=True)["choices"][0]["text"]
        word = free.split()[1].strip(".,!?\"'")
        r = self.completion(prompt=PROMPT, max_tokens=16, temperature=0, ignore_eos=True, bad_words=[word])
        self.assertNotEqual(r["choices"][0]["text"], free)
        self.assertNotIn(f" {word} ", r["choices"][0]["text"], (word, free))
        for extra, param, message in [
                ({"bad_words": "word"}, "bad_words", "an array of strings"),
                ({"bad_words": ["ok", 5]}, "bad_words[1]", "a string"),
                ({"bad_words": ["ok", " "]}, "bad_words[1]", "is empty")]:
            code, body = curl(self.url + "/v1/completions", data=json.dumps({"prompt": PROMPT, **extra}))
            self.assertEqual(code, 400, body)
            self.assertEqual(json.loads(body)["error"]["param"], param, body)
            self.assertIn(message, json.loads(body)["error"]["message"], body)

    def test_penalties(self):
        # Through the cluster (gRPC CLI) the penalized greedy ids are those of the one-process
        # engine (shardserve-run) with the same penalties; through the openai package, the text is
        # the CLI's; the penalties change the answer; bad values are 400 naming the field.
        ids = "1,403,407,261,378"
        flags = ["--presence_penalty=0.8", "--frequency_penalty=0.6", "--repetition_penalty=1.3", "--ignore_eos"]
        run = subprocess.run([os.path.join(BIN, "shardserve-run"), f"--model={STORIES}", f"--prompt_ids={ids}",
                              "--max_tokens=32", "--print_ids", "--stop_at_eos=false", *flags[:3]],
                             capture_output=True, text=True, timeout=120)
        self.assertEqual(run.returncode, 0, run.stderr)
        cli = subprocess.run([os.path.join(BIN, "shardserve"), "generate", f"--server={self.cluster.address}",
                              f"--prompt_ids={ids}", "--max_tokens=32", "--temperature=0", "--print_ids", *flags],
                             capture_output=True, text=True, timeout=120)
        self.assertEqual(cli.returncode, 0, cli.stderr)
        self.assertEqual(cli.stdout.split(), run.stdout.split())
        plain = subprocess.run([os.path.join(BIN, "shardserve-run"), f"--model={STORIES}", f"--prompt_ids={ids}",
                                "--max_tokens=32", "--print_ids", "--stop_at_eos=false"],
                               capture_output=True, text=True, timeout=120)
        self.assertNotEqual(plain.stdout.split(), run.stdout.split())
        script = f"""
import json, openai
c = openai.OpenAI(base_url={self.url + '/v1'!r}, api_key="unused", max_retries=0)
r = c.completions.create(model="stories260K", prompt={PROMPT!r}, max_tokens=40, temperature=0,
                         presence_penalty=0.8, frequency_penalty=0.6, extra_body={{"repetition_penalty": 1.3}})
print(json.dumps(r.choices[0].text))
"""
        p = subprocess.run([self.python, "-c", script], capture_output=True, text=True, timeout=120)
        self.assertEqual(p.returncode, 0, p.stderr)
        self.assertEqual(json.loads(p.stdout), self.grpc_text(PROMPT, 40, *flags[:3]))
        self.assertNotEqual(json.loads(p.stdout), self.grpc_text(PROMPT, 40))
        for body, param in [({"presence_penalty": 3}, "presence_penalty"),
                            ({"frequency_penalty": -2.5}, "frequency_penalty"),
                            ({"repetition_penalty": 0}, "repetition_penalty")]:
            code, out = curl(self.url + "/v1/completions", data=json.dumps({"prompt": "a", **body}))
            self.assertEqual(code, 400, out)
            self.assertEqual(json.loads(out)["error"]["param"], param)

    def test_echo(self):
        # The answer starts with the prompt; with logprobs, so do its entries (the first prompt token
        # has no logprob); streamed gives the same; the openai package's scoring call (echo,
        # logprobs, max_tokens 1) gets the same prompt logprobs.
        greedy = self.completion(prompt=PROMPT, max_tokens=6, temperature=0)["choices"][0]["text"]
        r = self.completion(prompt=PROMPT, max_tokens=6, temperature=0, echo=True)
        self.assertEqual(r["choices"][0]["text"], PROMPT + greedy)
        self.assertIsNone(r["choices"][0]["logprobs"])
        ids = self.completion(prompt=[1, 403, 407, 261, 378], max_tokens=6, temperature=0, echo=True)
        self.assertEqual(ids["choices"][0]["text"], PROMPT + greedy)  # the ids of the same prompt, decoded
        r = self.completion(prompt=PROMPT, max_tokens=6, temperature=0, echo=True, logprobs=2)
        lp = r["choices"][0]["logprobs"]
        prompt_tokens = r["usage"]["prompt_tokens"]
        self.assertEqual(len(lp["tokens"]), prompt_tokens + 6)
        self.assertIsNone(lp["token_logprobs"][0])
        self.assertIsNone(lp["top_logprobs"][0])
        for chosen, top in zip(lp["token_logprobs"][1:], lp["top_logprobs"][1:]):
            self.assertLessEqual(chosen, 0.0)
            self.assertLessEqual(max(top.values()), 0.0)
            self.assertGreaterEqual(max(top.values()), chosen - 1e-6)  # the most likely is at least as likely
        # The entries after "<s>" (which adds no text) concatenate to the echoed text, and
        # text_offset finds each in it.
        self.assertEqual(lp["tokens"][0], "<s>")
        self.assertEqual("".join(lp["tokens"][1:]), r["choices"][0]["text"])
        for token, offset in zip(lp["tokens"][1:], lp["text_offset"][1:]):
            self.assertEqual(r["choices"][0]["text"][offset:offset + len(token)], token, lp)
        # The generated tokens' entries are those of a request without echo.
        plain = self.completion(prompt=PROMPT, max_tokens=6, temperature=0, logprobs=2)["choices"][0]["logprobs"]
        self.assertEqual(lp["tokens"][prompt_tokens:], plain["tokens"])
        for a, b in zip(lp["token_logprobs"][prompt_tokens:], plain["token_logprobs"]):
            self.assertAlmostEqual(a, b, places=5)
        code, body = curl(self.url + "/v1/completions", data=json.dumps(
            {"prompt": PROMPT, "max_tokens": 6, "temperature": 0, "echo": True, "logprobs": 2, "stream": True}))
        self.assertEqual(code, 200, body)
        chunks = [json.loads(e) for e in sse_events(body) if e != "[DONE]"]
        self.assertEqual("".join(c["choices"][0]["text"] for c in chunks), PROMPT + greedy)
        streamed = [t for c in chunks if c["choices"][0]["logprobs"] for t in c["choices"][0]["logprobs"]["token_logprobs"]]
        self.assertEqual(len(streamed), prompt_tokens + 6)
        self.assertIsNone(streamed[0])
        for a, b in zip(streamed[1:], lp["token_logprobs"][1:]):
            self.assertAlmostEqual(a, b, places=5)
        script = f"""
import json, openai
c = openai.OpenAI(base_url={self.url + '/v1'!r}, api_key="unused", max_retries=0)
r = c.completions.create(model="stories260K", prompt={PROMPT!r}, max_tokens=1, temperature=0, echo=True, logprobs=1)
print(json.dumps(r.choices[0].logprobs.token_logprobs))
"""
        p = subprocess.run([self.python, "-c", script], capture_output=True, text=True, timeout=120)
        self.assertEqual(p.returncode, 0, p.stderr)
        scored = json.loads(p.stdout)
        self.assertEqual(len(scored), prompt_tokens + 1)
        for a, b in zip(scored[1:prompt_tokens], lp["token_logprobs"][1:prompt_tokens]):
            self.assertAlmostEqual(a, b, places=5)

    def test_n_and_best_of(self):
        # Choice i is the request alone with seed + i; streamed choices carry their index; best_of
        # answers the most likely of its choices (by the sum of their tokens' logprobs).
        base = dict(prompt=PROMPT, max_tokens=12, temperature=1.0, ignore_eos=True)
        r = self.completion(n=3, seed=5, **base)
        self.assertEqual([c["index"] for c in r["choices"]], [0, 1, 2])
        alone = [self.completion(n=1, seed=5 + i, logprobs=0, **base)["choices"][0] for i in range(3)]
        self.assertEqual([c["text"] for c in r["choices"]], [a["text"] for a in alone])
        self.assertEqual(r["usage"]["completion_tokens"], 36)
        self.assertEqual(len({c["text"] for c in r["choices"]}), 3)
        code, body = curl(self.url + "/v1/completions", data=json.dumps({"n": 3, "seed": 5, "stream": True, **base}))
        self.assertEqual(code, 200, body)
        texts = {}
        for e in sse_events(body):
            if e == "[DONE]":
                continue
            for c in json.loads(e)["choices"]:
                texts[c["index"]] = texts.get(c["index"], "") + c["text"]
        self.assertEqual([texts[i] for i in range(3)], [a["text"] for a in alone])
        best = self.completion(n=1, best_of=3, seed=5, **base)
        sums = [sum(a["logprobs"]["token_logprobs"]) for a in alone]
        self.assertEqual(len(best["choices"]), 1)
        self.assertEqual(best["choices"][0]["text"], alone[sums.index(max(sums))]["text"])
        self.assertIsNone(best["choices"][0]["logprobs"])  # used to rank, not asked for
        echoed = self.completion(n=2, seed=5, echo=True, **base)
        for c in echoed["choices"]:
            self.assertTrue(c["text"].startswith(PROMPT))
        for body, param in [({"n": 2, "best_of": 1}, "best_of"), ({"best_of": 2, "stream": True}, "best_of"),
                            ({"n": 0}, "n")]:
            code, out = curl(self.url + "/v1/completions", data=json.dumps({"prompt": "a", **body}))
            self.assertEqual(code, 400, out)
            self.assertEqual(json.loads(out)["error"]["param"], param)
        self.assertEqual(self.openai_texts(prompt=PROMPT, max_tokens=12, temperature=1.0, n=3, seed=5,
                                           extra_body={"ignore_eos": True}), [a["text"] for a in alone])

    def test_several_prompts(self):
        # "prompt" as a list (of strings or of token-id lists): choice k of prompt p is the answer's
        # choice p * n + k, exactly the request of that prompt alone; usage sums over the prompts;
        # streamed gives the same; best_of ranks within each prompt; echo starts each with its own.
        prompts = [PROMPT, "The little dog", "Lily"]
        base = dict(max_tokens=10, temperature=1.0, seed=7, ignore_eos=True, logprobs=1)
        r = self.completion(prompt=prompts, n=2, **base)
        alone = [self.completion(prompt=p, n=2, **base) for p in prompts]
        self.assertEqual([c["index"] for c in r["choices"]], list(range(6)))
        for p, a in enumerate(alone):
            for k in range(2):
                got, want = r["choices"][2 * p + k], a["choices"][k]
                self.assertEqual(got["text"], want["text"], (p, k))
                self.assertEqual(got["logprobs"]["tokens"], want["logprobs"]["tokens"], (p, k))
        self.assertEqual(r["usage"]["prompt_tokens"], sum(a["usage"]["prompt_tokens"] for a in alone))
        self.assertEqual(r["usage"]["completion_tokens"], 60)
        ids = [[1, 403, 407, 261, 378], [1, 400]]
        by_ids = self.completion(prompt=ids, n=1, **base)
        self.assertEqual([c["text"] for c in by_ids["choices"]],
                         [self.completion(prompt=p, n=1, **base)["choices"][0]["text"] for p in ids])
        code, body = curl(self.url + "/v1/completions", data=json.dumps(
            {"prompt": prompts, "n": 2, "stream": True, "stream_options": {"include_usage": True}, **base}))
        self.assertEqual(code, 200, body)
        texts, usage = {}, None
        for e in sse_events(body):
            if e == "[DONE]":
                continue
            chunk = json.loads(e)
            usage = chunk.get("usage") or usage
            for c in chunk["choices"]:
                texts[c["index"]] = texts.get(c["index"], "") + c["text"]
        self.assertEqual([texts[i] for i in range(6)], [c["text"] for c in r["choices"]])
        self.assertEqual(usage["completion_tokens"], 60)
        best = self.completion(prompt=prompts[:2], n=1, best_of=2, **base)
        self.assertEqual([c["text"] for c in best["choices"]],
                         [self.completion(prompt=p, n=1, best_of=2, **base)["choices"][0]["text"] for p in prompts[:2]])
        echoed = self.completion(prompt=prompts, echo=True, max_tokens=3, temperature=0)
        for p, c in zip(prompts, echoed["choices"]):
            self.assertTrue(c["text"].startswith(p), (p, c["text"]))
        for prompt, message in [([], "'prompt' is empty"), (["a", [1]], "must be a string as 'prompt[0]' is"),
                                (["a"] * 65, "at most 64"), ([[1], [1, 10**6]], "prompt[1]: ")]:
            code, out = curl(self.url + "/v1/completions", data=json.dumps({"prompt": prompt}))
            self.assertEqual(code, 400, out)
            self.assertIn(message, json.loads(out)["error"]["message"])
            self.assertEqual(json.loads(out)["error"]["param"], "prompt")
        self.assertEqual(self.openai_texts(prompt=prompts, max_tokens=10, temperature=1.0, n=2, seed=7,
                                           extra_body={"ignore_eos": True}), [c["text"] for c in r["choices"]])

    def test_cli_n_choices_equal_the_http_choices(self):
        # `shardserve generate --n 2` (gRPC, the C++ SDK's GenerateChoices) prints each choice on its
        # line: the same texts as /v1/completions with n = 2 and the same seed.
        r = self.completion(prompt=PROMPT, max_tokens=12, temperature=1.0, seed=3, n=2)
        texts = [c["text"] for c in sorted(r["choices"], key=lambda c: c["index"])]
        self.assertNotEqual(texts[0], texts[1])
        p = subprocess.run([os.path.join(BIN, "shardserve"), "generate", f"--server={self.cluster.address}",
                            "--prompt", PROMPT, "--max_tokens", "12", "--temperature", "1", "--seed", "3", "--n", "2"],
                           capture_output=True, text=True, timeout=120)
        self.assertEqual(p.returncode, 0, p.stderr)
        self.assertEqual(p.stdout.split("\n")[:2], texts)
        self.assertIn("choice 1 finish_reason: length", p.stderr)

    def test_logprobs(self):
        # Completions: "logprobs": N; greedy, so each chosen token is the most likely one.
        r = self.completion(prompt=PROMPT, max_tokens=6, temperature=0, logprobs=3)
        lp = r["choices"][0]["logprobs"]
        self.assertEqual(len(lp["tokens"]), 6)
        self.assertEqual(len(lp["token_logprobs"]), 6)
        self.assertEqual(len(lp["text_offset"]), 6)
        for chosen, top in zip(lp["token_logprobs"], lp["top_logprobs"]):
            self.assertLessEqual(chosen, 0.0)
            self.assertEqual(len(top), 3, top)  # spelled where they stand, no two alternatives alike
            self.assertAlmostEqual(max(top.values()), chosen, places=5)
        # Tokens are spelled where they stand, as OpenAI's are: they concatenate to the text, and
        # text_offset says where each starts in it (in characters). After "Once upon a time," the
        # first word keeps its space in the text and in its token (" there", where the token decoded
        # alone is "there"), and so do the alternatives.
        r = self.completion(prompt=PROMPT + ",", max_tokens=8, temperature=0, logprobs=2)
        text, lp = r["choices"][0]["text"], r["choices"][0]["logprobs"]
        self.assertTrue(text.startswith(" "), text)
        self.assertEqual("".join(lp["tokens"]), text)
        for i, (token, offset) in enumerate(zip(lp["tokens"], lp["text_offset"])):
            self.assertEqual(text[offset:offset + len(token)], token, (i, lp))
        self.assertTrue(lp["tokens"][0].startswith(" "), lp["tokens"])
        self.assertIn(lp["tokens"][0], lp["top_logprobs"][0])
        self.assertNotIn("", [t for top in lp["top_logprobs"] for t in top])
        # Without asking: null.
        r = self.completion(prompt=PROMPT, max_tokens=2, temperature=0)
        self.assertIsNone(r["choices"][0]["logprobs"])

    def test_prompt_as_token_ids(self):
        r = self.completion(prompt=[1, 403, 407], max_tokens=5, temperature=0)
        self.assertEqual(r["usage"]["prompt_tokens"], 3)
        self.assertEqual(r["usage"]["completion_tokens"], 5)

    def test_bad_inputs_get_400_and_the_server_keeps_serving(self):
        cases = [
            ('{"prompt": "a",', None, "not valid JSON"),
            ('{"prompt": "a", "bogus": true}', "bogus", "unknown field"),
            ('{"prompt": "a", "max_tokens": "many"}', "max_tokens", "must be an integer"),
            ('{"prompt": "a", "temperature": -3}', "temperature", "[0, 2]"),
            ('{"prompt": "a", "n": 17}', "n", "must be in [1, 16]"),
            ('{"prompt": "a", "max_tokens": 100000}', "max_tokens", "exceeds the context"),
            ('{"prompt": [1, 99999]}', "prompt", "outside the vocabulary"),
            ('{"prompt": "a", "stop": [""]}', "stop", "is empty"),
            ('[]', None, "JSON object"),
        ]
        for body, param, message in cases:
            with self.subTest(body=body):
                code, reply = curl(self.url + "/v1/completions", data=body)
                self.assertEqual(code, 400, reply)
                err = json.loads(reply)["error"]
                self.assertEqual(err["type"], "invalid_request_error")
                self.assertIn(message, err["message"])
                self.assertEqual(err["param"], param)
        # Oversized body: 413 with an OpenAI error.
        big = json.dumps({"prompt": "x" * (2 << 20)})
        code, reply = curl(self.url + "/v1/completions", data=big)
        self.assertEqual(code, 413, reply)
        self.assertIn("larger than", json.loads(reply)["error"]["message"])
        # Unknown route and wrong method.
        code, reply = curl(self.url + "/v1/nothing")
        self.assertEqual(code, 404, reply)
        self.assertIn("error", json.loads(reply))
        code, reply = curl(self.url + "/v1/completions")
        self.assertEqual(code, 405, reply)
        # Unknown model: 404.
        code, reply = curl(self.url + "/v1/completions", data='{"model": "gpt-9", "prompt": "a"}')
        self.assertEqual(code, 404, reply)
        self.assertEqual(json.loads(reply)["error"]["param"], "model")
        # A model without a chat template: 400 naming the file.
        code, reply = curl(self.url + "/v1/chat/completions", data='{"messages": [{"role": "user", "content": "hi"}]}')
        self.assertEqual(code, 400, reply)
        self.assertIn("tokenizer_config.json", json.loads(reply)["error"]["message"])
        # Still serving.
        r = self.completion(prompt=PROMPT, max_tokens=4, temperature=0)
        self.assertEqual(r["usage"]["completion_tokens"], 4)

    def test_openai_package(self):
        script = f"""
import json, openai
c = openai.OpenAI(base_url={self.url + '/v1'!r}, api_key="unused", max_retries=0)
out = {{"models": [m.id for m in c.models.list()]}}
r = c.completions.create(model="stories260K", prompt={PROMPT!r}, max_tokens=24, temperature=0)
out["text"], out["finish"], out["usage"] = r.choices[0].text, r.choices[0].finish_reason, r.usage.completion_tokens
s = c.completions.create(model="stories260K", prompt={PROMPT!r}, max_tokens=24, temperature=0, stream=True)
out["streamed"] = "".join(ch.choices[0].text for ch in s if ch.choices)
try:
    c.completions.create(model="stories260K", prompt="x", max_tokens=0)
except openai.BadRequestError as e:
    out["error"] = [e.status_code, e.body["param"]]
print(json.dumps(out))
"""
        p = subprocess.run([self.python, "-c", script], capture_output=True, text=True, timeout=120)
        self.assertEqual(p.returncode, 0, p.stderr)
        out = json.loads(p.stdout)
        expected = self.grpc_text(PROMPT, 24)
        self.assertEqual(out["models"], ["stories260K"])
        self.assertEqual(out["text"], expected)
        self.assertEqual(out["streamed"], expected)
        self.assertEqual(out["finish"], "length")
        self.assertEqual(out["usage"], 24)
        self.assertEqual(out["error"], [400, "max_tokens"])


class HttpChatTest(unittest.TestCase):
    """Chat completions with a chat template added to a copy of the model."""

    TEMPLATE = ("{{ bos_token }}{% for m in messages %}{% if m.role == 'system' %}{{ m.content | trim }}\n"
                "{% else %}{{ m.role | capitalize }}: {{ m.content }}\n{% endif %}{% endfor %}"
                "{% if add_generation_prompt %}Assistant:{% endif %}")

    @classmethod
    def setUpClass(cls):
        cls.python = venv_python()
        cls.dir = tempfile.mkdtemp(prefix="http_chat_")
        model = os.path.join(cls.dir, "stories-copy")
        shutil.copytree(STORIES, model, ignore=shutil.ignore_patterns("llama2c"))
        path = os.path.join(model, "tokenizer_config.json")
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
        config["chat_template"] = cls.TEMPLATE
        with open(path, "w", encoding="utf-8") as f:
            json.dump(config, f)
        # Served under another name than its directory's.
        cls.cluster = Cluster(model, ["--served_model_name=stories-chat"])
        cls.url = cls.cluster.http

    @classmethod
    def tearDownClass(cls):
        cls.cluster.stop()
        shutil.rmtree(cls.dir)

    def test_served_model_name(self):
        code, body = curl(self.url + "/v1/models")
        self.assertEqual([m["id"] for m in json.loads(body)["data"]], ["stories-chat"])
        code, body = curl(self.url + "/v1/models/stories-chat")
        self.assertEqual(code, 200, body)
        code, body = curl(self.url + "/v1/models/stories-copy")
        self.assertEqual(code, 404, body)

    def test_tokenize_messages(self):
        # vLLM's /tokenize of chat messages: the prompt a chat request with them computes (its
        # prompt_tokens), which is the template's text tokenized as it stands (its BOS included).
        messages = [{"role": "system", "content": " Be brief. "}, {"role": "user", "content": "Hi"}]
        code, body = curl(self.url + "/tokenize", data=json.dumps({"messages": messages}))
        self.assertEqual(code, 200, body)
        ids = json.loads(body)["tokens"]
        code, body = curl(self.url + "/tokenize", data=json.dumps(
            {"prompt": "<s>Be brief.\nUser: Hi\nAssistant:", "add_special_tokens": False}))
        self.assertEqual(json.loads(body)["tokens"], ids)
        self.assertEqual(ids[0], 1)
        code, body = curl(self.url + "/v1/chat/completions", data=json.dumps({"messages": messages, "max_tokens": 1}))
        self.assertEqual(code, 200, body)
        self.assertEqual(json.loads(body)["usage"]["prompt_tokens"], len(ids))
        code, body = curl(self.url + "/tokenize", data=json.dumps({"messages": messages, "add_generation_prompt": False}))
        code2, plain = curl(self.url + "/tokenize", data=json.dumps(
            {"prompt": "<s>Be brief.\nUser: Hi\n", "add_special_tokens": False}))
        self.assertEqual(json.loads(body)["tokens"], json.loads(plain)["tokens"])

    def test_chat_logprobs(self):
        # Chat: "logprobs": true and "top_logprobs", streamed and not, give the same entries.
        body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5, "temperature": 0,
                "logprobs": True, "top_logprobs": 2}
        code, out = curl(self.url + "/v1/chat/completions", data=json.dumps(body))
        self.assertEqual(code, 200, out)
        content = json.loads(out)["choices"][0]["logprobs"]["content"]
        self.assertEqual(len(content), 5)
        for c in content:
            self.assertEqual(len(c["top_logprobs"]), 2)
            self.assertEqual(c["top_logprobs"][0]["logprob"], c["logprob"])
            self.assertEqual(bytes(c["bytes"]).decode("utf-8", "replace"), c["token"])
        code, out = curl(self.url + "/v1/chat/completions", "-N", data=json.dumps({**body, "stream": True}))
        self.assertEqual(code, 200, out)
        streamed = []
        for e in sse_events(out)[:-1]:
            chunk = json.loads(e)
            if chunk["choices"] and chunk["choices"][0]["logprobs"]:
                streamed += chunk["choices"][0]["logprobs"]["content"]
        # The same tokens; logprobs equal up to float rounding (the second request may reuse the
        # first one's cached prompt blocks, which sums in another order).
        self.assertEqual([c["token"] for c in streamed], [c["token"] for c in content])
        for a, b in zip(streamed, content):
            self.assertAlmostEqual(a["logprob"], b["logprob"], places=4)
            self.assertEqual([t["token"] for t in a["top_logprobs"]], [t["token"] for t in b["top_logprobs"]])

    def test_chat_n_choices(self):
        # Chat with n: one message per choice, streamed deltas carry their choice's index.
        body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8, "temperature": 1.0, "seed": 3,
                "n": 2}
        code, out = curl(self.url + "/v1/chat/completions", data=json.dumps(body))
        self.assertEqual(code, 200, out)
        choices = json.loads(out)["choices"]
        self.assertEqual([c["index"] for c in choices], [0, 1])
        code, out = curl(self.url + "/v1/chat/completions", "-N", data=json.dumps({**body, "stream": True}))
        self.assertEqual(code, 200, out)
        texts, roles = {}, []
        for e in sse_events(out)[:-1]:
            for c in json.loads(e)["choices"]:
                if "role" in c["delta"]:
                    roles.append(c["index"])
                texts[c["index"]] = texts.get(c["index"], "") + c["delta"].get("content", "")
        self.assertEqual(sorted(roles), [0, 1])
        self.assertEqual([texts[0], texts[1]], [c["message"]["content"] for c in choices])

    def test_chat_streamed_and_not(self):
        messages = [{"role": "system", "content": " Tell a story. "}, {"role": "user", "content": "A cat"}]
        code, body = curl(self.url + "/v1/chat/completions", data=json.dumps(
            {"model": "stories-chat", "messages": messages, "max_tokens": 20, "temperature": 0}))
        self.assertEqual(code, 200, body)
        r = json.loads(body)
        self.assertEqual(r["object"], "chat.completion")
        message = r["choices"][0]["message"]
        self.assertEqual(message["role"], "assistant")
        self.assertTrue(message["content"])
        self.assertIn(r["choices"][0]["finish_reason"], ("stop", "length"))
        # The rendered prompt, tokenized: "<s>Tell a story.\nUser: A cat\nAssistant:" is more than 10 tokens.
        self.assertGreater(r["usage"]["prompt_tokens"], 10)

        code, body = curl(self.url + "/v1/chat/completions", "-N", data=json.dumps(
            {"messages": messages, "max_tokens": 20, "temperature": 0, "stream": True}))
        self.assertEqual(code, 200, body)
        events = sse_events(body)
        self.assertEqual(events[-1], "[DONE]")
        chunks = [json.loads(e) for e in events[:-1]]
        self.assertEqual(chunks[0]["choices"][0]["delta"], {"role": "assistant", "content": ""})
        self.assertTrue(all(c["object"] == "chat.completion.chunk" for c in chunks))
        text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
        self.assertEqual(text, message["content"])
        self.assertEqual(chunks[-1]["choices"][0]["finish_reason"], r["choices"][0]["finish_reason"])

    def test_chat_with_openai_package(self):
        script = f"""
import json, openai
c = openai.OpenAI(base_url={self.url + '/v1'!r}, api_key="unused", max_retries=0)
msgs = [{{"role": "user", "content": "A dog"}}]
r = c.chat.completions.create(model="stories-chat", messages=msgs, max_tokens=16, temperature=0)
s = c.chat.completions.create(model="stories-chat", messages=msgs, max_tokens=16, temperature=0, stream=True)
streamed = "".join(ch.choices[0].delta.content or "" for ch in s if ch.choices)
print(json.dumps([r.choices[0].message.content, streamed, r.usage.completion_tokens]))
"""
        p = subprocess.run([self.python, "-c", script], capture_output=True, text=True, timeout=120)
        self.assertEqual(p.returncode, 0, p.stderr)
        content, streamed, tokens = json.loads(p.stdout)
        self.assertTrue(content)
        self.assertEqual(streamed, content)
        self.assertLessEqual(tokens, 16)

    def test_tool_calls_with_openai_package(self):
        # tool_choice "required" (one call: the model's context is 512 tokens) and a named function:
        # the answer is constrained to a call, which the
        # openai package reads as message.tool_calls (and as streamed deltas) whose arguments
        # validate against the tool's schema, over several seeds; "none" gives plain content.
        script = f"""
import json, openai
c = openai.OpenAI(base_url={self.url + '/v1'!r}, api_key="unused", max_retries=0)
tools = [{{"type": "function", "function": {{"name": "get_weather", "description": "The weather.",
          "parameters": {{"type": "object", "properties": {{"city": {{"type": "string", "maxLength": 10}},
                          "unit": {{"type": "string", "enum": ["celsius", "fahrenheit"]}}, "days": {{"type": "integer"}}}},
                          "required": ["city", "unit"], "additionalProperties": False}}}}}},
         {{"type": "function", "function": {{"name": "get_time", "parameters": {{"type": "object",
          "properties": {{"zone": {{"type": "string", "maxLength": 6}}}}, "required": ["zone"]}}}}}}]
msgs = [{{"role": "user", "content": "A dog"}}]
out = {{"calls": [], "streamed": [], "none": None}}
for seed in range(1, 4):
    for choice in ("required", {{"type": "function", "function": {{"name": "get_time"}}}}):
        r = c.chat.completions.create(model="stories-chat", messages=msgs, tools=tools, tool_choice=choice,
                                      parallel_tool_calls=False, temperature=1.0, seed=seed)
        m = r.choices[0].message
        out["calls"].append([r.choices[0].finish_reason, m.content,
                             [[t.id, t.type, t.function.name, t.function.arguments] for t in m.tool_calls or []],
                             choice if isinstance(choice, str) else "get_time"])
s = c.chat.completions.create(model="stories-chat", messages=msgs, tools=tools, tool_choice="required",
                              parallel_tool_calls=False, temperature=1.0, seed=1, stream=True)
calls = {{}}
for ch in s:
    for d in (ch.choices[0].delta.tool_calls or []) if ch.choices else []:
        e = calls.setdefault(d.index, ["", ""])
        if d.function.name: e[0] = d.function.name
        e[1] += d.function.arguments or ""
out["streamed"] = [calls[k] for k in sorted(calls)]
r = c.chat.completions.create(model="stories-chat", messages=msgs, tools=tools, tool_choice="none", max_tokens=8,
                              temperature=0)
out["none"] = [r.choices[0].finish_reason, r.choices[0].message.content, r.choices[0].message.tool_calls]
print(json.dumps(out))
"""
        p = subprocess.run([self.python, "-c", script], capture_output=True, text=True, timeout=300)
        self.assertEqual(p.returncode, 0, p.stderr)
        out = json.loads(p.stdout)
        self.assertEqual(len(out["calls"]), 6)
        for finish, content, calls, want in out["calls"]:
            self.assertEqual(finish, "tool_calls")
            self.assertIsNone(content)
            self.assertEqual(len(calls), 1)
            if want != "required":
                self.assertEqual([c[2] for c in calls], [want])
            for call_id, kind, name, arguments in calls:
                self.assertTrue(call_id)
                self.assertEqual(kind, "function")
                args = json.loads(arguments)
                if name == "get_weather":
                    self.assertLessEqual(set(args), {"city", "unit", "days"})
                    self.assertIsInstance(args["city"], str)
                    self.assertLessEqual(len(args["city"]), 10)
                    self.assertIn(args["unit"], ("celsius", "fahrenheit"))
                    if "days" in args:
                        self.assertIsInstance(args["days"], int)
                else:
                    self.assertEqual(name, "get_time")
                    self.assertIsInstance(args["zone"], str)
                    self.assertLessEqual(len(args["zone"]), 6)
        first = out["calls"][0]
        self.assertEqual(out["streamed"], [[c[2], c[3]] for c in first[2]])
        finish, content, calls = out["none"]
        self.assertIsNone(calls)
        self.assertTrue(content)


if __name__ == "__main__":
    BIN = sys.argv.pop(1)
    unittest.main(verbosity=2)
