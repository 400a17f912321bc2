"""The engine: one generation from spec to output.

* :mod:`.spec`: :class:`EngineSpec`, what an engine is built from (the models and every drafter option,
  retrieval, cache reuse); ``Rapid(spec)`` is how every surface builds one.
* :mod:`.defaults`: the one step that fills in a request's eta default and gamma schedule.
* :mod:`.rapid`: :class:`Rapid`, the prompt API and the generation (1 prefill, then the rounds).
* :mod:`.rounds`: the decode loop (2 draft, 3 verify, 4 accept, 5 commit) and the state its rounds share.
"""

from __future__ import annotations

import importlib

_EXPORTS = {"Rapid": "rapidspec.engine.rapid", "EngineSpec": "rapidspec.engine.spec", "resolve": "rapidspec.engine.defaults"}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):  # torch loads with Rapid, not with the spec or the resolve step
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'rapidspec.engine' has no attribute {name!r}")
