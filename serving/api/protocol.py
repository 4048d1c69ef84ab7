"""The OpenAI wire format: error bodies, request models, and the parameters we refuse rather than ignore.

Every error a client can cause is an APIError, rendered as {"error": {"message", "type", "param", "code"}}.
A request is parsed in one place (`parse`, in a worker thread, or for a big body in a process of its own: `read`,
big_bodies.py): JSON that Python cannot represent (nesting too deep, integers too long, lone surrogates) is a 400
like any other malformed body. The work one request costs is
bounded before it is done, as the body limit bounds its bytes: at most MAX_JSON_OBJECTS objects are built, and the
parse and the validation of the messages run in small steps, so the worker thread hands the GIL back to the event
loop (and other clients) between them. Integers (token ids) are counted the same way: at most MAX_JSON_INTS. JSON
text inside the body (tool calls' `arguments`) is read by the same rules, within the same counts.
"""
from __future__ import annotations

import asyncio
import json
import re
from typing import Annotated, Any, Literal

from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, TypeAdapter, ValidationError

from serving.api import big_bodies

ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}
# The least that one message adds to serving/shaping/tokenizer.py's rendered_chars (its keys "role" and "content",
# the shortest role, empty content): a list of more messages than the context's char_bound over this cannot fit.
MESSAGE_CHARS = len("role") + len("content") + min(map(len, ROLES.values()))
INT64 = (-2**63, 2**63 - 1)     # vLLM's seed range (torch.long)
MAX_LOGIT_BIAS = 300            # entries (a fixed width on the JAX runtime's device)
MAX_STOP_TOKEN_IDS = 32
MAX_STOP = 64                   # stop strings in one request (OpenAI takes 4)
MAX_STOP_CHARS = 16_384         # their characters, all together (what the engine thread's matcher is built from)
MAX_BAD_WORDS = 128
MAX_PROMPTS = 1024              # prompts in one completions request (also bounded by the server's slots + queue)
MAX_LOGPROBS = 20               # vLLM's default --max-logprobs; OpenAI's top_logprobs bound
MAX_JSON_OBJECTS = 65_536       # objects in one request body (messages, content parts, tools, schemas ...)
MAX_JSON_INTS = 2**20           # integers in one request body (token ids): more than slots x context would take
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")


# ------------------------------------------------------------------------------------------------ errors
class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    def __reduce__(self):       # back from the parsing process (big_bodies.py) as it was raised there
        return APIError, (self.status, self.message, self.type, self.param, self.code)

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self, headers: dict | None = None) -> Response:
        # ASCII JSON: a message quoting client text (e.g. a lone surrogate in `model`) always encodes.
        return Response(json.dumps(self.body()), status_code=self.status, media_type="application/json",
                        headers=headers)


def unavailable(message: str) -> APIError:
    return APIError(503, message, "service_unavailable")


# ----------------------------------------------------------------------------------------------- models
class _Strict(BaseModel):
    # Unknown fields are ignored, as vLLM does (clients send `user`, `metadata`, ...); known parameters we do not
    # honour are refused by `parse` (UNSUPPORTED) before validation.
    model_config = ConfigDict(strict=True, extra="ignore")


class TextPart(_Strict):
    type: str
    text: str | None = None


class CalledFunction(_Strict):
    name: str
    arguments: str                          # JSON text, as OpenAI sends it
    _parsed: Any = PrivateAttr(default=None)    # `arguments` as read by `parse`, within the body's limits


class ToolCall(_Strict):
    id: str | None = None
    type: Literal["function"] = "function"
    function: CalledFunction


class Message(_Strict):
    role: str
    content: str | list[TextPart] | None = None
    tool_calls: list[ToolCall] | None = None    # an assistant turn that called tools
    tool_call_id: str | None = None             # a tool turn: the call it answers
    name: str | None = None
    function_call: dict | None = None           # the deprecated form: refused


FunctionName = Annotated[str, Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")]


class Function(_Strict):
    name: FunctionName
    description: str | None = None
    parameters: dict[str, Any] | None = None    # a JSON schema; none: no arguments
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: Function


class ChosenFunction(_Strict):
    name: FunctionName


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: ChosenFunction


class JsonSchemaFormat(_Strict):
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | bool = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False        # refused when true (parse)


Seed = Annotated[int, Field(ge=INT64[0], le=INT64[1])]
Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]                  # OpenAI's and vLLM's range
Finite = Annotated[float, Field(allow_inf_nan=False)]


class _Sampling(_Strict):
    model: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Field(ge=-1)] | None = None
    stop: str | list[str] | None = None        # at most MAX_STOP, of MAX_STOP_CHARS in all (parse)
    include_stop_str_in_output: bool = False
    seed: Seed | None = None
    ignore_eos: bool = False
    n: Annotated[int, Field(ge=1)] = 1
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    # vLLM: > 0; bounded here so that float32 logits divided by it stay finite
    repetition_penalty: Annotated[float, Field(ge=1e-6, le=1e6)] | None = None
    logit_bias: Annotated[dict[str, Finite], Field(max_length=MAX_LOGIT_BIAS)] | None = None
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    min_tokens: Annotated[int, Field(ge=0)] = 0
    stop_token_ids: Annotated[list[Annotated[int, Field(ge=0)]], Field(max_length=MAX_STOP_TOKEN_IDS)] | None = None
    allowed_token_ids: Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)] | None = None
    bad_words: Annotated[list[Annotated[str, Field(min_length=1, max_length=1000)]],
                         Field(max_length=MAX_BAD_WORDS)] | None = None
    response_format: ResponseFormat | None = None
    skip_special_tokens: bool = True            # false: the text shows the special tokens generated (not eos)
    prompt_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None     # vLLM's extension


class ChatRequest(_Sampling):
    messages: Annotated[list[Message], Field(min_length=1)]
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None


TokenIds = list[Annotated[int, Field(ge=0)]]


class CompletionRequest(_Sampling):
    # A string or token ids, or a list of either: several prompts (their n choices each; serving/api/completions.py).
    prompt: str | Annotated[list[str], Field(min_length=1, max_length=MAX_PROMPTS)] | TokenIds | \
        Annotated[list[TokenIds], Field(min_length=1, max_length=MAX_PROMPTS)]
    max_tokens: Annotated[int, Field(ge=0)] | None = 16     # OpenAI's and vLLM's default for completions
    echo: bool = False
    logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None


class TokenizeRequest(_Strict):
    model: str | None = None
    prompt: str | None = None
    messages: list[Message] | None = None
    tools: list[Tool] | None = None             # shown by the chat template, as in a chat request
    return_token_strs: bool = False
    add_special_tokens: bool | None = None      # default: True for a prompt, False for messages (as vLLM)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: TokenIds


_MODELS = (ChatRequest, CompletionRequest, TokenizeRequest, DetokenizeRequest, Message, TextPart, StreamOptions,
           ToolCall, CalledFunction, Tool, Function, NamedToolChoice, ChosenFunction, ResponseFormat, JsonSchemaFormat)
_FIELDS = {f.alias or name for m in _MODELS for name, f in m.model_fields.items()}

# Parameters of the OpenAI / vLLM APIs that this server does not honour, with the values that mean "not used".
# A request that sets one to anything else gets a 400 naming it: never a 200 that silently ignored it.
_NOT_HONOURED = {
    "best_of": (None, 1),       # removed from vLLM (0.19); `n` and `logprobs` do what it did
    "structured_outputs": (None,),
    "guided_json": (None,), "guided_regex": (None,), "guided_choice": (None,), "guided_grammar": (None,),
    "use_beam_search": (None, False), "length_penalty": (None, 1),
    # Gemma's fast tokenizer never puts spaces between special tokens: only the default has a meaning here
    "spaces_between_special_tokens": (None, True),
    "truncate_prompt_tokens": (None,),
    "logits_processors": (None,), "prediction": (None,), "audio": (None,), "modalities": (None, ["text"]),
    "return_tokens_as_token_ids": (None, False),
    "priority": (None, 0),      # vLLM too refuses it unless started with --scheduling-policy priority
}
UNSUPPORTED = {
    ChatRequest: {**_NOT_HONOURED, "echo": (None, False), "functions": (None, []),
                  "function_call": (None, "none", "auto"), "chat_template": (None,)},
    CompletionRequest: {**_NOT_HONOURED, "suffix": (None, "")},
    TokenizeRequest: {"chat_template": (None,), "mm_processor_kwargs": (None, {})},
}


def _null_means_default(model: type[BaseModel]) -> frozenset[str]:
    """The fields with a default that null is not a value of: OpenAI's API takes null for them ("stream": null,
    "n": null) and means the default, so the request is read as if they were not sent."""
    out = set()
    for name, f in model.model_fields.items():
        try:
            if not f.is_required():
                TypeAdapter(f.annotation).validate_python(None, strict=True)
        except ValidationError:
            out.add(f.alias or name)
    return frozenset(out)


NULL_MEANS_DEFAULT = {m: _null_means_default(m) for m in (ChatRequest, CompletionRequest, TokenizeRequest)}


def _param(loc: tuple) -> str:
    """The request path of a validation error: pydantic puts union members ('str', 'list[str]') in `loc`,
    which are not part of the request, so the path ends where they begin."""
    out = []
    for p in loc:
        if not (isinstance(p, int) or p in _FIELDS):
            break
        out.append(str(p))
    return ".".join(out)


def _is_default(value: Any, defaults: tuple) -> bool:
    return any(value is d if d is None or isinstance(d, bool) else
               (type(value) is not bool and value == d) for d in defaults)


def _may_hold_lone_surrogate(body: bytes) -> bool:
    """Whether a \\uD800-\\uDFFF escape stands outside a high-low pair, or the body is not plain UTF-8 (json.loads
    decodes UTF-8 with surrogatepass, and UTF-16/32). A scan in small steps, like the parse."""
    try:
        body.decode()
    except UnicodeDecodeError:
        return True
    low_at = -1                 # where the low half of a pair must start
    for m in _SURROGATE_ESCAPE.finditer(body):
        high = m.group()[3] in b"89abAB"
        if low_at >= 0 and (high or m.start() != low_at):
            return True
        if low_at < 0 and not high:
            return True
        low_at = m.end() if high and low_at < 0 else -1
    return low_at >= 0


def _too_many(limit: int, what: str) -> APIError:
    return APIError(400, f"request body has more than {limit} {what}")


class _Budget:
    """What one request body may still build: MAX_JSON_OBJECTS objects and MAX_JSON_INTS integers, counted over the
    body and the JSON texts inside it (tool calls' arguments) together."""

    def __init__(self):
        self.objects = self.ints = 0

    def hook(self, obj: dict) -> dict:
        self.objects += 1
        if self.objects > MAX_JSON_OBJECTS:
            raise _too_many(MAX_JSON_OBJECTS, "JSON objects")
        return obj

    def parse_int(self, text: str) -> int:
        self.ints += 1
        if self.ints > MAX_JSON_INTS:
            raise _too_many(MAX_JSON_INTS, "integers (token ids)")
        return int(text)


def _load(body: bytes | str, budget: _Budget) -> Any:
    """json.loads, stopped once the budget is spent (a flat list of millions of token ids is refused by count,
    before validation). The hooks, Python code run per object and per integer, also let the interpreter switch
    threads in the middle of a long parse."""
    return json.loads(body, object_hook=budget.hook, parse_int=budget.parse_int)


def _strict_json(text: bytes | str, budget: _Budget, what: str, param: str | None = None) -> Any:
    """JSON text as Python holds it, or the client's 400 naming `what`: too deep, a lone surrogate, past the
    budget, or not JSON at all."""
    try:
        data = _load(text, budget)
        # Lone surrogates ("\ud800") parse, but no tokenizer or response can encode them.
        raw = text if isinstance(text, bytes) else text.encode(errors="surrogatepass")
        if _may_hold_lone_surrogate(raw):         # the full check (one long call) only when one may be there
            json.dumps(data, ensure_ascii=False).encode()
    except RecursionError:
        raise APIError(400, f"{what} is nested too deeply", param=param) from None
    except UnicodeEncodeError:
        raise APIError(400, f"{what} contains an invalid unicode escape (a lone surrogate)", param=param) from None
    except (ValueError, UnicodeDecodeError) as e:      # JSONDecodeError, and integers with too many digits
        raise APIError(400, f"{what} is not valid JSON: {e}", param=param) from None
    return data


def _validation_error(e: ValidationError, prefix: tuple = ()) -> APIError:
    first = e.errors(include_url=False)[0]
    param = _param((*prefix, *first["loc"]))
    return APIError(400, f"{param}: {first['msg']}" if param else first["msg"], param=param or None)


async def read(request, model: type[_Strict], max_messages: int | None = None) -> Any:
    """parse(model, the request's body, max_messages) off the event loop: in a worker thread, or for a body of
    big_bodies.BIG_BODY bytes or more in the parsing process (its death is a retryable 503)."""
    body = await request.body()
    if len(body) < big_bodies.BIG_BODY:
        return await asyncio.to_thread(parse, model, body, max_messages)
    try:
        return await big_bodies.PARSER.run(parse, model, body, max_messages)
    except big_bodies.BodyParserStopped as e:
        raise unavailable(f"{e} (out of memory?); retry") from None


def parse(model: type[_Strict], body: bytes, max_messages: int | None = None) -> Any:
    """The request body as `model`, or an APIError(400) naming what is wrong. A message list longer than
    max_messages (what the context can hold: MESSAGE_CHARS) is refused before a message is validated."""
    budget = _Budget()
    data = _strict_json(body, budget, "request body")
    if not isinstance(data, dict):
        raise APIError(400, "request body must be a JSON object")
    unset = NULL_MEANS_DEFAULT.get(model, frozenset())
    data = {k: v for k, v in data.items() if v is not None or k not in unset}
    if isinstance(data.get("stop"), list) and len(data["stop"]) > MAX_STOP:     # before validating a million
        raise APIError(400, f"stop: more than {MAX_STOP} stop strings", param="stop")
    for name, defaults in UNSUPPORTED.get(model, {}).items():
        if name in data and not _is_default(data[name], defaults):
            raise APIError(400, f"{name} is not supported by this server (unset it, or send "
                                f"{' or '.join(json.dumps(d) for d in defaults)})", param=name)
    msgs = data.get("messages")
    if isinstance(msgs, list) and "messages" in model.model_fields:
        if max_messages is not None and len(msgs) > max_messages:
            raise APIError(400, f"messages: more than {max_messages} messages cannot fit this model's context",
                           param="messages", code="context_length_exceeded")
        # One message at a time: a validation of many thousands in one call would hold the GIL throughout.
        valid = []
        for i, m in enumerate(msgs):
            try:
                valid.append(Message.model_validate(m))
            except ValidationError as e:
                raise _validation_error(e, ("messages", i)) from None
            for j, call in enumerate(valid[-1].tool_calls or ()):   # JSON text too: as strict as the body
                where = f"messages.{i}.tool_calls.{j}.function.arguments"
                call.function._parsed = _strict_json(call.function.arguments, budget, where, where)
        data = {**data, "messages": valid}
    try:
        req = model.model_validate(data)
    except ValidationError as e:
        raise _validation_error(e) from None
    stop = getattr(req, "stop", None)
    if stop is not None and sum(map(len, [stop] if isinstance(stop, str) else stop)) > MAX_STOP_CHARS:
        raise APIError(400, f"stop: more than {MAX_STOP_CHARS} characters in the stop strings", param="stop")
    options = getattr(req, "stream_options", None)
    if options is not None and not req.stream:
        raise APIError(400, "stream_options is only allowed when stream is true", param="stream_options")
    if getattr(req, "stream", False) and getattr(req, "prompt_logprobs", None) is not None:     # as vLLM
        raise APIError(400, "prompt_logprobs are not available when stream is true", param="prompt_logprobs")
    if options is not None and options.continuous_usage_stats:
        raise APIError(400, "stream_options.continuous_usage_stats is not supported by this server (unset it, or "
                            "send false)", param="stream_options.continuous_usage_stats")
    return req


# apply_chat_template's own arguments: set through the request's fields, never through chat_template_kwargs
_TEMPLATE_ARGS = {"conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
                  "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors",
                  "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs"}


def template_options(req: ChatRequest | TokenizeRequest) -> dict:
    """What the chat template is rendered with besides messages and tools, as vLLM takes them: add_generation_prompt,
    continue_final_message (the last message, an assistant's, is continued), chat_template_kwargs (variables the
    template reads, e.g. enable_thinking)."""
    if req.add_generation_prompt and req.continue_final_message:
        raise APIError(400, "continue_final_message and add_generation_prompt cannot both be true (send "
                            "add_generation_prompt: false)", param="continue_final_message")
    if req.continue_final_message and (not req.messages or req.messages[-1].role != "assistant"):
        raise APIError(400, "continue_final_message needs an assistant message last", param="continue_final_message")
    extra = req.chat_template_kwargs or {}
    bad = sorted(set(extra) & _TEMPLATE_ARGS)
    if bad:
        raise APIError(400, f"chat_template_kwargs.{bad[0]}: set it as a request field, not a template variable",
                       param=f"chat_template_kwargs.{bad[0]}")
    return {**extra, "add_generation_prompt": req.add_generation_prompt,
            "continue_final_message": req.continue_final_message}


def messages(msgs: list[Message]) -> list[dict]:
    """Chat messages as the chat template takes them: text content; an assistant's tool calls with their arguments
    as objects; a tool's answer with the name of the function it answers."""
    out, called = [], {}            # called: tool call id -> function name
    for i, m in enumerate(msgs):
        where = f"messages.{i}"
        if m.role not in ROLES:
            raise APIError(400, f"{where}.role: unsupported role {m.role!r} (expected one of {', '.join(ROLES)})",
                           param=f"{where}.role")
        if m.function_call:
            raise APIError(400, f"{where}.function_call: the deprecated function_call is not supported by this "
                                f"server (send tool_calls)", param=f"{where}.function_call")
        if isinstance(m.content, list):
            for part in m.content:
                if part.type != "text":
                    raise APIError(400, f"{where}.content: only text parts are supported, got {part.type!r}",
                                   param=f"{where}.content")
                if part.text is None:
                    raise APIError(400, f"{where}.content: a text part needs `text`", param=f"{where}.content")
            content = "\n".join(p.text for p in m.content)   # as vLLM joins text parts
        elif m.content is None:
            if m.role != "assistant":
                raise APIError(400, f"{where}.content is required", param=f"{where}.content")
            content = ""
        else:
            content = m.content
        msg = {"role": ROLES[m.role], "content": content}
        if m.tool_calls:
            if m.role != "assistant":
                raise APIError(400, f"{where}.tool_calls: only an assistant message has tool calls",
                               param=f"{where}.tool_calls")
            msg["tool_calls"] = [_called(c, f"{where}.tool_calls.{j}") for j, c in enumerate(m.tool_calls)]
            called.update((c.id, c.function.name) for c in m.tool_calls if c.id)
        if m.role == "tool":
            name = m.name or called.get(m.tool_call_id)
            if name is None:
                why = "is required" if m.tool_call_id is None else f"{m.tool_call_id!r} names no earlier tool call"
                raise APIError(400, f"{where}.tool_call_id {why}", param=f"{where}.tool_call_id")
            msg.update(name=name, tool_call_id=m.tool_call_id)
        out.append(msg)
    return out


def _called(call: ToolCall, where: str) -> dict:
    arguments = call.function._parsed
    if not isinstance(arguments, dict):
        raise APIError(400, f"{where}.function.arguments: not a JSON object", param=f"{where}.function.arguments")
    return {"id": call.id, "type": "function", "function": {"name": call.function.name, "arguments": arguments}}
