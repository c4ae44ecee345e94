#!/usr/bin/env python3
"""The Python SDK (sdk/python), installed into a venv by tests/sdk/python_sdk_setup.sh: against a
local cluster (same greedy output as the C++ CLI, sync and asyncio, errors with their gRPC code)
and against an in-process fake server (retry before the first token, resume after tokens, deadline, bearer
token, TLS).
    VENV/bin/python tests/sdk/python_sdk_test.py BIN_DIR"""
import asyncio
import json
import os
import subprocess
import tempfile
import sys
import threading
import time
import unittest
from concurrent import futures

import grpc

import shardserve
from shardserve.v1 import common_pb2, inference_pb2, inference_pb2_grpc

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "testing"))
from local_cluster import LocalCluster  # noqa: E402

BIN = None
PROMPT = "Once upon a time"
TESTDATA = "tests/sdk/testdata"


def read(name):
    with open(os.path.join(TESTDATA, name), "rb") as f:
        return f.read()


class AgainstALocalCluster(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.cluster = LocalCluster(BIN)
        cls.client = shardserve.Client(cls.cluster.address, timeout=60)

    @classmethod
    def tearDownClass(cls):
        cls.client.close()
        assert cls.cluster.stop() == 0, "".join(cls.cluster.stderr[-20:])

    def test_greedy_text_equals_the_cli(self):
        cli = self.cluster.cli("generate", "--prompt", PROMPT, "--max_tokens", "24")
        deltas = list(self.client.generate(PROMPT, max_tokens=24))
        self.assertGreater(len(deltas), 1)
        self.assertEqual("".join(d.text for d in deltas) + "\n", cli.stdout)
        self.assertTrue(all(d.finish_reason is None for d in deltas[:-1]))
        self.assertEqual(deltas[-1].finish_reason, "length")
        self.assertEqual(deltas[-1].usage, shardserve.Usage(prompt_tokens=5, completion_tokens=24))

    def test_id_prompt_gives_the_cli_ids(self):
        ids = self.client.tokenize(PROMPT, add_special_tokens=True)
        self.assertEqual(ids[0], 1)  # BOS
        cli = self.cluster.cli("generate", "--prompt_ids", ",".join(map(str, ids)), "--max_tokens", "16",
                               "--print_ids", "--ignore_eos")
        result = self.client.generate(ids, max_tokens=16, ignore_eos=True).result()
        self.assertEqual(result.token_ids, [int(x) for x in cli.stdout.strip().split(",")])
        self.assertEqual(result.finish_reason, "length")
        self.assertEqual(result.usage.completion_tokens, 16)
        self.assertEqual(self.client.generate(PROMPT, max_tokens=16, ignore_eos=True).result().token_ids,
                         result.token_ids)

    def test_logprobs_and_sampling_extras(self):
        # Through the workers' stage streams: greedy, so each token is its step's most likely one.
        ids = self.client.tokenize(PROMPT, add_special_tokens=True)
        r = self.client.generate(ids, max_tokens=4, ignore_eos=True, logprobs=True, top_logprobs=3).result()
        self.assertEqual(len(r.logprobs), 4)
        for token, lp in zip(r.token_ids, r.logprobs):
            self.assertEqual(len(lp.top_ids), 3)
            self.assertEqual(lp.top_ids[0], token)
            self.assertEqual(lp.top_logprobs[0], lp.logprob)
            self.assertLessEqual(lp.logprob, 0.0)
        self.assertEqual(self.client.generate(ids, max_tokens=2).result().logprobs, [])
        # Prompt logprobs: one per prompt token after the first, each at most its position's best.
        scored = self.client.generate(ids, max_tokens=1, prompt_logprobs=True, top_logprobs=2).result()
        self.assertEqual(len(scored.prompt_logprobs), len(ids) - 1)
        for lp in scored.prompt_logprobs:
            self.assertEqual(len(lp.top_ids), 2)
            self.assertLessEqual(lp.logprob, lp.top_logprobs[0] + 1e-6)
        self.assertEqual(scored.token_ids, r.token_ids[:1])
        # logit_bias -100 on the first token: the runner-up comes instead.
        biased = self.client.generate(ids, max_tokens=1, logit_bias={r.token_ids[0]: -100.0}).result()
        self.assertEqual(biased.token_ids, [r.logprobs[0].top_ids[1]])
        # The second token as a stop id, held back by min_tokens.
        stopped = self.client.generate(ids, max_tokens=6, stop_token_ids=[r.token_ids[1]]).result()
        self.assertEqual(stopped.token_ids, r.token_ids[:2])
        held = self.client.generate(ids, max_tokens=6, stop_token_ids=[r.token_ids[1]], min_tokens=3).result()
        self.assertGreaterEqual(len(held.token_ids), 3)
        self.assertNotEqual(held.token_ids[1], r.token_ids[1])

    def test_bad_words(self):
        # Each word of the greedy answer in turn, banned: its spellings (alone, and after a space
        # where that has as many tokens and starts with another one) are never completed. The
        # answer is the free one up to the token that would have completed the first, and that
        # token is then the step's most likely one not banned (from the free run's top logprobs).
        ids = self.client.tokenize(PROMPT, add_special_tokens=True)
        free = self.client.generate(ids, max_tokens=24, ignore_eos=True, logprobs=True, top_logprobs=8).result()

        def completes(tokens, spellings):  # the end of the first completed spelling, or None
            for end in range(len(tokens)):
                if any(len(s) <= end + 1 and tokens[end + 1 - len(s):end + 1] == s for s in spellings):
                    return end
            return None

        tried = 0
        for word in dict.fromkeys(w.strip(".,!?\"'") for w in free.text.split()):
            if not word:
                continue
            alone, spaced = self.client.tokenize(word), self.client.tokenize(" " + word)
            spellings = [alone] + ([spaced] if len(spaced) == len(alone) and spaced[0] != alone[0] else [])
            end = completes(free.token_ids, spellings)
            if end is None:
                continue
            tried += 1
            banned = self.client.generate(ids, max_tokens=24, ignore_eos=True, bad_words=[word]).result()
            self.assertIsNone(completes(banned.token_ids, spellings), (word, spellings, banned.token_ids))
            self.assertEqual(banned.token_ids[:end], free.token_ids[:end], word)
            out = free.token_ids[:end]
            bans = {s[-1] for s in spellings if len(s) == 1 or out[len(out) - len(s) + 1:] == s[:-1]}
            best = next(t for t in free.logprobs[end].top_ids if t not in bans)
            self.assertEqual(banned.token_ids[end], best, word)
            sampled = self.client.generate(ids, max_tokens=24, ignore_eos=True, temperature=1.0, seed=7,
                                           bad_words=[word]).result()
            self.assertIsNone(completes(sampled.token_ids, spellings), (word, sampled.token_ids))
        self.assertGreaterEqual(tried, 3, free.text)
        with self.assertRaises(shardserve.ShardserveError) as e:
            self.client.generate(PROMPT, max_tokens=2, bad_words=["fine", "  "]).result()
        self.assertIn("bad_words[1]", str(e.exception))
        with self.assertRaises(TypeError):
            self.client.generate(PROMPT, max_tokens=2, bad_words="word")

    def test_penalties_give_the_cli_ids(self):
        ids = self.client.tokenize(PROMPT, add_special_tokens=True)
        cli = self.cluster.cli("generate", "--prompt_ids", ",".join(map(str, ids)), "--max_tokens", "32",
                               "--print_ids", "--ignore_eos", "--presence_penalty=0.8", "--frequency_penalty=0.6",
                               "--repetition_penalty=1.3")
        penalized = self.client.generate(ids, max_tokens=32, ignore_eos=True, presence_penalty=0.8,
                                         frequency_penalty=0.6, repetition_penalty=1.3).result()
        self.assertEqual(penalized.token_ids, [int(x) for x in cli.stdout.strip().split(",")])
        plain = self.client.generate(ids, max_tokens=32, ignore_eos=True).result()
        self.assertNotEqual(penalized.token_ids, plain.token_ids)
        with self.assertRaises(shardserve.ShardserveError) as e:
            self.client.generate(ids, max_tokens=2, presence_penalty=3.0).result()
        self.assertIn("presence_penalty", str(e.exception))

    def test_stop_strings_and_chat(self):
        # A text stop string cuts the text right before it; chat messages need a chat template,
        # which this model lacks: the server says so.
        full = self.client.generate(PROMPT, max_tokens=24).result()
        stop = full.text[10:14]
        cut = self.client.generate(PROMPT, max_tokens=24, stop=[stop]).result()
        self.assertEqual(cut.text, full.text[:full.text.index(stop)])
        self.assertEqual(cut.finish_reason, "stop")
        # include_stop_str_in_output: the text ends with the stop string instead.
        kept = self.client.generate(PROMPT, max_tokens=24, stop=[stop], include_stop_str_in_output=True).result()
        self.assertEqual(kept.text, full.text[:full.text.index(stop) + len(stop)])
        self.assertEqual(kept.finish_reason, "stop")
        # skip_special_tokens=False: EOS (forced by a logit bias, generated past by ignore_eos) is spelled.
        eos = dict(max_tokens=3, ignore_eos=True, logit_bias={2: 100})
        self.assertEqual(self.client.generate(PROMPT, **eos).result().text, "")
        self.assertEqual(self.client.generate(PROMPT, skip_special_tokens=False, **eos).result().text, "</s>" * 3)
        # truncate_prompt_tokens: the prompt's last k tokens, which answer as those ids alone do.
        ids = self.client.tokenize(PROMPT)
        cut = self.client.generate(PROMPT, max_tokens=8, truncate_prompt_tokens=3).result()
        self.assertEqual(cut.usage.prompt_tokens, 3)
        self.assertEqual(cut.token_ids, self.client.generate(ids[-3:], max_tokens=8).result().token_ids)
        with self.assertRaises(shardserve.ShardserveError) as e:
            self.client.generate(PROMPT, max_tokens=8, truncate_prompt_tokens=-2).result()
        self.assertIn("truncate_prompt_tokens", str(e.exception))
        # allowed_token_ids: every generated id is one of them, sampled or greedy.
        allowed = [261, 378, 403, 407]
        for seed in (0, 5):
            ids = self.client.generate(PROMPT, max_tokens=12, ignore_eos=True, temperature=0.9 if seed else 0.0,
                                       seed=seed, allowed_token_ids=allowed).result().token_ids
            self.assertEqual(len(ids), 12)
            self.assertTrue(set(ids) <= set(allowed), ids)
        with self.assertRaises(shardserve.ShardserveError) as e:
            self.client.generate(PROMPT, max_tokens=2, allowed_token_ids=[1 << 20]).result()
        self.assertIn("allowed_token_ids[0]", str(e.exception))
        # priority: the test cluster schedules first come, first served, which takes only 0.
        self.assertEqual(self.client.generate(PROMPT, max_tokens=2, priority=0).result().usage.completion_tokens, 2)
        with self.assertRaises(shardserve.ShardserveError) as e:
            self.client.generate(PROMPT, max_tokens=2, priority=1).result()
        self.assertIn("--scheduling_policy=priority", str(e.exception))
        with self.assertRaises(shardserve.ShardserveError) as e:
            self.client.generate([{"role": "user", "content": "Hi"}], max_tokens=4).result()
        self.assertIn("has no chat template", str(e.exception))

    def test_structured_output(self):
        schema = {"type": "object", "properties": {"color": {"enum": ["red", "green"]}, "n": {"type": "integer"}},
                  "required": ["color", "n"]}
        r = self.client.generate(PROMPT, max_tokens=100, temperature=1.0, seed=5, json_schema=schema).result()
        self.assertEqual(r.finish_reason, "stop")
        value = json.loads(r.text)
        self.assertIn(value["color"], ("red", "green"))
        self.assertIsInstance(value["n"], int)
        r = self.client.generate(PROMPT, max_tokens=100, temperature=1.0, seed=5, regex="[a-z]{2,5}-[0-9]{3}").result()
        self.assertRegex(r.text, "^[a-z]{2,5}-[0-9]{3}$")
        with self.assertRaises(shardserve.ShardserveError) as e:
            self.client.generate(PROMPT, max_tokens=4, json_schema={"type": "string", "pattern": "a+"}).result()
        self.assertIn("pattern", str(e.exception))

    def test_n_choices_equal_the_cli_and_async(self):
        # n = 2: each delta names its choice; results() gives both answers, choice i equal to the
        # CLI's line i (`shardserve generate --n 2`) and to the async client's; result() refuses.
        stream = self.client.generate(PROMPT, max_tokens=12, temperature=1.0, seed=3, n=2)
        results = stream.results()
        self.assertEqual(len(results), 2)
        self.assertNotEqual(results[0].token_ids, results[1].token_ids)
        cli = self.cluster.cli("generate", "--prompt", PROMPT, "--max_tokens", "12", "--temperature", "1",
                               "--seed", "3", "--n", "2", "--print_ids")
        self.assertEqual([[int(x) for x in line.split(",")] for line in cli.stdout.strip().split("\n")],
                         [r.token_ids for r in results])
        indexes = {d.index for d in self.client.generate(PROMPT, max_tokens=12, temperature=1.0, seed=3, n=2)}
        self.assertEqual(indexes, {0, 1})
        with self.assertRaises(shardserve.ShardserveError):
            self.client.generate(PROMPT, max_tokens=4, n=2).result()
        with self.assertRaises(ValueError):
            self.client.generate(PROMPT, n=0)

        async def main():
            async with shardserve.AsyncClient(self.cluster.address, timeout=60) as client:
                return await client.generate(PROMPT, max_tokens=12, temperature=1.0, seed=3, n=2).results()

        self.assertEqual([r.token_ids for r in asyncio.run(main())], [r.token_ids for r in results])

    def test_async_client_gives_the_same_answer(self):
        expected = self.client.generate(PROMPT, max_tokens=20).result()

        async def main():
            async with shardserve.AsyncClient(self.cluster.address, timeout=60) as client:
                texts = [d.text async for d in client.generate(PROMPT, max_tokens=20)]
                result = await client.generate(PROMPT, max_tokens=20).result()
                info = await client.model_info()
                status = await client.cluster_status()
                ids = await client.tokenize(PROMPT)
                with self.assertRaises(shardserve.ShardserveError) as e:
                    await client.generate(PROMPT, max_tokens=0).result()
                return texts, result, info, status, ids, e.exception

        texts, result, info, status, ids, error = asyncio.run(main())
        self.assertEqual("".join(texts), expected.text)
        self.assertEqual(result.token_ids, expected.token_ids)
        self.assertEqual(info.vocab_size, 512)
        self.assertTrue(status.ready)
        self.assertEqual(ids, self.client.tokenize(PROMPT))
        self.assertEqual(error.code, grpc.StatusCode.INVALID_ARGUMENT)
        self.assertIn("max_tokens", error.message)

    def test_bad_requests_are_invalid_argument(self):
        for kwargs in ({"max_tokens": 0}, {"max_tokens": 8, "temperature": -1.0}, {"max_tokens": 100000}):
            with self.assertRaises(shardserve.ShardserveError) as e:
                self.client.generate(PROMPT, **kwargs).result()
            self.assertEqual(e.exception.code, grpc.StatusCode.INVALID_ARGUMENT, kwargs)
            self.assertTrue(e.exception.message, kwargs)
        with self.assertRaises(shardserve.ShardserveError) as e:
            self.client.generate([], max_tokens=4).result()
        self.assertEqual(e.exception.code, grpc.StatusCode.INVALID_ARGUMENT)

    def test_model_info_and_cluster_status(self):
        info = self.client.model_info()
        self.assertEqual(info.architecture, "LlamaForCausalLM")
        self.assertEqual(info.num_layers, 5)
        self.assertTrue(info.has_tokenizer)
        status = self.client.cluster_status()
        self.assertTrue(status.ready)
        self.assertEqual(len(status.workers), 1)
        self.assertEqual(status.workers[0].state, "ready")
        self.assertEqual(status.workers[0].devices, ["cpu:0"])
        # The replica's pipelining and decode-steps lines, as `shardserve status` prints them (no
        # request runs in between, so the coordinator's choice cannot move).
        self.assertEqual(len(status.pipelining), 1)
        self.assertEqual(len(status.decode_steps), 1)
        self.assertRegex(status.decode_steps[0], r"^replica 0: \d+ \((auto|fixed)")
        cli = self.cluster.cli("status").stdout.splitlines()
        self.assertEqual([line for line in cli if line.startswith("pipelining: ")],
                         ["pipelining: " + line for line in status.pipelining])
        self.assertEqual([line for line in cli if line.startswith("decode steps per call: ")],
                         ["decode steps per call: " + line for line in status.decode_steps])
        self.assertEqual(status.scheduling_policy, "fcfs")
        self.assertIn("scheduling: fcfs", cli)

    def test_cancel_mid_stream(self):
        stream = self.client.generate(PROMPT, max_tokens=400, ignore_eos=True)
        first = next(stream)
        self.assertIsNone(first.finish_reason)
        stream.cancel()
        with self.assertRaises(shardserve.ShardserveError) as e:
            stream.result()
        self.assertEqual(e.exception.code, grpc.StatusCode.CANCELLED)

    def test_async_cancel_mid_stream(self):
        async def main():
            async with shardserve.AsyncClient(self.cluster.address, timeout=60) as client:
                stream = client.generate(PROMPT, max_tokens=400, ignore_eos=True)
                first = await stream.__anext__()
                stream.cancel()
                with self.assertRaises(shardserve.ShardserveError) as e:
                    await stream.result()
                return first, e.exception

        first, error = asyncio.run(main())
        self.assertIsNone(first.finish_reason)
        self.assertEqual(error.code, grpc.StatusCode.CANCELLED)

    def test_unreachable_server_is_unavailable(self):
        with shardserve.Client("127.0.0.1:1", retry=shardserve.RetryOptions(max_attempts=2, initial_backoff=0.01,
                                                                            max_backoff=0.01)) as c:
            with self.assertRaises(shardserve.ShardserveError) as e:
                c.model_info()
        self.assertEqual(e.exception.code, grpc.StatusCode.UNAVAILABLE)


class FakeInference(inference_pb2_grpc.InferenceServicer):
    """Fails the first `unavailable_first` calls with UNAVAILABLE, then streams `responses` and ends
    with `end` (a (code, message) pair or None), or holds the stream until the deadline. Resume:
    call i (from 0, counting every call) with i < len(cuts) breaks with UNAVAILABLE after cuts[i]
    responses, and every call starts after the responses whose tokens its resume.token_ids hold."""

    def __init__(self, unavailable_first=0, responses=(), end=None, hold=False, cuts=()):
        self.unavailable_first = unavailable_first
        self.responses = list(responses)
        self.end = end
        self.hold = hold
        self.cuts = list(cuts)
        self.calls = 0
        self.authorization = []
        self.requests = []
        self.lock = threading.Lock()

    def Generate(self, request, context):
        with self.lock:
            self.calls += 1
            n = self.calls
            self.requests.append(request)
            self.authorization.append(dict(context.invocation_metadata()).get("authorization"))
        if n <= self.unavailable_first:
            context.abort(grpc.StatusCode.UNAVAILABLE, "fake server: warming up")
        rest, have = list(self.responses), list(request.resume.token_ids)
        while have and rest:
            ids = list(rest.pop(0).token_ids)
            if have[:len(ids)] != ids:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, "fake server: resume.token_ids do not match")
            have = have[len(ids):]
        if have:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "fake server: resume.token_ids run past the answer")
        if n - 1 < len(self.cuts):
            yield from rest[:self.cuts[n - 1]]
            context.abort(grpc.StatusCode.UNAVAILABLE, "fake server: the coordinator restarted")
        yield from rest
        if self.hold:
            while context.is_active():
                time.sleep(0.01)
            return
        if self.end:
            context.abort(*self.end)


def tokens(ids, text, finish=common_pb2.FINISH_REASON_UNSPECIFIED):
    r = inference_pb2.GenerateResponse(token_ids=ids, text=text, finish_reason=finish, request_id="req-1")
    if finish != common_pb2.FINISH_REASON_UNSPECIFIED:
        r.usage.prompt_tokens, r.usage.completion_tokens = 3, 2
    return r


ANSWER = [tokens([10], "Once"), tokens([11], " upon"), tokens([], "", common_pb2.FINISH_REASON_STOP)]
FAST = shardserve.RetryOptions(max_attempts=4, initial_backoff=0.01, max_backoff=0.05)


class AgainstAFakeServer(unittest.TestCase):
    def serve(self, fake, tls=False):
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        inference_pb2_grpc.add_InferenceServicer_to_server(fake, server)
        if tls:
            creds = grpc.ssl_server_credentials([(read("server.key"), read("server.pem"))])
            port = server.add_secure_port("127.0.0.1:0", creds)
        else:
            port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        self.addCleanup(server.stop, None)
        return f"127.0.0.1:{port}"

    def test_reasoning_text_adds_up_apart_from_the_text(self):
        first = tokens([10, 11], "")
        first.reasoning_text = "Paris is in "
        second = tokens([12, 13], "It is")
        second.reasoning_text = "France."
        fake = FakeInference(responses=[first, second, tokens([], " sunny.", common_pb2.FINISH_REASON_STOP)])
        chat = [{"role": "user", "content": "Weather in Paris?"}]
        with shardserve.Client(self.serve(fake), retry=FAST) as c:
            self.assertEqual([d.reasoning_text for d in c.generate(chat)], ["Paris is in ", "France.", ""])
            result = c.generate(chat).result()
            self.assertEqual(result.reasoning_text, "Paris is in France.")
            self.assertEqual(result.text, "It is sunny.")

    def test_tools_go_out_and_tool_calls_come_back(self):
        last = tokens([], "", common_pb2.FINISH_REASON_TOOL_CALLS)
        last.tool_calls.add(id="call-1", name="get_weather", arguments='{"city": "Oslo"}')
        fake = FakeInference(responses=[tokens([10, 11], "<tool_call>"), last])
        tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
        chat = [{"role": "user", "content": "Weather in Bergen, then Oslo?"},
                {"role": "assistant", "content": None, "reasoning_content": "Bergen first.",
                 "tool_calls": [{"id": "call-0", "type": "function",
                                 "function": {"name": "get_weather", "arguments": {"city": "Bergen"}}}]},
                {"role": "tool", "content": "rain", "tool_call_id": "call-0"}]
        address = self.serve(fake)
        with shardserve.Client(address, retry=FAST) as c:
            result = c.generate(chat, tools=tools, tool_choice="required", parallel_tool_calls=False).result()
            self.assertEqual(result.finish_reason, "tool_calls")
            self.assertEqual(result.tool_calls, [shardserve.ToolCall("call-1", "get_weather", '{"city": "Oslo"}')])
            sent = fake.requests[-1].chat
            self.assertEqual(json.loads(sent.tools), tools)
            self.assertEqual(sent.tool_choice, inference_pb2.TOOL_CHOICE_REQUIRED)
            self.assertTrue(sent.single_tool_call)
            self.assertEqual(sent.messages[1].content, "")
            self.assertEqual((sent.messages[1].tool_calls[0].id, sent.messages[1].tool_calls[0].name),
                             ("call-0", "get_weather"))
            self.assertEqual(json.loads(sent.messages[1].tool_calls[0].arguments), {"city": "Bergen"})
            self.assertEqual(sent.messages[2].tool_call_id, "call-0")
            self.assertEqual(sent.messages[1].reasoning_content, "Bergen first.")
            self.assertEqual(sent.messages[0].reasoning_content, "")
            c.generate(chat, tools=tools, tool_choice={"type": "function", "function": {"name": "get_weather"}}).result()
            sent = fake.requests[-1].chat
            self.assertEqual((sent.tool_choice, sent.tool_name), (inference_pb2.TOOL_CHOICE_FUNCTION, "get_weather"))
            self.assertFalse(sent.continue_final_message)
            c.generate(chat, continue_final_message=True).result()
            self.assertTrue(fake.requests[-1].chat.continue_final_message)
            self.assertEqual(fake.requests[-1].chat.template_kwargs, "")
            c.generate(chat, chat_template_kwargs={"enable_thinking": False}).result()
            self.assertEqual(json.loads(fake.requests[-1].chat.template_kwargs), {"enable_thinking": False})
            with self.assertRaises(ValueError):
                c.generate("hi", chat_template_kwargs={"enable_thinking": False})
            # Tools and continue_final_message need a chat prompt; tool_choice must be one of OpenAI's forms.
            with self.assertRaises(ValueError):
                c.generate("hi", tools=tools)
            with self.assertRaises(ValueError):
                c.generate("hi", continue_final_message=True)
            with self.assertRaises(ValueError):
                c.generate(chat, tools=tools, tool_choice="sometimes")

        async def run():
            async with shardserve.AsyncClient(address, retry=FAST) as c:
                return await c.generate(chat, tools=tools).result()
        result = asyncio.run(run())
        self.assertEqual(result.tool_calls[0].name, "get_weather")
        self.assertEqual(fake.requests[-1].chat.tool_choice, inference_pb2.TOOL_CHOICE_UNSPECIFIED)

    def test_retries_unavailable_before_the_first_token(self):
        fake = FakeInference(unavailable_first=2, responses=ANSWER)
        with shardserve.Client(self.serve(fake), retry=FAST) as c:
            result = c.generate("hi").result()
        self.assertEqual(result.token_ids, [10, 11])
        self.assertEqual(result.text, "Once upon")
        self.assertEqual(result.finish_reason, "stop")
        self.assertEqual(fake.calls, 3)

    def test_retries_are_bounded(self):
        fake = FakeInference(unavailable_first=100)
        with shardserve.Client(self.serve(fake), retry=shardserve.RetryOptions(max_attempts=3, initial_backoff=0.01,
                                                                               max_backoff=0.01, max_resumes=2)) as c:
            with self.assertRaises(shardserve.ShardserveError) as e:
                c.generate("hi").result()
        self.assertEqual(e.exception.code, grpc.StatusCode.UNAVAILABLE)
        self.assertEqual(e.exception.message, "fake server: warming up")
        # gRPC's 3 attempts, then sent again twice (3 attempts each) before giving up.
        self.assertEqual(fake.calls, 9)

    def test_a_generate_is_sent_again_when_grpc_retries_run_out_before_any_response(self):
        # A coordinator restart longer than gRPC's own retries: the stream is sent again as it was.
        retry = shardserve.RetryOptions(max_attempts=3, initial_backoff=0.01, max_backoff=0.01)
        fake = FakeInference(unavailable_first=7, responses=ANSWER)
        with shardserve.Client(self.serve(fake), retry=retry) as c:
            result = c.generate("hi").result()
        self.assertEqual(result.token_ids, [10, 11])
        self.assertEqual(fake.calls, 8)
        fake = FakeInference(unavailable_first=7, responses=ANSWER)
        never = shardserve.RetryOptions(max_attempts=3, initial_backoff=0.01, max_backoff=0.01, max_resumes=0)
        with shardserve.Client(self.serve(fake), retry=never) as c:
            with self.assertRaises(shardserve.ShardserveError):
                c.generate("hi").result()
        self.assertEqual(fake.calls, 3)

    def resumable(self, cuts):
        """A fake whose four-token answer (one token per message, "Once up" + "on a" splits a word
        across messages, with logprobs) breaks after the numbers of messages in `cuts`."""
        answer = [tokens([10], "Once"), tokens([11], " up"), tokens([12], "on a"), tokens([13], " time"),
                  tokens([], "", common_pb2.FINISH_REASON_LENGTH)]
        for i in range(4):
            answer[i].logprobs.add(logprob=-0.5 * (i + 1))
        return FakeInference(responses=answer, cuts=cuts)

    def check_resumed(self, fake, deltas):
        self.assertEqual([t for d in deltas for t in d.token_ids], [10, 11, 12, 13])
        self.assertEqual("".join(d.text for d in deltas), "Once upon a time")
        self.assertEqual([lp.logprob for d in deltas for lp in d.logprobs], [-0.5, -1.0, -1.5, -2.0])
        self.assertEqual(deltas[-1].finish_reason, "length")
        self.assertEqual([list(r.resume.token_ids) for r in fake.requests], [[], [10, 11], [10, 11, 12]])
        self.assertEqual([r.sampling.seed for r in fake.requests], [42, 42, 42])  # the same seed every time
        self.assertEqual([r.request_id for r in fake.requests], ["", "req-1", "req-1"])  # the server's id
        self.assertTrue(all(r.text == "hi" and r.max_tokens == 4 for r in fake.requests))

    def test_resumes_a_stream_broken_after_tokens(self):
        fake = self.resumable([2, 1])
        with shardserve.Client(self.serve(fake), retry=FAST) as c:
            deltas = list(c.generate("hi", max_tokens=4, temperature=0.8, seed=42, logprobs=True))
        self.check_resumed(fake, deltas)

    def test_asyncio_resumes_too(self):
        fake = self.resumable([2, 1])
        address = self.serve(fake)

        async def run():
            async with shardserve.AsyncClient(address, retry=FAST) as c:
                return [d async for d in c.generate("hi", max_tokens=4, temperature=0.8, seed=42, logprobs=True)]
        self.check_resumed(fake, asyncio.run(run()))

    def test_resumes_in_a_row_without_a_token_are_bounded(self):
        fake = self.resumable([1] + [0] * 10)
        retry = shardserve.RetryOptions(max_attempts=1, initial_backoff=0.01, max_backoff=0.05, max_resumes=3)
        with shardserve.Client(self.serve(fake), retry=retry) as c:
            stream = c.generate("hi")
            self.assertEqual(next(stream).token_ids, [10])
            with self.assertRaises(shardserve.ShardserveError) as e:
                next(stream)
        self.assertEqual(e.exception.code, grpc.StatusCode.UNAVAILABLE)
        self.assertEqual(e.exception.message, "fake server: the coordinator restarted")
        self.assertEqual(fake.calls, 1 + 3)

    def test_cancel_ends_the_wait_before_a_resume(self):
        fake = self.resumable([1])
        slow = shardserve.RetryOptions(max_attempts=1, initial_backoff=20, max_backoff=20)  # only cancel ends it
        with shardserve.Client(self.serve(fake), retry=slow) as c:
            stream = c.generate("hi")
            self.assertEqual(next(stream).token_ids, [10])
            threading.Timer(0.1, stream.cancel).start()
            started = time.time()
            with self.assertRaises(shardserve.ShardserveError) as e:
                next(stream)
        self.assertEqual(e.exception.code, grpc.StatusCode.CANCELLED)
        self.assertLess(time.time() - started, 10)
        self.assertEqual(fake.calls, 1)

    def test_never_resumes_without_resumes_or_with_several_choices(self):
        fake = self.resumable([1, 1])
        address = self.serve(fake)
        off = shardserve.RetryOptions(max_attempts=4, initial_backoff=0.01, max_backoff=0.05, max_resumes=0)
        for retry, n in ((off, 1), (FAST, 2)):
            with shardserve.Client(address, retry=retry) as c:
                stream = c.generate("hi", n=n)
                self.assertEqual(next(stream).token_ids, [10])
                with self.assertRaises(shardserve.ShardserveError) as e:
                    next(stream)
            self.assertEqual(e.exception.code, grpc.StatusCode.UNAVAILABLE)
        self.assertEqual(fake.calls, 2)

    def test_timeout_is_deadline_exceeded(self):
        fake = FakeInference(responses=ANSWER[:1], hold=True)
        address = self.serve(fake)
        with shardserve.Client(address, timeout=60) as c:
            with self.assertRaises(shardserve.ShardserveError) as e:
                c.generate("hi", timeout=0.3).result()
        self.assertEqual(e.exception.code, grpc.StatusCode.DEADLINE_EXCEEDED)

        async def main():
            async with shardserve.AsyncClient(address, timeout=0.3) as c:
                await c.generate("hi").result()

        with self.assertRaises(shardserve.ShardserveError) as e:
            asyncio.run(main())
        self.assertEqual(e.exception.code, grpc.StatusCode.DEADLINE_EXCEEDED)

    def test_sends_the_bearer_token(self):
        fake = FakeInference(responses=ANSWER)
        address = self.serve(fake)
        with shardserve.Client(address, bearer_token="s3cret") as c:
            c.generate("hi").result()
        with shardserve.Client(address) as c:
            c.generate("hi").result()
        self.assertEqual(fake.authorization, ["Bearer s3cret", None])

    def test_tls_with_the_right_root(self):
        fake = FakeInference(responses=ANSWER)
        address = self.serve(fake, tls=True)
        with shardserve.Client(address, tls=shardserve.TlsOptions(root_certs=read("ca.pem"))) as c:
            self.assertEqual(c.generate("hi").result().text, "Once upon")
        untrusted = shardserve.TlsOptions(root_certs=read("other_ca.pem"))
        for kwargs in ({"tls": untrusted}, {}):
            with shardserve.Client(address, retry=shardserve.RetryOptions(max_attempts=1), **kwargs) as c:
                with self.assertRaises(shardserve.ShardserveError) as e:
                    c.generate("hi").result()
            self.assertEqual(e.exception.code, grpc.StatusCode.UNAVAILABLE, kwargs)
        self.assertEqual(fake.calls, 1)

    def test_cli_uses_tls_and_the_bearer_token(self):
        fake = FakeInference(responses=ANSWER)
        address = self.serve(fake, tls=True)
        cli = [os.path.join(BIN, "shardserve"), "generate", f"--server={address}", "--prompt", "hi"]
        with tempfile.NamedTemporaryFile("w", suffix=".token") as token:
            token.write("cli-token\n")
            token.flush()
            p = subprocess.run(cli + [f"--tls_ca_file={TESTDATA}/ca.pem", f"--bearer_token_file={token.name}"],
                               capture_output=True, text=True, timeout=60)
        self.assertEqual(p.returncode, 0, p.stderr)
        self.assertEqual(p.stdout, "Once upon\n")
        self.assertEqual(fake.authorization, ["Bearer cli-token"])
        p = subprocess.run(cli + ["--tls_ca_file=/nonexistent.pem"], capture_output=True, text=True, timeout=60)
        self.assertEqual(p.returncode, 1)
        self.assertIn("--tls_ca_file", p.stderr)
        p = subprocess.run(cli, capture_output=True, text=True, timeout=60)  # plaintext to a TLS server
        self.assertEqual(p.returncode, 1)
        self.assertIn("UNAVAILABLE", p.stderr)

    def test_bad_options_are_value_errors(self):
        for args, kwargs, word in (
                (("localhost",), {}, "HOST:PORT"), (("h:0",), {}, "HOST:PORT"), (("h:1",), {"timeout": 0}, "timeout"),
                (("h:1",), {"retry": shardserve.RetryOptions(max_attempts=9)}, "max_attempts"),
                (("h:1",), {"retry": shardserve.RetryOptions(max_resumes=-1)}, "max_resumes"),
                (("h:1",), {"bearer_token": "a\nb"}, "bearer_token"),
                (("h:1",), {"tls": shardserve.TlsOptions(client_cert=b"x")}, "client_key")):
            with self.assertRaises(ValueError) as e:
                shardserve.Client(*args, **kwargs)
            self.assertIn(word, str(e.exception))


if __name__ == "__main__":
    BIN = os.path.abspath(sys.argv.pop(1))
    unittest.main(verbosity=2)
