"""Benchmark: this checkout against another one (e.g. the main branch's previous kernels), in turns.

    python -m specav.bench.ab --other /work/main [--dtype auto] [--tokens 48] [--rounds 3] [--threads 2]
                              [--role target|drafter] [--rows 1,5,16]

Each checkout runs in its own worker process (its own `specav` on PYTHONPATH), both loaded side by
side; the parent has them take turns, one greedy target-only decoding run (through the engine,
as `bench quantized` runs it) or one forward each, round after round, so load from elsewhere
falls on both alike. Printed: per checkout, decode tokens/s (one over the median time per token
after the prefill step, over every round and prompt) and the packed forward's median ms at 1, 5
and 16 new tokens on a 128-token context (logits for every new token), then this checkout's
figures relative to the other's. The workers use only what both checkouts have
(`load_checkpoint`, `PackedCausalLM.forward`, `bench.quantized.decode` and its prompts).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROWS = (1, 5, 16)

WORKER = r"""
import json, sys, time, torch
torch.set_num_threads(int(sys.argv[1]))
from specav.models import load_checkpoint
from specav.bench.quantized import decode, _prompts
checkpoint = load_checkpoint("default", sys.argv[2], role=sys.argv[3])
if sys.argv[3] == "drafter":
    from specav.config import PACKAGED_SPECULATIVE
    from specav.models.vocab_subset import apply_vocab_subset
    if PACKAGED_SPECULATIVE.draft_vocab_size is not None:
        apply_vocab_subset(checkpoint, PACKAGED_SPECULATIVE.draft_vocab_size)
model = checkpoint.model
prompts = _prompts(checkpoint.tokenizer, 1)
gen = torch.Generator().manual_seed(0)
context = torch.randint(0, model.vocab_size, (128,), generator=gen).tolist()
cache = model.new_cache(128 + int(sys.argv[4]))
model.forward([context], [cache], [0])
print(json.dumps({"ready": True, "prompts": len(prompts)}), flush=True)
for line in sys.stdin:
    cmd = json.loads(line)
    if cmd["op"] == "decode":
        run = decode(checkpoint, prompts[cmd["prompt"]], cmd["tokens"])
        print(json.dumps({"steps": run.step_s, "tokens": run.tokens}), flush=True)
    elif cmd["op"] == "forward":
        new = torch.randint(0, model.vocab_size, (cmd["rows"],), generator=gen).tolist()
        start = time.perf_counter()
        model.forward([new], [cache], [len(new)])
        seconds = time.perf_counter() - start
        cache.rollback(len(new))
        print(json.dumps({"seconds": seconds}), flush=True)
"""


class Worker:
    def __init__(self, tree: Path, dtype: str, threads: int, role: str, max_rows: int) -> None:
        env = {**os.environ, "PYTHONPATH": str(tree)}
        self.tree = tree
        self.proc = subprocess.Popen([sys.executable, "-c", WORKER, str(threads), dtype, role, str(max_rows)],
                                     cwd=tree, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.hello = self._read()

    def ask(self, **cmd) -> dict:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def _read(self) -> dict:
        while True:
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError(f"the worker for {self.tree} stopped (exit status {self.proc.poll()})")
            if line.startswith("{"):
                return json.loads(line)

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m specav.bench.ab", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--other", required=True, type=Path, help="the other checkout's root")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--role", choices=("target", "drafter"), default="target")
    parser.add_argument("--rows", type=lambda s: tuple(int(n) for n in s.split(",")), default=ROWS,
                        help="the packed forwards' row counts, comma-separated (default 1,5,16)")
    args = parser.parse_args(argv)
    rows = args.rows
    trees = {"this": Path(__file__).resolve().parents[2], "other": args.other.resolve()}
    workers = {}
    try:
        for name, tree in trees.items():  # one at a time: loading is not what is measured
            workers[name] = Worker(tree, args.dtype, args.threads, args.role, max(rows))
        steps = {name: [] for name in workers}
        forward = {name: {n: [] for n in rows} for name in workers}
        outputs = {name: [] for name in workers}
        for _ in range(args.rounds):
            for prompt in range(workers["this"].hello["prompts"]):
                for name, w in workers.items():
                    reply = w.ask(op="decode", prompt=prompt, tokens=args.tokens)
                    steps[name] += reply["steps"]
                    outputs[name].append(reply["tokens"])
            for n in rows:
                for name, w in workers.items():
                    forward[name][n].append(w.ask(op="forward", rows=n)["seconds"])
    finally:
        for w in workers.values():
            w.close()
    tps = {name: 1.0 / statistics.median(s) for name, s in steps.items()}
    ms = {name: {n: 1e3 * statistics.median(t) for n, t in per.items()} for name, per in forward.items()}
    print(f"{args.role}, {args.dtype}, {args.threads} threads, {args.rounds} rounds x {workers['this'].hello['prompts']} prompts "
          f"x {args.tokens} greedy tokens, in turns")
    for name, tree in trees.items():
        cells = "  ".join(f"{n} rows {ms[name][n]:.1f} ms" for n in rows)
        ratios = ", ".join(f"{n} rows {ms[name][n] / ms[name][rows[0]]:.2f}x" for n in rows[1:])
        print(f"  {name:<5} {str(tree):<28} decode {tps[name]:6.2f} tok/s   forward {cells}   "
              f"({ratios} the {rows[0]}-row forward)")
    same = sum(a == b for a, b in zip(outputs["this"], outputs["other"]))
    print(f"  this / other: decode {tps['this'] / tps['other']:.2f}x, forward "
          + "  ".join(f"{n} rows {ms['other'][n] / ms['this'][n]:.2f}x faster" for n in rows)
          + f"; identical greedy outputs in {same} of {len(outputs['this'])} runs")


if __name__ == "__main__":
    main()
