"""Ingress: the OpenAI-compatible HTTP front door (FastAPI through serve.ingress).

POST /v1/chat/completions, POST /v1/completions (stream or not), GET /v1/models and /v1/models/{model},
GET /health, GET /version, GET /metrics (this process's metrics merged with every replica's), vLLM's
POST /tokenize and /detokenize (the prompt tokens a request would have, with the same chat template) and
GET /tokenizer_info, and with LoRA on, vLLM's POST /v1/load_lora_adapter and /v1/unload_lora_adapter. A
request's `model` names the base model or a LoRA adapter; the adapters' registry lives in the cluster state
actor, so every ingress replica serves the same ones. Requests are parsed and checked by
router/openai_protocol.py, tokenized once here (chat template), and run by router/orchestrator.py.
"""

import asyncio
import dataclasses
import importlib.metadata
import json
import logging
import time
import uuid
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
import jinja2
import prometheus_client
from ray import serve

from engine.beam_search import BeamSearch
from engine.errors import InvalidRequestError
from engine.llm import chat_token_ids
from engine.lora import LoRARequest
from engine.loader import load_tokenizer
from engine.pooling import PoolingParams
from engine.sampling_params import SamplingParams
from replica.messages import TokenDelta
from router import openai_protocol as oa, responses as rs
from router.cluster_state import merge_expositions
from router.admission import Admission
from router.config import (AdmissionConfig, AuthConfig, ChatConfig, DisaggregationConfig, LimitsConfig, LoRAConfig,
                           MigrationConfig, ReasoningConfig, RouterConfig, ToolsConfig)
from router.orchestrator import Orchestrator, as_openai_error
from router.tools import tool_format

log = logging.getLogger(__name__)
try:
    BATON_VERSION = importlib.metadata.version("baton")
except importlib.metadata.PackageNotFoundError:        # run from a source tree that was never installed
    BATON_VERSION = "unknown"
app = FastAPI(title="Baton", description="OpenAI-compatible API of a disaggregated Baton cluster")


def _openapi() -> dict:
    """FastAPI's OpenAPI document plus the request bodies' JSON schemas (the routes read raw bodies, to bound
    and check them themselves): /docs shows them, and the fuzz suite generates requests from them."""
    if app.openapi_schema is None:
        from fastapi.openapi.utils import get_openapi
        doc = get_openapi(title=app.title, version="1", description=app.description, routes=app.routes)
        schemas = doc.setdefault("components", {}).setdefault("schemas", {})
        for model in (oa.ChatCompletionRequest, oa.CompletionRequest, rs.ResponsesRequest, oa.LoadLoRAAdapterRequest,
                      oa.UnloadLoRAAdapterRequest, oa.TokenizeRequest, oa.DetokenizeRequest, oa.EmbeddingRequest,
                      oa.ScoreRequest, oa.RerankRequest):
            schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
            schemas.update(schema.pop("$defs", {}))
            schemas[model.__name__] = schema
        schemas["TokenizeBody"] = {"anyOf": [{"$ref": "#/components/schemas/TokenizeRequest"},
                                             {"$ref": "#/components/schemas/ChatCompletionRequest"}]}
        app.openapi_schema = doc
    return app.openapi_schema


def _body(model: str) -> dict:
    return {"requestBody": {"required": True, "content": {
        "application/json": {"schema": {"$ref": f"#/components/schemas/{model}"}}}}}


app.openapi = _openapi
LORA_REFRESH_S = 1.0            # an ingress rereads the adapter registry this often (and on an unknown name)
DRAIN_LIMIT_BYTES = 64 << 20     # an oversized body is read and dropped up to this, so the client gets its 413


async def _json(request: Request, max_bytes: int) -> Any:
    """The body as JSON; beyond max_bytes a 413. The excess is read and discarded (never held) so that the
    client, still sending, receives the answer instead of a reset connection."""
    raw, size = bytearray(), 0
    async for chunk in request.stream():
        size += len(chunk)
        if size <= max_bytes:
            raw += chunk
        elif size > DRAIN_LIMIT_BYTES:
            break
    if size > max_bytes:
        raise oa.OpenAIError(413, f"the request body exceeds {max_bytes} bytes", "RequestTooLargeError")
    try:
        return json.loads(raw, parse_constant=_no_constant)
    except (ValueError, UnicodeDecodeError) as e:        # JSONDecodeError is a ValueError
        raise oa.OpenAIError(400, f"the request body is not valid JSON: {e}", "BadRequestError") from e
    except RecursionError:
        raise oa.OpenAIError(400, "the request body is not valid JSON: nested too deeply",
                             "BadRequestError") from None


def _no_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")     # Python's json takes NaN/Infinity; JSON does not


@serve.ingress(app)
class Ingress:
    def __init__(self, prefill, decode, state, *, state_actor: str, num_replicas: int, limits: LimitsConfig,
                 auth: AuthConfig, admission: AdmissionConfig, disaggregation: DisaggregationConfig,
                 router: RouterConfig, migration: MigrationConfig = MigrationConfig(),
                 tools: ToolsConfig = ToolsConfig(), reasoning: ReasoningConfig = ReasoningConfig(),
                 lora: LoRAConfig = LoRAConfig(), stream_channels: bool = True, chat: ChatConfig = ChatConfig()):
        """prefill, decode, state: handles of the pools and of the state actor's owner (cluster/app.py);
        state_actor: the actor's name (the index mirror reads it); num_replicas: ingress replicas, which
        share the decode pool's KV budget; stream_channels: the decode section's; the rest are the cluster
        config's sections."""
        self.stream_channels = stream_channels
        self.limits, self.disaggregation, self.router_config = limits, disaggregation, router
        self.migration, self.tools_config, self.lora_config, self.chat_config = migration, tools, lora, chat
        self.reasoning = reasoning.parser
        self._loras: dict[str, LoRARequest] = {}     # the registry's copy: adapter name -> request
        self._loras_read = 0.0
        self._lora_refused: set[str] = set()    # configured adapters that failed their check: not retried
        self.tool_format = None             # router.tools.ToolFormat of the served model's chat template
        self.keys = oa.ApiKeys(auth.api_keys_env)
        self.protect_metrics = auth.protect_metrics
        if self.keys.enabled:
            log.info("ingress: API keys required (from $%s)", auth.api_keys_env)
        self.state = state
        self.decode = decode
        self.info = None
        self._prefill, self._state_name = prefill, state_actor
        self.served_name = None
        self.tokenizer = None
        self._grammars = None               # engine.structured.GrammarCompiler over the tokenizer, on first use
        self.orchestrator = None
        # asked only once a request is admitted, after _setup made the orchestrator; each replica's share
        self.admission = Admission(admission, lambda: self.orchestrator.kv_capacity_tokens() // num_replicas)
        self._ready = asyncio.Lock()

    async def _setup(self) -> Orchestrator:
        """Model facts come from a decode replica once (the model key that block hashes use)."""
        if self.orchestrator is None:
            async with self._ready:
                if self.orchestrator is None:
                    info = await self.decode.model_info.remote()
                    self.tokenizer = await asyncio.to_thread(load_tokenizer, info["model_path"])
                    if self.chat_config.template is not None:        # the server's template, for every chat
                        self.tokenizer.chat_template = self.chat_config.template
                    self.tool_format = tool_format(self.tokenizer, self.tools_config.parser)
                    self.served_name = info["served_model_name"]
                    self.info = info
                    await self._load_configured_adapters()
                    self.orchestrator = Orchestrator(self._prefill, self.decode, info, self._state_name,
                                             self.disaggregation.min_remote_prefill_tokens,
                                             self.router_config.index_sync_interval_s,
                                             self.migration.max_moves, self.stream_channels)
        return self.orchestrator

    # -- LoRA adapters ----------------------------------------------------------------------------
    async def _load_configured_adapters(self) -> None:
        """The config's adapters, each checked by a decode replica and registered once (the first ingress
        replica to start does it; the others find them registered). A bad one is logged and not served."""
        have = await self.state.lora_adapters.remote()
        for name, path in self.lora_config.adapters.items():
            if name in have:
                continue
            try:
                await self._register_adapter(name, path)
            except oa.OpenAIError as e:
                self._lora_refused.add(name)
                log.error("LoRA adapter %r from the cluster config is not served: %s", name, e.message)

    async def _register_adapter(self, name: str, path: str) -> None:
        """A decode replica loads and checks the adapter (its key is the KV namespace), then the registry takes it."""
        if name == self.served_name:
            raise oa.OpenAIError(400, f"a LoRA adapter cannot take the base model's name {name!r}", param="lora_name")
        try:
            info = await self.decode.load_lora.remote(LoRARequest(name, 0, path))
        except Exception as e:                      # noqa: BLE001 - a LoRAError comes wrapped by Ray: its cause
            err = as_openai_error(e, f"load_lora_adapter {name}")
            err.param = "lora_path" if err.status == 400 else None
            raise err from e
        if not await self.state.add_lora.remote(name, path, info["key"]):
            raise oa.OpenAIError(400, f"the LoRA adapter {name!r} has already been loaded", param="lora_name")
        self._loras_read = 0.0

    async def _adapters(self, refresh: bool = False) -> dict[str, LoRARequest]:
        """The registry (name -> LoRARequest), reread every LORA_REFRESH_S or when asked."""
        if self.lora_config.on and (refresh or time.monotonic() - self._loras_read > LORA_REFRESH_S):
            reg = await self.state.lora_adapters.remote()
            if any(name not in reg and name not in self._lora_refused for name in self.lora_config.adapters):
                # a new state actor (its predecessor ended with the state replica): the config's adapters again
                await self._load_configured_adapters()
                reg = await self.state.lora_adapters.remote()
            self._loras = {n: LoRARequest(n, i, path, key) for n, (i, path, key) in reg.items()}
            self._loras_read = time.monotonic()
        return self._loras

    async def _resolve_model(self, name: str) -> LoRARequest | None:
        """The base model (None) or the LoRA adapter a request's `model` names; 404 for anything else."""
        if name == self.served_name:
            return None
        adapters = await self._adapters()
        if name not in adapters and self.lora_config.on:
            adapters = await self._adapters(refresh=True)
        if name in adapters:
            return adapters[name]
        oa.check_model(name, [self.served_name, *adapters])
        return None

    async def _lora_route(self, request: Request, parse) -> tuple[Any, Response | None]:
        try:
            self.keys.check(request.headers.get("authorization"))
            if not self.lora_config.on:
                raise oa.OpenAIError(400, "this cluster serves no LoRA adapters (the config's lora section is off)")
            if not self.lora_config.runtime_updates:
                raise oa.OpenAIError(404, "loading and unloading LoRA adapters at run time is off "
                                          "(lora.runtime_updates)", "NotFoundError")
            body = oa.parse_body(await _json(request, self.limits.max_body_bytes), parse)
            await self._setup()
            return body, None
        except oa.OpenAIError as e:
            return None, JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.post("/v1/load_lora_adapter", openapi_extra=_body("LoadLoRAAdapterRequest"))
    async def load_lora_adapter(self, request: Request) -> Response:
        body, error = await self._lora_route(request, oa.LoadLoRAAdapterRequest)
        if error is not None:
            return error
        try:
            await self._register_adapter(body.lora_name, body.lora_path)
        except oa.OpenAIError as e:
            return JSONResponse(e.body(), status_code=e.status, headers=e.headers)
        log.info("LoRA adapter %r loaded from %s", body.lora_name, body.lora_path)
        return Response(f"Success: LoRA adapter '{body.lora_name}' added successfully.", media_type="text/plain")

    @app.post("/v1/unload_lora_adapter", openapi_extra=_body("UnloadLoRAAdapterRequest"))
    async def unload_lora_adapter(self, request: Request) -> Response:
        body, error = await self._lora_route(request, oa.UnloadLoRAAdapterRequest)
        if error is not None:
            return error
        if not await self.state.remove_lora.remote(body.lora_name):
            e = oa.OpenAIError(404, f"the LoRA adapter {body.lora_name!r} is not loaded", "NotFoundError",
                               "lora_name")
            return JSONResponse(e.body(), status_code=e.status, headers=e.headers)
        self._loras_read = 0.0
        log.info("LoRA adapter %r unloaded", body.lora_name)
        return Response(f"Success: LoRA adapter '{body.lora_name}' removed successfully.", media_type="text/plain")

    # -- routes -----------------------------------------------------------------------------------
    @app.get("/health")
    async def health(self) -> dict:
        return {"status": "ok"}

    async def _keyed(self, request: Request) -> Response | None:
        """A request's API key checked and the ingress set up: None, or the refusal to answer with."""
        try:
            self.keys.check(request.headers.get("authorization"))
        except oa.OpenAIError as e:
            return JSONResponse(e.body(), status_code=e.status, headers=e.headers)
        await self._setup()
        return None

    @app.get("/v1/models")
    async def models(self, request: Request) -> Response:
        if (refused := await self._keyed(request)) is not None:
            return refused
        adapters = {n: r.lora_path for n, r in (await self._adapters()).items()}
        return JSONResponse(oa.models_body([self.served_name], self.info["max_model_len"], adapters))

    @app.get("/v1/models/{name:path}")
    async def model(self, request: Request, name: str) -> Response:
        """OpenAI's GET /v1/models/{model}: the base model or an adapter, as /v1/models lists it; 404 otherwise."""
        if (refused := await self._keyed(request)) is not None:
            return refused
        adapters = {n: r.lora_path for n, r in (await self._adapters()).items()}
        data = oa.models_body([self.served_name], self.info["max_model_len"], adapters)["data"]
        try:
            oa.check_model(name, [m["id"] for m in data])
        except oa.OpenAIError as e:
            return JSONResponse(e.body(), status_code=e.status, headers=e.headers)
        return JSONResponse(next(m for m in data if m["id"] == name))

    @app.get("/version")
    async def version(self) -> dict:
        return {"version": BATON_VERSION}

    @app.get("/metrics")
    async def metrics(self, request: Request) -> Response:
        if self.protect_metrics:
            try:
                self.keys.check(request.headers.get("authorization"))
            except oa.OpenAIError as e:
                return JSONResponse(e.body(), status_code=e.status, headers=e.headers)
        texts = await self.state.metrics_texts.remote()
        # the module attribute, not a name imported here: Serve ships this class by value, and a
        # registry captured at import would be a copy, not this process's live one
        body = merge_expositions([prometheus_client.generate_latest(prometheus_client.REGISTRY), *texts])
        return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.post("/tokenize", openapi_extra=_body("TokenizeBody"))
    async def tokenize(self, request: Request) -> Response:
        """A prompt's token ids (add_special_tokens as the tokenizer's encode), or a chat request's prompt ids
        under the model's chat template and its tools, as /v1/chat/completions builds them."""
        try:
            self.keys.check(request.headers.get("authorization"))
            body = await _json(request, self.limits.max_body_bytes)
            await self._setup()
            if isinstance(body, dict) and "messages" in body:
                req = oa.parse_request(body, True, self.limits)
                await self._resolve_model(req.model)
                ids, strs = self._prompts(req, True, oa.tool_plan(req, self.tool_format))[0], None
            else:
                req = oa.parse_body(body, oa.TokenizeRequest)
                await self._resolve_model(req.model or self.served_name)
                ids = self.tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens)
                strs = self.tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs else None
        except oa.OpenAIError as e:
            return JSONResponse(e.body(), status_code=e.status, headers=e.headers)
        return JSONResponse(oa.tokenize_body(list(ids), self.info["max_model_len"], strs))

    @app.get("/tokenizer_info")
    async def tokenizer_info(self, request: Request) -> Response:
        if (refused := await self._keyed(request)) is not None:
            return refused
        return JSONResponse(oa.tokenizer_info_body(self.tokenizer, self.info["max_model_len"]))

    @app.post("/detokenize", openapi_extra=_body("DetokenizeRequest"))
    async def detokenize(self, request: Request) -> Response:
        try:
            self.keys.check(request.headers.get("authorization"))
            req = oa.parse_body(await _json(request, self.limits.max_body_bytes), oa.DetokenizeRequest)
            await self._setup()
            await self._resolve_model(req.model or self.served_name)
            if req.tokens and (min(req.tokens) < 0 or max(req.tokens) >= self.info["vocab_size"]):
                raise oa.OpenAIError(400, f"tokens must be token ids in [0, {self.info['vocab_size']})", param="tokens")
        except oa.OpenAIError as e:
            return JSONResponse(e.body(), status_code=e.status, headers=e.headers)
        return JSONResponse({"prompt": self.tokenizer.decode(req.tokens)})

    @app.post("/v1/chat/completions", openapi_extra=_body("ChatCompletionRequest"))
    async def chat(self, request: Request) -> Response:
        return await self._serve(request, chat=True)

    @app.post("/v1/completions", openapi_extra=_body("CompletionRequest"))
    async def completions(self, request: Request) -> Response:
        return await self._serve(request, chat=False)

    @app.post("/v1/embeddings", openapi_extra=_body("EmbeddingRequest"))
    async def embeddings(self, request: Request) -> Response:
        """OpenAI's embeddings: each input's prompt computed in a pool and pooled as the model pools
        (engine/pooling.py), all inputs at once; floats or base64."""
        async def answer(req, lora, rid: str) -> dict:
            pooling = PoolingParams(normalize=req.normalize, dimensions=req.dimensions)
            try:
                pooling.validate(self.info["hidden_size"], self.info["matryoshka"])
            except InvalidRequestError as e:
                raise oa.OpenAIError(400, str(e), param="dimensions") from e
            if (req.input is None) == (req.messages is None):
                raise oa.OpenAIError(400, "give input or messages (vLLM's chat embeddings), one of them",
                                     param="input")
            inputs = oa.completion_prompts(req) if req.messages is None else [self._chat_ids(req)]
            vectors, tokens = await self._embed(inputs, "input" if req.messages is None else "messages", req, lora,
                                                pooling)
            return oa.embedding_body(rid, int(time.time()), self._name(lora), vectors, req.encoding_format, tokens)
        return await self._pooled(request, oa.EmbeddingRequest, "embd-", answer)

    @app.post("/score", openapi_extra=_body("ScoreRequest"))
    @app.post("/v1/score", openapi_extra=_body("ScoreRequest"))
    async def score(self, request: Request) -> Response:
        """vLLM's score API for an embedding model: each pair's cosine similarity, text_1 against each text_2 (one
        against many, or pairwise for two lists of one length)."""
        async def answer(req, lora, rid: str) -> dict:
            pairs = oa.score_pairs(req)
            texts = list(dict.fromkeys([a for a, _ in pairs] + [b for _, b in pairs]))     # each text embedded once
            vectors, tokens = await self._embed(texts, "text_1", req, lora, PoolingParams())
            at = {t: v for t, v in zip(texts, vectors)}
            return oa.score_body(rid, int(time.time()), self._name(lora),
                                 [float(at[a] @ at[b]) for a, b in pairs], tokens)
        return await self._pooled(request, oa.ScoreRequest, "score-", answer)

    @app.post("/rerank", openapi_extra=_body("RerankRequest"))
    @app.post("/v1/rerank", openapi_extra=_body("RerankRequest"))
    @app.post("/v2/rerank", openapi_extra=_body("RerankRequest"))
    async def rerank(self, request: Request) -> Response:
        """vLLM's (Jina's and Cohere's) rerank API for an embedding model: the documents by their cosine similarity
        to the query, best first, the top_n of them."""
        async def answer(req, lora, rid: str) -> dict:
            if not req.documents:
                raise oa.OpenAIError(400, "documents must not be empty", param="documents")
            vectors, tokens = await self._embed([req.query, *req.documents], "documents", req, lora, PoolingParams())
            scores = [float(vectors[0] @ v) for v in vectors[1:]]
            return oa.rerank_body(rid, self._name(lora), req, scores, tokens)
        return await self._pooled(request, oa.RerankRequest, "rerank-", answer)

    def _chat_ids(self, req) -> list[int]:
        """An embedding request's conversation under the chat template (the assistant's turn left out unless
        add_generation_prompt), as vLLM's chat embeddings render it."""
        if not req.messages:
            raise oa.OpenAIError(400, "messages must not be empty", param="messages")
        turns = [{"role": m.role, "content": oa.message_text(m)} for m in req.messages]
        try:
            return chat_token_ids(self.tokenizer, turns, add_generation_prompt=req.add_generation_prompt,
                                  template_kwargs=req.chat_template_kwargs)
        except InvalidRequestError as e:
            raise oa.OpenAIError(400, str(e), param="messages") from e
        except jinja2.TemplateError as e:
            raise oa.OpenAIError(400, f"the model's chat template failed on these messages: {e}",
                                 param="messages") from e

    def _name(self, lora) -> str:
        return self.served_name if lora is None else lora.lora_name

    async def _pooled(self, request: Request, model, prefix: str, answer) -> Response:
        """A pooling route (embeddings, score, rerank): the body checked, its model resolved, then answer(request,
        adapter, id) -> the body; OpenAI's errors for bad input (400) and failures in the pools alike."""
        rid = prefix + uuid.uuid4().hex
        try:
            self.keys.check(request.headers.get("authorization"))
            body = await _json(request, self.limits.max_body_bytes)
            await self._setup()
            req = oa.parse_body(body, model)
            lora = await self._resolve_model(req.model)
            return JSONResponse(await answer(req, lora, rid))
        except oa.OpenAIError as e:
            return JSONResponse(e.body(), status_code=e.status, headers=e.headers)
        except Exception as e:                      # noqa: BLE001 - one request fails, the server goes on
            err = as_openai_error(e, rid)
            return JSONResponse(err.body(), status_code=err.status, headers=err.headers)

    async def _embed(self, inputs: list, param: str, req, lora, pooling: PoolingParams) -> tuple[list, int]:
        """Each input's (a text or token ids) pooled vector, all at once through the pools (Orchestrator.embed),
        admitted as one request; and their tokens in all. Inputs are checked first (400s naming `param`): their
        count, each one's ids and length (an input may fill max_model_len: it generates nothing)."""
        if not inputs:
            raise oa.OpenAIError(400, f"{param} must not be empty", param=param)
        if len(inputs) > self.limits.max_embedding_inputs:
            raise oa.OpenAIError(400, f"{param} has {len(inputs)} entries; this server embeds at most "
                                      f"{self.limits.max_embedding_inputs} a request", param=param)
        special = getattr(req, "add_special_tokens", True)
        prompts = [p if isinstance(p, list) else self.tokenizer.encode(p, add_special_tokens=special) for p in inputs]
        k = getattr(req, "truncate_prompt_tokens", None)
        prompts = [ids[-k:] for ids in prompts] if k else prompts
        limit = min(self.info["max_model_len"], self.limits.max_prompt_tokens or self.info["max_model_len"])
        for ids in prompts:
            oa.check_token_ids(ids, self.info["vocab_size"], param=param)
            if len(ids) > limit:
                raise oa.OpenAIError(400, f"an input has {len(ids)} tokens; this server embeds at most {limit}",
                                     param=param, code="context_length_exceeded")
        orchestrator = self.orchestrator
        hashes = [orchestrator.hashes(ids, lora) for ids in prompts]
        whole = self.info["pooling_type"] != "last"          # its prompt is computed whole, cached or not
        ticket = self.admission.admit([len(ids) - (0 if whole else orchestrator.cached_tokens(h))
                                       for ids, h in zip(prompts, hashes)], [len(ids) for ids in prompts], 1)
        priority = getattr(req, "priority", 0)

        async def one(i: int, ids: list[int], h: list[int]):
            try:
                out = await orchestrator.embed(ids, pooling, h, lora, priority)
                ticket.progress(i, 0)
                return out.embedding
            finally:
                ticket.release(i)
        try:
            vectors = await asyncio.gather(*(one(i, ids, h) for i, (ids, h) in enumerate(zip(prompts, hashes))))
        finally:
            ticket.release_all()
        return vectors, sum(len(ids) for ids in prompts)

    @app.post("/v1/responses", openapi_extra=_body("ResponsesRequest"))
    async def responses(self, request: Request) -> Response:
        return await self._serve(request, chat=True, responses=True)

    @app.get("/v1/responses/{response_id}")
    @app.delete("/v1/responses/{response_id}")
    @app.post("/v1/responses/{response_id}/cancel")
    async def stored_response(self, request: Request, response_id: str) -> Response:
        """OpenAI's retrieve, delete and cancel of a stored response: Baton stores none, so each is a 404 that says
        so (the openai client raises NotFoundError with it)."""
        if (refused := await self._keyed(request)) is not None:
            return refused
        e = oa.OpenAIError(404, rs.NOT_STORED.format(response_id), "NotFoundError", param="response_id",
                           code="not_found")
        return JSONResponse(e.body(), status_code=e.status)

    # -- one request ------------------------------------------------------------------------------
    async def _serve(self, request: Request, chat: bool, responses: bool = False) -> Response:
        """A chat or completion request; `responses`: a Responses API request, served as the chat request it
        translates to (router/responses.py) and shaped back."""
        try:
            self.keys.check(request.headers.get("authorization"))
            body = await _json(request, self.limits.max_body_bytes)
            orchestrator = await self._setup()
            if responses:
                rreq = rs.parse(body)
                body = rs.to_chat(rreq)
            req = oa.parse_request(body, chat, self.limits)
            lora = await self._resolve_model(req.model)
            tools = oa.tool_plan(req, self.tool_format)
            if tools is not None and tools.keeps_special_tokens or chat and self.reasoning == "gpt_oss":
                req.skip_special_tokens = False          # Mistral's [TOOL_CALLS] and harmony's markers are special
            prompts = self._prompts(req, chat, tools)
            for ids in prompts:
                oa.check_prompt_length(len(ids), self.limits)
                oa.check_token_ids(ids, self.info["vocab_size"])
            structured = await self._structured(req, tools)
            hashes = [orchestrator.hashes(ids, lora, req.cache_salt) for ids in prompts]
            jobs = [(ids, h, oa.to_sampling_params(req, self.info["max_model_len"], len(ids), index=i,
                                                   structured=structured, vocab_size=self.info["vocab_size"],
                                                   defaults=self.info.get("default_sampling")), lora)
                    for ids, h in zip(prompts, hashes) for i in range(req.n)]
            beams = [oa.beam_search_params(req, jobs[k * req.n][2].max_tokens) for k in range(len(prompts))]
            scoring = jobs[0][2].prompt_logprobs is not None       # its prompt is computed whole, cached or not
            ticket = self.admission.admit([len(ids) - (0 if scoring else orchestrator.cached_tokens(h))
                                           for ids, h in zip(prompts, hashes)], [len(ids) for ids in prompts], req.n)
        except oa.OpenAIError as e:
            return JSONResponse(e.body(), status_code=e.status, headers=e.headers)
        rid = ("resp_" if responses else "chatcmpl-" if chat else "cmpl-") + (req.request_id or uuid.uuid4().hex)
        created, model = int(time.time()), self.served_name if lora is None else lora.lora_name
        builder = oa.ResponseBuilder(rid, created, model, chat, req, self.tokenizer, tools, prompts, self.reasoning)
        if responses:
            builder = rs.ResponsesBuilder(builder, rreq, len(hashes[0]) * orchestrator.model["block_size"])
        if beams[0] is not None:
            search = self._beam_search(orchestrator, prompts, beams, lora, builder)
            if req.stream:
                body = self._stream_beams(search, builder)
                ticket.release_with(body)
                return StreamingResponse(body, media_type="text/event-stream")
            try:
                for i, d in await search:
                    builder.add(i, d)
                return JSONResponse(builder.final())
            except Exception as e:                  # noqa: BLE001 - one request fails, the server goes on
                err = as_openai_error(e, builder.id)
                return JSONResponse(err.body(), status_code=err.status, headers=err.headers)
            finally:
                ticket.release_all()
        if req.stream:
            body = self._stream(orchestrator, jobs, builder, ticket)
            ticket.release_with(body)
            return StreamingResponse(body, media_type="text/event-stream")
        try:
            return await self._complete(orchestrator, jobs, builder, ticket)
        finally:                    # choices cancelled before they ran never reach their own `finally`
            ticket.release_all()

    async def _structured(self, req, tools):
        """The request's structured-output spec (response_format, or the grammar of a forced tool call),
        compiled here first (in a thread, bounded in size and time): a spec the grammar engine refuses is a 400
        before any pool sees it, and a streamed request never starts (200) only to fail. The replicas compile
        it again from their own cache."""
        spec, param = oa.structured_spec(req)
        forced = tools.structured() if tools is not None else None
        if forced is not None:
            if spec is not None:
                raise oa.OpenAIError(400, f"give {param} or a forced tool_choice, not both", param=param)
            spec, param = forced, "tools"
        if spec is None:
            return None
        if isinstance(req, oa.ChatCompletionRequest) and self.reasoning != "none":
            spec = dataclasses.replace(spec, after_thinking=True)     # the grammar shapes the answer, not the thinking
        if self._grammars is None:
            from engine.structured import GrammarCompiler
            eos = [self.tokenizer.eos_token_id] if self.tokenizer.eos_token_id is not None else []
            self._grammars = GrammarCompiler(self.tokenizer, self.info["vocab_size"], eos,
                                             max_bytes=self.limits.max_grammar_bytes,
                                             timeout_s=self.limits.grammar_compile_timeout_s)
        try:
            await asyncio.to_thread(self._grammars.compile, spec)
        except InvalidRequestError as e:
            raise oa.OpenAIError(400, f"{param}: {e}", param=param) from e
        return spec

    def _prompts(self, req, chat: bool, tools=None) -> list[list[int]]:
        """Each prompt's token ids: a chat's under the model's template (with vLLM's template options), a
        completion's as given or encoded; the last truncate_prompt_tokens of each when that is set."""
        if chat:
            messages, template_tools = oa.chat_messages(req, tools, self.tool_format)
            if req.chat_template is not None and not self.chat_config.trust_request_template:
                raise oa.OpenAIError(400, "this server does not run a chat_template a request brings (the cluster's "
                                          "chat.trust_request_template, vLLM's --trust-request-chat-template)",
                                     param="chat_template")
            try:
                variables = {**({"reasoning_effort": req.reasoning_effort} if req.reasoning_effort else {}),
                             **(req.chat_template_kwargs or {})}
                prompts = [chat_token_ids(self.tokenizer, messages, template_tools, req.add_generation_prompt,
                                          req.continue_final_message, variables, req.documents,
                                          req.add_special_tokens, req.chat_template)]
            except InvalidRequestError as e:
                param = str(e).split(" ", 1)[0]
                raise oa.OpenAIError(400, str(e), param=param if param in type(req).model_fields else None) from e
            except jinja2.TemplateError as e:
                whose = "the request's" if req.chat_template is not None else "the server's" \
                    if self.chat_config.template is not None else "the model's"
                raise oa.OpenAIError(400, f"{whose} chat template failed on this request: {e}",
                                     param="chat_template" if req.chat_template is not None else
                                     "chat_template_kwargs" if req.chat_template_kwargs else "messages") from e
        else:
            prompts = [p if isinstance(p, list) else self.tokenizer.encode(p, add_special_tokens=req.add_special_tokens)
                       for p in oa.completion_prompts(req)]
        k = req.truncate_prompt_tokens
        return [ids[-k:] for ids in prompts] if k else prompts

    async def _complete(self, orchestrator: Orchestrator, jobs, builder, ticket) -> Response:
        priority = builder.req.priority

        async def one(i: int, ids: list[int], hashes: list[int], params, lora) -> None:
            try:
                async for d in orchestrator.stream(ids, params, hashes=hashes, lora=lora, priority=priority):
                    ticket.progress(i, len(d.token_ids))
                    builder.add(i, d)
            finally:
                ticket.release(i)
        try:
            await asyncio.gather(*(one(i, *job) for i, job in enumerate(jobs)))
        except Exception as e:                      # noqa: BLE001 - one request fails, the server goes on
            err = as_openai_error(e, builder.id)
            return JSONResponse(err.body(), status_code=err.status, headers=err.headers)
        return JSONResponse(builder.final())

    async def _beam_search(self, orchestrator: Orchestrator, prompts, beams, lora, builder) -> list:
        """vLLM's use_beam_search (engine/beam_search.py): every prompt's rounds through the pools, one token of
        each live beam a round (its prompt mostly cached), all at once; choice k * n + j is prompt k's beam j,
        as one finished delta."""
        req = builder.req

        async def top(ids: list[int], k: int) -> dict[int, float]:
            params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, logprobs=k)
            hashes = orchestrator.hashes(ids, lora, req.cache_salt)
            async for d in orchestrator.stream(ids, params, hashes=hashes, lora=lora, priority=req.priority):
                if d.logprobs:
                    return d.logprobs[0]
            raise RuntimeError("a beam search round ended without its token")

        async def search(ids: list[int], params) -> list:
            s = BeamSearch(ids, params, self.info["eos_token_ids"], self.info["max_model_len"])
            while not s.done:
                s.advance(await asyncio.gather(*(top(p, s.num_top_logprobs) for p in s.prompts())))
            return s.results().sequences

        results = await asyncio.gather(*(search(ids, params) for ids, params in zip(prompts, beams)))
        out = []
        for k, (ids, seqs) in enumerate(zip(prompts, results)):
            for j, b in enumerate(seqs):
                gen = b.tokens[len(ids):]
                text = self.tokenizer.decode(gen, skip_special_tokens=req.skip_special_tokens)
                out.append((k * req.n + j, TokenDelta(gen, text, True, finish_reason=b.finish_reason,
                                                      prompt_tokens=len(ids), completion_tokens=len(gen))))
        return out

    async def _stream_beams(self, search, builder) -> AsyncIterator[bytes]:
        """A beam search streamed: its choices come whole once the search ends (as vLLM's)."""
        for chunk in builder.first_chunks():
            yield builder.sse(chunk)
        try:
            results = await search
        except Exception as e:                       # noqa: BLE001
            yield builder.sse_error(as_openai_error(e, builder.id))
            yield builder.end()
            return
        yield b"".join(builder.sse(chunk) for i, d in results for chunk in builder.chunks(i, d))
        usage = builder.usage_chunk()
        if usage is not None:
            yield builder.sse(usage)
        yield builder.end()

    async def _stream(self, orchestrator: Orchestrator, jobs, builder, ticket) -> AsyncIterator[bytes]:
        queue: asyncio.Queue = asyncio.Queue()
        priority = builder.req.priority

        async def one(i: int, ids: list[int], hashes: list[int], params, lora) -> None:
            try:
                async for d in orchestrator.stream(ids, params, hashes=hashes, lora=lora, priority=priority):
                    ticket.progress(i, len(d.token_ids))
                    await queue.put((i, d))
            except Exception as e:                  # noqa: BLE001
                await queue.put((i, e))
            finally:
                ticket.release(i)

        tasks = [asyncio.create_task(one(i, *job)) for i, job in enumerate(jobs)]
        try:
            for chunk in builder.first_chunks():
                yield builder.sse(chunk)
            done, failed = 0, False
            while done < len(tasks) and not failed:
                # every delta that is already here goes out as one body message: under load, one hop through
                # Serve's proxy carries many tokens instead of one each
                events = []
                while True:
                    i, d = await queue.get() if not events else queue.get_nowait()
                    if isinstance(d, Exception):     # the stream ends with an error event in OpenAI's shape
                        events.append(builder.sse_error(as_openai_error(d, builder.id)))
                        failed = True
                        break
                    events += [builder.sse(chunk) for chunk in builder.chunks(i, d)]
                    done += d.finished
                    if done == len(tasks) or queue.empty():
                        break
                if events:
                    yield b"".join(events)
            if not failed:
                usage = builder.usage_chunk()
                if usage is not None:
                    yield builder.sse(usage)
            yield builder.end()
        finally:
            for t in tasks:                 # client gone: cancel every choice; the pools abort and free
                t.cancel()
            ticket.release_all()            # a choice never started (cancelled before running) is released too

