"""``/tokenize`` and ``/detokenize`` (vLLM's extensions), off the engine thread."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Depends

from rapidspec.prompting.conversation import parse_messages
from rapidspec.server.openapi import TOKENS
from rapidspec.server.schemas import DetokenizeRequest, TokenizeRequest
from rapidspec.server.state import ServerState, server_state

router = APIRouter()


@router.post("/tokenize", responses=TOKENS)
async def tokenize(body: TokenizeRequest, state: ServerState = Depends(server_state)) -> dict:
    state.check_model(body.model)
    messages = None if body.messages is None else parse_messages(body.messages)
    ids = await asyncio.to_thread(state.tokens.tokenize, body.prompt, messages, body.add_special_tokens)
    out = {"count": len(ids), "max_model_len": state.window, "tokens": ids}
    if body.return_token_strs:
        out["token_strs"] = await asyncio.to_thread(state.pieces.texts, ids)
    return out


@router.post("/detokenize", responses=TOKENS)
async def detokenize(body: DetokenizeRequest, state: ServerState = Depends(server_state)) -> dict:
    state.check_model(body.model)
    return {"prompt": await asyncio.to_thread(state.tokens.detokenize, body.tokens)}
