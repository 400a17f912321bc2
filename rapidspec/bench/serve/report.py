"""The tables of ``rapidspec bench serve``: outcomes and throughputs, then latencies in milliseconds."""

from __future__ import annotations

from rich.table import Table

from rapidspec.bench.serve.stats import percentile

LATENCIES = (("ttft", "TTFT (time to first token)"), ("tpot", "TPOT (time per output token, excl. 1st)"),
             ("itl", "ITL (inter-token latency, per chunk)"), ("e2el", "E2EL (end-to-end latency)"))
STATS = ("mean", "median", "p90", "p95", "p99")


def _fmt(value, spec: str = ".2f", unit: str = "") -> str:
    return "-" if value is None else f"{format(value, spec)}{unit}"


def results_tables(summary: dict) -> list[Table]:
    return [outcome_table(summary), latency_table(summary)]


def outcome_table(s: dict) -> Table:
    concurrency = s["max_concurrency"] or "no limit"
    table = Table(title=(f"rapidspec bench serve: {s['base_url']}, {s['num_prompts']} prompts ({s['dataset']}), "
                         f"rate {s['request_rate']}/s, concurrency {concurrency}, max_tokens {s['max_tokens']}"
                         f"{' (EOS ignored)' if s['ignore_eos'] else ''}{'' if s['stream'] else ', not streamed'}"))
    table.add_column("")
    table.add_column("value", justify="right")
    rows = [
        ("completed", str(s["completed"])),
        ("rejected (429, queue full)", str(s["rejected"])),
        ("errors", str(s["errors"])),
        ("lost (no answer: connection error, 5xx, cut stream, timeout)", str(s["lost"])),
        ("benchmark duration (s)", _fmt(s["duration"])),
        ("total input tokens (of them cached)", f"{s['total_input_tokens']} ({s['cached_input_tokens']})"),
        ("total output tokens", str(s["total_output_tokens"])),
        ("request throughput (req/s)", _fmt(s["request_throughput"], ".3f")),
        ("output token throughput (tok/s)", _fmt(s["output_throughput"])),
        ("total token throughput (tok/s)", _fmt(s["total_token_throughput"])),
        ("output tokens per stream chunk", _fmt(s["mean_output_tokens_per_chunk"])),
    ]
    if s["requests_without_usage"]:
        rows.append(("completed requests without usage (tokens not counted)", str(s["requests_without_usage"])))
    metrics = s.get("server_metrics")
    if metrics:
        rows += [
            ("server: requests that reused a cached prefix", f"{metrics['prefix_cache_hit_requests']:g}"),
            ("server: prefix-cache hit rate (prompt tokens)", _fmt(metrics["prefix_cache_hit_rate"], ".1%")),
            ("server: draft acceptance rate", _fmt(metrics["acceptance_rate"], ".1%")),
        ]
        if metrics.get("lookup_draft_tokens"):  # rounds drafted by prompt lookup before the drafter joined
            rows.append(("server: prompt-lookup drafts accepted", f"{metrics['lookup_accepted_tokens']:g} of "
                                                                  f"{metrics['lookup_draft_tokens']:g}"))
    reuse = s.get("prefix_reuse_by_session")
    if reuse:
        rates = [r for r in reuse.values() if r is not None]
        rows.append((f"prompt tokens cached, per session ({len(reuse)}): min / median / max",
                     " / ".join(f"{v:.1%}" for v in (min(rates), percentile(rates, 50), max(rates))) if rates else "-"))
    health = s.get("health_after")
    if isinstance(health, dict) and "running" in health:
        replicas = f", {len(health['replicas'])} replicas" if "replicas" in health else ""
        rows.append(("server /health after", f"{health.get('status')}, running {health['running']}, "
                                              f"waiting {health.get('waiting')}{replicas}"))
    server = s.get("server") or {}
    if server.get("started_here"):
        rows.append(("server exit code after SIGTERM", str(server.get("exit_code"))))
    if s.get("first_error"):
        rows.append(("first error", s["first_error"]))
    for name, value in rows:
        table.add_row(name, value)
    return table


def latency_table(s: dict) -> Table:
    table = Table(title="latency of completed requests (ms)")
    table.add_column("")
    for stat in STATS:
        table.add_column(stat, justify="right")
    for key, label in LATENCIES:
        table.add_row(label, *(_fmt(s[f"{stat}_{key}_ms"]) for stat in STATS))
    return table


def _acceptance(s: dict) -> tuple[float | None, float | None]:
    """(draft acceptance rate, mean accepted length per round): from the server's /metrics counters where they
    have them (vLLM's), else from the answers' per-request speculative metrics (rapidspec serve's)."""
    metrics = s.get("server_metrics") or {}
    rate = metrics.get("acceptance_rate")
    length = metrics.get("mean_acceptance_length")
    return (rate if rate is not None else s.get("spec_draft_acceptance_rate"),
            length if length is not None else s.get("spec_mean_acceptance_length"))


def comparison_table(servers: dict[str, dict]) -> Table:
    """One column per server (name -> summary): outcomes, throughputs, acceptance and latency medians and p99; a
    server that did not run (``failed``) has dashes."""
    first = next(s for s in servers.values() if not s.get("failed"))
    concurrency = first["max_concurrency"] or "no limit"
    table = Table(title=(f"bench serve, same load on each server: {first['num_prompts']} prompts ({first['dataset']}), "
                         f"rate {first['request_rate']}/s, concurrency {concurrency}, max_tokens {first['max_tokens']}"))
    table.add_column("")
    for name in servers:
        table.add_column(name, justify="right")
    rows = [("completed", lambda s: str(s["completed"])), ("lost", lambda s: str(s["lost"])),
            ("errors (incl. rejected)", lambda s: str(s["errors"] + s["rejected"])),
            ("duration (s)", lambda s: _fmt(s["duration"])),
            ("output tokens", lambda s: str(s["total_output_tokens"])),
            ("input tokens (of them cached)", lambda s: f"{s['total_input_tokens']} ({s['cached_input_tokens']})"),
            ("output token throughput (tok/s)", lambda s: _fmt(s["output_throughput"])),
            ("request throughput (req/s)", lambda s: _fmt(s["request_throughput"], ".3f")),
            ("draft acceptance rate", lambda s: _fmt(_acceptance(s)[0], ".1%")),
            ("mean accepted length per round", lambda s: _fmt(_acceptance(s)[1]))]
    for key, label in LATENCIES:
        for stat in ("median", "p99"):
            rows.append((f"{label.split(' (')[0]} {stat} (ms)", lambda s, k=f"{stat}_{key}_ms": _fmt(s[k])))
    if any(s.get("failed") for s in servers.values()):
        rows.insert(0, ("ran", lambda s: "yes"))
    for name, value in rows:
        absent = "no (see stderr)" if name == "ran" else "-"
        table.add_row(name, *(absent if s.get("failed") else value(s) for s in servers.values()))
    return table
