"""What the synchronous and the asyncio clients share: option checks, channel options, request
building and the conversions from the protocol's messages."""
from __future__ import annotations

import json
import time
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import grpc

from shardserve._types import (ClusterStatus, GenerateDelta, GenerateResult, ModelInfo, RetryOptions, TokenLogprob,
                               ShardserveError, TlsOptions, ToolCall, Usage, WorkerStatus)
from shardserve.v1 import common_pb2, control_pb2, inference_pb2

# Text (tokenized by the server), token ids (used as given), or chat messages ({"role": ...,
# "content": ..., optional "name"}) rendered with the model's chat template by the server.
Prompt = Union[str, Sequence[int], Sequence[Mapping[str, str]]]
Metadata = Tuple[Tuple[str, str], ...]

_FINISH = {
    common_pb2.FINISH_REASON_LENGTH: "length",
    common_pb2.FINISH_REASON_STOP: "stop",
    common_pb2.FINISH_REASON_CANCELLED: "cancelled",
    common_pb2.FINISH_REASON_TOOL_CALLS: "tool_calls",
}


class Settings:
    """The checked options of a client: channel arguments, credentials, per-call metadata."""

    def __init__(self, address: str, timeout: float, tls: Union[TlsOptions, bool, None],
                 bearer_token: Optional[str], retry: RetryOptions) -> None:
        host, sep, port = address.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f'server address "{address}" is not HOST:PORT with a port in 1..65535')
        if not timeout > 0:
            raise ValueError(f"timeout must be > 0 seconds, not {timeout}")
        if not 1 <= retry.max_attempts <= 5:
            raise ValueError(f"retry.max_attempts must be in 1..5, not {retry.max_attempts}")
        if not 0 < retry.initial_backoff <= retry.max_backoff:
            raise ValueError("retry needs 0 < initial_backoff <= max_backoff, not "
                             f"{retry.initial_backoff} and {retry.max_backoff}")
        if not 1 <= retry.backoff_multiplier <= 100:
            raise ValueError(f"retry.backoff_multiplier must be in [1, 100], not {retry.backoff_multiplier}")
        if not 0 <= retry.max_resumes <= 100:
            raise ValueError(f"retry.max_resumes must be in 0..100, not {retry.max_resumes}")
        if bearer_token is not None and not all(0x20 <= ord(c) <= 0x7E for c in bearer_token):
            raise ValueError("bearer_token has a character that is not printable ASCII")
        if tls is True:
            tls = TlsOptions()
        if isinstance(tls, TlsOptions) and (tls.client_cert is None) != (tls.client_key is None):
            raise ValueError("TlsOptions: give both client_cert and client_key, or neither")
        self.address = address
        self.timeout = timeout
        self.tls: Optional[TlsOptions] = tls if isinstance(tls, TlsOptions) else None
        self.metadata: Metadata = (("authorization", f"Bearer {bearer_token}"),) if bearer_token else ()
        options: List[Tuple[str, Any]] = [("grpc.enable_retries", 1 if retry.max_attempts > 1 else 0)]
        if retry.max_attempts > 1:
            options.append(("grpc.service_config", _retry_config(retry)))
        # Reconnect soon after a server comes back (gRPC's default backoff grows to two minutes),
        # so that retries and resumes find it.
        options.append(("grpc.initial_reconnect_backoff_ms", max(1, int(retry.initial_backoff * 1000))))
        options.append(("grpc.max_reconnect_backoff_ms", max(1, int(retry.max_backoff * 1000))))
        self.retry = retry
        if self.tls is not None and self.tls.server_name:
            options.append(("grpc.ssl_target_name_override", self.tls.server_name))
        self.channel_options = options

    def credentials(self) -> Optional[grpc.ChannelCredentials]:
        """None for a plaintext channel."""
        if self.tls is None:
            return None
        return grpc.ssl_channel_credentials(root_certificates=self.tls.root_certs, private_key=self.tls.client_key,
                                            certificate_chain=self.tls.client_cert)

    def call_timeout(self, timeout: Optional[float]) -> float:
        if timeout is not None and not timeout > 0:
            raise ValueError(f"timeout must be > 0 seconds, not {timeout}")
        return self.timeout if timeout is None else timeout


class Resume:
    """What a generation's stream needs to resume after it broke (RetryOptions): the tokens and the
    request id received so far, and how many resumes in a row brought nothing. A stream that broke
    before anything reached the caller is sent again as it was, under the same limits."""

    def __init__(self, request: inference_pb2.GenerateRequest, retry: RetryOptions, timeout: float) -> None:
        self._request = request
        self._retry = retry
        self._deadline = time.monotonic() + timeout
        self._received: List[int] = []
        self._request_id = ""
        self._finished = False
        self._delivered = False  # any response reached the caller
        self._failures = 0  # resumes (or re-sends) in a row without a new token

    def seen(self, resp: inference_pb2.GenerateResponse) -> None:
        self._delivered = True
        self._received.extend(resp.token_ids)
        self._request_id = resp.request_id or self._request_id
        if resp.token_ids:
            self._failures = 0
        if resp.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED:
            self._finished = True

    def backoff(self, e: grpc.RpcError) -> Optional[float]:
        """Seconds to wait before resuming after `e`, or None when the error stands."""
        code = e.code() if hasattr(e, "code") else None
        left = self._deadline - time.monotonic()
        if (code != grpc.StatusCode.UNAVAILABLE or self._finished or self._failures >= self._retry.max_resumes
                or left <= 0):
            return None
        # Nothing delivered yet (gRPC's own retries ran out, e.g. while the coordinator restarts):
        # the request is sent again as it was. After tokens, only one choice can be resumed; a
        # response without tokens (prompt logprobs) would come again.
        if self._delivered and (not self._received or self._request.n > 1):
            return None
        wait = self._retry.initial_backoff * self._retry.backoff_multiplier ** self._failures
        self._failures += 1
        return min(wait, self._retry.max_backoff, left)

    def request(self) -> inference_pb2.GenerateRequest:
        """The next attempt's request: the same, resumed after the tokens received so far (if any)."""
        req = inference_pb2.GenerateRequest()
        req.CopyFrom(self._request)
        if not self._received:
            return req
        req.request_id = self._request_id or req.request_id
        req.resume.token_ids.extend(self._received)
        return req

    def timeout_left(self) -> float:
        return max(self._deadline - time.monotonic(), 0.001)


def _retry_config(r: RetryOptions) -> str:
    policy = {
        "maxAttempts": r.max_attempts,
        "initialBackoff": f"{r.initial_backoff:.3f}s",
        "maxBackoff": f"{r.max_backoff:.3f}s",
        "backoffMultiplier": r.backoff_multiplier,
        "retryableStatusCodes": ["UNAVAILABLE"],
    }
    names = [{"service": "shardserve.v1.Inference"}, {"service": "shardserve.v1.Admin"}]
    return json.dumps({"methodConfig": [{"name": names, "retryPolicy": policy}]})


def error(e: grpc.RpcError) -> ShardserveError:
    code = e.code() if hasattr(e, "code") else None
    details = e.details() if hasattr(e, "details") else None
    return ShardserveError(code if isinstance(code, grpc.StatusCode) else grpc.StatusCode.UNKNOWN,
                           details or str(e))


def generate_request(prompt: Prompt, max_tokens: int, temperature: float, top_k: int, top_p: float, seed: int,
                     stop_token_ids: Sequence[int], ignore_eos: bool, request_id: str, min_p: float = 0.0,
                     logit_bias: Optional[Mapping[int, float]] = None, min_tokens: int = 0, logprobs: bool = False,
                     top_logprobs: int = 0, presence_penalty: float = 0.0, frequency_penalty: float = 0.0,
                     repetition_penalty: float = 1.0, prompt_logprobs: bool = False,
                     stop: Sequence[str] = (), json_schema=None, json_object: bool = False,
                     regex: Optional[str] = None, n: int = 1, tools: Optional[Sequence[Mapping]] = None,
                     tool_choice=None, parallel_tool_calls: bool = True, include_stop_str_in_output: bool = False,
                     skip_special_tokens: bool = True,
                     continue_final_message: bool = False,
                     truncate_prompt_tokens: Optional[int] = None,
                     priority: int = 0, allowed_token_ids: Sequence[int] = (),
                     bad_words: Sequence[str] = (),
                     chat_template_kwargs: Optional[Mapping] = None) -> inference_pb2.GenerateRequest:
    if not 1 <= n <= 16:
        raise ValueError(f"n must be in [1, 16], got {n}")
    is_chat = not isinstance(prompt, str) and len(prompt) > 0 and isinstance(prompt[0], Mapping)
    if (tools is not None or tool_choice is not None) and not is_chat:
        raise ValueError("tools and tool_choice need a chat prompt (a list of messages)")
    if continue_final_message and not is_chat:
        raise ValueError("continue_final_message needs a chat prompt (a list of messages)")
    if chat_template_kwargs is not None and not is_chat:
        raise ValueError("chat_template_kwargs needs a chat prompt (a list of messages)")
    req = inference_pb2.GenerateRequest(max_tokens=max_tokens, stop_token_ids=list(stop_token_ids),
                                        ignore_eos=ignore_eos, request_id=request_id, min_tokens=min_tokens,
                                        logprobs=logprobs, top_logprobs=top_logprobs, n=n)
    # Structured output (at most one): a JSON Schema (a dict or JSON text), any JSON object, or a regex.
    if json_schema is not None:
        req.json_schema = json_schema if isinstance(json_schema, str) else json.dumps(json_schema)
    if json_object:
        req.json_object = True
    if regex is not None:
        req.regex = regex
    req.sampling.min_p = min_p
    req.prompt_logprobs = prompt_logprobs
    req.stop.extend(stop)
    req.include_stop_str_in_output = include_stop_str_in_output
    req.keep_special_tokens = not skip_special_tokens
    if truncate_prompt_tokens is not None:
        req.truncate_prompt_tokens = truncate_prompt_tokens
    req.priority = priority
    req.allowed_token_ids.extend(int(t) for t in allowed_token_ids)
    if isinstance(bad_words, str):
        raise TypeError("bad_words must be a sequence of strings, not one string")
    req.bad_words.extend(bad_words)
    req.sampling.presence_penalty = presence_penalty
    req.sampling.frequency_penalty = frequency_penalty
    req.sampling.repetition_penalty = repetition_penalty
    for token, bias in (logit_bias or {}).items():
        req.sampling.logit_bias[int(token)] = float(bias)
    if isinstance(prompt, str):
        req.text = prompt
    elif len(prompt) > 0 and isinstance(prompt[0], Mapping):
        for m in prompt:
            content = m.get("content")
            msg = req.chat.messages.add(role=str(m.get("role", "")), content="" if content is None else str(content))
            if m.get("name") is not None:
                msg.name = str(m["name"])
            for call in m.get("tool_calls") or ():
                fn = call.get("function") or {}
                args = fn.get("arguments", "{}")
                msg.tool_calls.add(id=str(call.get("id", "")), name=str(fn.get("name", "")),
                                   arguments=args if isinstance(args, str) else json.dumps(args))
            if m.get("tool_call_id") is not None:
                msg.tool_call_id = str(m["tool_call_id"])
            # An answer given back as a message keeps its reasoning (a result's reasoning_text, or
            # OpenAI-shaped reasoning_content).
            reasoning = m.get("reasoning_content", m.get("reasoning"))
            if reasoning is not None:
                msg.reasoning_content = str(reasoning)
        _set_tools(req.chat, tools, tool_choice, parallel_tool_calls)
        req.chat.continue_final_message = continue_final_message
        if chat_template_kwargs is not None:
            req.chat.template_kwargs = json.dumps(dict(chat_template_kwargs))
    else:
        req.token_ids.ids.extend(prompt)
        req.token_ids.SetInParent()  # an empty id list is still an ids prompt; the server names it
    req.sampling.temperature = temperature
    req.sampling.top_k = top_k
    req.sampling.top_p = top_p
    req.sampling.seed = seed
    return req


def _set_tools(chat: inference_pb2.ChatMessages, tools: Optional[Sequence[Mapping]], tool_choice,
               parallel_tool_calls: bool) -> None:
    """OpenAI's tools / tool_choice / parallel_tool_calls, as the gRPC API carries them."""
    if tools is not None:
        chat.tools = json.dumps(list(tools))
    if tool_choice is None:
        return
    choices = {"none": inference_pb2.TOOL_CHOICE_NONE, "auto": inference_pb2.TOOL_CHOICE_AUTO,
               "required": inference_pb2.TOOL_CHOICE_REQUIRED}
    if isinstance(tool_choice, str) and tool_choice in choices:
        chat.tool_choice = choices[tool_choice]
        chat.single_tool_call = tool_choice == "required" and not parallel_tool_calls
    elif (isinstance(tool_choice, Mapping) and tool_choice.get("type") == "function"
          and isinstance(tool_choice.get("function"), Mapping) and tool_choice["function"].get("name")):
        chat.tool_choice = inference_pb2.TOOL_CHOICE_FUNCTION
        chat.tool_name = str(tool_choice["function"]["name"])
    else:
        raise ValueError('tool_choice must be "none", "auto", "required" or {"type": "function", '
                         f'"function": {{"name": ...}}}}, not {tool_choice!r}')


def delta(resp: inference_pb2.GenerateResponse) -> GenerateDelta:
    finished = resp.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED
    return GenerateDelta(
        token_ids=list(resp.token_ids), text=resp.text,
        finish_reason=_FINISH.get(resp.finish_reason, "unknown") if finished else None,
        usage=Usage(resp.usage.prompt_tokens, resp.usage.completion_tokens,
                    resp.usage.cached_prompt_tokens) if finished else None,
        request_id=resp.request_id,
        logprobs=[TokenLogprob(lp.logprob, list(lp.top_ids), list(lp.top_logprobs)) for lp in resp.logprobs],
        prompt_logprobs=[TokenLogprob(lp.logprob, list(lp.top_ids), list(lp.top_logprobs))
                         for lp in resp.prompt_logprobs],
        index=resp.index,
        tool_calls=[ToolCall(c.id, c.name, c.arguments) for c in resp.tool_calls],
        reasoning_text=resp.reasoning_text)


class Accumulator:
    """Builds the GenerateResult from the deltas of a stream."""

    def __init__(self) -> None:
        self.token_ids: List[int] = []
        self.text: List[str] = []
        self.reasoning_text: List[str] = []
        self.last: Optional[GenerateDelta] = None
        self.request_id = ""
        self.logprobs: List[TokenLogprob] = []
        self.prompt_logprobs: List[TokenLogprob] = []
        self.tool_calls: List[ToolCall] = []

    def add(self, d: GenerateDelta) -> None:
        self.token_ids.extend(d.token_ids)
        self.logprobs.extend(d.logprobs)
        self.prompt_logprobs.extend(d.prompt_logprobs)
        self.tool_calls.extend(d.tool_calls)
        self.text.append(d.text)
        self.reasoning_text.append(d.reasoning_text)
        self.request_id = d.request_id or self.request_id
        if d.finish_reason is not None:
            self.last = d

    def result(self) -> GenerateResult:
        if self.last is None or self.last.usage is None or self.last.finish_reason is None:
            raise ShardserveError(grpc.StatusCode.INTERNAL, "the server ended the generation without a finish reason")
        return GenerateResult(token_ids=self.token_ids, text="".join(self.text), finish_reason=self.last.finish_reason,
                              usage=self.last.usage, request_id=self.request_id, logprobs=self.logprobs,
                              prompt_logprobs=self.prompt_logprobs, tool_calls=self.tool_calls,
                              reasoning_text="".join(self.reasoning_text))


class Choices:
    """The GenerateResult of each choice (generate's n) from the deltas of a stream."""

    def __init__(self) -> None:
        self.by_index: Dict[int, Accumulator] = {}

    def add(self, d: GenerateDelta) -> None:
        self.by_index.setdefault(d.index, Accumulator()).add(d)

    def results(self) -> List[GenerateResult]:
        if sorted(self.by_index) != list(range(len(self.by_index))):
            raise ShardserveError(grpc.StatusCode.INTERNAL,
                                  f"the server answered choices {sorted(self.by_index)}, not 0..n-1")
        return [self.by_index[i].result() for i in range(len(self.by_index))]

    def result(self) -> GenerateResult:
        if len(self.by_index) > 1:
            raise ShardserveError(grpc.StatusCode.INVALID_ARGUMENT,
                                  f"the generation has {len(self.by_index)} choices: use results()")
        return self.by_index.get(0, Accumulator()).result()


def model_info(m: inference_pb2.ModelInfo) -> ModelInfo:
    return ModelInfo(model_path=m.model_path, architecture=m.architecture, vocab_size=m.vocab_size,
                     max_position_embeddings=m.max_position_embeddings, num_layers=m.num_layers,
                     num_parameters=m.num_parameters, eos_token_ids=list(m.eos_token_ids),
                     has_tokenizer=m.has_tokenizer)


def cluster_status(s: control_pb2.ClusterStatus) -> ClusterStatus:
    def state(v: int) -> str:
        name = control_pb2.WorkerState.Name(v) if v in control_pb2.WorkerState.values() else "WORKER_STATE_UNKNOWN"
        return name[len("WORKER_STATE_"):].lower()

    def device(d: common_pb2.Device) -> str:
        return f"{'cuda' if d.kind == common_pb2.DEVICE_KIND_CUDA else 'cpu'}:{d.index}"

    workers = [WorkerStatus(worker_id=w.worker_id, node_name=w.node_name, address=w.address, state=state(w.state),
                            error=w.error, devices=[device(d) for d in w.devices], metrics_address=w.metrics_address)
               for w in s.workers]
    return ClusterStatus(ready=s.ready, reason=s.reason, model_path=s.model_path, plan=s.plan,
                         running_sequences=s.running_sequences, waiting_sequences=s.waiting_sequences, workers=workers,
                         pipelining=[f"replica {p.replica}: {p.explanation}" for p in s.pipelining],
                         decode_steps=[f"replica {d.replica}: {d.explanation}" for d in s.decode_steps],
                         scheduling_policy=s.scheduling_policy)
