"""The request mix of benchmarks/soak.py: what each kind sends and what a well-formed answer to it is.

Each kind is a function ``(Client, random.Random) -> list[Outcome]`` that sends
one request (two for ``chat``: a first turn, then a second one carrying its
answer) with bounded timeouts and judges the answer:

* a 200 is well-formed when its body parses, it has a ``finish_reason``, and
  what the kind asked for holds (a JSON answer finished with ``stop`` is valid
  under its schema, ``ignore_eos`` ran to ``max_tokens``, a stop string is not
  in the text, one log-probability entry per answer token, a stream ends with
  ``[DONE]``);
* a bad body is well-formed when its answer is a 4xx with OpenAI's error body;
* a stream closed on purpose after a few chunks is ``cancelled``, not lost;
* no answer at all (a connection error, a timeout) is ``lost``.
"""

from __future__ import annotations

import json
import random
import time
from dataclasses import dataclass, field

import httpx
import jsonschema
import openai

MODES = ("rapid", "rapid", "rapid", "lc", "sd", "ragsd", "rag", "magicdec", "lookup")
QUESTIONS = ("Say hello in five words.", "Name three colours.", "What is 2 + 2?", "Write a haiku about rain.",
             "List two fruits.", "Describe a cat in one sentence.", "Why is the sky blue?", "Count to five.")
FOLLOW_UPS = ("Say it again, shorter.", "And in French?", "Why?", "Give one more example.")
SCHEMAS = (
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {"answer": {"type": "string", "enum": ["yes", "no", "maybe"]},
                                      "sure": {"type": "boolean"}},
     "required": ["answer", "sure"], "additionalProperties": False},
    {"type": "object", "properties": {"colours": {"type": "array", "items": {"type": "string", "maxLength": 8},
                                                  "minItems": 1, "maxItems": 3}},
     "required": ["colours"], "additionalProperties": False},
)
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]
WORDS = ("river", "archive", "lantern", "harbour", "engine", "orchard", "signal", "ledger", "bridge", "meadow")
PLACES = ("Lisbon", "Oslo", "Quito", "Hanoi", "Dakar", "Perth", "Tallinn", "Cusco")
BAD_BODIES: tuple[bytes, ...] = (
    b'{"messages": [', b"not json", b"", b"\xff\xfe\x00", b"[1, 2]",
    b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8,}',
    b'{"messages": [{"role": "user", "content": "\\ud800"}], "max_tokens": 8}',
    *(json.dumps(body).encode() for body in (
        {"messages": "hi"}, {"messages": [{"role": "user", "content": "hi"}], "max_tokens": "eight"},
        {"messages": [{"role": "user", "content": "hi"}], "temperature": "hot"},
        {"messages": [{"role": "user", "content": "hi"}], "stop": 5},
        {"messages": [{"role": "user", "content": "hi"}], "mode": "fast"},
        {"messages": [{"role": "user", "content": "hi"}], "n": 2},
        {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0},
        {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 10**9},
        {"messages": []}, {"messages": [{"role": "assistant", "content": "hi"}]},
        {"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 50},
        {"messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "xml"}},
        {"messages": [{"role": "user", "content": "hi"}], "gamma": 1000},
        {"messages": [{"role": "user", "content": "hi"}], "model": "no-such-model"},
        {"messages": [{"role": "user", "content": "hi"}], "documents": "not a list"})),
)


@dataclass
class Outcome:
    """One HTTP request: ``status`` None means no answer (lost unless ``cancelled``)."""

    kind: str
    shape: str
    status: int | None = None
    seconds: float = 0.0
    ok: bool = False
    cancelled: bool = False
    note: str = ""
    error_type: str | None = None  # an error's ``type``, in the body or in a stream's chunk
    started: float = field(default_factory=time.monotonic)


@dataclass
class Client:
    """One worker's connections; ``long_docs`` are shared long documents (prefix-cache hits)."""

    url: str
    long_docs: list[str]
    timeout: httpx.Timeout
    http: httpx.Client = field(init=False)
    sdk: openai.OpenAI = field(init=False)

    def __post_init__(self) -> None:
        # a kept-alive connection is dropped before the server's 5 s would close it under a request being sent
        limits = httpx.Limits(keepalive_expiry=4.0)
        self.http = httpx.Client(base_url=self.url, timeout=self.timeout, limits=limits)
        self.sdk = openai.OpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0, timeout=self.timeout,
                                 http_client=httpx.Client(timeout=self.timeout, limits=limits))

    def close(self) -> None:
        self.http.close()
        self.sdk.close()


def sentences(rng: random.Random, tokens: int) -> str:
    """About ``tokens`` tokens of generated sentences (about 13 tokens each), different for each ``rng``."""
    return " ".join(f"The {rng.choice(WORDS)} of {rng.choice(PLACES)} held {rng.randint(2, 9999)} "
                    f"{rng.choice(WORDS)}s in {rng.randint(1700, 2030)}." for _ in range(tokens // 13))


def post(client: Client, out: Outcome, path: str, body: dict | None = None, content: bytes | None = None) -> dict | None:
    """Sends one request; fills status, seconds and error_type; the JSON body of a 200 (None otherwise)."""
    try:
        if content is not None:
            response = client.http.post(path, content=content, headers={"content-type": "application/json"})
        else:
            response = client.http.post(path, json=body)
    except httpx.HTTPError as err:
        out.seconds, out.note = time.monotonic() - out.started, f"no answer: {type(err).__name__}"
        return None
    out.seconds, out.status = time.monotonic() - out.started, response.status_code
    try:
        parsed = response.json()
    except ValueError:
        out.note = "body is not JSON"
        return None
    if response.status_code != 200:
        error = parsed.get("error") if isinstance(parsed, dict) else None
        out.error_type = error.get("type") if isinstance(error, dict) else None
        out.ok = error is not None and "Traceback" not in response.text and 400 <= response.status_code < 500
        out.note = f"{(error or {}).get('param')}: {(error or {}).get('message', '')[:80]}"
        return None
    return parsed


def judge(out: Outcome, finish: str | None, text: str, check=None) -> None:
    """Marks a 200 well-formed or says why not."""
    if finish not in ("stop", "length", "tool_calls"):
        out.note = f"finish_reason {finish!r}"
        return
    try:
        problem = check(finish, text) if check else None
    except (KeyError, TypeError, IndexError, AttributeError) as err:
        problem = f"the answer lacks what its check reads: {err!r}"
    out.ok, out.note = problem is None, problem or finish


def schema_check(schema: dict):
    def check(finish: str, text: str) -> str | None:
        if finish != "stop":
            return None  # cut at max_tokens: a prefix of valid JSON, not checked
        try:
            jsonschema.validate(json.loads(text), schema)
        except (ValueError, jsonschema.ValidationError) as err:
            return f"JSON not valid under its schema: {str(err)[:80]}"
        return None
    return check


def chat(client: Client, kind: str, shape: str, body: dict, check=None) -> Outcome:
    out = Outcome(kind, shape)
    if (reply := post(client, out, "/v1/chat/completions", body)) is not None:
        choice = (reply.get("choices") or [{}])[0]
        message = choice.get("message") or {}
        judge(out, choice.get("finish_reason"), message.get("content") or "",
              check and (lambda finish, text: check(finish, text, reply)))
    return out


def stream(client: Client, kind: str, shape: str, body: dict, cancel_after: int = 0, check=None) -> Outcome:
    """A stream read to ``[DONE]``, or closed after ``cancel_after`` content chunks (0: never)."""
    out, parts, finish, done, chunks = Outcome(kind, shape), [], None, False, 0
    try:
        with client.http.stream("POST", "/v1/chat/completions", json=body | {"stream": True}) as response:
            out.status = response.status_code
            if response.status_code != 200:
                response.read()
                out.seconds = time.monotonic() - out.started
                post_error(out, response)
                return out
            for line in response.iter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    done = True
                    break
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    out.error_type = chunk["error"].get("type")
                    out.note = f"error in the stream: {chunk['error'].get('message', '')[:80]}"
                for choice in chunk.get("choices") or []:
                    if (piece := (choice.get("delta") or {}).get("content")):
                        parts.append(piece)
                        chunks += 1
                    finish = choice.get("finish_reason") or finish
                if cancel_after and chunks >= cancel_after and finish is None:
                    out.cancelled, out.ok, out.note = True, True, f"closed after {chunks} chunks"
                    break
    except (httpx.HTTPError, ValueError) as err:
        out.note = f"no answer: {type(err).__name__}" if out.status is None else f"stream broken: {type(err).__name__}"
    out.seconds = time.monotonic() - out.started
    if not out.cancelled and out.status == 200 and out.error_type is None:
        if done:
            judge(out, finish, "".join(parts), check and (lambda f, text: check(f, text, None)))
        else:
            out.note = out.note or "stream ended without [DONE]"
    return out


def post_error(out: Outcome, response: httpx.Response) -> None:
    try:
        error = response.json().get("error") or {}
    except (ValueError, AttributeError):
        error = {}
    out.error_type = error.get("type")
    out.ok = bool(error) and 400 <= response.status_code < 500
    out.note = f"{error.get('param')}: {error.get('message', '')[:80]}"


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def short(client: Client, rng: random.Random) -> list[Outcome]:
    mode, tokens = rng.choice(MODES), rng.randint(8, 16)
    return [chat(client, "short", f"mode={mode}", {"messages": user(rng.choice(QUESTIONS)), "max_tokens": tokens,
                                                    "mode": mode})]


def document(client: Client, rng: random.Random, kind: str) -> list[Outcome]:
    """``short_doc`` (~150 tokens, new each time), ``long_doc`` (one of the shared few thousand tokens),
    ``long_doc_new`` (~3,000 tokens never seen before: a new prefix-cache entry)."""
    text = {"short_doc": lambda: sentences(rng, 150), "long_doc": lambda: rng.choice(client.long_docs),
            "long_doc_new": lambda: sentences(rng, 3000)}[kind]()
    mode, retrieval = rng.choice(MODES), rng.choice(("auto", "auto", "bm25", "hybrid"))
    body = {"messages": user(f"What does the document say about {rng.choice(PLACES + WORDS)}?"),
            "documents": [text], "max_tokens": rng.randint(8, 16), "mode": mode, "retrieval": retrieval}
    return [chat(client, kind, f"mode={mode} retrieval={retrieval}", body)]


def two_turns(client: Client, rng: random.Random) -> list[Outcome]:
    mode = rng.choice(MODES)
    first = {"messages": user(rng.choice(QUESTIONS)), "max_tokens": rng.randint(8, 16), "mode": mode}
    if rng.random() < 0.5:
        first["documents"] = [rng.choice(client.long_docs)]
    shape = f"mode={mode}{' documents' if 'documents' in first else ''}"
    answers: list[str] = []  # the first answer, kept by its check (which finds no problem: None)
    turn1 = chat(client, "chat", shape, first, check=lambda finish, text, reply: answers.append(text))
    if turn1.status != 200 or not answers:
        return [turn1]
    second = first | {"messages": first["messages"] + [{"role": "assistant", "content": answers[0]},
                                                       *user(rng.choice(FOLLOW_UPS))]}
    return [turn1, chat(client, "chat_turn2", shape, second)]


def streamed(client: Client, rng: random.Random, cancel: bool) -> list[Outcome]:
    mode = rng.choice(MODES)
    body = {"messages": user(rng.choice(QUESTIONS)), "mode": mode, "max_tokens": 32 if cancel else rng.randint(8, 16)}
    if cancel:
        body["ignore_eos"] = True  # long enough to be closed part way
    elif rng.random() < 0.5:
        body["stream_options"] = {"include_usage": True}
    kind = "stream_cancel" if cancel else "stream"
    return [stream(client, kind, f"mode={mode}", body, cancel_after=rng.randint(1, 4) if cancel else 0)]


def logprobs(client: Client, rng: random.Random) -> list[Outcome]:
    mode, top = rng.choice(MODES), rng.randint(0, 5)

    def check(finish, text, reply):
        content = reply["choices"][0].get("logprobs", {}).get("content") or []
        if len(content) != reply["usage"]["completion_tokens"]:
            return f"{len(content)} log-probabilities for {reply['usage']['completion_tokens']} tokens"
        if any(len(entry.get("top_logprobs", [])) != top for entry in content):
            return f"not {top} top_logprobs per token"
        return None
    body = {"messages": user(rng.choice(QUESTIONS)), "max_tokens": rng.randint(8, 16), "mode": mode,
            "logprobs": True, "top_logprobs": top}
    return [chat(client, "logprobs", f"mode={mode} top_logprobs={top}", body, check)]


def schema(client: Client, rng: random.Random, ignore_eos: bool) -> list[Outcome]:
    mode, index = rng.choice(MODES), rng.randrange(len(SCHEMAS) + 1)
    if index == len(SCHEMAS):
        fmt, check_schema = {"type": "json_object"}, {"type": "object"}
    else:
        fmt = {"type": "json_schema", "json_schema": {"name": f"s{index}", "schema": SCHEMAS[index], "strict": True}}
        check_schema = SCHEMAS[index]
    body = {"messages": user("Answer in JSON: " + rng.choice(QUESTIONS)), "max_tokens": 48, "mode": mode,
            "response_format": fmt, "ignore_eos": ignore_eos}
    kind = "schema_ignore_eos" if ignore_eos else "schema"
    shape = f"mode={mode} {fmt['type']}{index if index < len(SCHEMAS) else ''}{' ignore_eos' if ignore_eos else ''}"
    valid = schema_check(check_schema)
    if rng.random() < 0.3:
        return [stream(client, kind, shape + " stream", body, check=lambda finish, text, _: valid(finish, text))]
    return [chat(client, kind, shape, body, lambda finish, text, _: valid(finish, text))]


def tools(client: Client, rng: random.Random) -> list[Outcome]:
    """Function calling; a model whose chat template has no tools answers 400 on ``tools`` (well-formed)."""
    choice = rng.choice(("auto", "none", "required"))
    body = {"messages": user(f"What is the weather in {rng.choice(PLACES)}?"), "tools": TOOLS, "tool_choice": choice,
            "max_tokens": 32}
    out = chat(client, "tools", f"tool_choice={choice}", body)
    if out.status == 400 and out.note.startswith("tools:"):
        out.note = "400 on tools: the model's template has none"
    return [out]


def ignore_eos(client: Client, rng: random.Random) -> list[Outcome]:
    mode, tokens = rng.choice(MODES), rng.randint(8, 24)

    def check(finish, text, reply):
        got = reply["usage"]["completion_tokens"]
        return None if finish == "length" and got == tokens else f"{finish} after {got} of {tokens} tokens"
    body = {"messages": user(rng.choice(QUESTIONS)), "max_tokens": tokens, "mode": mode, "ignore_eos": True}
    return [chat(client, "ignore_eos", f"mode={mode}", body, check)]


def stop(client: Client, rng: random.Random) -> list[Outcome]:
    mode, stops = rng.choice(MODES), rng.choice(([".", "!"], ["\n"], ["o"], ["the", "and"]))

    def check(finish, text, reply):
        return f"stop string in the text: {text!r}" if any(s in text for s in stops) else None
    body = {"messages": user(rng.choice(QUESTIONS)), "max_tokens": 16, "mode": mode, "stop": stops}
    return [chat(client, "stop", f"mode={mode} stop={stops}", body, check)]


def completion(client: Client, rng: random.Random) -> list[Outcome]:
    mode, top = rng.choice(MODES), rng.randint(0, 3)
    out = Outcome("completion", f"mode={mode} logprobs={top}")
    body = {"prompt": f"The {rng.choice(WORDS)} of {rng.choice(PLACES)} is", "max_tokens": rng.randint(8, 16),
            "mode": mode, "logprobs": top}
    if (reply := post(client, out, "/v1/completions", body)) is not None:
        choice = (reply.get("choices") or [{}])[0]
        judge(out, choice.get("finish_reason"), choice.get("text") or "")
    return [out]


def sdk(client: Client, rng: random.Random) -> list[Outcome]:
    """The official client, streaming or not; the server's own fields through ``extra_body``."""
    mode, streaming = rng.choice(MODES), rng.random() < 0.5
    out = Outcome("sdk", f"mode={mode}{' stream' if streaming else ''}")
    try:
        answer = client.sdk.chat.completions.create(model="builtin", messages=user(rng.choice(QUESTIONS)),
                                                    max_tokens=rng.randint(8, 16), stream=streaming,
                                                    extra_body={"mode": mode})
        if streaming:
            finish, text = None, ""
            for chunk in answer:
                for choice in chunk.choices:
                    text += choice.delta.content or ""
                    finish = choice.finish_reason or finish
        else:
            finish, text = answer.choices[0].finish_reason, answer.choices[0].message.content or ""
        out.status = 200
        judge(out, finish, text)
    except openai.APIStatusError as err:
        out.status, out.note = err.status_code, str(err)[:80]
        out.error_type = ((err.body or {}).get("error") or {}).get("type") if isinstance(err.body, dict) else None
        out.ok = 400 <= err.status_code < 500
    except openai.APIConnectionError as err:  # a timeout too
        out.note = f"no answer: {type(err).__name__}"
    except openai.APIError as err:  # an answer, not a well-formed one (an error inside the stream)
        out.status, out.error_type, out.note = 200, getattr(err, "type", None), f"error in the answer: {str(err)[:80]}"
    out.seconds = time.monotonic() - out.started
    return [out]


def bad(client: Client, rng: random.Random) -> list[Outcome]:
    index = rng.randrange(len(BAD_BODIES))
    out = Outcome("bad", f"bad body {index}: {BAD_BODIES[index][:60]!r}")
    if post(client, out, "/v1/chat/completions", content=BAD_BODIES[index]) is not None:
        out.ok, out.note = False, "a bad body was answered 200"
    return [out]


#: kind -> (weight, function, HTTP requests it sends at most)
MIX = {
    "short": (16, short, 1),
    "short_doc": (7, lambda c, r: document(c, r, "short_doc"), 1),
    "long_doc": (6, lambda c, r: document(c, r, "long_doc"), 1),
    "long_doc_new": (0.3, lambda c, r: document(c, r, "long_doc_new"), 1),
    "chat": (5, two_turns, 2),
    "stream": (8, lambda c, r: streamed(c, r, cancel=False), 1),
    "stream_cancel": (6, lambda c, r: streamed(c, r, cancel=True), 1),
    "logprobs": (6, logprobs, 1),
    "schema": (7, lambda c, r: schema(c, r, ignore_eos=False), 1),
    "schema_ignore_eos": (2, lambda c, r: schema(c, r, ignore_eos=True), 1),
    "tools": (4, tools, 1),
    "ignore_eos": (5, ignore_eos, 1),
    "stop": (5, stop, 1),
    "completion": (4, completion, 1),
    "sdk": (4, sdk, 1),
    "bad": (12, bad, 1),
}
