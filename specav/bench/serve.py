"""Benchmark: `specav serve` under C concurrent clients, speculation with and without adaptive verification, and off.

    specav bench serve [--concurrency 1,4,8] [--modes adaptive,static,off] [--requests 16] [--max-tokens 64]

For each mode a `specav serve` process is started on the packaged default pair (one at a time:
one real pair in memory), warmed up with one request, then for each concurrency C, C clients
send a fixed request set (chat prompts from the project's workloads, seeded sampling at the
pair's recommended temperature 0.7 / top-p 0.8 / top-k 20) as streamed chat completions, each
client taking the next request as soon as its last one finished. Prints, per mode and C:
requests completed and failed (with the errors), output tokens, throughput (output tokens per
second of wall time), request latency p50 / p95, time to first token p50, inter-token latency
p50 (per request: (last token - first token) / (tokens - 1)), the server's mean acceptance
length over the run, and throughput as a ratio to speculation off at the same C. The server
is measured through HTTP from this process; run it alone (`flock -x /tmp/specav-bench.lock`).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field

import httpx

from specav.config import PACKAGED_SPECULATIVE
from specav.evaluation.workloads import load_workload

MODES = {
    "adaptive": ["--speculative-config", json.dumps(dataclasses.asdict(PACKAGED_SPECULATIVE))],  # the default
    "static": ["--speculative-config", json.dumps({"num_speculative_tokens": 4,
                                                   "enable_adaptive_verification": False})],
    "off": ["--no-speculation"],
}
WORKLOADS = ("code", "chat", "math", "prose")
SAMPLING = {"temperature": 0.7, "top_p": 0.8, "top_k": 20}


@dataclass(slots=True)
class Result:
    latency: float = 0.0
    ttft: float = float("nan")
    itl: float = float("nan")
    tokens: int = 0
    error: str | None = None


@dataclass(slots=True)
class Run:
    mode: str
    concurrency: int
    seconds: float
    results: list[Result] = field(default_factory=list)
    acceptance_length: float = float("nan")

    @property
    def ok(self) -> list[Result]:
        return [r for r in self.results if r.error is None]

    @property
    def tokens(self) -> int:
        return sum(r.tokens for r in self.ok)

    @property
    def throughput(self) -> float:
        return self.tokens / self.seconds if self.seconds else float("nan")


def request_set(n: int, max_tokens: int) -> list[dict]:
    """n chat requests, taken round-robin from the workloads, each with its own seed."""
    per = -(-n // len(WORKLOADS))
    prompts = [p for i in range(per) for w in WORKLOADS for p in load_workload(w)[i:i + 1]][:n]
    return [{"messages": p.chat(), "max_tokens": max_tokens, "seed": i, "stream": True,
             "stream_options": {"include_usage": True}, **SAMPLING} for i, p in enumerate(prompts)]


async def one_request(client: httpx.AsyncClient, body: dict) -> Result:
    start, first, last, result = time.perf_counter(), None, None, Result()
    try:
        async with client.stream("POST", "/v1/chat/completions", json=body) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread()).decode()[:200]}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    result.error = event["error"]["message"]
                    return result
                if event.get("usage"):
                    result.tokens = event["usage"]["completion_tokens"]
                if event["choices"] and event["choices"][0]["delta"].get("content"):
                    now = time.perf_counter()
                    first = first or now
                    last = now
    except httpx.HTTPError as e:
        result.error = f"{type(e).__name__}: {e}"
        return result
    result.latency = time.perf_counter() - start
    if first is not None:
        result.ttft = first - start
        if result.tokens > 1:
            result.itl = (last - first) / (result.tokens - 1)
    return result


async def run_clients(url: str, bodies: list[dict], concurrency: int) -> tuple[float, list[Result]]:
    pending = list(enumerate(bodies))
    results: list[Result | None] = [None] * len(bodies)
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(600.0)) as client:
        async def worker():
            while pending:
                i, body = pending.pop(0)
                results[i] = await one_request(client, body)

        start = time.perf_counter()
        await asyncio.gather(*[worker() for _ in range(concurrency)])
    return time.perf_counter() - start, [r for r in results if r is not None]


class Server:
    """A `specav serve` process on a free port."""

    def __init__(self, mode: str, threads: int, max_num_seqs: int) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen([sys.executable, "-m", "specav.cli", "serve", *MODES[mode], "--port",
                                      str(self.port), "--threads", str(threads), "--max-num-seqs",
                                      str(max_num_seqs), "--log-level", "warning"], env=os.environ.copy())

    def wait_ready(self, timeout: float = 1800) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(f"specav serve exited with status {self.proc.returncode}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise SystemExit("specav serve did not become ready")

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(120)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def percentile(values: list[float], q: float) -> float:
    values = sorted(v for v in values if v == v)
    if not values:
        return float("nan")
    return statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1] if len(values) > 1 else values[0]


def print_table(runs: list[Run]) -> None:
    base = {r.concurrency: r.throughput for r in runs if r.mode == "off"}
    print("| mode | C | ok / failed | output tokens | tok/s | vs off | latency p50 / p95 s | TTFT p50 s | "
          "ITL p50 ms | acceptance length |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in runs:
        ratio = r.throughput / base[r.concurrency] if r.concurrency in base else float("nan")
        lat = [x.latency for x in r.ok]
        print(f"| {r.mode} | {r.concurrency} | {len(r.ok)} / {len(r.results) - len(r.ok)} | {r.tokens} | "
              f"{r.throughput:.2f} | {ratio:.2f}x | {percentile(lat, 50):.1f} / {percentile(lat, 95):.1f} | "
              f"{percentile([x.ttft for x in r.ok], 50):.2f} | {1e3 * percentile([x.itl for x in r.ok], 50):.0f} | "
              f"{r.acceptance_length:.2f} |")
    for r in runs:
        for x in r.results:
            if x.error:
                print(f"error ({r.mode}, C={r.concurrency}): {x.error}")


def main() -> None:
    parser = argparse.ArgumentParser(prog="specav bench serve", description=__doc__.split("\n\n")[0])
    parser.add_argument("--concurrency", default="1,4,8", help="comma-separated client counts")
    parser.add_argument("--modes", default="adaptive,static,off", help=f"comma-separated, of {sorted(MODES)}")
    parser.add_argument("--requests", type=int, default=16, help="requests per concurrency level")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2, help="the server's torch threads")
    parser.add_argument("--max-num-seqs", type=int, default=8, help="the server's batch limit")
    args = parser.parse_args()
    levels = [int(c) for c in args.concurrency.split(",")]
    bodies = request_set(args.requests, args.max_tokens)
    runs = []
    for mode in args.modes.split(","):
        server = Server(mode, args.threads, args.max_num_seqs)
        try:
            server.wait_ready()
            asyncio.run(run_clients(server.url, bodies[:1], 1))  # warm-up
            for c in levels:
                before = _acceptance_counters(server)
                seconds, results = asyncio.run(run_clients(server.url, bodies, c))
                run = Run(mode, c, seconds, results, _acceptance_length_since(server, before))
                runs.append(run)
                print(f"[{mode}, C={c}] {run.tokens} tokens in {seconds:.1f} s ({run.throughput:.2f} tok/s), "
                      f"{len(run.ok)}/{len(results)} ok", file=sys.stderr, flush=True)
        finally:
            server.stop()
    print(f"\n{args.requests} chat requests per run (workloads {', '.join(WORKLOADS)}), max_tokens {args.max_tokens}, "
          f"temperature 0.7 / top-p 0.8 / top-k 20, seeded; server threads {args.threads}, "
          f"max-num-seqs {args.max_num_seqs}; adaptive: the packaged default (AV, K <= "
          f"{PACKAGED_SPECULATIVE.num_speculative_tokens}), static: K = 4\n")
    print_table(runs)


def _acceptance_counters(server: Server) -> dict[str, float]:
    wanted = ("specav_slots_accepted_total", "specav_batch_size_sum")
    values = {}
    for line in httpx.get(f"{server.url}/metrics").text.splitlines():
        name, _, value = line.partition(" ")
        if name in wanted:
            values[name] = float(value)
    return values


def _acceptance_length_since(server: Server, before: dict[str, float]) -> float:
    """(accepted slots + request steps) / request steps over the run (request steps = the batch sizes' sum)."""
    after = _acceptance_counters(server)
    steps = after.get("specav_batch_size_sum", 0) - before.get("specav_batch_size_sum", 0)
    accepted = after.get("specav_slots_accepted_total", 0) - before.get("specav_slots_accepted_total", 0)
    return (accepted + steps) / steps if steps else float("nan")


if __name__ == "__main__":
    main()
