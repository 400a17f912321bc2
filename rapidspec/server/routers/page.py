"""``/``: the page that shows RAPID at work (static files of the package, served as they are, no key needed).

The page is HTML, CSS and JavaScript written for this server (no framework,
no CDN, nothing to build); it asks the documented API for everything it
shows (``/v1/models``, ``/v1/chat/completions`` with ``trace``), sending the
API key the user enters. See docs/serving.md, "The page".
"""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter, HTTPException
from fastapi.responses import FileResponse

STATIC = Path(__file__).resolve().parent.parent / "static"
FILES = {"index.html": "text/html", "app.js": "text/javascript", "style.css": "text/css"}

router = APIRouter()


@router.get("/", include_in_schema=False)
async def page() -> FileResponse:
    return FileResponse(STATIC / "index.html", media_type="text/html")


@router.get("/static/{name}", include_in_schema=False)
async def static_file(name: str) -> FileResponse:
    if name not in FILES:  # only the page's own files, never a path
        raise HTTPException(status_code=404, detail=f"no static file {name!r}")
    return FileResponse(STATIC / name, media_type=FILES[name])
