"""The probe's child: build one variant, load it, check every op on small inputs; print one JSON line.

    python -m specav.models.native.selftest <variant> [<native root>]

Run by probe.py in a separate process, so that a variant whose instructions this machine faults
on (SIGILL as soon as the library loads, or in a kernel) kills only this process. Exit status 0
and {"ok": true} when every op agrees with its reference; {"ok": false, "stage": "build" |
"selftest", "reason": ...} otherwise.

The checks are the tests' in miniature (tests/test_quant.py, tests/test_native_layers.py):
the k-quant matmul, under every schedule, against a float64 product of gguf's dequantised
weights with the kernel's own int8 activations, multi-row outputs equal to one-row outputs bit for
bit, the Q4_K quantiser through gguf's dequantiser, and the layer ops and vocabulary passes
against torch.

Must not know: which variant is chosen, or where its result is kept (probe.py).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import torch

from specav.models.native.build import NativeBuildError, build
from specav.models.native.variants import BY_NAME, Variant

Q4_K, Q6_K = 12, 14  # ggml type codes


def random_blocks(qtype: int, n: int, k: int, gen: np.random.Generator) -> np.ndarray:
    """n rows of random Q4_K / Q6_K blocks (every code and scale random; d, dmin small)."""
    size, d_at = {Q4_K: (144, (0, 2)), Q6_K: (210, (208,))}[qtype]
    blocks = gen.integers(0, 256, (n, k // 256, size), dtype=np.uint8)
    for at in d_at:
        blocks[..., at:at + 2] = gen.uniform(1e-3, 4e-3, (n, k // 256)).astype(np.float16)[..., None].view(np.uint8)
    return blocks.reshape(n, -1)


def check_matmul(ops, gen: np.random.Generator) -> None:
    """Under every schedule of kquant.cpp (K = 2304 runs in segments at 8 rows where a schedule has them)."""
    import gguf

    from specav.models.native.schedule import SCHEDULES

    k = 2304
    x = torch.from_numpy(gen.standard_normal((9, k)).astype(np.float32))  # [T, K]
    x[0, :256] *= 40
    xq, dx = ops.quantize_activations(x)
    x_used = (xq.double().view(9, k // 256, 256) * dx.double()[..., None]).view(9, k)
    weights = [random_blocks(q, 24, k, gen) for q in (Q4_K, Q6_K)]
    dense = [torch.from_numpy(gguf.quants.dequantize(w, gguf.GGMLQuantizationType(q)).astype(np.float64))
             for q, w in zip((Q4_K, Q6_K), weights)]
    expected = [x_used @ d.t() for d in dense]
    saved = ops.set_schedule(-1)
    try:
        for schedule in SCHEDULES:
            ops.set_schedule(schedule)
            ys = ops.kq_matmul(x, [torch.from_numpy(w) for w in weights], [Q4_K, Q6_K], [None, None])
            for qtype, w, y, e in zip((Q4_K, Q6_K), weights, ys, expected):
                error = ((y.double() - e).norm() / e.norm()).item()
                if not error < 1e-5:
                    raise AssertionError(f"kq_matmul type {qtype}, schedule {schedule}: relative error {error:.2e} "
                                         "against float64")
                alone = torch.cat([ops.kq_matmul(x[i:i + 1].contiguous(), [torch.from_numpy(w)], [qtype], [None])[0]
                                   for i in range(9)])
                if not torch.equal(alone, y):
                    raise AssertionError(f"kq_matmul type {qtype}, schedule {schedule}: a row's result depends on "
                                         "the other rows")
    finally:
        ops.set_schedule(saved)


def check_quantizer(ops, gen: np.random.Generator) -> None:
    import gguf

    w = torch.from_numpy(gen.standard_normal((8, 512)).astype(np.float32))
    back = gguf.quants.dequantize(ops.quantize_q4_k(w).numpy(), gguf.GGMLQuantizationType.Q4_K)
    error = float(np.linalg.norm(back - w.numpy()) / np.linalg.norm(w.numpy()))
    if not error < 0.12:  # 4 bits: ~0.09 on Gaussian weights; a wrong layout gives ~1
        raise AssertionError(f"quantize_q4_k: relative error {error:.3f}")


def check_layers(ops, gen: np.random.Generator) -> None:
    import torch.nn.functional as F

    x = torch.from_numpy(gen.standard_normal((3, 40)).astype(np.float32))
    w = torch.from_numpy(gen.standard_normal(40).astype(np.float32))
    torch.testing.assert_close(ops.rms_norm(x, w, 1e-6), x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w)
    torch.testing.assert_close(ops.silu_mul(x, w.expand(3, 40).contiguous()), F.silu(x) * w)
    q = torch.from_numpy(gen.standard_normal((3, 4, 16)).astype(np.float32))  # [T, H, D], one request
    kv = [torch.from_numpy(gen.standard_normal((5, 2, 16)).astype(np.float32)) for _ in range(2)]  # [P + n, Hkv, D]
    out = ops.attention(q, [kv[0]], [kv[1]], [3], 0.25)
    mask = torch.arange(5)[None, :] <= torch.arange(2, 5)[:, None]  # query j sees 0 .. 2 + j
    reference = F.scaled_dot_product_attention(q.transpose(0, 1), kv[0].transpose(0, 1), kv[1].transpose(0, 1),
                                               attn_mask=mask, scale=0.25, enable_gqa=True).transpose(0, 1)
    torch.testing.assert_close(out, reference, rtol=1e-4, atol=1e-5)


def check_top_k(ops, gen: np.random.Generator) -> None:
    from specav.topk import torch_candidate_probs, torch_scaled_top_k, torch_scan_rows, torch_top_two_tail

    x = torch.from_numpy(gen.standard_normal((3, 1000)).astype(np.float32))
    x[1, 10:20] = x[1].max() + 1.0  # a tie across the boundary of k = 5
    t = torch.tensor([0.7, 1.0, 0.0])
    for k in (1, 5, 64):
        values, _, at_least = ops.scaled_top_k(x, t, k)
        ref_values, _, ref_at_least = torch_scaled_top_k(x, t, k)
        if not (torch.equal(values, ref_values) and torch.equal(at_least, ref_at_least)):
            raise AssertionError(f"scaled_top_k k = {k}: differs from torch.topk")
    scan = ops.scan_rows(x, t, 5, True)
    ref = torch_scan_rows(x, t, 5, True)
    if not (torch.equal(scan[0], ref.values) and torch.equal(scan[2], ref.at_least) and torch.equal(scan[3], ref.bad)):
        raise AssertionError("scan_rows: differs from torch's top k")
    torch.testing.assert_close(scan[5], ref.tails.tail, rtol=1e-5, atol=0)
    ids, probs = ops.candidate_probs(ref.values, ref.ids, torch.tensor([0.8, 1.0, 0.5]))
    ref_ids, ref_probs = torch_candidate_probs(ref.values, ref.ids, torch.tensor([0.8, 1.0, 0.5]))
    if not torch.equal(ids, ref_ids):
        raise AssertionError("candidate_probs: its ids differ from torch's")
    torch.testing.assert_close(probs, ref_probs, rtol=1e-5, atol=1e-7)
    top_p, t_drawn = torch.tensor([0.8, 1.0, 0.5]), t.clamp(min=0.5)
    ids, probs, tokens, ok, *_ = ops.draw_top_k(x, t_drawn.tolist(), 5, top_p.tolist(), [0.3, 0.9, 0.5])
    ref_ids, ref_probs = ops.candidate_probs(*ops.scan_rows(x, t_drawn, 5, False)[:2], top_p)
    if ok.tolist() != [True, False, True] or not torch.equal(ids[ok], ref_ids[ok]) or not torch.equal(probs[ok], ref_probs[ok]):
        raise AssertionError("draw_top_k: its candidates differ from scan_rows' and candidate_probs'")
    if not all(t in row for t, row in zip(tokens[ok].tolist(), ids[ok].tolist())):
        raise AssertionError("draw_top_k: a token outside its row's candidates")
    if not torch.equal(ops.top_k_probs(x, t_drawn.tolist(), 5, top_p.tolist())[1][ok], probs[ok]):
        raise AssertionError("top_k_probs: differs from draw_top_k")
    values, _, tail, moment = ops.top_two_tail(x)
    ref_values, _, ref_tail, ref_moment = torch_top_two_tail(x)
    if not torch.equal(values, ref_values):
        raise AssertionError("top_two_tail: its top two differ from torch.topk")
    torch.testing.assert_close(tail, ref_tail, rtol=1e-5, atol=0)
    torch.testing.assert_close(moment, ref_moment, rtol=1e-5, atol=0)


def run(variant: Variant, root: Path | None) -> dict:
    try:
        library = build(variant, root)
    except NativeBuildError as err:
        return {"ok": False, "stage": "build", "reason": str(err)}
    if not hasattr(torch.ops, variant.namespace) or not hasattr(getattr(torch.ops, variant.namespace), "kq_matmul"):
        torch.ops.load_library(str(library))  # built earlier: load it here (the build loads what it builds)
    ops = getattr(torch.ops, variant.namespace)
    gen = np.random.default_rng(0)
    try:
        for check in (check_matmul, check_quantizer, check_layers, check_top_k):
            check(ops, gen)
    except (AssertionError, RuntimeError) as err:
        return {"ok": False, "stage": "selftest", "reason": f"its self-test failed: {str(err).splitlines()[0]}"}
    return {"ok": True, "isa": ops.isa()}


def main(argv: list[str]) -> int:
    variant = BY_NAME[argv[0]]
    root = Path(argv[1]) if len(argv) > 1 and argv[1] else None
    torch.set_num_threads(1)
    report = run(variant, root)
    print(json.dumps(report), flush=True)
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
