// INT8 GEMM on Hopper's warpgroup tensor cores (sm_90a), warp-specialised and persistent, with the quantized
// linear's epilogue fused.
//
//   acc[m, n] = sum_k a[m, k] * w[n, k]                  a: (M, K) int8, w: (N, K) int8, both row-major (K-major)
//   y[m, n]   = float(acc) * (a_scale * w_scale[n])       int32 -> float32 (round to nearest even), one rounding
//             + bias[n]                                   (optional, fp16 or fp32; one rounding)
//   y         = 0.5 y (1 + erf(y / sqrt 2))               (I8G_GELU: torch's default erf GELU, float32)
//   out       = fp16(y)                                   (I8G_OUT = OUT_F16)
//             = fp16(float(fp16(y)) + float(residual))    (... with I8G_RES: the unfused graph's two roundings)
//             = int8(rint(clamp(y / out_scale, -128, 127)))  (I8G_OUT = OUT_I8: the next layer's int8 codes;
//                                                         IEEE division, NaN -> 0, round half to even)
// Every float step is one IEEE-rounded operation (__fmul_rn / __fadd_rn: no FMA contraction), so the pure-torch
// reference (kernels/reference_i8_gemm.py) computes the same float32 values; only erf (erf.cuh's erf_f32, CUDA 13.5's
// erff algorithm, fixed here) differs from torch's erf.  a_scale and out_scale are read from device memory (one float
// each), so a CUDA graph replays the kernel with whatever scale the tensors hold.
//
// Pipeline.  One producer warpgroup (the last 128 threads) and NC = 2 or 3 consumer warpgroups.  The producer's one
// elected thread loads K steps of 128 bytes (128 int8 values) of the A and W tiles with TMA (cp.async.bulk.tensor.2d,
// box of rows x 128 bytes, 128-byte swizzle, out-of-bounds rows / columns read as zeros) into a ring of STAGES stages,
// each with a "full" mbarrier (one arrival: the producer's arrive.expect_tx, plus the stage's bytes of TMA
// transactions) and an "empty" one (an arrival from every consumer warp that reads the stage).  Steps are numbered
// across the block's tiles (g), so the producer runs ahead into the next tile while the consumers store this one; stage
// s = g % STAGES, phase g / STAGES, whose parity a wait names.  setmaxnreg gives the producer 40 registers and the
// consumers the rest (232); with three consumers 32 and 160.
//
// The wgmma operands.  A stage row is 128 bytes of K, 8-row groups 1024 bytes apart, every tile 1024-byte aligned:
// exactly the K-major 128-byte-swizzled layout wgmma reads through a matrix descriptor (bmma_gemm.cu's smem_desc, the
// same bytes: there a 1024-bit plane row, here 128 int8).  wgmma m64nNk32 s8 takes 32 bytes of K, so a stage is four
// k-steps, the descriptor's start address advanced by 32 bytes (2 in its 16-byte units) each.  The accumulator of
// m64nN s32 is the float one's fragment: warp w of the warpgroup holds rows 16 w + g and 16 w + g + 8 (g = lane / 4),
// columns 8 nt + 2 t + (0, 1) (t = lane % 4) in d[nt][0, 1] and d[nt][2, 3].
//
// Schedule: ping-pong (CUTLASS's KernelTmaWarpSpecializedPingpong).  The block's tiles go to the consumers in turn
// (tile i to consumer i % NC), each multiplying a whole WM x BN tile (4 arrivals on "empty"), so that one's wgmmas run
// while the others' epilogues do.  With three, two epilogues share the SM's schedulers with one main loop: at K = 768
// an epilogue with the GELU outlasts the main loop (decision 0169).  An order barrier (named barriers 2 .. 1 + NC,
// bar.sync by the waiting warpgroup, bar.arrive by the previous one) makes the consumers issue their main loops in tile
// order: consumer c starts tile i only after the previous one has waited on every stage of tile i - 1.  That order is
// also what keeps the phase parities right: a consumer waits on step g only after step g - STAGES's phase of the same
// stage has completed.  (A cooperative schedule, both consumers on one tile of 2 WM rows, lost to it on every GEMM
// measured: docs/decisions/0163.)
// WM = 64 or 128 rows a consumer multiplies (one or two m64 wgmmas a k-step); BN = 128 or 256; the accumulators,
// (WM / 64) * BN / 2 registers a thread, are at most 128 (64 with three consumers).  Tiles are walked persistently
// (block b: tiles b, b + grid, ...) in a grouped raster (GROUP_M row tiles share their W tiles in L2).
//
// Compile-time parameters (-D, from i8_gemm.py's Variant): I8G_BN, I8G_WM, I8G_STAGES, I8G_OUT (0 fp16, 1 int8
// codes), I8G_GELU, I8G_RES, I8G_NC (consumer warpgroups, 2 or 3), I8G_SMEM (the dynamic shared memory the host
// allocates, checked here).
//
// Epilogue.  The tile's a_scale * w_scale and bias are loaded before the main loop (their latency hidden by it) and
// parked in a per-consumer shared buffer after it.  Then
//   fast     full tiles (every row < M, every column < N), the scales and biases read from the shared buffer.
//            fp16 output (N % 8 == 0): the fp16 words are transposed within each quad (4 shuffles a 4 words) so a
//            lane holds 8 consecutive columns and writes them with one 16-byte store (a warp's store: 8 rows x 64
//            bytes); the residual is prefetched to L2 before the main loop and read with 16-byte loads.
//            int8 codes (N % 16 == 0): a lane packs the 4 codes of two adjacent column groups into a word, the words
//            are quad-transposed the same way, and a lane writes 16 consecutive codes with one 16-byte store (a
//            warp's store: 8 rows x 64 bytes, 4 shuffles a 16 codes).  y and GELU are the general epilogue's
//            (y_of); y / out_scale is the same IEEE quotient, from the reciprocal by Markstein's correction
//            (code_of_rcp, for 2^-64 <= |out_scale| <= 2^64), so the codes are the same.
//   general  everything else (edge tiles, N % 8 != 0, codes with N % 16 != 0): straight from the accumulator
//            fragment, per 8-column group a w_scale and a bias load from global memory, bounds-checked 2- / 4-byte
//            stores.

#ifndef I8G_BN
#define I8G_BN 256
#endif
#ifndef I8G_WM
#define I8G_WM 64
#endif
#ifndef I8G_STAGES
#define I8G_STAGES 4
#endif
#ifndef I8G_OUT
#define I8G_OUT 0
#endif
#ifndef I8G_GELU
#define I8G_GELU 0
#endif
#ifndef I8G_RES
#define I8G_RES 0
#endif
#ifndef I8G_NC
#define I8G_NC 2
#endif

typedef unsigned int u32;
typedef long long i64;
typedef unsigned long long u64;

namespace i8g {

// The values of I8G_OUT (i8_gemm.py: OutKind).
enum : int { OUT_F16 = 0, OUT_I8 = 1 };

constexpr int BN = I8G_BN, WM = I8G_WM, STAGES = I8G_STAGES, OUT = I8G_OUT, NC = I8G_NC;
constexpr bool GELU = I8G_GELU != 0, RES = I8G_RES != 0;
constexpr int MA = WM / 64;                       // m64 wgmmas a consumer stacks along M
constexpr int NT = BN / 8;                        // 8-column groups of the accumulator fragment
constexpr int BM = WM;                            // rows of one output tile (a consumer's)
constexpr int CONS_THREADS = 128 * NC;            // NC consumer warpgroups (2 or 3)
constexpr int THREADS = CONS_THREADS + 128;       // + the producer warpgroup
constexpr int BK = 128;                           // K bytes (int8 values) a stage
constexpr int KK = BK / 32;                       // wgmma k-steps a stage
constexpr int A_STAGE = BM * BK, W_STAGE = BN * BK, STAGE_BYTES = A_STAGE + W_STAGE;
constexpr int READERS = 4;                        // consumer warps that read (and release) one stage
constexpr int GROUP_M = 8;                        // row tiles of a raster group
// dynamic shared memory: up to 1023 bytes to align the ring to 1024, the ring, then STAGES "full" and STAGES "empty"
// mbarriers (8 bytes each) at BAR_OFF from the unaligned start, then each consumer's BN scales and BN biases
// (float32) at EPI_OFF
constexpr int BAR_OFF = 1024 + STAGES * STAGE_BYTES;
constexpr int EPI_OFF = BAR_OFF + 16 * STAGES;
constexpr int EPI_BYTES = NC * BN * 8;
constexpr int SMEM_BYTES = EPI_OFF + EPI_BYTES;
#ifdef I8G_SMEM
static_assert(SMEM_BYTES <= I8G_SMEM, "i8_gemm.Variant.smem_bytes disagrees with the layout");
#endif
static_assert(SMEM_BYTES <= 232448, "more than the 227 KB of dynamic shared memory a block of sm_90 may have");
static_assert(BN == 128 || BN == 256, "BN must be 128 or 256");
static_assert(WM == 64 || WM == 128, "WM must be 64 or 128");
static_assert(MA * NT * 4 <= 128, "at most 128 accumulator registers a thread");
static_assert(NC == 2 || (NC == 3 && MA * NT * 4 <= 64), "2 consumers, or 3 with at most 64 accumulators a thread");
static_assert(BM <= 256, "a TMA box has at most 256 rows");
static_assert(STAGES >= 3, "one stage stays with the wgmmas in flight: >= 3 stages");
static_assert(OUT == OUT_F16 || OUT == OUT_I8, "I8G_OUT must be OUT_F16 or OUT_I8");
static_assert(!RES || OUT == OUT_F16, "the residual is added to the fp16 output only");
static_assert(NT % 8 == 0, "the quad transposes take 4 column groups (fp16) or 8 (codes) at a time");

// ---------------------------------------------------------------------------------------------
// PTX wrappers (the shared ones in hopper.cuh)
// ---------------------------------------------------------------------------------------------

#include "hopper.cuh"
#include "erf.cuh"

__device__ __forceinline__ void grid_dependency_wait() {  // programmatic dependent launch: a no-op without it
    asm volatile("griddepcontrol.wait;\n" ::: "memory");
}

__device__ __forceinline__ void mbar_arrive(u32 bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
// box (c0 bytes of K, c1 rows) of a (rows, K) int8 tensor -> shared memory at `dst`, completing its bytes on `bar`
__device__ __forceinline__ void tma_load(u32 dst, const TensorMap& map, int c0, int c1, u32 bar) {
    const u64 m = reinterpret_cast<u64>(&map);
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes"
        " [%0], [%1, {%2, %3}], [%4];\n" ::"r"(dst),
        "l"(m), "r"(c0), "r"(c1), "r"(bar)
        : "memory");
}
// named barrier `id` of `n` threads: wait for all of them / only count this warp's arrival
__device__ __forceinline__ void named_sync(int id, int n) { asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(n) : "memory"); }
__device__ __forceinline__ void named_arrive(int id, int n) {
    asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(n) : "memory");
}

// wgmma (sm_90a): D(64 x 8NT, int32) += A(64 x 32, s8) * B(8NT x 32, s8)^T, both from shared memory.  The
// accumulators are named one by one (the asm needs NT*4 register operands).
#define I8G_R4(d, i) "+r"(d[i][0]), "+r"(d[i][1]), "+r"(d[i][2]), "+r"(d[i][3])
#define I8G_A4(d, o) I8G_R4(d, (o)), I8G_R4(d, (o) + 1), I8G_R4(d, (o) + 2), I8G_R4(d, (o) + 3)
#define I8G_ACC16(d) I8G_A4(d, 0), I8G_A4(d, 4), I8G_A4(d, 8), I8G_A4(d, 12)
#define I8G_ACC32(d) I8G_ACC16(d), I8G_A4(d, 16), I8G_A4(d, 20), I8G_A4(d, 24), I8G_A4(d, 28)
template <int NT_>
struct Wgmma;
template <> struct Wgmma<16> {  // m64n128k32: 64 accumulators a thread
    static __device__ __forceinline__ void run(int (&d)[16][4], u64 da, u64 db) {
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
                     "wgmma.mma_async.sync.aligned.m64n128k32.s32.s8.s8 {"
                     "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
                     "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
                     "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
                     "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
                     "}, %64, %65, p;\n}\n"
                     : I8G_ACC16(d)
                     : "l"(da), "l"(db), "n"(1));
    }
};
template <> struct Wgmma<32> {  // m64n256k32: 128 accumulators a thread
    static __device__ __forceinline__ void run(int (&d)[32][4], u64 da, u64 db) {
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"
                     "wgmma.mma_async.sync.aligned.m64n256k32.s32.s8.s8 {"
                     "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
                     "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
                     "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
                     "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, "
                     "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, "
                     "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, "
                     "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, "
                     "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127"
                     "}, %128, %129, p;\n}\n"
                     : I8G_ACC32(d)
                     : "l"(da), "l"(db), "n"(1));
    }
};

// 16-bit float conversions (round to nearest even), as the bits a float16 tensor stores (codes.cuh's)
__device__ __forceinline__ unsigned short f32_to_f16(float x) {
    unsigned short h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(x));
    return h;
}
__device__ __forceinline__ float f16_to_f32(unsigned short h) {
    float x;
    asm("cvt.f32.f16 %0, %1;" : "=f"(x) : "h"(h));
    return x;
}

// n / d for 0 <= n < 2^31 without a division instruction (bmma_gemm.cu's FastDiv, Granlund-Montgomery)
struct FastDiv {
    u32 mul;
    int sh;
    __device__ __forceinline__ int div(int n) const { return (int)(((unsigned long long)(u32)n * mul) >> sh); }
};
__device__ __forceinline__ FastDiv fast_div(int d) {
    const int sh = 31 + (d > 1 ? 32 - __clz(d - 1) : 0);
    return {(u32)(((1ull << sh) + (unsigned long long)d - 1ull) / (unsigned long long)d), sh};
}

// the epilogue's value of one accumulator before the store: scaled, biased, GELU'd (float32, no contraction)
__device__ __forceinline__ float y_of(int acc, float sc, float bi, bool has_bias) {
    float y = __fmul_rn((float)acc, sc);
    if (has_bias) y = __fadd_rn(y, bi);
    if (GELU) y = __fmul_rn(__fmul_rn(0.5f, y), __fadd_rn(1.0f, erf_f32(__fmul_rn(y, 0.70710678f))));
    return y;
}
// rint(clamp(q, -128, 127)), NaN -> 0, as one instruction: cvt's float-to-int8 conversion rounds half to even,
// saturates and turns NaN into 0 (checked on the H200 for NaN, +-inf, +-1e10, 3e38, the halves around +-128 / 127,
// -0 and a subnormal); rounding before clamping is the same since the bounds are integers
__device__ __forceinline__ int sat_code(float q) {
    int c;
    asm("cvt.rni.sat.s8.f32 %0, %1;" : "=r"(c) : "f"(q));
    return c;
}
// the int8 code of y: rint(clamp(y / out_scale, -128, 127)), NaN -> 0 (quantize_static's codes for int8)
__device__ __forceinline__ int code_of(float y, float os) { return sat_code(__fdiv_rn(y, os)); }
// code_of(y, os) without a division instruction, given r = RN(1/os) (the fast epilogue, for 2^-64 <= |os| <= 2^64).
// Markstein's correction: q0 = RN(y r) is within an ulp or so of y / os, rem = y - os q0 is exact (an fma), and
// RN(q0 + rem r) is RN(y / os) (Markstein's theorem, r the correctly rounded reciprocal; checked against float64 on
// 3.9e8 float32 pairs, none apart).  div.rn's own fast path is these fmas, but behind a per-element range check and
// branch (FCHK) that splits the unrolled epilogue into a basic block per element.  Where |q0| >= 2^30 (and for +-inf)
// q0 itself is returned: the clamp makes any such quotient 127 / -128, and rem would overflow.  NaN stays NaN -> 0.
__device__ __forceinline__ int code_of_rcp(float y, float os, float r) {
    const float q0 = __fmul_rn(y, r);
    const float q1 = __fmaf_rn(__fmaf_rn(-os, q0, y), r, q0);
    return sat_code(fabsf(q0) < 1073741824.0f ? q1 : q0);
}

// Within each quad (lanes 4q .. 4q + 3): lane t holds w[k] = M[t][k]; afterwards w[k] = M[k][t] (two xor steps, two
// shuffles each).  Here M[t][k] is lane t's fp16 pair of column group k, columns 2t, 2t + 1: after the transpose lane
// t holds the 8 consecutive columns of group t.
__device__ __forceinline__ void quad_transpose(u32 (&w)[4], int lane) {
    const bool b0 = lane & 1, b1 = lane & 2;
#pragma unroll
    for (int p = 0; p < 2; ++p) {  // xor 1: exchange the slots whose low bit differs from the lane's
        const u32 send = b0 ? w[2 * p] : w[2 * p + 1];
        const u32 got = __shfl_xor_sync(0xffffffffu, send, 1);
        if (b0) w[2 * p] = got; else w[2 * p + 1] = got;
    }
#pragma unroll
    for (int q = 0; q < 2; ++q) {  // xor 2: exchange the slot pairs whose high bit differs from the lane's
        const u32 send = b1 ? w[q] : w[2 + q];
        const u32 got = __shfl_xor_sync(0xffffffffu, send, 2);
        if (b1) w[q] = got; else w[2 + q] = got;
    }
}
__device__ __forceinline__ u32 pack_f16(float lo, float hi) { return (u32)f32_to_f16(lo) | ((u32)f32_to_f16(hi) << 16); }
// four int8 codes (ints in [-128, 127]) as the bytes of a word, q0 lowest
__device__ __forceinline__ u32 pack_codes(int q0, int q1, int q2, int q3) {
    return __byte_perm(__byte_perm((u32)q0, (u32)q1, 0x0040), __byte_perm((u32)q2, (u32)q3, 0x0040), 0x5410);
}
// fp16(float(h) + float(r)) on both halves of a word (the residual's two roundings, as epilogue 0)
__device__ __forceinline__ u32 add_res(u32 h, u32 r) {
    const float lo = __fadd_rn(f16_to_f32((unsigned short)(h & 0xffff)), f16_to_f32((unsigned short)(r & 0xffff)));
    const float hi = __fadd_rn(f16_to_f32((unsigned short)(h >> 16)), f16_to_f32((unsigned short)(r >> 16)));
    return pack_f16(lo, hi);
}
// a lane's scales and biases of the G column groups g0 .. g0 + G - 1 (fragment layout: columns 8g + 2 t4, + 1 of
// each), from a consumer's shared buffer.  (A function template, not a lambda with `auto&` parameters: NVRTC 13.0
// takes such a lambda in a kernel for a host function in JIT mode and fails; 13.5 compiles it.)
template <int G>
__device__ __forceinline__ void scale_bias_groups(const float* sh_sc, const float* sh_bi, int g0, int t4,
                                                  float2 (&sc)[G], float2 (&bi)[G]) {
#pragma unroll
    for (int k = 0; k < G; ++k) {
        const int cc = 8 * (g0 + k) + 2 * t4;
        sc[k] = *reinterpret_cast<const float2*>(sh_sc + cc);
        bi[k] = *reinterpret_cast<const float2*>(sh_bi + cc);
    }
}
__device__ __forceinline__ void prefetch_l2(const void* p) { asm volatile("prefetch.global.L2 [%0];\n" ::"l"(p)); }

}  // namespace i8g

using namespace i8g;

// registers a thread after setmaxnreg: the producer keeps 40, the consumers share the rest (<= 232).  setmaxnreg moves
// registers within what the block was launched with: THREADS x (65536 / THREADS rounded down to 8)
constexpr int PRODUCER_REGS = NC == 2 ? 40 : 32;
constexpr int REG_POOL = 65536 / THREADS / 8 * 8 * THREADS;
constexpr int MMA_REGS_ = (REG_POOL - PRODUCER_REGS * 128) / CONS_THREADS / 8 * 8;
constexpr int MMA_REGS = MMA_REGS_ > 232 ? 232 : MMA_REGS_;

extern "C" __global__ void __launch_bounds__(THREADS, 1)
i8_gemm(const __grid_constant__ TensorMap tmA,   // (M, K) int8 a, box (BM rows, 128 bytes), 128 B swizzle
        const __grid_constant__ TensorMap tmW,   // (N, K) int8 w, box (BN rows, 128 bytes), 128 B swizzle
        void* __restrict__ out,                  // (M, N) row-major: fp16 (OUT_F16) or int8 codes (OUT_I8)
        const float* __restrict__ a_scale,       // (1,) the activations' per-tensor scale
        const float* __restrict__ w_scale,       // (N,) the weights' per-channel scales
        const void* __restrict__ bias,           // (N,) fp32 or fp16 (bias_f16), or null
        int bias_f16,
        const float* __restrict__ out_scale,     // (1,) OUT_I8: the output codes' scale
        const unsigned short* __restrict__ residual,  // RES: (M, N) fp16, added to the fp16 output
        int M, int N, int K) {
    extern __shared__ __align__(128) unsigned char smem[];
    grid_dependency_wait();
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;

    // ---- tiles: grouped raster, GROUP_M row tiles share their W tiles in L2; block b takes tiles b, b + grid, ... ----
    const int grid_m = (M + BM - 1) / BM, grid_n = (N + BN - 1) / BN, tiles = grid_m * grid_n;
    const int in_group = GROUP_M * grid_n;
    const FastDiv by_group = fast_div(in_group);
    auto tile_origin = [&](int pid, int& m0, int& n0) {
        const int gi = by_group.div(pid), in = pid - gi * in_group, first_m = gi * GROUP_M;
        const int gm = min(grid_m - first_m, GROUP_M);
        m0 = (first_m + in % gm) * BM;
        n0 = (in / gm) * BN;
    };
    const int k_tiles = (K + BK - 1) / BK;  // K steps (the last one zero-filled past K by TMA)

    // wgmma's 128-byte swizzle needs 1024-byte aligned tiles (the host allocates 1 KB extra)
    const u32 smem_raw = (u32)__cvta_generic_to_shared(smem);
    const u32 smem_base = (smem_raw + 1023u) & ~1023u;
    const u32 full0 = smem_raw + BAR_OFF, empty0 = full0 + 8 * STAGES;
    if (tid == 0) {
#pragma unroll
        for (int s = 0; s < STAGES; ++s) {
            mbar_init(full0 + 8 * s, 1);
            mbar_init(empty0 + 8 * s, READERS);
        }
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();  // barriers initialised before any wait, arrival or TMA

    if (warp >= CONS_THREADS / 32) {  // ---- producer warpgroup: one thread issues every TMA load ----
        shrink_regs<PRODUCER_REGS>();
        if (warp == CONS_THREADS / 32 && lane == 0) {
            int g = 0;  // steps loaded, counted across the block's tiles
            for (int pid = blockIdx.x; pid < tiles; pid += gridDim.x) {
                int m0, n0;
                tile_origin(pid, m0, n0);
                for (int kt = 0; kt < k_tiles; ++kt, ++g) {
                    const int s = g % STAGES;
                    if (g >= STAGES) mbar_wait(empty0 + 8 * s, ((g / STAGES) + 1) & 1);  // step g - STAGES released
                    mbar_arrive_expect_tx(full0 + 8 * s, STAGE_BYTES);
                    const u32 sA = smem_base + s * STAGE_BYTES, sW = sA + A_STAGE;
                    tma_load(sA, tmA, kt * BK, m0, full0 + 8 * s);
                    tma_load(sW, tmW, kt * BK, n0, full0 + 8 * s);
                }
            }
        }
        return;
    }

    // ---- consumer warpgroups ----
    set_max_regs<MMA_REGS>();
    const int cg = warp >> 2;         // this consumer warpgroup (0 .. NC - 1)
    const int wq = warp & 3;          // its warp: rows 16 wq .. of each m64 slab
    const int g4 = lane >> 2, t4 = lane & 3;
    const float a_s = a_scale[0];
    const float o_s = OUT == OUT_I8 ? out_scale[0] : 1.0f;
    // the fast codes epilogue divides through the reciprocal (code_of_rcp): out_scale within 2^-64 .. 2^64 (not 0,
    // inf, NaN or subnormal: those tiles take the general epilogue's division)
    const float o_r = OUT == OUT_I8 ? __frcp_rn(o_s) : 1.0f;
    const bool o_s_ok = fabsf(o_s) >= 5.421010862e-20f && fabsf(o_s) <= 1.844674407e19f;
    const bool has_bias = bias != nullptr;

    int acc[MA][NT][4];

    // one arrival per warp on step g's "empty" barrier
    auto release = [&](int g) {
        if (lane == 0) mbar_arrive(empty0 + 8 * (g % STAGES));
    };
    // the main loop of one tile, steps g0 .. g0 + k_tiles - 1, all but the last step's wgmmas retired on return
    auto mainloop = [&](int g0) {
#pragma unroll
        for (int ma = 0; ma < MA; ++ma)
#pragma unroll
            for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                for (int e = 0; e < 4; ++e) acc[ma][nt][e] = 0;
        for (int kt = 0; kt < k_tiles; ++kt) {
            const int g = g0 + kt, s = g % STAGES;
            mbar_wait(full0 + 8 * s, (g / STAGES) & 1);
            const u32 sA = smem_base + s * STAGE_BYTES, sW = smem_base + s * STAGE_BYTES + A_STAGE;
            const u64 dA = smem_desc(sA), dW = smem_desc(sW);
            wgmma_fence();
#pragma unroll
            for (int kk = 0; kk < KK; ++kk)
#pragma unroll
                for (int ma = 0; ma < MA; ++ma)  // (descriptor addresses count 16-byte units: 32 bytes = 2)
                    Wgmma<NT>::run(acc[ma], dA + (u64)((ma * 64 * BK + kk * 32) >> 4), dW + (u64)((kk * 32) >> 4));
            wgmma_commit();
            wgmma_wait<1>();  // step g-1's wgmmas are done: release its stage
            if (kt > 0) release(g - 1);
        }
    };

    // ---- the general epilogue of the consumer's rows [m0, m0 + WM) x [n0, n0 + BN), straight from the accumulators:
    // any tile, any N, fp16 or codes ----
    auto epilogue_general = [&](int m0, int n0) {
        // column pairs (c, c + 1) load / store as one where both lie inside N and the pair is aligned (N even)
        const bool even_n = (N & 1) == 0;
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
            const int c = n0 + 8 * nt + 2 * t4;
            if (c >= N) continue;
            const bool pair = even_n && c + 1 < N;
            float sc0, sc1 = 0.0f, bi0 = 0.0f, bi1 = 0.0f;
            if (pair) {
                const float2 ws = __ldg(reinterpret_cast<const float2*>(w_scale + c));
                sc0 = __fmul_rn(a_s, ws.x), sc1 = __fmul_rn(a_s, ws.y);
            } else {
                sc0 = __fmul_rn(a_s, __ldg(w_scale + c));
                if (c + 1 < N) sc1 = __fmul_rn(a_s, __ldg(w_scale + c + 1));
            }
            if (has_bias) {
                if (bias_f16) {
                    const unsigned short* b16 = reinterpret_cast<const unsigned short*>(bias);
                    bi0 = f16_to_f32(b16[c]);
                    if (c + 1 < N) bi1 = f16_to_f32(b16[c + 1]);
                } else {
                    const float* b32 = reinterpret_cast<const float*>(bias);
                    if (pair) {
                        const float2 b2 = __ldg(reinterpret_cast<const float2*>(b32 + c));
                        bi0 = b2.x, bi1 = b2.y;
                    } else {
                        bi0 = __ldg(b32 + c);
                        if (c + 1 < N) bi1 = __ldg(b32 + c + 1);
                    }
                }
            }
#pragma unroll
            for (int ma = 0; ma < MA; ++ma)
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const int r = m0 + ma * 64 + 16 * wq + g4 + 8 * h;
                    if (r >= M) continue;
                    const float y0 = y_of(acc[ma][nt][2 * h], sc0, bi0, has_bias);
                    const float y1 = y_of(acc[ma][nt][2 * h + 1], sc1, bi1, has_bias);
                    const i64 o = (i64)r * N + c;
                    if (OUT == OUT_I8) {
                        const int q0 = code_of(y0, o_s), q1 = code_of(y1, o_s);
                        signed char* o8 = reinterpret_cast<signed char*>(out) + o;
                        if (pair) {
                            *reinterpret_cast<unsigned short*>(o8) = (unsigned short)((q0 & 0xff) | ((q1 & 0xff) << 8));
                        } else {
                            o8[0] = (signed char)q0;
                            if (c + 1 < N) o8[1] = (signed char)q1;
                        }
                    } else {
                        unsigned short h0 = f32_to_f16(y0), h1 = f32_to_f16(y1);
                        if (RES) {  // the branch as stored (fp16), plus the residual, rounded to fp16 once more
                            float r0, r1 = 0.0f;
                            if (pair) {
                                const u32 rr = __ldg(reinterpret_cast<const unsigned int*>(residual + o));
                                r0 = f16_to_f32((unsigned short)(rr & 0xffff)), r1 = f16_to_f32((unsigned short)(rr >> 16));
                            } else {
                                r0 = f16_to_f32(residual[o]);
                                if (c + 1 < N) r1 = f16_to_f32(residual[o + 1]);
                            }
                            h0 = f32_to_f16(__fadd_rn(f16_to_f32(h0), r0));
                            h1 = f32_to_f16(__fadd_rn(f16_to_f32(h1), r1));
                        }
                        unsigned short* o16 = reinterpret_cast<unsigned short*>(out) + o;
                        if (pair) {
                            *reinterpret_cast<u32*>(o16) = (u32)h0 | ((u32)h1 << 16);
                        } else {
                            o16[0] = h0;
                            if (c + 1 < N) o16[1] = h1;
                        }
                    }
                }
        }
    };

    // ---- the tile's scales and biases, loaded before the main loop, parked in shared memory after it ----
    const int ct = tid & 127;  // this thread within its consumer warpgroup
    constexpr int PER = BN / 128;  // columns of the tile a consumer thread loads
    float st_sc[PER], st_bi[PER];
    const u32 epi_sc = smem_raw + EPI_OFF + cg * (BN * 8), epi_bi = epi_sc + BN * 4;
    const float* sh_sc = reinterpret_cast<const float*>(smem + EPI_OFF + cg * (BN * 8));
    const float* sh_bi = sh_sc + BN;
    auto stage_load = [&](int m0, int n0) {
#pragma unroll
        for (int q = 0; q < PER; ++q) {
            const int c = n0 + ct + 128 * q;
            st_sc[q] = c < N ? __fmul_rn(a_s, __ldg(w_scale + c)) : 0.0f;
            st_bi[q] = 0.0f;
            if (has_bias && c < N)
                st_bi[q] = bias_f16 ? f16_to_f32(reinterpret_cast<const unsigned short*>(bias)[c])
                                    : __ldg(reinterpret_cast<const float*>(bias) + c);
        }
        if (RES) {  // the residual rows this consumer will add, into L2 while the main loop runs
            constexpr int LINES = BN * 2 / 128;  // 128-byte lines a row
            for (int i = ct; i < WM * LINES; i += 128) {
                const int r = m0 + i / LINES;
                if (r < M) prefetch_l2(residual + (i64)r * N + min(n0 + (i % LINES) * 64, N - 1));
            }
        }
    };
    auto stage_store = [&]() {  // after the main loop: the previous tile's epilogue has read the buffer
        named_sync(2 + NC + cg, 128);
#pragma unroll
        for (int q = 0; q < PER; ++q) {
            asm volatile("st.shared.f32 [%0], %1;\n" ::"r"(epi_sc + 4 * (ct + 128 * q)), "f"(st_sc[q]) : "memory");
            asm volatile("st.shared.f32 [%0], %1;\n" ::"r"(epi_bi + 4 * (ct + 128 * q)), "f"(st_bi[q]) : "memory");
        }
        named_sync(2 + NC + cg, 128);
    };

    // acc[ma][8 jb .. 8 jb + 7][*], the accumulators of column block jb (64 columns), for a run-time jb: one select a
    // block a register.  The GELU epilogues loop over the blocks without unrolling (see the fast epilogues below);
    // unrolled, jb is a constant and the selects fold away.
    auto pick_block = [&](int jb, int (&vv)[MA][8][4]) {
#pragma unroll
        for (int ma = 0; ma < MA; ++ma)
#pragma unroll
            for (int x = 0; x < 8; ++x)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    int v = acc[ma][x][e];
#pragma unroll
                    for (int jj = 1; jj < NT / 8; ++jj) v = jb == jj ? acc[ma][8 * jj + x][e] : v;
                    vv[ma][x][e] = v;
                }
    };

    // ---- the fast epilogue, full fp16 tiles: 16-byte stores of 8 consecutive columns a lane; column block jb ----
    auto fast_block = [&](int m0, int n0, int jb, const int (&vv)[MA][8][4]) {
        unsigned short* o16 = reinterpret_cast<unsigned short*>(out);
#pragma unroll
        for (int jh = 0; jh < 2; ++jh) {
            const int j = 2 * jb + jh;
            float2 sc[4], bi[4];  // groups 4j .. 4j + 3: 8 scales, 8 biases
            scale_bias_groups(sh_sc, sh_bi, 4 * j, t4, sc, bi);
            const int col = n0 + 8 * (4 * j + t4);  // after the transpose: group 4j + t4, 8 columns
            uint4 rr[MA][2];
            if (RES) {  // issued first: their latency overlaps the math below
#pragma unroll
                for (int ma = 0; ma < MA; ++ma)
#pragma unroll
                    for (int h = 0; h < 2; ++h) {
                        const int r = m0 + ma * 64 + 16 * wq + g4 + 8 * h;
                        rr[ma][h] = __ldg(reinterpret_cast<const uint4*>(residual + (i64)r * N + col));
                    }
            }
#pragma unroll
            for (int ma = 0; ma < MA; ++ma)
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    u32 w[4];
#pragma unroll
                    for (int k = 0; k < 4; ++k) {
                        const int(&a)[4] = vv[ma][4 * jh + k];  // group 4j + k
                        w[k] = pack_f16(y_of(a[2 * h], sc[k].x, bi[k].x, has_bias),
                                        y_of(a[2 * h + 1], sc[k].y, bi[k].y, has_bias));
                    }
                    quad_transpose(w, lane);
                    if (RES) {
                        w[0] = add_res(w[0], rr[ma][h].x), w[1] = add_res(w[1], rr[ma][h].y);
                        w[2] = add_res(w[2], rr[ma][h].z), w[3] = add_res(w[3], rr[ma][h].w);
                    }
                    const int r = m0 + ma * 64 + 16 * wq + g4 + 8 * h;
                    uint4* dst = reinterpret_cast<uint4*>(o16 + (i64)r * N + col);
                    *dst = make_uint4(w[0], w[1], w[2], w[3]);
                }
        }
    };
    // ---- the fast epilogue, full int8-code tiles: 16-byte stores of 16 consecutive codes a lane; column block j ----
    auto fast_codes_block = [&](int m0, int n0, int j, const int (&vv)[MA][8][4]) {
        signed char* o8 = reinterpret_cast<signed char*>(out);
        float2 sc[8], bi[8];  // groups 8j .. 8j + 7: 16 scales, 16 biases
        scale_bias_groups(sh_sc, sh_bi, 8 * j, t4, sc, bi);
        const int col = n0 + 8 * (8 * j + 2 * t4);  // after the transpose: groups 8j + 2 t4 and 8j + 2 t4 + 1
#pragma unroll
        for (int ma = 0; ma < MA; ++ma)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                // w[k]: this lane's codes of groups 8j + 2k (bytes 0, 1) and 8j + 2k + 1 (bytes 2, 3), columns
                // 2 t4, 2 t4 + 1 of each
                u32 w[4];
#pragma unroll
                for (int k = 0; k < 4; ++k) {
                    const float2 s0 = sc[2 * k], s1 = sc[2 * k + 1], b0 = bi[2 * k], b1 = bi[2 * k + 1];
                    const int(&a0)[4] = vv[ma][2 * k], (&a1)[4] = vv[ma][2 * k + 1];  // groups 8j + 2k, + 1
                    w[k] = pack_codes(code_of_rcp(y_of(a0[2 * h], s0.x, b0.x, has_bias), o_s, o_r),
                                      code_of_rcp(y_of(a0[2 * h + 1], s0.y, b0.y, has_bias), o_s, o_r),
                                      code_of_rcp(y_of(a1[2 * h], s1.x, b1.x, has_bias), o_s, o_r),
                                      code_of_rcp(y_of(a1[2 * h + 1], s1.y, b1.y, has_bias), o_s, o_r));
                }
                quad_transpose(w, lane);  // w[s]: lane s's codes of groups 8j + 2 t4, 8j + 2 t4 + 1
                // group 8j + 2 t4's 8 codes (the low halves, lanes 0..3), then group 8j + 2 t4 + 1's (high halves)
                const uint4 v = make_uint4(__byte_perm(w[0], w[1], 0x5410), __byte_perm(w[2], w[3], 0x5410),
                                           __byte_perm(w[0], w[1], 0x7632), __byte_perm(w[2], w[3], 0x7632));
                const int r = m0 + ma * 64 + 16 * wq + g4 + 8 * h;
                *reinterpret_cast<uint4*>(o8 + (i64)r * N + col) = v;
            }
    };
    // A fast epilogue's column blocks.  With the GELU, erf's ~20 instructions an element make a fully unrolled
    // epilogue ~75 KB of straight-line code run once a tile, and the consumer stalled on instruction fetch (ncu: 44% of
    // its cycles); looping over the blocks keeps one block's code in the instruction cache (decision 0164).  Without
    // the GELU the code is small and the unrolled loop (no selects) is faster.
    auto one_block = [&](int m0, int n0, int jb) {
        int vv[MA][8][4];
        pick_block(jb, vv);
        if (OUT == OUT_I8) fast_codes_block(m0, n0, jb, vv); else fast_block(m0, n0, jb, vv);
    };
    auto fast_blocks = [&](int m0, int n0) {
        if constexpr (GELU) {
#pragma unroll 1
            for (int jb = 0; jb < NT / 8; ++jb) one_block(m0, n0, jb);
        } else {
#pragma unroll
            for (int jb = 0; jb < NT / 8; ++jb) one_block(m0, n0, jb);
        }
    };
    // the consumer's epilogue of rows [m0, m0 + WM) x [n0, n0 + BN)
    auto epilogue_any = [&](int m0, int n0) {
        if (OUT == OUT_F16 && m0 + WM <= M && n0 + BN <= N && (N & 7) == 0)
            fast_blocks(m0, n0);
        else if (OUT == OUT_I8 && o_s_ok && m0 + WM <= M && n0 + BN <= N && (N & 15) == 0)
            fast_blocks(m0, n0);
        else
            epilogue_general(m0, n0);
    };

    // ---- the block's i-th tile is consumer (i % NC)'s; main loops issued in tile order ----
    const int n_mine = (tiles - (int)blockIdx.x + (int)gridDim.x - 1) / (int)gridDim.x;  // the block's tiles
    for (int i = cg; i < n_mine; i += NC) {
        int m0, n0;
        tile_origin((int)blockIdx.x + i * (int)gridDim.x, m0, n0);
        stage_load(m0, n0);
        if (i > 0) named_sync(2 + cg, 256);  // the previous consumer has waited on every stage of tile i - 1
        mainloop(i * k_tiles);
        // the next consumer's turn: tile i + 1 (cg ^ 1 for two: the SASS the GPU tests validated before NC)
        if (i + 1 < n_mine) named_arrive(2 + (NC == 2 ? cg ^ 1 : (cg + 1) % NC), 256);
        wgmma_wait<0>();
        release(i * k_tiles + k_tiles - 1);
        stage_store();
        epilogue_any(m0, n0);
    }
}
