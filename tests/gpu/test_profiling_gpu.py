"""tcprec.profile on the GPU: the CUDA clock, tensor-core kernels of an fp16 channels_last conv net,
host<->device copies counted from memcpy events, our own kernels classified, Chrome trace with
kernels.  Skipped without a CUDA GPU (tests/conftest.py)."""

import json

import pytest
import torch
from torch import nn

import tcprec as tp
from tcprec import profiling as P
from tcprec.profiling import profile

DEV = "cuda"


def conv_net():
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(64, 128, 3, padding=1), nn.BatchNorm2d(128), nn.ReLU(),
        nn.Conv2d(128, 128, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(128, 10),
    ).eval()


@pytest.fixture(scope="module")
def fp16_net():
    return conv_net().to(DEV, memory_format=torch.channels_last).half()


def test_fp16_channels_last_uses_tensor_cores(fp16_net):
    x = torch.randn(16, 64, 32, 32, device=DEV, dtype=torch.float16).to(memory_format=torch.channels_last)
    rep = profile(fp16_net, x, warmup=3, iters=5)
    assert rep.clock == "cuda" and rep.device == torch.cuda.get_device_name()
    tc = [k for k in rep.kernels if k.tensor_core]
    assert tc, f"no tensor-core kernel among {[k.name for k in rep.kernels]}"
    assert rep.tensor_core_ms > 0
    # the convs carry the GPU time, attributed through launch correlation
    by = {lay.name: lay for lay in rep.layers}
    assert [lay.name for lay in rep.layers] == [str(i) for i in range(8)]
    assert by["0"].ms > 0 and by["3"].ms > 0
    assert sum(lay.share for lay in rep.layers) == pytest.approx(1.0, abs=1e-6)
    assert rep.breakdown["compute"] > 0 and all(v >= 0 for v in rep.breakdown.values())
    # device time cannot exceed the synchronized wall time of a call
    assert sum(rep.breakdown.values()) <= rep.wall_ms * 1.05
    assert rep.copies == {"HtoD": 0, "DtoH": 0, "DtoD": 0}
    assert rep.dtype_trace == "fp16 -> 0 -> 1 -> 2 -> 3 -> 4 -> 5 -> 6 -> 7 -> fp16"


def test_copies_counted(fp16_net):
    def infer(x_cpu):
        x = x_cpu.cuda().half().to(memory_format=torch.channels_last)
        return fp16_net(x).float().cpu()

    x = torch.randn(8, 64, 16, 16)
    rep = profile(infer, x, warmup=2, iters=4)
    assert rep.copies["HtoD"] == 1 and rep.copies["DtoH"] == 1, rep.copies
    assert rep.breakdown["memcpy"] > 0
    # .half() / .float() / channels_last are device kernels: conversion or copy, never compute
    assert rep.breakdown["type_conversion"] + rep.breakdown["memcpy"] > 0
    assert rep.layers == [] and any("named_layers" in n for n in rep.notes)
    assert rep.dtype_trace == "fp32 -> infer -> fp32"


def test_named_layers_on_gpu(fp16_net):
    class Engine:
        def __call__(self, x):
            return fp16_net(x)

        def named_layers(self):
            return [("features", fp16_net[:6]), ("head", fp16_net[6:])]

    x = torch.randn(4, 64, 16, 16, device=DEV, dtype=torch.float16)
    rep = profile(Engine(), x, warmup=2, iters=3)
    assert [lay.name for lay in rep.layers] == ["features", "head"]
    assert rep.layers[0].ms > rep.layers[1].ms > 0


def test_our_cast_kernel_is_quantize_pack():
    x = torch.randn(1 << 20, device=DEV)
    rep = profile(lambda v: tp.cast(v, "e4m3"), x, warmup=2, iters=3)
    cats = {k.name: k.category for k in rep.kernels}
    assert "_float_round_kernel" in cats, cats
    assert cats["_float_round_kernel"] == "quantize_pack" and rep.breakdown["quantize_pack"] > 0


def test_cuda_graph_replay_is_seen(fp16_net):
    x = torch.randn(8, 64, 16, 16, device=DEV, dtype=torch.float16).to(memory_format=torch.channels_last)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s), torch.no_grad():
        for _ in range(3):
            fp16_net(x)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g), torch.no_grad():
        y = fp16_net(x)

    def replay(_):
        g.replay()
        return y

    rep = profile(replay, x, warmup=2, iters=3)
    assert rep.clock == "cuda" and any(k.tensor_core for k in rep.kernels), [k.name for k in rep.kernels]


def test_chrome_trace_has_kernels(tmp_path, fp16_net):
    x = torch.randn(4, 64, 16, 16, device=DEV, dtype=torch.float16).to(memory_format=torch.channels_last)
    rep = profile(fp16_net, x, warmup=1, iters=2, trace_path=tmp_path / "t.json")
    events = json.loads((tmp_path / "t.json").read_text())["traceEvents"]
    names = {e.get("name") for e in events}
    assert P.ITER_SCOPE in names and P.LAYER_SCOPE + "0" in names
    assert {k.name for k in rep.kernels} & names
