"""The Responses API when several base models are served: each model's Router has its own
`ResponsesEndpoint` and store (in its registry namespace); a new response goes to the Router
its `model` names, and a stored one is found in whichever model's store holds it."""
from __future__ import annotations

from fastapi import Depends, FastAPI, Request

from .errors import APIError
from .response_store import ResponseStore
from .responses_api import ResponsesRequest
from .responses_endpoint import ResponsesEndpoint, request_context
from .tenancy import sent_priority


def add_model_responses_routes(app: FastAPI, routers, authorized, while_connected, wants_timing) -> None:
    """POST /v1/responses, GET and DELETE /v1/responses/{id} over `routers` (a ModelRouters)."""
    endpoints = {name: ResponsesEndpoint(r, ResponseStore.of_router(r)) for name, r in routers.routers.items()}

    @app.post("/v1/responses", dependencies=[Depends(authorized)])
    async def create_response(req: ResponsesRequest, request: Request):
        router = routers.pick(req.model)
        ctx = request_context(router, request, sent_priority(req), req.user, req.model or "")
        return await while_connected(request, endpoints[router.model_name].create(req, ctx, wants_timing(request)))

    async def first_found(method: str, response_id: str, request: Request):
        error = None
        for endpoint in endpoints.values():
            try:
                return await getattr(endpoint, method)(response_id, request_context(routers.first, request))
            except APIError as e:
                if e.status != 404:
                    raise
                error = e
        raise error

    @app.get("/v1/responses/{response_id}", dependencies=[Depends(authorized)])
    async def get_response(response_id: str, request: Request):
        return await first_found("retrieve", response_id, request)

    @app.delete("/v1/responses/{response_id}", dependencies=[Depends(authorized)])
    async def delete_response(response_id: str, request: Request):
        return await first_found("delete", response_id, request)
