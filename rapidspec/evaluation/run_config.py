"""What a results file's records were made under: everything that can change an answer or its speed.

``rapidspec eval`` resumes a results file only under the same configuration
(:class:`~rapidspec.evaluation.runner.ResultsFile`): a rerun with another
dtype, weight quantization, runtime, device, drafter backend or any decode
knob is refused with one line naming what differs, never merged. What varies
per record (mode, η, γ, sweep point) is in each record's key instead.
"""

from __future__ import annotations

from dataclasses import asdict

from rapidspec.config import DecodeConfig

#: Answer token limit per task type when none is given (needles: RULER's 128).
DEFAULT_MAX_NEW_TOKENS = {"mc": 64, "qa": 64, "needle": 128, "summary": 256}
#: Retrieval fields that change neither what is retrieved nor its scores.
RETRIEVAL_SPEED_ONLY = ("batch_size", "max_cached_documents")
#: Decode fields that are per record (the record key) or set per task type, not part of the file's identity.
PER_RECORD = ("mode", "eta", "gamma", "max_new_tokens")
#: Knobs added after results files were written: stored only when set, so those files still resume.
STORED_WHEN_SET = ("frequency_penalty", "presence_penalty", "repetition_penalty")


def describe_model(model) -> dict | str | None:
    """Name, dtype, weight quantization, runtime and device of a loaded model; a name given as a string as is."""
    if model is None or isinstance(model, str):
        return model
    return {
        "name": getattr(model, "name", type(model).__name__),
        "dtype": str(getattr(model, "dtype", "")).removeprefix("torch."),
        "quantization": getattr(model, "quantization", "none"),
        "runtime": getattr(model, "runtime", ""),
        "device": str(getattr(model, "device", "")),
    }


def decode_identity(base: DecodeConfig) -> dict:
    """Every decode knob of ``base`` but the per-record ones, JSON-ready."""
    defaults = DecodeConfig()
    knobs = {k: v for k, v in asdict(base).items()
             if k not in PER_RECORD and not (k in STORED_WHEN_SET and v == getattr(defaults, k))}
    knobs["stop"] = list(knobs["stop"])
    return knobs


def run_config(target, drafter, drafter_backend: str, base: DecodeConfig, *, data: str, max_new_tokens: int | None,
               retrieval, retrieve_from: str | None, logprobs: int = 0, drafter_relation: str = "self") -> dict:
    """The configuration stored in (and compared against) every record of a results file.

    ``drafter_backend``: the backend that drafts (``torch`` or ``llama.cpp``, resolved from ``auto``);
    ``drafter_relation``: ``self``, ``larger`` or ``smaller`` (the engine's, which sets the default eta);
    ``max_new_tokens=None`` stores the per-task defaults; ``logprobs``: the top-K of the views
    (:mod:`.logprob_views`), stored only when > 0.
    """
    return {
        "model": getattr(target, "name", type(target).__name__),
        "target": describe_model(target),
        "drafter": describe_model(drafter),
        "drafter_backend": drafter_backend,
        "drafter_relation": drafter_relation,
        "data": data,
        "temperature": base.temperature,
        "max_new_tokens": max_new_tokens if max_new_tokens is not None else dict(DEFAULT_MAX_NEW_TOKENS),
        "seed": base.seed,
        "retrieval": {k: v for k, v in asdict(retrieval).items() if k not in RETRIEVAL_SPEED_ONLY},
        "decode": decode_identity(base),
        **({"retrieve_from": retrieve_from} if retrieve_from is not None else {}),
        **({"logprobs": logprobs} if logprobs else {}),
    }


def drafter_name(config: dict) -> str | None:
    """The drafter a stored configuration names (a label, or the name in its description); None: self."""
    drafter = config.get("drafter")
    if isinstance(drafter, dict):
        quantization = drafter.get("quantization", "none")
        return drafter.get("name") if quantization == "none" else f"{drafter.get('name')} {quantization}"
    return drafter


def separate_drafter(config: dict) -> bool:
    """Whether a stored configuration's drafter is another model than the target (not its own weights)."""
    drafter = config.get("drafter")
    name = drafter.get("name") if isinstance(drafter, dict) else drafter
    return name not in (None, "self", (config.get("target") or {}).get("name"))
