"""The parse and prepare stages' work (gateway/pipeline/stages.py runs them): from a request
body to an engine request — the body's type and range checks, the served model, the prompt's
tokens, the output cap, the tier and the scheduler metadata. Every refusal is an ApiError naming
the field (the client sees it as is; the batch runner writes it to the error file)."""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, replace
from typing import Any

import msgspec

from common.wire import RequestMeta, Tier, meta_to_custom_params
from gateway.api.schemas import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    Endpoint,
    OpenAIRequest,
    SamplingFields,
    check_sampling,
    check_token_ids,
    decode_request,
    unsupported,
)
from gateway.api.tool_schemas import NamedToolChoice
from gateway.auth import Principal
from gateway.errors import ApiError
from gateway.store.types import Tenant
from gateway.tokenizer import ModelTokenizer, TemplateError, TextTooLong
from gateway.tools import TOOL_FAMILIES, ToolFamily, ToolPlan, required_schema


@dataclass(frozen=True)
class EngineRequest:
    """Everything needed to run one generation on the engine and account for it."""

    rid: str
    """Unique engine request id (never reused: the engine's abort matches rid prefixes)."""
    input_ids: list[int]
    max_tokens: int
    meta: RequestMeta
    payload: dict[str, Any]
    """The `/generate` body."""
    tool_plan: ToolPlan | None = None
    """How the answer is read for tool calls (None: it is plain content)."""

    @property
    def asks_logprobs(self) -> bool:
        """Whether the request asked for its output tokens' log probabilities."""
        return bool(self.payload.get("return_logprob"))


def new_rid() -> str:
    """A fresh engine request id; it is also the usage record's `request_id` and the tail of the
    OpenAI body's `id` (gateway/api/render.py), so the three can be joined."""
    return f"tdm-{uuid.uuid4().hex}"


@dataclass(frozen=True)
class PreparedPrompt:
    """A request's prompt as the engine takes it."""

    input_ids: list[int]
    max_tokens: int
    """The output cap, tokens (the request's, or the gateway's default; within the context)."""


def parse_body(
    raw: bytes, endpoint: Endpoint, served_model: str, *, declares_tools: bool = False
) -> OpenAIRequest:
    """The body of an API request as its endpoint's Struct, type- and range-checked, asking for
    the served model and nothing the gateway does not honour (400 / 422 naming the field, 404
    for another model, otherwise). *declares_tools*: whether the model's chat template declares
    tools (what the refusal of tools says)."""
    body = decode_request(raw, endpoint, declares_tools=declares_tools)
    check_sampling(body)
    check_model(body.model, served_model)
    return body


def check_model(model: str, served: str) -> None:
    """404 `model_not_found` unless *model* is the one this gateway serves (OpenAI's status
    for a model that does not exist: a client does not retry it)."""
    if model != served:
        raise ApiError(
            404,
            f"model {model!r} does not exist; this gateway serves {served!r}",
            param="model",
            code="model_not_found",
        )


@dataclass(frozen=True)
class PromptSource:
    """A body's prompt before tokenizing: the text to encode, or the token ids it gave."""

    param: str
    """The field it came from ("messages" or "prompt"), for the errors that name it."""
    text: str | None = None
    add_special_tokens: bool = True
    ids: list[int] | None = None


INLINE_MAX_CHARS = 8192
"""Prompts up to this long are tokenized on the event loop (well under a millisecond); longer
ones in a worker thread (`prepare_prompt_off_loop`), so that a long prompt never holds the loop
that serves every other request."""


def prepare_prompt(
    body: OpenAIRequest, tokenizer: ModelTokenizer, default_max_tokens: int
) -> PreparedPrompt:
    """The prompt's token ids and the output cap of a parsed body (API request or batch line
    alike, so both are refused for the same reasons with the same error)."""
    source = prompt_source(body, tokenizer)
    return finish_prompt(body, prompt_ids(source, tokenizer), tokenizer, default_max_tokens)


async def prepare_prompt_off_loop(
    body: OpenAIRequest, tokenizer: ModelTokenizer, default_max_tokens: int
) -> PreparedPrompt:
    """`prepare_prompt` with a long prompt tokenized in a worker thread (INLINE_MAX_CHARS), and
    one too long for the context refused before it is tokenized at all."""
    source = prompt_source(body, tokenizer)
    if source.text is None or len(source.text) <= INLINE_MAX_CHARS:
        ids = prompt_ids(source, tokenizer)
    else:
        try:
            ids = await tokenizer.encode_off_loop(
                source.text, add_special_tokens=source.add_special_tokens
            )
        except TextTooLong as exc:
            raise _too_long(source.param, exc, tokenizer.context_len) from None
        ids = _non_empty(ids)
    return finish_prompt(body, ids, tokenizer, default_max_tokens)


def prompt_source(body: OpenAIRequest, tokenizer: ModelTokenizer) -> PromptSource:
    """What a body's prompt is before tokenizing: chat messages rendered with the model's chat
    template, a completion's text, or its token ids (checked against the vocabulary)."""
    if isinstance(body, ChatCompletionRequest):
        return PromptSource(
            param="messages", text=chat_prompt_text(body, tokenizer), add_special_tokens=False
        )
    return completion_prompt_source(body, tokenizer)


def prompt_ids(
    source: PromptSource,
    tokenizer: ModelTokenizer,
    encoded: list[int] | TextTooLong | None = None,
) -> list[int]:
    """The token ids of a prompt: tokenized here (call it off the loop for a long text), or
    *encoded*, the text's `ModelTokenizer.encode_many` result, when given."""
    if source.ids is not None:
        return source.ids
    assert source.text is not None
    if encoded is None:
        try:
            encoded = tokenizer.encode(source.text, add_special_tokens=source.add_special_tokens)
        except TextTooLong as exc:
            encoded = exc
    if isinstance(encoded, TextTooLong):
        raise _too_long(source.param, encoded, tokenizer.context_len)
    return _non_empty(encoded)


def finish_prompt(
    body: OpenAIRequest, input_ids: list[int], tokenizer: ModelTokenizer, default_max_tokens: int
) -> PreparedPrompt:
    """The prepared prompt of a body whose prompt is *input_ids*: its output cap checked
    against the context."""
    requested, requested_param = body.max_tokens, "max_tokens"
    if isinstance(body, ChatCompletionRequest) and body.max_completion_tokens is not None:
        # OpenAI's newer name wins
        requested, requested_param = body.max_completion_tokens, "max_completion_tokens"
    max_tokens = output_cap(
        body,
        requested,
        len(input_ids),
        tokenizer.context_len,
        default_max_tokens,
        requested_param=requested_param,
    )
    if body.min_tokens is not None and body.min_tokens > max_tokens:
        # the engine refuses it too, but only after the admission counted the request
        raise ApiError(
            400,
            f"min_tokens must be in [0, {max_tokens}] (the output cap), got {body.min_tokens}",
            param="min_tokens",
            code="invalid_value",
        )
    return PreparedPrompt(input_ids=input_ids, max_tokens=max_tokens)


def chat_prompt_text(req: ChatCompletionRequest, tokenizer: ModelTokenizer) -> str:
    """The conversation rendered with the model's chat template (the text to tokenize)."""
    if not req.messages:
        raise ApiError(400, "messages must not be empty", param="messages", code="invalid_value")
    tool_plan(req, tokenizer.tool_family)  # refuses, before tokenizing, what cannot be read back
    messages = [_message_dict(i, m) for i, m in enumerate(req.messages)]
    tools = [msgspec.to_builtins(tool) for tool in req.tools] if req.tools else None
    try:
        return tokenizer.render_chat(messages, add_generation_prompt=True, tools=tools)
    except TemplateError as exc:
        raise ApiError(400, str(exc), param="messages", code="invalid_value") from None


def tool_plan(req: SamplingFields, family: ToolFamily | None) -> ToolPlan | None:
    """How the answer of *req* is read for tool calls, for a model whose template teaches
    *family* (gateway/tools.py); None: as plain content (no tools, or `tool_choice: none`).
    `auto` needs a family tandem parses: otherwise 400 `unsupported_parameter` naming
    tool_choice (a forced call needs none: the engine decodes it under a schema)."""
    if not isinstance(req, ChatCompletionRequest) or not req.tools:
        return None
    choice = req.effective_tool_choice
    is_parallel = req.parallel_tool_calls is not False
    if isinstance(choice, NamedToolChoice):
        name = choice.function.name
        return ToolPlan("named", family=family, function_name=name, is_parallel=is_parallel)
    if choice == "required":
        return ToolPlan("required", family=family, is_parallel=is_parallel)
    if choice == "none":
        return None
    if family is None:
        raise unsupported(
            "tool_choice",
            "tool_choice auto (the default with tools) is not supported for this model: its chat"
            " template's tool-call format is none tandem parses"
            f" ({', '.join(TOOL_FAMILIES)}), so the calls the model chose could not be read"
            " back; send tool_choice required or a named function (decoded under the tools'"
            " schemas), or none",
        )
    return ToolPlan("auto", family=family, is_parallel=is_parallel)


def completion_prompt_source(req: CompletionRequest, tokenizer: ModelTokenizer) -> PromptSource:
    """A text completion's prompt: a string, a one-string list, token ids, or a one-element
    list of token ids. Token ids outside the model's vocabulary are a 400 naming the first one
    (`prompt[i]`, `prompt[0][i]`): the engine would crash on them."""
    prompt = req.prompt
    if isinstance(prompt, str):
        return PromptSource(param="prompt", text=prompt)
    if len(prompt) > 1 and all(isinstance(p, (str, list)) for p in prompt):
        raise ApiError(
            400, "only one prompt per request is supported", param="prompt", code="invalid_value"
        )
    if len(prompt) == 1 and isinstance(prompt[0], str):
        return PromptSource(param="prompt", text=prompt[0])
    if len(prompt) == 1 and isinstance(prompt[0], list):
        _check_fits(len(prompt[0]), tokenizer.context_len)
        check_token_ids("prompt[0]", prompt[0], tokenizer.vocab_size)
        return PromptSource(param="prompt", ids=_non_empty(list(prompt[0])))
    ids = [p for p in prompt if isinstance(p, int)]
    if len(ids) != len(prompt):
        raise ApiError(
            400,
            "prompt must be a string or a list of token ids, not a mix of both",
            param="prompt",
            code="invalid_value",
        )
    _check_fits(len(ids), tokenizer.context_len)
    check_token_ids("prompt", ids, tokenizer.vocab_size)
    return PromptSource(param="prompt", ids=_non_empty(ids))


def _non_empty(ids: list[int]) -> list[int]:
    if not ids:
        raise ApiError(400, "prompt must not be empty", param="prompt", code="invalid_value")
    return ids


def _check_fits(prompt_len: int, context_len: int) -> None:
    """The context check of a token-id prompt, before each id is looked at (a million ids
    take a while)."""
    if prompt_len >= context_len:
        raise ApiError(
            400,
            f"prompt is {prompt_len} tokens; the model's context is {context_len} tokens",
            param="prompt",
            code="context_length_exceeded",
        )


def _too_long(param: str, exc: TextTooLong, context_len: int) -> ApiError:
    return ApiError(
        400,
        f"prompt is {exc.chars} characters, so at least {exc.min_tokens} tokens (no token of the"
        f" model stands for more than {exc.max_chars_per_token} characters); the model's context"
        f" is {context_len} tokens",
        param=param,
        code="context_length_exceeded",
    )


def output_cap(
    req: SamplingFields,
    requested: int | None,
    prompt_len: int,
    context_len: int,
    default_max_tokens: int,
    *,
    requested_param: str = "max_tokens",
) -> int:
    """The request's max output tokens; 400 naming *requested_param* (the field *requested*
    came from) when it cannot fit."""
    room = context_len - prompt_len
    if room < 1:
        raise ApiError(
            400,
            f"prompt is {prompt_len} tokens; the model's context is {context_len} tokens",
            param="messages" if isinstance(req, ChatCompletionRequest) else "prompt",
            code="context_length_exceeded",
        )
    if requested is None:
        return min(room, default_max_tokens)
    if not 1 <= requested <= room:
        raise ApiError(
            400,
            f"{requested_param} must be in [1, {room}]: the prompt ({prompt_len} tokens) leaves"
            f" room for at most {room} in the model's context of {context_len} tokens,"
            f" got {requested}",
            param=requested_param,
            code="context_length_exceeded" if requested > room else "invalid_value",
        )
    return requested


def resolve_tier(tenant: Tenant, requested: Tier | None) -> Tier:
    """The tier a request runs in: the tenant's, or an explicitly requested one the contract
    allows. A looser tier (rt tenant asking be) is always allowed; a stricter one needs the
    contract's `allow_rt` and RT targets."""
    if requested is None or requested == tenant.tier or requested == "be":
        return requested or tenant.tier
    if tenant.slo.allow_rt and tenant.slo.ttft_target_ms is not None:
        return "rt"
    raise ApiError(
        403, "the tenant's contract does not allow tier 'rt'", param="tier", code="tier_not_allowed"
    )


def build_engine_request(
    req: SamplingFields,
    input_ids: list[int],
    max_tokens: int,
    principal: Principal,
    tier: Tier,
    arrival_unix_s: float | None = None,
    rid: str | None = None,
    tool_family: ToolFamily | None = None,
) -> EngineRequest:
    """The `/generate` payload with sampling parameters and the scheduler metadata; *rid*: the
    request's id when it has one already (default: a fresh one); *tool_family*: the served
    model's tool-call format (`ModelTokenizer.tool_family`)."""
    meta = request_meta(
        principal.tenant,
        tier,
        max_tokens,
        arrival_unix_s if arrival_unix_s is not None else time.time(),
    )
    rid = rid if rid is not None else new_rid()
    plan = tool_plan(req, tool_family)
    payload: dict[str, Any] = {
        "rid": rid,
        "input_ids": input_ids,
        "sampling_params": _sampling_params(req, max_tokens, meta, plan),
        "priority": meta.sglang_priority,
        "stream": True,
    }
    top_logprobs_num = (
        req.top_logprobs_num
        if isinstance(req, (ChatCompletionRequest, CompletionRequest))
        else None
    )
    if top_logprobs_num is not None:
        # SGLang's native fields: the output tokens' log probabilities (none of the prompt's:
        # logprob_start_len -1), each with its text, and top_logprobs_num alternatives
        payload.update(
            return_logprob=True,
            top_logprobs_num=top_logprobs_num,
            logprob_start_len=-1,
            return_text_in_logprobs=True,
        )
    return EngineRequest(
        rid=rid,
        input_ids=input_ids,
        max_tokens=max_tokens,
        meta=meta,
        payload=payload,
        tool_plan=plan,
    )


def request_meta(tenant: Tenant, tier: Tier, max_tokens: int, arrival_unix_s: float) -> RequestMeta:
    """The scheduler metadata of a request of *tenant* run in *tier*: the contract's RT targets
    or its BE deadline, and its fair-share weight."""
    slo = tenant.slo
    return RequestMeta(
        tier=tier,
        tenant_id=tenant.id,
        length_key=tenant.id,
        arrival_unix_s=arrival_unix_s,
        ttft_target_ms=slo.ttft_target_ms if tier == "rt" else None,
        tpot_target_ms=slo.tpot_target_ms if tier == "rt" else None,
        deadline_s=slo.deadline_s if tier == "be" else None,
        max_tokens=max_tokens,
        tenant_weight=slo.weight,
    )


def in_tier(request: EngineRequest, tenant: Tenant, tier: Tier) -> EngineRequest:
    """*request* to run in *tier* instead (the SLO admission's downgrade to BE): the metadata
    and priority of that tier, the same rid, prompt and sampling (it has not reached an engine)."""
    meta = request_meta(tenant, tier, request.max_tokens, request.meta.arrival_unix_s)
    params = {**request.payload["sampling_params"], "custom_params": meta_to_custom_params(meta)}
    payload = {**request.payload, "sampling_params": params, "priority": meta.sglang_priority}
    return replace(request, meta=meta, payload=payload)


def _sampling_params(
    req: SamplingFields, max_tokens: int, meta: RequestMeta, plan: ToolPlan | None = None
) -> dict[str, Any]:
    params: dict[str, Any] = {
        "max_new_tokens": max_tokens,
        "custom_params": meta_to_custom_params(meta),
    }
    optional = {
        "temperature": req.temperature,
        "top_p": req.top_p,
        "top_k": req.top_k,
        "min_p": req.min_p,
        "presence_penalty": req.presence_penalty,
        "frequency_penalty": req.frequency_penalty,
        "repetition_penalty": req.repetition_penalty,
        "min_new_tokens": req.min_tokens,
        "ignore_eos": req.ignore_eos,
        "skip_special_tokens": req.skip_special_tokens,
        "sampling_seed": req.seed,
        "stop": req.stop,
    }
    params.update({k: v for k, v in optional.items() if v is not None})
    if isinstance(req, ChatCompletionRequest) and req.response_format is not None:
        schema = req.response_format.engine_schema()
        if schema is not None:  # the engine decodes under the schema's grammar (xgrammar)
            params["json_schema"] = schema
    if plan is not None:
        params.update(_tool_sampling(req, plan))
    return params


def _tool_sampling(req: SamplingFields, plan: ToolPlan) -> dict[str, Any]:
    """What reading the answer for tool calls asks of the engine: a forced call's schema, and
    the special tokens kept in the text (some families' markers are special tokens, e.g.
    Mistral's `[TOOL_CALLS]`) unless the client chose."""
    assert isinstance(req, ChatCompletionRequest) and req.tools
    if plan.mode == "named":
        [function] = [t.function for t in req.tools if t.function.name == plan.function_name]
        return {"json_schema": json.dumps(function.parameters_schema, ensure_ascii=False)}
    if plan.mode == "required":
        tools = [(t.function.name, t.function.parameters_schema) for t in req.tools]
        return {"json_schema": required_schema(tools, is_parallel=plan.is_parallel)}
    return {} if req.skip_special_tokens is not None else {"skip_special_tokens": False}


def _message_dict(index: int, message: ChatMessage) -> dict[str, Any]:
    content = message.content
    if isinstance(content, list):
        texts = []
        for part in content:
            if part.type != "text" or part.text is None:
                raise ApiError(
                    400,
                    f"content part of type {part.type!r} is not supported (text only)",
                    param=f"messages[{index}].content",
                    code="invalid_value",
                )
            texts.append(part.text)
        content = "".join(texts)
    # an assistant's calls may come with null content: the template is given None, as Hugging
    # Face's apply_chat_template gives it
    keep_null = content is None and bool(message.tool_calls)
    out: dict[str, Any] = {"role": message.role, "content": None if keep_null else content or ""}
    if message.name is not None:
        out["name"] = message.name
    if message.tool_calls:
        out["tool_calls"] = [
            {
                "id": call.id,
                "type": call.type,
                # the templates render `arguments | tojson`: an object, not its JSON text
                # (check_message_tool_fields made sure it decodes to one)
                "function": {
                    "name": call.function.name,
                    "arguments": json.loads(call.function.arguments),
                },
            }
            for call in message.tool_calls
        ]
    if message.tool_call_id is not None:
        out["tool_call_id"] = message.tool_call_id
    return out
