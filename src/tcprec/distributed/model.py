"""A byte and latency (alpha-beta) model of the low-precision all-reduce, one node per GPU.

    time = calls * alpha_call + steps * alpha_step + bytes_per_rank / link_bw + hbm_bytes / hbm_bw

* ``bytes_per_rank``: what one rank receives in the data exchange (the figure the code counts:
  distributed/algorithms.py ``model_bytes``);
* ``steps``: sequential message rounds (ring: 2 (N - 1); halving: 2 log2 P, + 2 when N is not a
  power of two; direct: an all_to_all round and a ring all-gather, N rounds; the fp32 baseline is
  NCCL's ring all-reduce, 2 (N - 1));
* ``calls``: collective launches (the maxima's all-reduce, then the exchange's collectives: 3 for
  direct, N + 1 for ring -- a send/recv per step and the all-gather --, 1 + steps for halving);
* ``hbm_bytes``: the kernels' memory traffic per rank (read the fp32 gradients twice -- max and
  encode --, write and read the codes, write the fp32 mean: ~15 bytes an element, independent of N).

The defaults are calibrated on the one measurement there is (H200 x2, NVLink, NCCL 2.28,
benchmarks/results/emulate_allreduce_2gpu.json, 11.7M gradients): ``link_bw`` so that NCCL's fp32
all-reduce takes its measured 0.186 ms, ``hbm_bw`` the rate the three fused kernels reached (175.5
MB in 0.099 ms: 1.77 TB/s).  ``alpha_step`` (5 us) and ``alpha_call`` (12 us) are assumptions for
one NVLink node; across nodes (InfiniBand) use ~10-20 us steps and the per-GPU network rate.
"""

from __future__ import annotations

import math

from .algorithms import model_bytes

__all__ = ["allreduce_model", "MEASURED_2GPU"]

# benchmarks/results/emulate_allreduce_2gpu.json (H200 x2, 11.7M fp32 gradients, 62 tensors, GPU ms)
MEASURED_2GPU = {"numel": 11_700_000, "nccl_fp32_ms": 0.186, "lowp_allgather_ms": 0.168, "kernels_ms": 0.099,
                 "allgather_gbps": 163.0}


def _steps(algorithm: str, n: int) -> int:
    if n == 1:
        return 0
    if algorithm in ("ring", "nccl_fp32", "nccl_bf16"):
        return 2 * (n - 1)
    if algorithm == "halving":
        P = 1 << (n.bit_length() - 1)
        return 2 * int(math.log2(P)) + (2 if P != n else 0)
    if algorithm == "direct":
        return 1 + (n - 1)
    if algorithm == "allgather":
        return n - 1
    raise ValueError(f"algorithm must be one of ring, halving, direct, allgather, nccl_fp32, nccl_bf16; got {algorithm!r}")


def _calls(algorithm: str, n: int) -> int:
    """Collective calls of one all-reduce: the maxima's all-reduce, then the exchange's -- one
    all_to_all and one all_gather (direct), one all_gather (allgather), a send/recv per step and the
    closing all_gather (ring: n - 1 + 1), a send/recv per step (halving)."""
    if algorithm == "allgather":
        return 2
    if algorithm == "direct":
        return 3
    if algorithm == "ring":
        return 1 + (n - 1) + 1 if n > 1 else 1
    return 1 + _steps(algorithm, n)


def _bytes(algorithm: str, numel: int, n: int, bpc: int) -> int:
    if algorithm == "nccl_fp32":
        return int(2 * (n - 1) / n * 4 * numel)
    if algorithm == "nccl_bf16":
        return int(2 * (n - 1) / n * 2 * numel)
    if algorithm == "allgather":
        return (n - 1) * numel * bpc
    return model_bytes(algorithm, numel, n, bpc)


def allreduce_model(numel: int = 11_700_000, worlds=tuple(range(2, 9)) + (16, 32, 64, 128, 256), *,
                    bytes_per_code: int = 1, link_bw: float = 2.85e11, hbm_bw: float = 1.77e12,
                    alpha_step: float = 5e-6, alpha_call: float = 12e-6, hbm_bytes_per_elem: float = 15.0,
                    algorithms=("nccl_fp32", "nccl_bf16", "allgather", "direct", "ring", "halving")) -> list[dict]:
    """Rows ``{"world", "algorithm", "bytes_per_rank", "steps", "ms", "vs_fp32"}`` for each world size
    and algorithm (see the module doc for the formula and the calibration).

    >>> rows = allreduce_model(11_700_000, [2, 256], algorithms=("nccl_fp32", "ring"))
    >>> [(r["world"], r["algorithm"], round(r["bytes_per_rank"] / 11.7e6, 2)) for r in rows]
    [(2, 'nccl_fp32', 4.0), (2, 'ring', 1.0), (256, 'nccl_fp32', 7.97), (256, 'ring', 1.99)]
    """
    rows = []
    for n in worlds:
        if n < 1:
            raise ValueError(f"world sizes must be >= 1, got {n}")
        base = None
        for alg in algorithms:
            nbytes = _bytes(alg, numel, n, bytes_per_code)
            steps = _steps(alg, n)
            if alg.startswith("nccl"):
                calls, hbm = 1, 0.0  # NCCL reduces inside its kernels, fused with the transfer
            else:
                calls = _calls(alg, n)
                hbm = hbm_bytes_per_elem * numel / hbm_bw
            t = calls * alpha_call + steps * alpha_step + nbytes / link_bw + hbm
            row = dict(world=n, algorithm=alg, bytes_per_rank=nbytes, steps=steps, ms=round(t * 1e3, 4))
            if alg == "nccl_fp32":
                base = t
            row["vs_fp32"] = round(base / t, 3) if base else None
            rows.append(row)
    return rows
