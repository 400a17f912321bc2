// The page of `rapidspec serve`: a conversation over the server's own OpenAI API, each token marked by how it
// came (the documented "trace" extension of the stream), the chunks the drafter read highlighted in the
// document, and per-answer statistics with a per-round timeline. No framework, no network beyond the server.
"use strict";

const $ = (id) => document.getElementById(id);
const KEY_STORE = "rapidspec-api-key";
const state = { messages: [], files: [], busy: false };
window.rapidspecRuns = [];  // what each answer measured in the page (read by the browser test)

function apiKey() { return $("api-key").value.trim(); }

function headers() {
  const out = { "Content-Type": "application/json" };
  if (apiKey()) out.Authorization = "Bearer " + apiKey();
  return out;
}

function showError(message) {
  const box = $("error");
  box.textContent = message || "";
  box.hidden = !message;
}

async function errorText(response) {
  try {
    const body = await response.json();
    return (body.error && body.error.message) || response.statusText;
  } catch (_) {
    return response.statusText;
  }
}

async function loadModels() {
  let response;
  try {
    response = await fetch("v1/models", { headers: headers() });
  } catch (err) {
    showError("cannot reach the server: " + err.message);
    return;
  }
  if (!response.ok) {
    const hint = response.status === 401 ? " Enter the server's API key above." : "";
    showError(`the server refused the model list (HTTP ${response.status}): ${await errorText(response)}.${hint}`);
    $("server-state").textContent = "not connected";
    return;
  }
  const models = (await response.json()).data || [];
  $("model").replaceChildren(...models.map((m) => new Option(m.id, m.id)));
  $("server-state").textContent = "connected";
  showError("");
}

// ------------------------------------------------------------------ documents
function looksBinary(text) {
  const replaced = (text.match(/\uFFFD/g) || []).length;
  return text.includes("\u0000") || replaced > Math.max(4, text.length / 200);
}

async function addFiles(files) {
  const refused = [];
  for (const file of files) {
    const text = await file.text();
    if (looksBinary(text)) refused.push(file.name);
    else if (text.trim()) state.files.push({ name: file.name, text });
  }
  $("files").value = "";
  renderFiles();
  showError(refused.length ? `cannot read ${refused.join(", ")}: only text and Markdown files can be documents` : "");
}

function renderFiles() {
  $("file-list").replaceChildren(...state.files.map((file, index) => {
    const row = document.createElement("div");
    const remove = document.createElement("button");
    remove.type = "button";
    remove.textContent = "remove";
    remove.onclick = () => { state.files.splice(index, 1); renderFiles(); };
    row.append(`${file.name} (${file.text.length.toLocaleString()} characters) `, remove);
    return row;
  }));
}

function documents() {
  const pasted = $("document").value;
  return [...(pasted.trim() ? [pasted] : []), ...state.files.map((f) => f.text)];
}

// The chunks' spans are code-point offsets into the documents joined by blank lines (as the server joins them).
function showRetrieval(docs, retrieval) {
  const view = $("docview");
  const chunks = ((retrieval && retrieval.chunks) || []).slice().sort((a, b) => a.char_start - b.char_start);
  if (!docs.length) return;
  const points = Array.from(docs.join("\n\n"));
  const parts = [];
  let at = 0;
  for (const chunk of chunks) {
    if (chunk.char_start < at) continue;
    parts.push(document.createTextNode(points.slice(at, chunk.char_start).join("")));
    const mark = document.createElement("mark");
    mark.className = "chunk";
    mark.dataset.rank = chunk.rank;
    mark.dataset.label = `#${chunk.rank + 1} ${Number(chunk.score).toFixed(3)}`;
    mark.title = `retrieved chunk, rank ${chunk.rank + 1}, score ${Number(chunk.score).toFixed(4)}`;
    mark.textContent = points.slice(chunk.char_start, chunk.char_end).join("");
    parts.push(mark);
    at = chunk.char_end;
  }
  parts.push(document.createTextNode(points.slice(at).join("")));
  view.replaceChildren(...parts);
  const best = view.querySelector('mark[data-rank="0"]') || view.querySelector("mark");
  if (best) view.scrollTop = best.offsetTop - view.offsetTop - 20;
}

// ------------------------------------------------------------------ requests
function number(id) {
  const value = $(id).value.trim();
  return value === "" ? undefined : Number(value);
}

function requestBody(mode) {
  const docs = documents();
  const body = {
    model: $("model").value || undefined, messages: state.messages, mode,
    max_tokens: number("max-tokens"), temperature: number("temperature"),
    eta: mode === "rapid" ? number("eta") : undefined, gamma: number("gamma"),
    retrieval: $("retrieval").value || undefined, budget_tokens: number("budget"),
    repetition_penalty: number("repetition-penalty"), frequency_penalty: number("frequency-penalty"),
    presence_penalty: number("presence-penalty"),
  };
  if (docs.length) body.documents = docs;
  if ($("logprobs").checked) body.logprobs = true;
  return JSON.parse(JSON.stringify(body));  // without the undefined fields
}

// One streamed answer into `view`; returns what it measured.
async function streamAnswer(body, view) {
  const started = performance.now();
  const response = await fetch("v1/chat/completions", {
    method: "POST", headers: headers(),
    body: JSON.stringify({ ...body, stream: true, trace: true, stream_options: { include_usage: true } }),
  });
  if (!response.ok) throw new Error(`${await errorText(response)} (HTTP ${response.status})`);
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  const run = { mode: body.mode, text: "", rounds: [], ttftMs: null, paints: [], final: null, kinds: {} };
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += decoder.decode(value, { stream: true });
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      if (event.startsWith(": prefill")) showPrefill(event.slice(2), run, view);  // the server reads the prompt
      else if (event.startsWith("data: ") && event !== "data: [DONE]") handleChunk(JSON.parse(event.slice(6)), run, view, started);
    }
  }
  run.totalMs = performance.now() - started;
  return run;
}

// "prefill 4096/32150 tokens, 180 tokens/s, 156 s left" where the answer will be, until its first token
function showPrefill(text, run, view) {
  if (!run.progress) {
    run.progress = document.createElement("span");
    run.progress.className = "prefill";
    view.text.append(run.progress);
  }
  run.progress.textContent = `reading the prompt: ${text.replace(/^prefill /, "")}`;
  run.prefillEvents = (run.prefillEvents || 0) + 1;
}

function handleChunk(chunk, run, view, started) {
  if (chunk.error) throw new Error(chunk.error.message);
  const choice = chunk.choices && chunk.choices[0];
  const ext = chunk.rapidspec;
  if (choice && choice.delta && choice.delta.content) run.text += choice.delta.content;
  if (ext && ext.tokens) {
    if (run.progress) { run.progress.remove(); run.progress = null; }
    const logprobs = (choice && choice.logprobs && choice.logprobs.content) || [];
    ext.tokens.forEach((token, i) => {
      const span = document.createElement("span");
      span.className = `tok ${token.kind}`;
      span.textContent = token.text;
      const logprob = logprobs[i] ? `, log-probability ${logprobs[i].logprob.toFixed(3)}` : "";
      span.title = `round ${ext.round.index}: ${token.kind}${logprob}`;
      view.text.append(span);
      run.kinds[token.kind] = (run.kinds[token.kind] || 0) + 1;
    });
    run.rounds.push(ext.round);
    const now = performance.now();
    run.paints.push(now);
    if (run.ttftMs === null) requestAnimationFrame(() => { run.ttftMs = performance.now() - started; });
  }
  if (ext && ext.stats) run.final = ext;
}

// ------------------------------------------------------------------ rendering
function messageView(role, text) {
  const box = document.createElement("div");
  box.className = `message ${role}`;
  const label = document.createElement("div");
  label.className = "role";
  label.textContent = role;
  box.append(label);
  if (text !== undefined) {
    const body = document.createElement("div");
    body.className = "answer-text";
    body.textContent = text;
    box.append(body);
  }
  $("conversation").append(box);
  return box;
}

function answerView(parent, title) {
  const box = document.createElement("div");
  const head = document.createElement("div");
  head.className = "role";
  head.textContent = title;
  const text = document.createElement("div");
  text.className = "answer-text";
  const stats = document.createElement("div");
  stats.className = "stats";
  box.append(head, text, stats);
  parent.append(box);
  return { text, stats };
}

function showStats(view, run) {
  const s = (run.final && run.final.stats) || {};
  const fmt = (v, digits = 2) => (v === null || v === undefined ? "n/a" : Number(v).toFixed(digits));
  const gaps = run.paints.slice(1).map((t, i) => t - run.paints[i]);
  run.maxGapMs = gaps.length ? Math.max(...gaps) : 0;
  view.stats.innerHTML = "";
  const line = document.createElement("div");
  line.innerHTML = `acceptance <b>${fmt(s.acceptance_rate)}</b> · mean accepted length <b>${fmt(s.mean_accepted_length)}</b>` +
    ` · decode <b>${fmt(s.decode_tokens_per_second, 1)}</b> tok/s · first token <b>${fmt(run.ttftMs, 0)}</b> ms` +
    ` · prefill reused <b>${s.target_prefill_reused_tokens ?? 0}</b> of ${s.prompt_tokens_target ?? "?"} tokens` +
    ` · ${s.new_tokens ?? 0} tokens in ${fmt(run.totalMs / 1000, 1)} s` +
    (s.mode === "lc" || s.mode === "rag" || !s.mode ? "" : s.drafter_joined_at === null || s.drafter_joined_at === undefined
      ? " · drafter <b>not joined</b>" : ` · drafter joined after <b>${s.drafter_joined_at}</b> tokens`);
  view.stats.append(line);
  if (!run.rounds.length) return;
  const most = Math.max(...run.rounds.map((r) => r.draft_ms + r.verify_ms), 1);
  const timeline = document.createElement("div");
  timeline.className = "timeline";
  for (const r of run.rounds) {
    const bar = document.createElement("div");
    bar.className = "round";
    bar.title = `round ${r.index}: ${r.drafted} drafted, ${r.accepted} accepted, draft ${r.draft_ms.toFixed(1)} ms, verify ${r.verify_ms.toFixed(1)} ms`;
    const draft = document.createElement("div");
    draft.className = "draft";
    draft.style.height = `${(40 * r.draft_ms) / most}px`;
    const verify = document.createElement("div");
    verify.className = "verify";
    verify.style.height = `${(40 * r.verify_ms) / most}px`;
    bar.append(verify, draft);
    timeline.append(bar);
  }
  const legend = document.createElement("div");
  legend.className = "timeline-legend";
  legend.textContent = "per round: verify (blue) under draft (amber) milliseconds; hover a bar for its tokens";
  view.stats.append(timeline, legend);
}

// Before the first question the page says what it shows and how to start; the colour legend waits for an answer.
function showEmptyState() {
  const conversation = $("conversation");
  $("intro").hidden = conversation.children.length > 0;
  $("legend").hidden = !conversation.querySelector(".message.assistant");
}

function markTurnsRead(turns) {
  const views = $("conversation").querySelectorAll(".message");
  views.forEach((v) => v.classList.remove("read-by-drafter"));
  for (const index of turns || []) if (views[index]) {
    views[index].classList.add("read-by-drafter");
    views[index].title = "the drafter read this turn";
  }
}

// ------------------------------------------------------------------ a turn
async function send(event) {
  event.preventDefault();
  const question = $("question").value.trim();
  if (!question || state.busy) return;
  state.busy = true;
  $("send").disabled = true;
  showError("");
  state.messages.push({ role: "user", content: question });
  messageView("user", question);
  $("question").value = "";
  const box = messageView("assistant");
  showEmptyState();
  const answers = document.createElement("div");
  const comparing = $("compare").checked && $("mode").value !== "lc";
  answers.className = comparing ? "answers two" : "answers";
  box.append(answers);
  const docs = documents();
  try {
    const mode = $("mode").value;
    const main = answerView(answers, mode);
    const other = comparing ? answerView(answers, "lc") : null;
    const body = requestBody(mode);
    const run = await streamAnswer(body, main);
    showStats(main, run);
    const retrieval = run.final && run.final.retrieval;
    if (docs.length) showRetrieval(docs, retrieval);
    else markTurnsRead(run.final && run.final.retrieved_turns);
    window.rapidspecRuns.push(summary(run));
    if (other) {  // the same question by lc, after: the target's prefill comes from the prefix cache
      const lc = await streamAnswer(requestBody("lc"), other);
      showStats(other, lc);
      window.rapidspecRuns.push(summary(lc));
    }
    state.messages.push({ role: "assistant", content: run.text });
  } catch (err) {
    state.messages.pop();
    box.remove();
    showEmptyState();
    showError("the answer failed: " + err.message);
  } finally {
    state.busy = false;
    $("send").disabled = false;
  }
}

function summary(run) {
  const stats = (run.final && run.final.stats) || {};
  return { mode: run.mode, ttftMs: run.ttftMs, totalMs: run.totalMs, maxGapMs: run.maxGapMs, rounds: run.rounds.length,
           tokens: stats.new_tokens, acceptance: stats.acceptance_rate, kinds: run.kinds,
           prefillEvents: run.prefillEvents || 0, progressLeft: Boolean(run.progress) };
}

function conversationJson() {
  return JSON.stringify(requestBody($("mode").value), null, 2);
}

function init() {
  $("api-key").value = localStorage.getItem(KEY_STORE) || "";
  $("api-key").addEventListener("change", () => { localStorage.setItem(KEY_STORE, apiKey()); loadModels(); });
  $("files").addEventListener("change", (e) => addFiles([...e.target.files]));
  $("ask").addEventListener("submit", send);
  $("question").addEventListener("keydown", (e) => { if (e.key === "Enter" && (e.ctrlKey || e.metaKey)) send(e); });
  $("copy").addEventListener("click", () => navigator.clipboard.writeText(conversationJson())
    .then(() => showError(""), () => showError("the browser did not allow copying; use Download")));
  $("download").addEventListener("click", () => {
    const link = document.createElement("a");
    link.href = URL.createObjectURL(new Blob([conversationJson()], { type: "application/json" }));
    link.download = "conversation.json";
    link.click();
    URL.revokeObjectURL(link.href);
  });
  $("clear").addEventListener("click", () => {
    state.messages = [];
    $("conversation").replaceChildren();
    showEmptyState();
  });
  showEmptyState();
  loadModels();
}

init();
