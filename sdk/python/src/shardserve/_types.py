"""The values the shardserve clients take and return, and their error type."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional

import grpc


class ShardserveError(Exception):
    """A call failed. `code` is the gRPC status code (e.g. grpc.StatusCode.INVALID_ARGUMENT when the
    request is bad, UNAVAILABLE when the cluster is not ready or cannot be reached, DEADLINE_EXCEEDED
    when the timeout passed, CANCELLED after cancel()), `message` the server's message."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message


@dataclass(frozen=True)
class TlsOptions:
    """TLS for the channel, with PEM contents (not file names)."""

    root_certs: Optional[bytes] = None  # CA certificates to trust; None = the system's roots
    client_cert: Optional[bytes] = None  # certificate chain for mutual TLS, with client_key
    client_key: Optional[bytes] = None
    server_name: Optional[str] = None  # the name to check the certificate against; None = the host


@dataclass(frozen=True)
class RetryOptions:
    """Retry of UNAVAILABLE before the server has sent anything (gRPC's retry policy), and resume
    of a generation (n = 1) whose stream broke with UNAVAILABLE after tokens arrived (a coordinator
    restart, a replica failure): the same request (same seed) goes again with the server's request
    id and the tokens received so far, and the server goes on exactly where the stream broke, so
    each token, text character and logprob is seen once. At most max_resumes resumes in a row
    without a new token, each after initial_backoff * backoff_multiplier**k seconds (at most
    max_backoff), within the call's timeout. A generation whose gRPC retries ran out before any
    response (a coordinator restart longer than they last) is sent again as it was, under the same
    limits."""

    max_attempts: int = 4  # attempts in all, 1..5 (gRPC's limit); 1 = never retry
    initial_backoff: float = 0.1  # seconds
    max_backoff: float = 2.0
    backoff_multiplier: float = 2.0
    max_resumes: int = 10  # 0..100; 0 = never resume; the defaults ride out a 15 s coordinator restart


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int = 0  # of prompt_tokens, found in the server's prefix cache


@dataclass(frozen=True)
class TokenLogprob:
    """One generated token's log-probability and the most likely tokens' (most likely first)."""

    logprob: float
    top_ids: List[int] = field(default_factory=list)
    top_logprobs: List[float] = field(default_factory=list)


@dataclass(frozen=True)
class ToolCall:
    """A call of one of the request's tools, parsed by the server from the model's output."""

    id: str  # a "tool" message answers the call by this id ("tool_call_id")
    name: str  # the function's name
    arguments: str  # the arguments object as JSON text


@dataclass(frozen=True)
class GenerateDelta:
    """A piece of a streamed answer: the new tokens since the previous delta and their text. The
    last delta has finish_reason ("length", "stop" or "cancelled") and usage."""

    token_ids: List[int]
    text: str
    finish_reason: Optional[str] = None
    usage: Optional[Usage] = None
    request_id: str = ""
    logprobs: List[TokenLogprob] = field(default_factory=list)  # with logprobs=True: one per token
    # with prompt_logprobs=True: prompt tokens 1, 2, ... (all before the first token)
    prompt_logprobs: List[TokenLogprob] = field(default_factory=list)
    index: int = 0  # the choice (generate's n) this delta belongs to
    tool_calls: List[ToolCall] = field(default_factory=list)  # on the choice's last delta: its calls
    # with the server's --reasoning_parser, for chat answers: the new reasoning (text is then content)
    reasoning_text: str = ""


@dataclass(frozen=True)
class GenerateResult:
    """The whole answer of a generation."""

    token_ids: List[int]
    text: str
    finish_reason: str
    usage: Usage
    request_id: str = ""
    logprobs: List[TokenLogprob] = field(default_factory=list)  # with logprobs=True: one per token
    # with prompt_logprobs=True: prompt tokens 1, 2, ... (all before the first token)
    prompt_logprobs: List[TokenLogprob] = field(default_factory=list)
    tool_calls: List[ToolCall] = field(default_factory=list)  # with tools: the calls the model made
    # with the server's --reasoning_parser, for chat answers: the model's reasoning (<think>...</think>
    # without the tags); text is then the answer's content
    reasoning_text: str = ""


@dataclass(frozen=True)
class ModelInfo:
    model_path: str
    architecture: str
    vocab_size: int
    max_position_embeddings: int  # the context length served
    num_layers: int
    num_parameters: int
    eos_token_ids: List[int]
    has_tokenizer: bool


@dataclass(frozen=True)
class WorkerStatus:
    worker_id: str
    node_name: str
    address: str
    state: str  # "idle", "loading", "ready", "failed", "dead"
    error: str
    devices: List[str]  # "cpu:0", "cuda:1", ...
    metrics_address: str


@dataclass(frozen=True)
class ClusterStatus:
    ready: bool
    reason: str  # why not ready
    model_path: str
    plan: str
    running_sequences: int
    waiting_sequences: int
    workers: List[WorkerStatus] = field(default_factory=list)
    # Per serving replica: "replica R: <how it splits its running sequences into micro-batches>".
    pipelining: List[str] = field(default_factory=list)
    # Per serving replica: "replica R: <decode steps per worker call, and why>" (multi-step decoding;
    # empty from a coordinator that does not say).
    decode_steps: List[str] = field(default_factory=list)
    # The order waiting requests are admitted in: "fcfs" or "priority" (empty from a coordinator
    # that does not say).
    scheduling_policy: str = ""
