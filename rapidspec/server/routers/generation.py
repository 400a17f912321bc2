"""``/v1/chat/completions`` and ``/v1/completions``: served by :class:`~rapidspec.server.serving.GenerationServing`."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request

from rapidspec.server.openapi import GENERATION
from rapidspec.server.schemas import ChatCompletionRequest, CompletionRequest
from rapidspec.server.serving import GenerationServing
from rapidspec.server.state import ServerState, server_state

router = APIRouter()


@router.post("/v1/chat/completions", responses=GENERATION)
async def chat_completions(body: ChatCompletionRequest, request: Request,
                           state: ServerState = Depends(server_state)):
    return await GenerationServing(state).generate(body, request, body.messages, chat=True)


@router.post("/v1/completions", responses=GENERATION)
async def completions(body: CompletionRequest, request: Request, state: ServerState = Depends(server_state)):
    messages = [{"role": "user", "content": body.prompt_text()}]
    return await GenerationServing(state).generate(body, request, messages, chat=False)
