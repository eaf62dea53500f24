"""The OpenAI-compatible routes' bodies (/v1/models, /v1/completions, /v1/chat/completions), the fields the `openai`
client and lm-evaluation-harness send, plus PoolBench's own `steering` extra field. What PoolBench cannot honour
(n > 1, top_p < 1, penalties, logit_bias) is refused in one line rather than ignored."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

_REQUEST = ConfigDict(extra="forbid", allow_inf_nan=False)


class Steering(BaseModel):
    """Which vector to add, and how strongly: a stored vector of the service's run (concept, strategy) or a raw
    `vector`, alpha times it added to the output of `layer` (default: the layer the run steered the concept at)."""

    model_config = _REQUEST
    run: str | None = Field(None, description="the run folder the service was started with (checked when given)")
    concept: str | None = Field(None, description="a concept of the run (see /healthz vectors)")
    strategy: str = Field("A1_mean", description="strategy id or short code the run pooled with")
    unit: Literal["residual", "raw"] = Field("residual", description="residual: alpha is D2's alpha")
    vector: list[float] | None = Field(None, description="or a raw vector of hidden_size floats")
    layer: int | None = Field(None, ge=0, description="decoder layer whose output is steered")
    alpha: float = Field(0.0, description="0: unsteered")

    @model_validator(mode="after")
    def _one_source(self) -> Steering:
        if (self.concept is None) == (self.vector is None):
            raise ValueError("steering: give either concept (a stored vector of the run) or vector, not both")
        if self.vector is not None and self.layer is None:
            raise ValueError("steering.layer: a raw vector needs the layer it is added at")
        return self


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False


class _Sampling(BaseModel):
    """Fields both routes share."""

    model_config = _REQUEST
    model: str
    temperature: float = Field(1.0, ge=0, le=2, description="0: greedy")
    top_p: float | None = Field(None, description="only 1 (no nucleus truncation)")
    n: int = Field(1, description="only 1")
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = Field(None, description="up to 4 strings; the text is cut before the first")
    seed: int | None = Field(None, description="prompt i samples with seed + i")
    user: str | None = None
    presence_penalty: float = Field(0.0, description="only 0")
    frequency_penalty: float = Field(0.0, description="only 0")
    logit_bias: dict[str, float] | None = Field(None, description="not supported")
    steering: Steering | None = Field(None, description="PoolBench's extra field: the vector to steer with")

    @model_validator(mode="after")
    def _supported(self):
        unsupported = [(self.n != 1, f"n: {self.n}, only 1 is supported"),
                       (self.top_p not in (None, 1, 1.0), f"top_p: {self.top_p}, only 1 is supported"),
                       (self.presence_penalty != 0 or self.frequency_penalty != 0,
                        "presence_penalty/frequency_penalty: only 0 is supported"),
                       (bool(self.logit_bias), "logit_bias: not supported"),
                       (isinstance(self.stop, list) and len(self.stop) > 4, "stop: at most 4 strings")]
        for bad, message in unsupported:
            if bad:
                raise ValueError(message)
        return self

    @property
    def stops(self) -> list[str]:
        return [] if self.stop is None else [self.stop] if isinstance(self.stop, str) else list(self.stop)


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]] = Field(
        description="text, texts, token ids, or lists of token ids (read as given, no special tokens added)")
    max_tokens: int = Field(16, ge=0, description="0 with echo: only the prompt's log-probabilities")
    logprobs: int | None = Field(None, ge=0, le=20, description="top log-probabilities per token")
    echo: bool = False

    @model_validator(mode="after")
    def _prompt_nonempty(self) -> CompletionRequest:
        if self.prompt in ("", []) or (isinstance(self.prompt, list) and any(p in ("", []) for p in self.prompt)):
            raise ValueError("prompt: empty")
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("max_tokens: 0 returns nothing without echo")
        return self


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]

    @property
    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)

    @property
    def new_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = 0
    owned_by: str = "poolbench"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: Literal["stop", "length"] | None


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob]


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: Literal["stop", "length"]


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
