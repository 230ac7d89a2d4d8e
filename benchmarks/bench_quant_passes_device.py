"""The networks' activation passes on the GPU, one run: bit-plane quantize+pack, pool+quantize+pack, the
INT8 layers' one-pass quantizer, and the thin-stem window gather (Triton against the torch passes it replaced) -- each against a device copy of the same bytes
(read + write), the memory roofline this machine reaches.  Kernel time by CUDA-graph replay.

    PYTHONPATH=src python3 benchmarks/bench_quant_passes_device.py [--out benchmarks/results/quant_passes.json]
"""

from __future__ import annotations

import argparse
import json
import sys

import torch


def _graph_ms(fn, reps: int = 20) -> float:
    fn()
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn()
    g.replay()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(5):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        best = min(best, a.elapsed_time(b) / reps)
    return best


def _copy_ms(nbytes_read: int, nbytes_write: int) -> float:
    """A device copy moving the same bytes: read max(r, w) and write it (the roofline stand-in)."""
    n = max(nbytes_read, nbytes_write)
    src = torch.empty(n, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return _graph_ms(lambda: dst.copy_(src))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/results/quant_passes.json")
    args = ap.parse_args(argv)
    from tcprec.kernels.conv_geometry import ConvGeometry
    from tcprec.kernels.triton import pack as tpack
    from tcprec.kernels.triton import quant_bytes as qb
    from tcprec.ops import qconv
    from tcprec.ops.quantize import _qp_params
    from tcprec.formats import as_format
    from tcprec.ops.quantize import quantize_pack
    from tcprec.packing import packed_words

    dev = torch.cuda.get_device_name()
    rows = []
    s = torch.tensor([0.05], device="cuda")
    u2, u8 = as_format("uint2"), as_format("uint8")
    # (name, N, H, W, C): the networks' activations at batch 256 (fp16, channels_last)
    acts = [("resnet18.l1", 256, 56, 56, 64), ("resnet18.l2", 256, 28, 28, 128), ("resnet18.l3", 256, 14, 14, 256),
            ("vgg.conv3", 256, 56, 56, 256), ("vgg.conv6", 256, 28, 28, 512)]
    for name, N, H, W, C in acts:
        x = torch.randn(N, H, W, C, device="cuda", dtype=torch.float16)
        rows2 = x.reshape(-1, C)
        nb_in, nb_planes, nb_i8 = x.numel() * 2, 2 * N * H * W * packed_words(C) * 4, x.numel()  # planes: 512-bit rows
        new = _graph_ms(lambda: tpack.quantize_pack(rows2, s, 2, *_qp_params(u2)))
        head = rows2[:4099]
        assert torch.equal(tpack.quantize_pack(head, s, 2, *_qp_params(u2)).cpu(),
                           quantize_pack(head.cpu(), u2, s.cpu(), backend="reference"))
        xf = x.float()
        pool = _graph_ms(lambda: tpack.pool_quantize_pack(xf, s, 2, 2, *_qp_params(u2)))
        q8 = _graph_ms(lambda: qconv.quantize_int8_static(x, u8, s))
        q8_torch = _graph_ms(lambda: qconv.quantize_int8_static(x, u8, s, backend="reference"))
        cp = _copy_ms(nb_in, nb_planes)
        cp8 = _copy_ms(nb_in, nb_i8)
        cpf = _copy_ms(xf.numel() * 4, nb_planes // 4)
        rows.append(dict(op="activation", layer=name, shape=[N, H, W, C],
                         quantize_pack_ms={"triton": new, "copy_same_bytes": cp},
                         pool_quantize_pack_fp32_ms={"triton": pool, "copy_same_bytes": cpf},
                         quantize_int8_ms={"triton": q8, "torch": q8_torch, "copy_same_bytes": cp8}))
        print(json.dumps(rows[-1]), flush=True)
    # thin stems: quantize (fp16 image) then the window gather, Triton vs the torch passes
    for name, (N, H, W, C, K, R, S, st, pd) in {"vgg.conv1": (256, 224, 224, 3, 96, 3, 3, 2, 1),
                                                "resnet18.conv1": (256, 224, 224, 3, 64, 7, 7, 4, 3),
                                                "alexnet.conv1": (256, 224, 224, 3, 64, 11, 11, 4, 2)}.items():
        g = ConvGeometry(N, H, W, C, K, R, S, (st, st), (pd, pd), (1, 1))
        x8 = torch.randint(-128, 128, (N, H, W, C), dtype=torch.int8, device="cuda")
        kp = qconv._stem_kp(g)
        tri = _graph_ms(lambda: qb.im2col_rows(x8, R, S, g.stride, g.padding, g.dilation, g.P, g.Q, kp))

        def torch_path():
            b = x8.view(torch.uint8)
            out = torch.zeros((N, g.P, g.Q, kp), dtype=torch.uint8, device="cuda")
            out[..., :R * S * C] = qconv._im2col_codes(b, g).view(N, g.P, g.Q, R * S * C)
            return out

        tor = _graph_ms(torch_path)
        assert torch.equal(torch_path().view(torch.int8),
                           qb.im2col_rows(x8, R, S, g.stride, g.padding, g.dilation, g.P, g.Q, kp))
        cp = _copy_ms(x8.numel(), N * g.P * g.Q * kp)
        rows.append(dict(op="stem_gather", layer=name, kp=kp, ms={"triton": tri, "torch": tor, "copy_out_bytes": cp}))
        print(json.dumps(rows[-1]), flush=True)
    res = {"device": dev, "command": "PYTHONPATH=src python3 benchmarks/bench_quant_passes_device.py",
           "timing": "CUDA-graph replay, 20 calls per replay, best of 5", "rows": rows}
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)
    print("wrote", args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
