"""`POST /v1/responses`, `GET` and `DELETE /v1/responses/{id}`: the Responses API over the
chat pipeline. A request becomes a chat request (router/responses_api.py), runs as one
chat generation, and its answer becomes a response object or the stream's events
(router/responses_output.py); stored responses (router/response_store.py) let a follow-up
continue the conversation without resending it.

A conversation's turns share one session, the id of its first response, so the router's
session affinity keeps them on the decode worker that holds the conversation's KV: a
follow-up's prompt is its history (cached there) plus its new tokens.
"""
from __future__ import annotations

import logging
import time
from dataclasses import replace

from fastapi import Depends, FastAPI, Request

from . import responses
from .errors import APIError
from .response_store import ResponseStore, StoredResponse
from .responses_api import ResponsesRequest, chat_request, input_messages, renamed
from .responses_output import ResponseEvents, Turn, finished, new_id, now, response_object
from .tenancy import RequestContext, sent_priority
from .tools import parse_tool_call

log = logging.getLogger("pdserve.router")


class ResponsesEndpoint:
    """The Responses API of one router, with its store."""

    def __init__(self, router, store: ResponseStore):
        self.router, self.store = router, store

    async def _previous(self, req: ResponsesRequest, tenant: str) -> StoredResponse | None:
        if req.previous_response_id is None:
            return None
        prev = await self.store.get(tenant, req.previous_response_id)
        if prev is None:  # also another tenant's: to this one it does not exist
            raise APIError(400, f"previous response {req.previous_response_id[:64]!r} not found (it was not "
                                "stored, has expired or was deleted)", param="previous_response_id",
                           code="previous_response_not_found")
        return prev

    async def create(self, req: ResponsesRequest, ctx: RequestContext, timing: bool = False):
        """Run one response; a JSON response object, or its event stream."""
        arrival = time.perf_counter()
        req.check_supported()
        ctx = replace(ctx, lora=self.router.check_model(req.model))
        prev = await self._previous(req, ctx.tenant)
        rid, msg_id, created = new_id("resp"), new_id("msg"), now()
        session = prev.session if prev else rid
        conversation = (prev.conversation if prev else []) + input_messages(req.input)
        chat = chat_request(req, conversation)
        try:
            chat.check_supported()
            specs = chat.tool_specs()
            params = chat.sampling_params(self.router.tokenizer.vocab_size)
            ids = await self.router._chat_ids(chat)
            self.router._check_length(ids, "the conversation", "messages")
            gens = await self.router._start_choices(ids, params, 1, "resp", replace(ctx, session=session), arrival)
        except APIError as e:
            raise renamed(e) from e.__cause__
        run = _Run(self, req, ctx.tenant, rid, msg_id, created, session, conversation,
                   specs if chat.tool_choice != "none" else {})
        if req.stream:
            return await run.stream(gens)
        texts = await responses.collect(gens, lambda *_: None)
        obj = await run.done(texts[0], gens[0])
        return obj | ({"timing": responses.timing(gens)[0]} if timing else {})

    async def retrieve(self, rid: str, ctx: RequestContext) -> dict:
        stored = await self.store.get(ctx.tenant, rid)
        if stored is None:
            raise _not_found(rid)
        return stored.response

    async def delete(self, rid: str, ctx: RequestContext) -> dict:
        if not await self.store.delete(ctx.tenant, rid):
            raise _not_found(rid)
        return {"id": rid, "object": "response.deleted", "deleted": True}


def _not_found(rid: str) -> APIError:
    return APIError(404, f"response {rid[:64]!r} not found", param="response_id", code="response_not_found")


class _Run:
    """One response in flight: what it needs to finish, store and stream itself."""

    def __init__(self, endpoint: ResponsesEndpoint, req: ResponsesRequest, tenant: str, rid: str, msg_id: str,
                 created: int, session: str, conversation: list[dict], specs: dict):
        self.endpoint, self.req, self.tenant = endpoint, req, tenant
        self.rid, self.msg_id, self.created = rid, msg_id, created
        self.session, self.conversation, self.specs = session, conversation, specs

    def turn(self, text: str, finish_reason: str) -> Turn:
        calls = parse_tool_call(text, self.specs) if self.specs else None
        return Turn(text, calls, finish_reason or "stop")

    async def done(self, text: str, gen) -> dict:
        """The finished response object, stored when asked to be."""
        turn = self.turn(text, gen.finish_reason)
        obj = finished(self.rid, self.req, self.endpoint.router.model_name, self.created, turn, self.msg_id,
                       gen.usage())
        if self.req.store:
            stored = StoredResponse(obj, self.conversation + [turn.assistant_message()], self.session)
            await self.endpoint.store.put(self.tenant, self.rid, stored)
        return obj

    async def stream(self, gens):
        """The events: the lifecycle and text events as the answer comes (held while it may be
        a tool call), then, once it is stored, `response.completed`; an `error` event if it
        fails after the first token."""
        router, gen = self.endpoint.router, gens[0]
        snapshot = response_object(self.rid, self.req, router.model_name, self.created)
        events = ResponseEvents(snapshot, self.msg_id)
        started, whole = [False], [""]

        def chunk(i: int, d, offset: int):
            head = [] if started[0] else events.start()
            started[0] = True
            whole[0] += d.text
            return (head + ([] if self.specs else events.delta(d.text))) or None

        def final(i: int) -> list:
            head = [] if started[0] else events.start()
            started[0] = True
            return [head + events.finish(self.turn(whole[0], gen.finish_reason))]
        resp = await responses.stream(gens, chunk, final, {}, False, **router._stall(), encode=events.encode,
                                      done="")
        inner = resp.body_iterator

        async def body():
            try:
                async for piece in inner:
                    yield piece
                if not events.failed:
                    obj = await self.done(whole[0], gen)  # stored before the client hears it is done
                    yield events.encode(events.end(obj))
            except APIError as e:  # the store failed: the answer was sent, the client hears why it is not kept
                yield events.encode(e.body())
            finally:
                await inner.aclose()
        resp.body_iterator = body()
        return resp


def request_context(router, request: Request, priority: int | None = None, user: str | None = None,
                    model: str = "") -> RequestContext:
    """Who a request is for, as every endpoint sees it: under a keys-file key (`authorized`
    put it in request.state), its tenant, ceiling and default priority (`priority` None: the
    body has none), and 403 for a `model` it may not use; else the tenant of the operator's
    API key (its digest) or, with none, of the headers."""
    key = getattr(request.state, "api_key", None)
    if key is not None:
        if model and not key.allows(model):
            raise APIError(403, f"the key {key.name!r} may not use the model {model!r}", "permission_error",
                           code="model_not_allowed", param="model")
        return replace(RequestContext.for_key(key, request.headers, priority, user),
                       meter=getattr(request.state, "meter", None))
    bearer = request.headers.get("authorization", "").removeprefix("Bearer ").strip()
    return replace(RequestContext.of(request.headers, priority or 0, user,
                                     bearer if bearer in router.security.api_keys else ""),
                   meter=getattr(request.state, "meter", None))


def add_responses_routes(app: FastAPI, router, authorized, while_connected, wants_timing) -> None:
    """The Responses API's routes on `app`, behind `authorized`; `while_connected(request, work)`
    and `wants_timing(request)` are router/app.py's (the other endpoints' too)."""
    endpoint = ResponsesEndpoint(router, ResponseStore.of_router(router))

    @app.post("/v1/responses", dependencies=[Depends(authorized)])
    async def create_response(req: ResponsesRequest, request: Request):
        ctx = request_context(router, request, sent_priority(req), req.user, req.model or "")
        return await while_connected(request, endpoint.create(req, ctx, wants_timing(request)))

    @app.get("/v1/responses/{response_id}", dependencies=[Depends(authorized)])
    async def get_response(response_id: str, request: Request):
        return await endpoint.retrieve(response_id, request_context(router, request))

    @app.delete("/v1/responses/{response_id}", dependencies=[Depends(authorized)])
    async def delete_response(response_id: str, request: Request):
        return await endpoint.delete(response_id, request_context(router, request))
