"""Benchmark of the compression ops and compressors against the PyTorch code they replace.

Cases: one fp32 gradient buffer of 25 MiB and one of 100 MiB (``--sizes``), plus a batch of PowerSGD
P matrices (64 x [2048, r], r = 1, 2, 4, 8, 16) for the orthogonalisation. Peers, measured in the same run:

  fp16 / bf16:     x.to(dtype) (PyTorch's fp16_compress_hook) and out.copy_(payload);
  top-k 1%:        two peers, with error feedback (x + r, then the residual update) and without:
                   - the same algorithm as torsh's approximate mode, DGC-style, in plain torch
                     (:class:`DgcTopk`: the threshold from a strided sample's top-k, the candidates
                     |x + r| >= threshold, the exact top-k among them; the sample, the target rank, the
                     band [k, k + ceil(0.25 k)], the re-aim and the 4 rounds before the exact fallback
                     are torsh's own, read from ops/topk/api.py); the approximate rows' speedup is over
                     this peer;
                   - the exact top-k, torch.topk(|x + r|, k, sorted=False) + gather + residual update, as
                     GRACE's TopKCompressor runs it (and plain torch.topk(|x|) without error feedback): the
                     exact rows' speedup is over this one; the approximate rows list it too, as a different
                     algorithm. Both peers are checked against the exact top-k before they are timed;
                   decompress: zero_ + index_put_;
  int8 / int4:     a torch-ops blockwise absmax quantizer (amax, divide, round, clamp, cast; nibble
                   packing for int4; torch.rand_like noise for stochastic rounding) and its dequantizer;
  sign (1-bit):    torch ops: x + r, mean |.|, sign bits packed 8 per byte, residual update; on CUDA with
                   CuPy also DeepSpeed's way (cupy.packbits through DLPack);
  PowerSGD:        PyTorch's powerSGD_hook arithmetic on the buffer as a near-square matrix (residual
                   add, P = M Q, its Python Gram-Schmidt loop, Q = M^T P, P Q^T, error update);
  orthogonalize:   PyTorch's PowerSGD hook's _orthogonalize as the hook runs it (in place: its Gram-Schmidt
                   loop for rank <= 2, torch.linalg.qr(out=(P, R)) above), torch.linalg.qr alone (batched,
                   a new Q) and the Gram-Schmidt loop; torsh's default provider is timed beside them (row
                   "torsh default"), its note giving the speedup (peer's time / ours: above 1 is faster)
                   over the hook and over linalg.qr as the best of 5 interleaved rounds of 5 calls.

Each row of ours records in the JSON the peers it is compared with like for like (``peers``; every peer
of its op when absent), the one its ``speedup_vs_best_peer`` is over (``best_peer``) and its speedup over
each peer of its op (``speedups``: that peer's median time / ours).

Each row reports the median time, GB/s of the bytes the operation must move at least (read + write)
and that as a fraction of the same device's measured copy bandwidth; notes give the compression ratio
and the relative error ||decompress(compress(x)) - x|| / ||x|| of one step without error feedback.
"""

from __future__ import annotations

import argparse
import math

import torch

from ... import cli_common
from ... import compression as cz
from ...ops import (
    dequantize,
    orthogonalize,
    quantize,
    sign_compress,
    sign_decompress,
    topk_compress,
    topk_count,
    topk_decompress,
)
from . import (
    Case,
    Result,
    add_device,
    add_providers,
    emit,
    environment,
    print_tables,
    resolve_device,
    result_doc,
    select_providers,
)
from .compression_peers import (
    BLOCK,
    CHOLQR2_LABEL,
    DgcTopk,
    PeerPowerSGD,
    check_topk_peer,
    cupy_sign_peer,
    peer_cholesky_qr2,
    peer_dequantize,
    peer_quantize,
    peer_sign,
    peer_sign_decompress,
    peer_topk_ef,
    torch_gram_schmidt,
    torch_orthogonalize,
)

MIB = 1 << 20
RATIO = 0.01


def _rel_err(approx: torch.Tensor, x: torch.Tensor) -> float:
    return ((approx.float() - x.float()).norm() / x.float().norm()).item()


# ------------------------------------------------------------------------------------------- cases


def run_buffer(mib: float, device: torch.device, providers: list[str], reps: int, psgd_rank: int) -> list[Result]:
    n = int(mib * MIB) // 4 // BLOCK * BLOCK
    nbytes = 4 * n
    case = Case(f"{nbytes / MIB:g} MiB fp32 buffer ({n:,} elements)", device)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, generator=g).to(device)
    src, dst = torch.randn(n, generator=g).to(device), torch.empty(n, device=device)
    case.add("copy", "dst.copy_(src)", "copy", lambda: dst.copy_(src), 2 * nbytes)
    out = torch.empty(n, device=device)
    _add_casts(case, x, out, n, nbytes, providers)
    dgc = _add_topk(case, x, out, n, nbytes, providers, device)
    _add_quantize(case, x, out, n, nbytes, providers)
    _add_signs(case, x, out, n, nbytes, providers, device)
    _add_powersgd(case, x, out, n, nbytes, providers, psgd_rank)
    res = case.time(reps)
    for r in res:
        r.extra.setdefault("elements", n)
    for op, peer in dgc:  # what the DGC-style peer ran while timed (in band at once: 1 round, no fallback)
        for r in res:
            if r.op == op and r.kind == "peer" and r.impl.startswith("DGC-style"):
                r.extra.update(calls=peer.calls, rounds=peer.rounds, fallbacks=peer.fallbacks, note=peer.stats())
    _note_other_peers(res)
    return res


def _note_other_peers(results: list[Result]) -> None:
    """A row compared like for like with named peers: its speedup over the op's other peers in its note,
    marked as a different algorithm."""
    for r in results:
        if r.peers is None:
            continue
        other = [f"{s:.2f}x over {p} (different algorithm)" for p, s in r.speedups.items() if p not in r.peers]
        if other:
            r.extra["note"] = "; ".join([r.extra["note"], *other]) if r.extra.get("note") else "; ".join(other)


def _add_casts(case: Case, x: torch.Tensor, out: torch.Tensor, n: int, nbytes: int, providers: list[str]) -> None:
    """FP16 and BF16: the casts each way."""
    for name, comp, dt in (("fp16", cz.FP16, torch.float16), ("bf16", cz.BF16, torch.bfloat16)):
        moved = nbytes + n * 2
        for p in providers:
            c = comp(provider=p, check_finite=False)
            st = c.new_state()
            got, pl = cz.roundtrip(c, x, st, out)
            note = f"ratio 2.0x, rel err {_rel_err(got, x):.1e}"
            case.add(f"{name} compress", f"torsh[{p}]", "ours", lambda c=c, st=st: c.compress(x, st), moved, note=note)
        case.add(f"{name} compress", f"x.to({dt}) (fp16/bf16_compress_hook's cast)", "peer", lambda dt=dt: x.to(dt),
                 moved)  # fmt: skip
        payload = x.to(dt)
        for p in providers:
            c = comp(provider=p)
            pl = cz.Payload({"data": payload}, n)
            case.add(f"{name} decompress", f"torsh[{p}]", "ours", lambda c=c, pl=pl: c.decompress(pl, None, out), moved)
        case.add(f"{name} decompress", f"out.copy_({name} payload) (the hooks' decompress)", "peer",
                 lambda pl=payload: out.copy_(pl), moved)  # fmt: skip


# The top-k peers' labels: each names the peer and its setting.
TOPK_EXACT_EF = "torch.topk(|x+r|, k, sorted=False) exact + gather + residual"
TOPK_EXACT = "torch.topk(|x|, k, sorted=False) exact + gather"


def _dgc_label(peer: DgcTopk, n: int, ef: bool) -> str:
    what = "|x+r|" if ef else "|x|"
    if peer.stride == 1:
        return f"DGC-style sampled threshold in plain torch: sample = all n, so exact torch.topk({what}) as torsh"
    return (f"DGC-style sampled threshold in plain torch: {what}[::{peer.stride}] sample "
            f"({100 * peer.ns / n:.2g}%), band [k, 1.25k], torsh's re-aim{' + residual' if ef else ''}")  # fmt: skip


def _add_topk(
    case: Case, x: torch.Tensor, out: torch.Tensor, n: int, nbytes: int, providers: list[str], device: torch.device
) -> list[tuple[str, DgcTopk]]:
    """Top-k 1%, with and without error feedback, and its decompression. The approximate rows are compared
    with the DGC-style peer (the same algorithm in plain torch), the exact rows with torch.topk; both peers
    are checked against the exact top-k first. Returns the DGC peers (op, peer) for their counts."""
    k = topk_count(n, RATIO)
    idx_bytes = 4
    ef_moved = 3 * nbytes + k * (4 + idx_bytes)  # read x and r, write r, write the payload
    plain_moved = nbytes + k * (4 + idx_bytes)
    ratio_note = f"ratio {nbytes / (k * 8):.0f}x"
    dgc_ef, dgc = DgcTopk(n, k), DgcTopk(n, k)
    dgc_ef_label, dgc_label = _dgc_label(dgc_ef, n, True), _dgc_label(dgc, n, False)
    recall = {
        "dgc_ef": check_topk_peer(dgc_ef, x, k, True),
        "dgc": check_topk_peer(dgc, x, k, False),
        "exact_ef": check_topk_peer(lambda x, r: peer_topk_ef(x, r, k), x, k, True),
    }
    dgc_ef.calls = dgc_ef.rounds = dgc_ef.fallbacks = dgc.calls = dgc.rounds = dgc.fallbacks = 0  # count the timed
    op = "top-k 1% + error feedback"
    for p in providers:
        for exact in (False, True):
            r = torch.zeros(n, device=device)
            v, i = topk_compress(x, ratio=RATIO, residual=r, exact=exact, provider=p)
            note = f"{ratio_note}, rel err {_rel_err(topk_decompress(v, i, n), x):.2f}"
            if not exact:
                note += f"; DGC-style peer's recall of the exact top-k {recall['dgc_ef']:.4f}"
            case.add(op, f"torsh[{p}]{' exact' if exact else ' approx'}", "ours",
                     lambda r=r, p=p, exact=exact: topk_compress(x, ratio=RATIO, residual=r, exact=exact, provider=p),
                     ef_moved, peers=[TOPK_EXACT_EF if exact else dgc_ef_label], note=note)  # fmt: skip
    r_dgc = torch.zeros(n, device=device)
    case.add(op, dgc_ef_label, "peer", lambda: dgc_ef(x, r_dgc), ef_moved)
    r_peer = torch.zeros(n, device=device)
    case.add(op, TOPK_EXACT_EF, "peer", lambda: peer_topk_ef(x, r_peer, k), ef_moved)
    op = "top-k 1%"
    for p in providers:
        case.add(op, f"torsh[{p}] approx", "ours", lambda p=p: topk_compress(x, ratio=RATIO, provider=p),
                 plain_moved, peers=[dgc_label],
                 note=f"{ratio_note}; DGC-style peer's recall of the exact top-k {recall['dgc']:.4f}")  # fmt: skip
    case.add(op, dgc_label, "peer", lambda: dgc(x), plain_moved)
    case.add(op, TOPK_EXACT, "peer", lambda: x[torch.topk(x.abs(), k, sorted=False).indices], plain_moved)
    v, i = topk_compress(x, ratio=RATIO)
    dec_moved = nbytes + k * 8
    for p in providers:
        case.add("top-k decompress", f"torsh[{p}]", "ours",
                 lambda p=p: topk_decompress(v, i, n, out=out, provider=p), dec_moved)  # fmt: skip
    il = i.long()

    def peer_topk_dec():
        out.zero_()
        out.index_put_((il,), v)

    case.add("top-k decompress", "out.zero_() + out.index_put_((idx,), values), accumulate=False", "peer",
             peer_topk_dec, dec_moved)  # fmt: skip
    return [("top-k 1% + error feedback", dgc_ef), ("top-k 1%", dgc)]


def _add_quantize(case: Case, x: torch.Tensor, out: torch.Tensor, n: int, nbytes: int, providers: list[str]) -> None:
    """Blockwise int8 (plain and stochastic) and int4 quantization, and dequantization."""
    for bits, stochastic in ((8, False), (8, True), (4, False)):
        qbytes = n if bits == 8 else n // 2
        moved = nbytes + qbytes + 4 * (n // BLOCK)
        label = f"int{bits}{' stochastic' if stochastic else ''} quantize"
        for p in providers:
            q, s = quantize(x, bits=bits, block=BLOCK, stochastic=stochastic, seed=3, provider=p)
            err = _rel_err(dequantize(q, s, block=BLOCK, numel=n), x)
            note = f"ratio {nbytes / (moved - nbytes):.1f}x, rel err {err:.1e}"
            case.add(label, f"torsh[{p}]", "ours",
                     lambda p=p, bits=bits, st=stochastic: quantize(x, bits=bits, block=BLOCK, stochastic=st,
                                                                    seed=3, provider=p),
                     moved, note=note)  # fmt: skip
        how = "floor(y + rand_like)" if stochastic else "round half even"
        pack = ", nibble packing" if bits == 4 else ""
        case.add(label, f"torch ops, block {BLOCK}: amax, div, {how}, clamp, cast{pack}", "peer",
                 lambda bits=bits, st=stochastic: peer_quantize(x, bits, st), moved)  # fmt: skip
        if stochastic:
            continue
        q, s = quantize(x, bits=bits, block=BLOCK)
        qp, sp = peer_quantize(x, bits)
        if not (torch.equal(peer_dequantize(qp, sp, bits), dequantize(q, s, block=BLOCK, numel=n))):
            raise AssertionError(f"int{bits}: the torch peer and torsh disagree; not timing them")
        for p in providers:
            case.add(f"int{bits} dequantize", f"torsh[{p}]", "ours",
                     lambda p=p, q=q, s=s: dequantize(q, s, block=BLOCK, numel=n, out=out, provider=p),
                     moved)  # fmt: skip
        case.add(f"int{bits} dequantize", f"torch ops, block {BLOCK}: codes{' unpacked' if bits == 4 else ''} x scale",
                 "peer",
                 lambda qp=qp, sp=sp, bits=bits: peer_dequantize(qp, sp, bits), moved)  # fmt: skip


def _add_signs(
    case: Case, x: torch.Tensor, out: torch.Tensor, n: int, nbytes: int, providers: list[str], device: torch.device
) -> None:
    """Signs with error feedback (and DeepSpeed's 1-bit peer where CuPy is here), and their decompression."""
    moved = 3 * nbytes + n // 8
    for p in providers:
        r = torch.zeros(n, device=device)
        b, s = sign_compress(x, provider=p)
        note = f"ratio {nbytes / (n // 8 + 4):.0f}x, rel err {_rel_err(sign_decompress(b, s, n), x):.2f}"
        case.add("sign + error feedback", f"torsh[{p}]", "ours",
                 lambda r=r, p=p: sign_compress(x, r, provider=p), moved, note=note)  # fmt: skip
    r_peer2 = torch.zeros(n, device=device)
    case.add("sign + error feedback", "torch ops: x + r, scale mean |.|, 8 signs/byte (mul + sum), residual", "peer",
             lambda: peer_sign(x, r_peer2), moved)  # fmt: skip
    cupy_sign = cupy_sign_peer(device)
    if cupy_sign is not None:
        r_peer3 = torch.zeros(n, device=device)
        case.add("sign + error feedback", "torch ops + cupy.packbits, scale ||.|| / sqrt(n) (DeepSpeed 1-bit)", "peer",
                 lambda: cupy_sign(x, r_peer3), moved)  # fmt: skip
    b, s = sign_compress(x)
    for p in providers:
        case.add("sign decompress", f"torsh[{p}]", "ours",
                 lambda p=p: sign_decompress(b, s, n, out=out, provider=p), nbytes + n // 8)  # fmt: skip
    case.add("sign decompress", "torch ops: unpack bits (shift, and), (2 bit - 1) x scale", "peer",
             lambda: peer_sign_decompress(b, s, n),
             nbytes + n // 8)  # fmt: skip


def _add_powersgd(
    case: Case, x: torch.Tensor, out: torch.Tensor, n: int, nbytes: int, providers: list[str], psgd_rank: int
) -> None:
    """One PowerSGD compress + decompress step, world size 1."""
    rows, cols = cz.matrix_shape(x)
    moved = 6 * nbytes  # residual add (3), error update (3); the matmuls read M twice more
    for p in providers:
        c = cz.PowerSGD(psgd_rank, provider=p, check_finite=False)
        st = c.new_state()
        got, pls = cz.roundtrip(c, x, st, out)
        note = f"rank {psgd_rank}, {rows}x{cols}, ratio {nbytes / sum(pl.nbytes for pl in pls):.0f}x, " \
               f"rel err {_rel_err(got, x):.2f}"  # fmt: skip
        case.add(f"PowerSGD rank {psgd_rank} step", f"torsh[{p}]", "ours",
                 lambda c=c, st=st: cz.roundtrip(c, x, st, out), moved, note=note)  # fmt: skip
    peer = PeerPowerSGD(x, psgd_rank)
    case.add(f"PowerSGD rank {psgd_rank} step",
             f"powerSGD_hook arithmetic, rank {psgd_rank}, one {rows}x{cols} matrix, its _orthogonalize", "peer",
             lambda: peer.step(x, out), moved)  # fmt: skip


QR_LABEL = "torch.linalg.qr(P) batched, mode='reduced' (its default), a new Q"
HOOK_LABEL = "PowerSGD hook _orthogonalize(P, 0), in place: Gram-Schmidt loop r <= 2, linalg.qr(out=(P, R)) above"


def run_orthogonalize(device: torch.device, providers: list[str], reps: int, batch: int, rows: int) -> list[Result]:
    results: list[Result] = []
    for r in (1, 2, 4, 8, 16):
        case = Case(f"orthogonalize {batch} x [{rows}, {r}] fp32 (PowerSGD P matrices)", device)
        nbytes = batch * rows * r * 4
        src = torch.randn(batch * rows * r * 64, device=device)
        dst = torch.empty_like(src)
        case.add("copy", "dst.copy_(src)", "copy", lambda src=src, dst=dst: dst.copy_(src), 2 * src.numel() * 4)
        g = torch.Generator().manual_seed(r)
        base = torch.randn(batch, rows, r, generator=g).to(device)
        work = base.clone()
        qr = lambda w=work: torch.linalg.qr(w)
        for p in [None, *providers]:  # None: the default choice, as PowerSGD calls it
            chk = base.clone()
            orthogonalize(chk, provider=p)
            err = (chk.transpose(1, 2) @ chk - torch.eye(r, device=device)).abs().max().item()
            fn = lambda p=p, work=work: orthogonalize(work, provider=p)
            note = f"max |Q^T Q - I| {err:.1e}"
            if p is None:  # over the peer as PowerSGD's hook runs it (in place), and over linalg.qr alone
                hook = lambda w=work: torch_orthogonalize(w)
                note += (
                    f"; speedup (peer's time / ours, best of 5 interleaved rounds of 5 calls): "
                    f"{_speedup(fn, hook, device):.3g}x over the PowerSGD hook's _orthogonalize, "
                    f"{_speedup(fn, qr, device):.3g}x over batched torch.linalg.qr (which writes a new Q)"
                )
            case.add("orthogonalize", "torsh default" if p is None else f"torsh[{p}]", "ours", fn, 2 * nbytes,
                     note=note)  # fmt: skip
        chk = base.clone()  # the same-algorithm peer must give torsh's Q (unique with R's positive diagonal)
        peer_cholesky_qr2(chk)
        want = base.clone()
        orthogonalize(want)
        if not torch.allclose(chk, want, rtol=0, atol=1e-4):
            raise AssertionError(f"r = {r}: the CholeskyQR2 peer's Q differs from torsh's by "
                                 f"{(chk - want).abs().max().item():.1e}; not timing it")  # fmt: skip
        case.add("orthogonalize", QR_LABEL, "peer", qr, 2 * nbytes)
        case.add("orthogonalize", CHOLQR2_LABEL, "peer", lambda w=work: peer_cholesky_qr2(w), 2 * nbytes)
        # what PyTorch's PowerSGD hook runs, in place: Gram-Schmidt for rank <= 2, linalg.qr(out=(P, R)) above
        case.add("orthogonalize", HOOK_LABEL, "peer",
                 lambda w=work: torch_orthogonalize(w), 2 * nbytes)  # fmt: skip
        case.add("orthogonalize", "PowerSGD hook _orthogonalize_gram_schmidt(P, 0): its loop over columns, batched",
                 "peer",
                 lambda w=work: torch_gram_schmidt(w), 2 * nbytes)  # fmt: skip
        results += case.time(reps)
    return results


def _speedup(ours, peer, device: torch.device, rounds: int = 5, calls: int = 5) -> float:
    """The speedup of ours over peer, peer's time / ours (above 1: ours is faster), each time the best of
    ``rounds`` interleaved rounds of ``calls`` calls."""
    import time

    best = [math.inf, math.inf]
    for _ in range(rounds):
        for i, fn in enumerate((ours, peer)):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            best[i] = min(best[i], time.perf_counter() - t0)
    return best[1] / best[0]


def _mib_list(text: str) -> list[float]:
    try:
        sizes = [float(s) for s in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected MiB numbers like 25,100, got {text!r}") from None
    if not sizes or any(not (0 < s <= 4096) or math.isnan(s) for s in sizes):
        raise argparse.ArgumentTypeError(f"sizes must be in (0, 4096] MiB, got {text!r}")
    return sizes


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_device(p)
    add_providers(p)
    p.add_argument("--sizes", default=[25.0, 100.0], type=_mib_list, help="buffer sizes in MiB (default: 25,100)")
    p.add_argument(
        "--rank", type=cli_common.int_at_least(1), default=4, help="PowerSGD rank of the buffer case (default 4)"
    )
    p.add_argument("--ortho-batch", type=cli_common.int_at_least(1), default=64,
                   help="matrices in the orthogonalize case (default 64)")  # fmt: skip
    p.add_argument(
        "--ortho-rows", type=cli_common.int_at_least(1), default=2048, help="rows of each matrix (default 2048)"
    )
    p.add_argument(
        "--reps", type=cli_common.int_at_least(1), default=None, help="timed repetitions (default 20 GPU, 5 CPU)"
    )
    cli_common.add_json(p)


def run(args: argparse.Namespace) -> int:
    device = resolve_device(args.device)
    providers = select_providers("torsh bench compression", args.providers, device)
    sizes = args.sizes
    reps = args.reps or (20 if device.type == "cuda" else 5)
    env = environment(device)
    results: list[Result] = []
    for mib in sizes:
        results += run_buffer(mib, device, providers, reps, args.rank)
    results += run_orthogonalize(device, providers, reps, args.ortho_batch, args.ortho_rows)
    print_tables(results, "torsh bench compression", env)
    config = {"providers": providers, "reps": reps, "sizes_mib": sizes, "ratio": RATIO, "block": BLOCK,
              "powersgd_rank": args.rank, "ortho_batch": args.ortho_batch, "ortho_rows": args.ortho_rows,
              "torch_threads": torch.get_num_threads()}  # fmt: skip
    emit(args, result_doc("compression", env, results, config))
    return 0
