"""tcprec.profiling on the CPU: layer scopes and order, shares, breakdown, dtype trace, the kernel
name rules on real kernel names, the event analysis on hand-made GPU-like events (so the CUDA clock
logic is tested here too), Chrome-trace export, the named-layers protocol and bad input."""

import doctest
import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

import tcprec as tp
from tcprec import profiling as P
from tcprec.profiling import CATEGORIES, Event, analyze, classify_kernel, is_tensor_core_kernel, kernel_rule, profile

torch.manual_seed(0)


def small_net():
    return nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 6 * 6, 10)).eval()


X = torch.randn(2, 3, 8, 8)


# ---------------------------------------------------------------------------------------------
# profile() on the CPU
# ---------------------------------------------------------------------------------------------
def test_sequential_layers_breakdown_kernels():
    rep = profile(small_net(), X, warmup=1, iters=3)
    assert rep.clock == "cpu" and rep.device == "cpu" and rep.iters == 3
    assert [lay.name for lay in rep.layers] == ["0", "1", "2", "3"]
    assert [lay.kind for lay in rep.layers] == ["Conv2d", "ReLU", "Flatten", "Linear"]
    assert all(lay.ms > 0 and lay.calls == 1 for lay in rep.layers)
    assert sum(lay.share for lay in rep.layers) == pytest.approx(1.0, abs=1e-6)
    # the layers run inside the inference scope: their sum cannot exceed the wall time
    assert sum(lay.ms for lay in rep.layers) <= rep.wall_ms * (1 + 1e-6)
    assert list(rep.breakdown) == list(CATEGORIES)
    assert all(v >= 0 for v in rep.breakdown.values())
    # cpu clock: ops + the Python time between them make up the wall time
    assert sum(rep.breakdown.values()) == pytest.approx(rep.wall_ms, rel=1e-6)
    assert rep.breakdown["compute"] > 0
    names = [k.name for k in rep.kernels]
    assert {"aten::conv2d", "aten::relu", "aten::linear"} <= set(names)
    assert "aten::mkldnn_convolution" not in names  # only outermost ops
    assert all(k.calls == 1 and not k.tensor_core for k in rep.kernels)
    assert [k.total_ms for k in rep.kernels] == sorted((k.total_ms for k in rep.kernels), reverse=True)
    assert {k.name: k.category for k in rep.kernels}["aten::conv2d"] == "compute"
    assert rep.copies == {"HtoD": 0, "DtoH": 0, "DtoD": 0}
    assert rep.dtype_trace == "fp32 -> 0 -> 1 -> 2 -> 3 -> fp32"
    assert any("cpu clock" in n for n in rep.notes)


def test_hooks_removed_and_model_unchanged():
    m = small_net()
    ref = m(X)
    profile(m, X, warmup=0, iters=1)
    assert all(not mod._forward_hooks and not mod._forward_pre_hooks for mod in m.modules())
    torch.testing.assert_close(m(X), ref, rtol=0, atol=0)


def test_hooks_removed_after_error():
    class Boom(nn.Module):
        def forward(self, x):
            raise RuntimeError("boom")

    m = nn.Sequential(nn.ReLU(), Boom())
    with pytest.raises(RuntimeError, match="boom"):
        profile(m, X, warmup=1, iters=1)
    assert all(not mod._forward_hooks and not mod._forward_pre_hooks for mod in m.modules())


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(4, 4, 3, padding=1)
        self.act = nn.ReLU()

    def forward(self, x):
        return self.act(self.conv(x)) + x


class FusedBlock(Block):
    tcprec_leaf = True  # its conv and act are not layers of their own


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 4, 1)
        self.act = nn.ReLU()
        self.b1 = Block()
        self.b2 = FusedBlock()

    def forward(self, x):
        x = self.act(self.stem(x))
        x = self.b1(x)
        return self.act(self.b2(x))  # the shared ReLU runs twice


def test_leaves_call_order_repeats_and_tcprec_leaf():
    rep = profile(Net().eval(), X, warmup=1, iters=2)
    assert [lay.name for lay in rep.layers] == ["stem", "act", "b1.conv", "b1.act", "b2"]
    calls = {lay.name: lay.calls for lay in rep.layers}
    assert calls["act"] == 2 and calls["b2"] == 1
    assert {lay.name: lay.kind for lay in rep.layers}["b2"] == "FusedBlock"
    assert sum(lay.share for lay in rep.layers) == pytest.approx(1.0, abs=1e-6)
    assert rep.dtype_trace == "fp32 -> stem -> act -> b1.conv -> b1.act -> b2 -> act -> fp32"


def test_root_module_without_children_is_one_layer():
    rep = profile(nn.Linear(4, 3), torch.randn(2, 4), warmup=0, iters=2)
    assert [(lay.name, lay.kind, lay.share) for lay in rep.layers] == [("Linear", "Linear", 1.0)]


# ---------------------------------------------------------------------------------------------
# dtype trace
# ---------------------------------------------------------------------------------------------
class FakeQuantize(nn.Module):
    def forward(self, x):  # tcprec's packed activations: a QTensor in the BitPlanes layout
        return tp.quantize(x.abs(), "uint2", layout=tp.BitPlanes())


class FakeQConv(nn.Module):
    tcprec_leaf = True

    def __init__(self):
        super().__init__()
        self.inner = nn.Identity()  # children are not hooked

    def tcprec_trace(self):
        return ["int32", "scale/bias/relu"]

    def forward(self, p):
        assert isinstance(p, tp.QTensor) and isinstance(p.layout, tp.BitPlanes)
        return p.to_layout(tp.BitPlanes(compact=not p.layout.compact))


class FakeQLinear(nn.Module):
    def tcprec_trace(self):
        return ["int32", "scale/bias", "fp32"]  # a module may name its own output: not repeated

    def forward(self, p):
        return torch.zeros(p.shape[0], 10)


def test_dtype_trace_packed_activations():
    m = nn.Sequential()
    m.add_module("quantize", FakeQuantize())
    m.add_module("conv1", FakeQConv())
    m.add_module("conv2", FakeQConv())
    m.add_module("fc", FakeQLinear())
    rep = profile(m, X, warmup=2, iters=2)
    assert rep.dtype_trace == (
        "fp32 -> quantize -> uint2 planes -> conv1 -> int32 -> scale/bias/relu -> uint2 planes -> conv2 -> int32 "
        "-> scale/bias/relu -> uint2 planes -> fc -> int32 -> scale/bias -> fp32"
    )
    assert [lay.name for lay in rep.layers] == ["quantize", "conv1", "conv2", "fc"]


def test_dtype_trace_casts_between_layers():
    class Half(nn.Module):
        def forward(self, x):
            return x.half()

    m = nn.Sequential(nn.ReLU(), Half(), nn.ReLU())
    rep = profile(m, X, warmup=0, iters=1)
    assert rep.dtype_trace == "fp32 -> 0 -> 1 -> fp16 -> 2 -> fp16"


def test_build_dtype_trace_rules():
    b = P._build_dtype_trace
    assert b("fp32", [], "fp32") == "fp32"
    # input changed outside any layer: the new dtype is written before the layer
    assert b("fp32", [("a", "fp32", [], "fp32"), ("b", "fp16", [], "fp16")], "fp16") == "fp32 -> a -> fp16 -> b -> fp16"
    # internal steps always followed by the output, even when it equals the input
    assert b("int8", [("c", "int8", ["int32", "requant"], "int8")], "int8") == "int8 -> c -> int32 -> requant -> int8"


@pytest.mark.parametrize("value, name", [
    (torch.zeros(1), "fp32"), (torch.zeros(1, dtype=torch.float16), "fp16"), (torch.zeros(1, dtype=torch.bfloat16), "bf16"),
    (torch.zeros(1, dtype=torch.int32), "int32"), (torch.zeros(1, dtype=torch.int8), "int8"),
    (torch.zeros(1, dtype=torch.uint8), "uint8"), (torch.zeros(1, dtype=torch.float8_e4m3fn), "fp8e4m3"),
    (torch.zeros(1, dtype=torch.float8_e5m2), "fp8e5m2"), (torch.zeros(1, dtype=torch.float64), "fp64"),
    ((torch.zeros(1), torch.zeros(1, dtype=torch.int32)), "(fp32, int32)"), ({"a": torch.zeros(1)}, "fp32"),
    (3, "int"),
])
def test_describe_value(value, name):
    assert P.describe_value(value) == name


def test_describe_qtensor_and_packed():
    qx = tp.quantize(torch.randn(4, 8), "int4", tp.PerChannel(0))
    assert P.describe_value(qx) == "int4 codes"
    qa = tp.quantize(torch.rand(2, 40), "uint2")
    assert P.describe_value(qa.to_layout(tp.BitPlanes())) == "uint2 planes"
    assert P.describe_value(qa.to_layout(tp.ShiftedInt8())) == "uint2 int8"
    assert P.describe_value(tp.to_fp8(torch.randn(1, 4, 4, 8))) == "float8_e4m3fn codes"  # a Float8() QTensor


def test_bad_tcprec_trace():
    class Bad(nn.Module):
        def tcprec_trace(self):
            return "int32"

        def forward(self, x):
            return x

    with pytest.raises(TypeError, match="tcprec_trace"):
        profile(nn.Sequential(Bad()), X, warmup=0, iters=1)


# ---------------------------------------------------------------------------------------------
# opaque callables and the named-layers protocol
# ---------------------------------------------------------------------------------------------
def test_opaque_callable_has_no_layers():
    m = small_net()

    def engine(x):
        return m(x)

    rep = profile(engine, X, warmup=1, iters=2)
    assert rep.layers == []
    assert any("per-layer times need eager mode" in n and "named_layers" in n for n in rep.notes)
    assert rep.dtype_trace == "fp32 -> engine -> fp32"
    assert "aten::conv2d" in {k.name for k in rep.kernels}


class Engine:
    """An engine in the named-layers protocol: steps that compose to the same result."""

    def __init__(self):
        self.m = small_net()

    def __call__(self, x):
        return self.m(x)

    def named_layers(self):
        return [("features", lambda x: self.m[1](self.m[0](x))), ("flatten", self.m[2]), ("head", self.m[3])]


def test_named_layers_protocol():
    eng = Engine()
    rep = profile(eng, X, warmup=1, iters=2)
    assert [lay.name for lay in rep.layers] == ["features", "flatten", "head"]
    assert [lay.kind for lay in rep.layers] == ["function", "Flatten", "Linear"]
    assert sum(lay.share for lay in rep.layers) == pytest.approx(1.0, abs=1e-6)
    assert rep.dtype_trace == "fp32 -> features -> flatten -> head -> fp32"
    assert any("named_layers()" in n for n in rep.notes)


@pytest.mark.parametrize("layers, match", [
    ("conv", "list of \\(name, fn\\) pairs"),
    ([("a", 3)], r"named_layers\(\)\[0\] must be a \(str, callable\) pair"),
    ([("a", abs), ("a", abs)], "must be unique"),
])
def test_named_layers_bad(layers, match):
    class E:
        def __call__(self, x):
            return x

        def named_layers(self):
            return layers

    with pytest.raises((TypeError, ValueError), match=match):
        profile(E(), X, warmup=0, iters=1)


# ---------------------------------------------------------------------------------------------
# bad input
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs, exc, match", [
    ({"iters": 0}, ValueError, r"iters must be an int >= 1, got iters=0"),
    ({"iters": 2.5}, ValueError, r"iters must be an int >= 1, got iters=2.5"),
    ({"iters": True}, ValueError, r"iters must be an int >= 1"),
    ({"warmup": -1}, ValueError, r"warmup must be an int >= 0, got warmup=-1"),
    ({"trace_path": 3}, TypeError, r"trace_path must be a path"),
    ({"record_shapes": "yes"}, TypeError, r"record_shapes must be True or False"),
])
def test_bad_arguments(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        profile(small_net(), X, **kwargs)


def test_not_callable():
    with pytest.raises(TypeError, match=r"model must be an nn.Module or a callable, got int"):
        profile(3, X)


@pytest.mark.parametrize("x", [np.zeros((2, 3, 8, 8), np.float32), [1.0, 2.0], (), "x", None])
def test_bad_x(x):
    with pytest.raises(TypeError, match=r"x must be a torch.Tensor or a non-empty tuple/list of Tensors.*torch.as_tensor"):
        profile(small_net(), x)


def test_tuple_x_passed_positionally():
    rep = profile(lambda a, b: a @ b, (torch.randn(4, 5), torch.randn(5, 3)), warmup=0, iters=2)
    assert "aten::matmul" in {k.name for k in rep.kernels}


# ---------------------------------------------------------------------------------------------
# kernel name rules, on real names (cuBLAS / cuDNN / CUTLASS / PyTorch from Hopper and Ampere
# profiles in public issue threads and traces, and ours)
# ---------------------------------------------------------------------------------------------
REAL_KERNELS = [
    # (name, category, tensor core)
    # cuBLAS on Hopper
    ("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_TNT", "compute", True),
    ("nvjet_tst_64x8_64x16_2x1_v_bz_splitK_TNT", "compute", True),
    ("nvjet_tss_64x8_64x16_1x1_h_bz_splitK_TNT", "compute", True),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_execute_segment_k_off_kernel__5x_cublas",
     "compute", True),
    ("sm90_xmma_gemm_f32f32_tf32f32_f32_tn_n_tilesize128x128x32_warpgroupsize1x1x1_execute_segment_k_off_kernel__5x_cublas",
     "compute", True),
    ("sm90_xmma_gemm_f64f64_f64f64_f64_nt_n_tilesize64x128x16_stage3_warpsize2x2x1_tensor16x8x8_kernel", "compute", True),
    ("cutlass3x_sm90_tensorop_s64x128x16gemm_f16_f16_f32_f16_f16_128x128x64_1x1x1_0_tnn_align8_warpspecialized_cooperative",
     "compute", True),
    ("void cutlass::Kernel2<cutlass_80_tensorop_bf16_s16816gemm_relu_bf16_64x256_32x4_tn_align8>(T1::Params)", "compute", True),
    ("void cutlass::Kernel2<cutlass_80_wmma_tensorop_f16_s161616gemm_f16_32x32_32x1_nn_align8>(T1::Params)", "compute", True),
    ("ampere_fp16_s16816gemm_fp16_128x128_ldg8_f2f_stages_32x5_tn", "compute", True),
    ("volta_h884gemm_64x64_ldg8_nn", "compute", True),
    ("turing_i8816gemm_int8_128x128_ldg16_stages_64x3_nt", "compute", True),
    # cuDNN convolutions
    ("sm80_xmma_fprop_implicit_gemm_f16f16_f16f32_f32_nhwckrsc_nhwc_tilesize256x64x32_stage3_warpsize4x1x1_g1_tensor16x8x16"
     "_execute_kernel__5x_cudnn", "compute", True),
    ("sm80_xmma_fprop_implicit_gemm_indexed_wo_smem_f16f16_f16f32_f32_nhwckrsc_nhwc_tilesize128x32x64_stage1_warpsize4x1x1"
     "_g1_tensor16x8x16_alignc4_execute_kernel__5x_cudnn", "compute", True),
    ("sm90_xmma_fprop_implicit_gemm_f16f16_f16f32_f32_nhwckrsc_nhwc_tilesize128x128x64_warpgroupsize1x1x1_g1_execute_kernel"
     "__5x_cudnn", "compute", True),
    ("sm80_xmma_dgrad_implicit_gemm_f16f16_f16f32_f32_nhwckrsc_nhwc_tilesize128x128x32_stage4_warpsize2x2x1_g1_tensor16x8x16",
     "compute", True),
    ("void cutlass__5x_cudnn::Kernel<cutlass_tensorop_f16_s16816fprop_optimized_f16_128x64_32x6_nhwc_align8>(T1::Params)",
     "compute", True),
    ("void cutlass__5x_cudnn::Kernel<cutlass_tensorop_s1688fprop_optimized_tf32_128x64_16x6_nhwc_align4>(T1::Params)",
     "compute", True),
    ("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<(int)128, (int)128, (int)64, (int)4>>", "compute", True),
    ("triton_tem_fused_mm_0", "compute", True),
    # CUDA-core GEMMs / convs that must NOT count as tensor core
    ("void cutlass::Kernel2<cutlass_80_simt_sgemm_128x32_8x5_tn_align1>(T1::Params)", "compute", False),
    ("volta_sgemm_128x64_tn", "compute", False),
    ("void implicit_convolve_sgemm<float, float, (int)1024, (int)5, (int)5, (int)3, (int)3, (int)3, (int)1, (bool)0>", "compute",
     False),
    ("void cudnn::cnn::dgrad2d_grouped_direct_kernel<float, int, float, float, (bool)0, (bool)1, (int)1, (int)0>", "compute", False),
    ("sm80_xmma_gemm_f32f32_f32f32_f32_nn_n_tilesize128x128x8_stage3_warpsize2x2x1_ffma_aligna4_alignc4_execute_kernel__51x"
     "_cublas", "compute", False),
    ("void gemv2T_kernel_val<int, int, float, float, float, float, 128, 16, 4, 4, false, false>", "compute", False),
    ("void splitKreduce_kernel<32, 16, int, float, float, float, float, true, false, false>", "compute", False),
    # conversions
    ("void cudnn::engines_precompiled::nchwToNhwcKernel<__half, __half, float, (bool)0, (bool)1, (cudnnKernelDataType_t)0>",
     "type_conversion", False),
    ("void cudnn::engines_precompiled::nhwcToNchwKernel<__half, __half, float, (bool)1, (bool)0, (cudnnKernelDataType_t)0>",
     "type_conversion", False),
    ("void at::native::vectorized_elementwise_kernel<(int)4, at::native::bfloat16_copy_kernel_cuda(at::TensorIteratorBase &)"
     "::[lambda(float) (instance 1)], std::array<char *, (unsigned long)2>>", "type_conversion", False),
    ("triton_poi_fused__to_copy_0", "type_conversion", False),
    # copies, fills, elementwise, reductions
    ("Memcpy HtoD (Pageable -> Device)", "memcpy", False),
    ("Memcpy DtoH (Device -> Pageable)", "memcpy", False),
    ("Memcpy DtoD (Device -> Device)", "memcpy", False),
    ("Memset (Device)", "other", False),
    ("void at::native::elementwise_kernel<(int)128, (int)4, void at::native::gpu_kernel_impl_nocast<at::native::"
     "direct_copy_kernel_cuda(at::TensorIteratorBase &)::[lambda() (instance 3)]", "memcpy", False),
    ("void at::native::<unnamed>::CatArrayBatchedCopy_vectorized<at::native::<unnamed>::OpaqueType<(unsigned int)2>>",
     "memcpy", False),
    ("void at::native::vectorized_elementwise_kernel<(int)4, at::native::FillFunctor<int>, std::array<char *, (unsigned long)1>>",
     "other", False),
    ("void at::native::vectorized_elementwise_kernel<(int)4, at::native::CUDAFunctor_add<c10::Half>, std::array<char *, 3>>",
     "compute", False),
    ("void at::native::reduce_kernel<(int)512, (int)1, at::native::ReduceOp<float, at::native::MeanOps<float, float>>>",
     "compute", False),
    ("void cudnn::bn_fw_inf_1C11_kernel_NCHW<float, float, true, 1>", "compute", False),
    ("void at::native::(anonymous namespace)::max_pool_forward_nhwc<c10::Half, c10::Half>", "compute", False),
    ("triton_red_fused_sum_0", "compute", False),
    ("ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<(unsigned long)4096>)", "other", False),
    # ours
    ("bmma_gemm", "compute", True),
    ("stem_conv", "compute", True),
    ("stem_code_thresholds", "quantize_pack", False),
    ("_float_round_kernel", "quantize_pack", False),
    ("_int_round_kernel", "quantize_pack", False),
    ("_pack_bitplanes_kernel", "quantize_pack", False),
    ("_dgrad_kernel", "compute", True),
    ("_wgrad_kernel", "compute", True),
    ("_sum_splits_kernel", "compute", False),
    ("_conv_fwd_kernel", "compute", True),
    ("_fma_gemm_kernel", "compute", False),
    ("_chunk_gemm_kernel", "compute", True),
    # CPU-clock op names
    ("aten::conv2d", "compute", False),
    ("aten::to", "type_conversion", False),
    ("aten::copy_", "memcpy", False),
    ("aten::view", "other", False),
    ("some_kernel_nobody_knows", "other", False),
]


@pytest.mark.parametrize("name, category, tc", REAL_KERNELS, ids=[n[:40] for n, *_ in REAL_KERNELS])
def test_kernel_rules_on_real_names(name, category, tc):
    assert classify_kernel(name) == category, kernel_rule(name)
    assert is_tensor_core_kernel(name) is tc, kernel_rule(name)


def test_enough_real_names():
    assert len(REAL_KERNELS) >= 25


def test_rules_table_is_well_formed():
    for pattern, category, tc, why in P.KERNEL_RULES:
        re.compile(pattern)
        assert category in CATEGORIES and isinstance(tc, bool) and why
    with pytest.raises(TypeError, match="kernel name must be a str"):
        classify_kernel(None)


def _our_triton_kernels():
    src = Path(P.__file__).with_name("kernels") / "triton"
    out = []
    for path in sorted(src.glob("*.py")):
        text = path.read_text()
        for m in P._JIT_DEF.finditer(text):
            out.append((m.group(1), path.name))
    return out


def test_every_triton_kernel_of_ours_has_a_rule():
    found = _our_triton_kernels()
    assert {"_float_round_kernel", "_pack_bitplanes_kernel", "_dgrad_kernel"} <= {n for n, _ in found}
    for name, _ in found:
        assert kernel_rule(name)[2] != "no rule matched", name
    dot = {r[0].strip("^$") for r in P._our_triton_rules() if r[2]}
    assert {"_dgrad_kernel", "_wgrad_kernel", "_chunk_gemm_kernel"} <= dot  # _chunk_gemm_kernel: through a helper
    assert "_pack_bitplanes_kernel" not in dot and "_fma_gemm_kernel" not in dot


# ---------------------------------------------------------------------------------------------
# the analysis on GPU-like events (what torch.profiler gives on a GPU, in neutral form)
# ---------------------------------------------------------------------------------------------
def _gpu_events():
    """Two inferences.  In each: HtoD copy in layer 'quant', a pack kernel, an nvjet GEMM launched
    in 'conv' that runs on the GPU after the CPU scope closed, a copy launched via an op (no
    runtime event: found through the linked op), a DtoH copy.  Plus a stray kernel outside."""
    ev = [Event("nvjet_stray", "kernel", 1, 2, corr=999)]
    for it in range(2):
        t = 100 + 1000 * it
        c = 10 * it
        ev += [
            Event(P.ITER_SCOPE, "scope", t, t + 900),
            Event(P.LAYER_SCOPE + "quant", "scope", t + 10, t + 100),
            Event("cudaMemcpyAsync", "runtime", t + 20, t + 25, corr=c + 1),
            Event("Memcpy HtoD (Pageable -> Device)", "memcpy", t + 30, t + 40, corr=c + 1),
            Event("cudaLaunchKernel", "runtime", t + 50, t + 55, corr=c + 2),
            Event("_pack_bitplanes_kernel", "kernel", t + 60, t + 80, corr=c + 2),
            Event(P.LAYER_SCOPE + "conv", "scope", t + 110, t + 200),
            Event("aten::mm", "op", t + 115, t + 150, corr=500 + c),
            Event("cudaLaunchKernel", "runtime", t + 120, t + 125, corr=c + 3),
            Event("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_TNT", "kernel", t + 300, t + 600, corr=c + 3),
            Event("Memcpy DtoD (Device -> Device)", "memcpy", t + 610, t + 620, corr=777 + c, linked=500 + c),
            Event(P.LAYER_SCOPE + "out", "scope", t + 210, t + 250),
            Event("cudaMemcpyAsync", "runtime", t + 220, t + 230, corr=c + 4),
            Event("Memcpy DtoH (Device -> Pageable)", "memcpy", t + 700, t + 704, corr=c + 4),
        ]
    return ev


def test_analyze_gpu_events():
    res = analyze(_gpu_events(), {"quant": "Q", "conv": "QConv2d", "out": "O"}, ["quant", "conv", "out"], {"quant": 1})
    layers, breakdown, kernels, copies, clock, wall_ms = res[:6]
    assert clock == "cuda" and res.n_inferences == 2 and res.unattributed_ms == 0
    assert wall_ms == pytest.approx(0.9)
    assert copies == {"HtoD": 1, "DtoH": 1, "DtoD": 1}
    by = {lay.name: lay for lay in layers}
    assert by["quant"].ms == pytest.approx((10 + 20) / 1e3)  # HtoD + pack, GPU time
    assert by["conv"].ms == pytest.approx((300 + 10) / 1e3)  # kernel ran after the scope closed; DtoD via linked op
    assert by["out"].ms == pytest.approx(4 / 1e3)
    assert by["conv"].kind == "QConv2d"
    assert sum(lay.share for lay in layers) == pytest.approx(1.0)
    names = [k.name for k in kernels]
    assert names[0].startswith("nvjet") and "nvjet_stray" not in names
    k = {k.name: k for k in kernels}
    assert k["nvjet_tst_128x256_64x4_1x2_h_bz_coopA_TNT"].tensor_core
    assert k["nvjet_tst_128x256_64x4_1x2_h_bz_coopA_TNT"].calls == 1
    assert not k["_pack_bitplanes_kernel"].tensor_core
    assert breakdown == pytest.approx({"compute": 0.3, "quantize_pack": 0.02, "type_conversion": 0.0,
                                       "memcpy": (10 + 10 + 4) / 1e3, "other": 0.0})


def test_analyze_unattributed_and_linked_scope():
    ev = [Event(P.ITER_SCOPE, "scope", 0, 100, corr=1), Event(P.LAYER_SCOPE + "a", "scope", 10, 20, corr=2),
          Event("_pack_bitplanes_kernel", "kernel", 30, 35, corr=50, linked=2),  # launched in scope a, no runtime event
          Event("glue_elementwise_kernel", "kernel", 40, 48, corr=51, linked=999)]  # launch unknown
    res = analyze(ev, {}, ["a"], None)
    assert res.layers[0].ms == pytest.approx(5 / 1e3) and res.unattributed_ms == pytest.approx(8 / 1e3)
    assert res.breakdown["quantize_pack"] == pytest.approx(5 / 1e3)


def test_analyze_needs_inference_scopes():
    with pytest.raises(RuntimeError, match="no 'tcprec.inference' scopes"):
        analyze([Event("x", "kernel", 0, 1)])


def test_intervals_innermost():
    iv = P._Intervals([Event("a", "scope", 0, 100), Event("b", "scope", 10, 20), Event("c", "scope", 30, 40),
                       Event("d", "scope", 200, 300)])
    assert [getattr(iv.find(t), "name", None) for t in (5, 15, 25, 35, 150, 250, 301)] == \
        ["a", "b", "a", "c", None, "d", None]


# ---------------------------------------------------------------------------------------------
# output: table, JSON, Chrome trace
# ---------------------------------------------------------------------------------------------
def test_table_and_json():
    from rich.console import Console

    rep = profile(small_net(), X, warmup=1, iters=2)
    con = Console(record=True, width=200)
    con.print(rep.table())
    text = con.export_text()
    for s in ("Conv2d", "aten::conv2d", "breakdown", "copies per inference", "dtype trace: fp32 -> 0"):
        assert s in text
    d = json.loads(json.dumps(rep.to_json()))
    assert d["clock"] == "cpu" and [lay["name"] for lay in d["layers"]] == ["0", "1", "2", "3"]
    assert set(d["breakdown"]) == set(CATEGORIES) and d["copies"]["HtoD"] == 0


def test_chrome_trace(tmp_path):
    p1 = tmp_path / "a" / "trace.json"
    rep = profile(small_net(), X, warmup=1, iters=2, trace_path=p1)
    assert p1.is_file()
    names = {e.get("name") for e in json.loads(p1.read_text())["traceEvents"]}
    assert {P.ITER_SCOPE, P.LAYER_SCOPE + "0", P.LAYER_SCOPE + "3"} <= names
    p2 = rep.save_chrome_trace(tmp_path / "b.json")  # exported once, then copied
    assert json.loads(p2.read_text()) == json.loads(p1.read_text())
    p1.unlink()
    with pytest.raises(RuntimeError, match="exports a trace only once"):
        rep.save_chrome_trace(tmp_path / "c.json")


def test_save_chrome_trace_later(tmp_path):
    rep = profile(small_net(), X, warmup=0, iters=1)
    path = rep.save_chrome_trace(tmp_path / "t.json")
    assert P.LAYER_SCOPE + "1" in {e.get("name") for e in json.loads(path.read_text())["traceEvents"]}


def test_doctests():
    assert doctest.testmod(P).failed == 0
