// Direct INT8 convolution of a thin input (C <= 4 channels: a network's RGB stem) on the tensor cores, with the
// next bit-serial layer's epilogue fused: (2x2 stride-2 max-pool of the accumulators ->) codes -> bit planes.
//
// Why a kernel of its own: a C = 3 stem reduces over only R*S*3 bytes a window (27 for a 3x3), too little for an
// implicit GEMM's K tiles.  The Triton route gathers every window into a 32-byte row first (a pass writing 3.2 M
// rows for VGG at batch 256), then runs four dependent one-step accumulations a pooled pixel: 0.50 of VGG w1a2's
// 3.6 ms at batch 256 (H200).  Here a block copies the input patch its tile of outputs reads into
// shared memory once (the rows' bytes by 4-byte cp.async, then a pixel a 32-bit word: its C <= 4 channel bytes,
// zeros above C, shifted out of two raw words), so the window of an output
// pixel is R*S words at fixed offsets from its corner: the A fragments of mma.m16n8k32.s8 are single 32-bit shared
// loads (K = the window's taps, 8 a k-step; taps past R*S read any word, their weights are zero).
//
// Layout of a warp's unit (32 rows of two m16 tiles, mt = 0, 1; MMA row g + 8 h of tile mt):
//   TCP_POOL 2: 8 pooled pixels (g) of one pooled row, each window's 4 pixels at (mt, h) = (dy, dx), so a
//               thread holds all four and pools in registers;
//   TCP_POOL 1: 32 output pixels of one row, pixel mt * 16 + h * 8 + g.
// A block's tile is TPO pooled rows x TQO pooled columns of one image (TQO a multiple of the unit's width);
// its warps take the units in turn, and a unit's 32-channel words one after another (the accumulators of one word
// live at a time).  Blocks along grid.y take the output channels NBW words (<= 4) at a time.
//
// Exactness: the integer sum C = acc + acc_add[k] is the Triton route's (padded taps hold the code of
// value 0, `pad`, so the correction is one number a channel), and the epilogue is the same function of it:
// y = act(float(C) * col_scale[k] + bias[k]), one rounding each; the pool takes the window's largest C' = C ^ f
// (f = -1 where the epilogue is non-increasing in C); the code is the count of integer thresholds C' reaches
// (codes.cuh: threshold_word, computed by stem_code_thresholds).  A block with a column the thresholds mark (a
// non-finite scale or bias, or a column that never reaches the top code) takes the float path for all its columns:
// y as the Triton conv computes it, NaN -> 0, then the float thresholds T_i.
// TCP_FOUT (no pool): the 16-bit float y itself, as the Triton conv stores it, and (TCP_PLANES) the planes of that stored
// value: the integer words then include the rounding to it (threshold_word<FOUT>), the float path rounds before T_i.

#ifndef TCP_OB
#define TCP_OB 2
#endif
#ifndef TCP_OENC
#define TCP_OENC 1
#endif
#ifndef TCP_POOL
#define TCP_POOL 2
#endif
#ifndef TCP_WARPS
#define TCP_WARPS 4
#endif
#ifndef TCP_FOUT
#define TCP_FOUT 0
#endif
#ifndef TCP_PLANES
#define TCP_PLANES 1
#endif

typedef unsigned int u32;
typedef long long i64;

namespace tcp {

constexpr int OB = TCP_OB, OENC = TCP_OENC, NCODE = 1 << OB;
static_assert(OB >= 1 && OB <= 3, "stem_conv: 1..3-bit output codes (integer thresholds)");
static_assert(OENC >= 0 && OENC <= 2, "stem_conv: OENC 0 (twos), 1 (unsigned), 2 (pm1)");

#include "codes.cuh"

}  // namespace tcp

using namespace tcp;

constexpr int PF = TCP_POOL;        // 2: 2x2 stride-2 max-pool, 1: none
constexpr int WARPS = TCP_WARPS;
constexpr int THREADS = WARPS * 32;
constexpr int UW = PF == 2 ? 8 : 32;  // output columns a unit
// blocks an SM the registers must allow (a warp's accumulators are one 32-channel word of 32 rows: 32 registers);
// 3 for four rows' 3-bit codes (ptxas spilled at 4 blocks' 128 registers)
constexpr int MIN_BLOCKS = PF == 1 && OB == 3 ? 3 : 4;
constexpr i64 SAT = 1 << 30;  // saturated thresholds: the sums are < 2^24 in magnitude (<= 484 int8 x int8 products)
static_assert(PF == 1 || PF == 2, "stem_conv: TCP_POOL 1 (none) or 2");
// TCP_FOUT: the float output y itself, (N * PO * QO, K) of 16-bit floats (1: float16, 2: bfloat16), as the Triton
// conv stores it (y = act(float(C) * col_scale[k] + bias[k]) rounded once to the dtype, NaN kept); with TCP_PLANES
// the planes are of that stored value (what a separate quantize pass over the float tensor would write: the dual
// output of a ResNet stem, whose float is the first block's shortcut).  No pool with a float output.
constexpr int FOUT = TCP_FOUT;
enum : int { FOUT_NONE = 0, FOUT_F16 = 1, FOUT_BF16 = 2 };  // its values (stem_conv.py: FLOAT_OUTS)
constexpr bool PLANES = TCP_PLANES != 0;
static_assert(FOUT >= 0 && FOUT <= 2, "stem_conv: TCP_FOUT 0 (none), 1 (float16), 2 (bfloat16)");
static_assert(FOUT == FOUT_NONE || PF == 1, "stem_conv: a float output is not pooled");
static_assert(PLANES || FOUT != FOUT_NONE, "stem_conv: writes planes, a float output or both");

// Words a raw patch row takes in shared memory: its PWD * C bytes from any byte alignment, and one word more (the
// pixel words are shifted out of a word and the next).
__host__ __device__ constexpr int raw_words(int pwd, int c) { return (pwd * c + 3 + 3) / 4 + 1; }

struct StemGeo {
    int N, H, W, C, R, S, sh, sw, ph, pw, dh, dw;
    int PO, QO;    // output rows / columns (pooled for PF = 2)
    int K;         // output channels
    int TPO, TQO;  // a block's tile of outputs
    int TP, TQ;    // tiles along rows / columns of an image
    int PH, PWD;   // the input patch of a tile (words)
    int KW;        // weight words a channel (taps rounded up to a k-step of 8)
};

__device__ __forceinline__ void mma_s8(int (&d)[4], const u32 (&a)[4], u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ void cp_async4(int* smem_dst, const void* gsrc) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"((u32)__cvta_generic_to_shared(smem_dst)), "l"(gsrc));
}

// The kernel's act argument (stem_conv.py: Act).
enum : int { ACT_NONE = 0, ACT_RELU = 1, ACT_LEAKY = 2 };

// y of an output whose integer sum is C, as the Triton conv's epilogue computes it: float(C) * scale, + bias
// (each rounded), ReLU (y > 0 ? y : 0) or LeakyReLU (y > 0 ? y : y * slope); then NaN -> 0 as the quantizer does.
__device__ __forceinline__ float stem_y(int c, float cs, float bi, bool has_bias, int act, float slope) {
    float y = __fmul_rn(__int2float_rn(c), cs);
    if (has_bias) y = __fadd_rn(y, bi);
    if (act == ACT_RELU) y = y > 0.0f ? y : 0.0f;
    else if (act == ACT_LEAKY) y = y > 0.0f ? y : __fmul_rn(y, slope);
    return y == y ? y : 0.0f;
}

// The float output's value before its rounding: the Triton conv's epilogue (bias 0 added where there is none, as its
// zero vector is), NaN kept.
__device__ __forceinline__ float stem_yf(int c, float cs, float bi, int act, float slope) {
    float y = __fadd_rn(__fmul_rn(__int2float_rn(c), cs), bi);
    if (act == ACT_RELU) y = y > 0.0f ? y : 0.0f;
    else if (act == ACT_LEAKY) y = y > 0.0f ? y : __fmul_rn(y, slope);
    return y;
}
// Two values rounded to the stored dtype (nearest even) in one conversion: lo in bits 0..15, hi in 16..31.
__device__ __forceinline__ u32 pack16x2(float lo, float hi) {
    u32 d;
    if constexpr (FOUT == FOUT_BF16) asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(hi), "f"(lo));
    else asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(hi), "f"(lo));
    return d;
}
__device__ __forceinline__ unsigned short stem_round16(float y) { return FOUT == FOUT_BF16 ? f32_to_bf16(y) : f32_to_f16(y); }
__device__ __forceinline__ float stem_load16(unsigned short h) { return FOUT == FOUT_BF16 ? bf16_to_f32(h) : f16_to_f32(h); }

// The threshold words of the kernel's codes: (K, 2^OB) int32, one thread a word (codes.cuh, threshold_word).
extern "C" __global__ void __launch_bounds__(128)
stem_code_thresholds(const float* __restrict__ col_scale, const float* __restrict__ bias,
                     const float* __restrict__ out_scale, int relu, float slope, int K, int* __restrict__ thr) {
    __shared__ float T[NCODE];
    if (threadIdx.x >= 1 && threadIdx.x < NCODE) T[threadIdx.x] = code_threshold(threadIdx.x, out_scale[0]);
    __syncthreads();
    const int idx = blockIdx.x * blockDim.x + threadIdx.x, n = idx / NCODE, i = idx % NCODE;
    if (n >= K) return;
    const float bi = bias != nullptr ? bias[n] : 0.0f;
    thr[idx] = threshold_word<FOUT>(col_scale[n], bi, bias != nullptr, relu != 0, slope, i, T);  // (of the stored float)
}

extern "C" __global__ void __launch_bounds__(THREADS, MIN_BLOCKS)
stem_conv(const signed char* __restrict__ x,  // (N, H, W, C) int8 codes
          const int* __restrict__ wq,         // (ceil(K / 32), KW / 8, 4, 32, 2) weight words in B-fragment order
                                              // (stem_weight_words): tap j's C bytes, zeros past C / R*S / K
          const int* __restrict__ thr,        // (K, 2^OB) threshold words
          const float* __restrict__ col_scale,  // (K,)
          const float* __restrict__ bias,       // (K,) or null
          const float* __restrict__ out_scale,  // (1,)
          int act, float slope,               // 0 none, 1 ReLU, 2 LeakyReLU(slope >= 0)
          const int* __restrict__ acc_add, int pad,  // C = acc + acc_add[k] (or null); padded taps hold code pad
          u32* __restrict__ out, int ldo,     // planes (OB, N * PO * QO, ldo) int32
          int NBW,                            // 32-channel words a block (grid.y: ceil(K / (32 NBW)))
          int N, int H, int W, int C, int R, int S, int sh, int sw, int ph, int pw, int dh, int dw, int PO, int QO,
          int K, int TPO, int TQO, int TP, int TQ, int PH, int PWD, int KW,
          unsigned short* __restrict__ fout) {  // TCP_FOUT: (N * PO * QO, K) float16 / bfloat16 bits, else null
    const StemGeo g{N, H, W, C, R, S, sh, sw, ph, pw, dh, dw, PO, QO, K, TPO, TQO, TP, TQ, PH, PWD, KW};
    extern __shared__ __align__(16) int smem[];
    const int NB = 32 * NBW;  // output channels a block
    int* s_w = smem;                                   // NB x KW, as wq orders them (a lane's b0, b1 one 8-byte load)
    int* s_thr = s_w + NB * g.KW;                       // NB x NCODE
    float* s_cs = reinterpret_cast<float*>(s_thr + NB * NCODE);  // NB
    float* s_bias = s_cs + NB;                          // NB
    int* s_add = reinterpret_cast<int*>(s_bias + NB);  // NB
    float* s_T = reinterpret_cast<float*>(s_add + NB);  // NCODE (float path)
    int* s_tap = reinterpret_cast<int*>(s_T + NCODE);   // KW: (k-step, t) -> the byte offsets of taps 8 ks + t, + 4 + t
    int* s_patch = s_tap + g.KW;                        // PH x PWD
    const int RWS = raw_words(g.PWD, g.C);
    int* s_raw = s_patch + g.PH * g.PWD;                // PH x RWS: the patch rows' image bytes, as aligned words
    __shared__ int s_float;

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, gq = lane >> 2, t = lane & 3;
    const int k0 = blockIdx.y * NB;
    int tile = blockIdx.x;
    const int tq = tile % g.TQ;
    tile /= g.TQ;
    const int tp = tile % g.TP;
    const int n = tile / g.TP;
    const int po0 = tp * g.TPO, qo0 = tq * g.TQO;

    // ---- stage: the input patch's bytes (asynchronous copies, first), weights, epilogue vectors, tap offsets, then the
    // patch's pixel words ----
    // Row pr of the patch (image row ih0 + pr) reads columns iw0 .. iw0 + PWD - 1, those inside the image pc_lo <= pc <
    // pc_hi: contiguous bytes, copied as the aligned 32-bit words that hold them (4-byte cp.async, a warp a row, all
    // in flight at once), then each pixel's C bytes are shifted out of two words.  (Byte loads a pixel channel, a warp
    // a row, 8 pixels a lane in flight, took ~37 instructions a pixel and 18 dependent rounds a block: half of
    // ResNet-18's stem kernel time, ncu.)  A word beyond the row's bytes is never read: each copied word holds one.
    const int ih0 = po0 * PF * g.sh - g.ph, iw0 = qo0 * PF * g.sw - g.pw;
    const int pc_lo = max(0, -iw0), pc_hi = min(g.PWD, g.W - iw0);
    const unsigned char* xn = reinterpret_cast<const unsigned char*>(x) + (i64)n * g.H * g.W * g.C;
    auto row_first = [&](int ih) { return xn + ((i64)ih * g.W + iw0 + pc_lo) * g.C; };  // the row's first image byte
    for (int pr = warp; pr < g.PH; pr += WARPS) {
        const int ih = ih0 + pr;
        if (ih < 0 || ih >= g.H || pc_hi <= pc_lo) continue;
        const unsigned char* first = row_first(ih);
        const int skew = (int)(reinterpret_cast<unsigned long long>(first) & 3);
        const int words = (skew + (pc_hi - pc_lo) * g.C + 3) >> 2;
        const unsigned char* base = first - skew;
        for (int w = lane; w < words; w += 32) cp_async4(s_raw + pr * RWS + w, base + 4 * w);
    }
    asm volatile("cp.async.commit_group;\n" ::);
    if (tid == 0) s_float = 0;
    {  // the block's words of wq as they lie (16-byte copies: a channel word's KW * 32 words), LU a thread in flight
        constexpr int LU = 4;
        const int total = min(NB, (g.K + 31) / 32 * 32 - k0) * g.KW / 4;
        const int4* src = reinterpret_cast<const int4*>(wq + (i64)k0 * g.KW);
        int4* dst = reinterpret_cast<int4*>(s_w);
        for (int base = tid; base < total; base += THREADS * LU) {
            int4 v[LU];
#pragma unroll
            for (int u = 0; u < LU; ++u) {
                const int i = base + u * THREADS;
                if (i < total) v[u] = src[i];
            }
#pragma unroll
            for (int u = 0; u < LU; ++u) {
                const int i = base + u * THREADS;
                if (i < total) dst[i] = v[u];
            }
        }
    }
    __syncthreads();  // s_float
    // the integer path's words a column: u[0] = f, u[i] = t_i - 1 - (f ? -add : add) saturated to +-2^30, so that with
    // c = max over the window of acc ^ f (|acc| < 2^24) the sign bit of u[i] - c is [C' >= t_i]; channels past K get
    // the words of code pattern 0.  Without a pool c = acc ^ f, and u[i] - c = (u[i] - f) + m acc with m = -1 or 1
    // (acc ^ -1 = -acc - 1): the words are then u[0] = m, u[i] - f, one multiply-add a threshold
    for (int c = tid; c < NB; c += THREADS) {
        const int k = k0 + c;
        const bool in = k < g.K;
        const int add = in && acc_add != nullptr ? acc_add[k] : 0;
        s_cs[c] = in ? col_scale[k] : 0.0f;
        s_bias[c] = in && bias != nullptr ? bias[k] : 0.0f;
        s_add[c] = add;
        if constexpr (!PLANES) continue;
        const int f0 = in ? thr[(i64)k * NCODE] : 0, f = f0 == 1 ? 0 : f0;
        s_thr[c * NCODE] = PF == 2 ? f : f == -1 ? 1 : -1;
#pragma unroll
        for (int i = 1; i < NCODE; ++i) {
            i64 u = in ? (i64)thr[(i64)k * NCODE + i] - 1 - (f == -1 ? -(i64)add : (i64)add)
                       : (OENC == ENC_TWOS && i <= NCODE / 2 ? -SAT : SAT);
            s_thr[c * NCODE + i] = (int)(u < -SAT ? -SAT : u > SAT ? SAT : u) - (PF == 2 ? 0 : f);
        }
        if (in && f0 == 1) s_float = 1;
    }
    for (int i = tid; i < g.KW; i += THREADS) {  // entry i = 8 ks + 2 t + e holds tap j = 8 ks + 4 e + t
        const int j = (i & ~7) + 4 * (i & 1) + ((i >> 1) & 3), r = j / g.S, s = j - r * g.S;
        s_tap[i] = j < g.R * g.S ? 4 * (r * g.dh * g.PWD + s * g.dw) : 0;  // past R*S: any word (its weights are zero)
    }
    asm volatile("cp.async.wait_all;\n" ::: "memory");
    __syncthreads();  // (the raw rows, s_float)
    {
        u32 padw = 0;
        for (int c = 0; c < g.C; ++c) padw |= ((u32)pad & 0xFFu) << (8 * c);
        const u32 cmask = g.C == 4 ? 0xFFFFFFFFu : (1u << (8 * g.C)) - 1u;
        for (int pr = warp; pr < g.PH; pr += WARPS) {
            const int ih = ih0 + pr;
            const bool row_in = ih >= 0 && ih < g.H;
            const int skew = row_in ? (int)(reinterpret_cast<unsigned long long>(row_first(ih)) & 3) : 0;
            const int* raw = s_raw + pr * RWS;
            for (int pc = lane; pc < g.PWD; pc += 32) {
                u32 v = padw;
                if (row_in && pc >= pc_lo && pc < pc_hi) {
                    const int o = skew + (pc - pc_lo) * g.C;
                    v = __funnelshift_r((u32)raw[o >> 2], (u32)raw[(o >> 2) + 1], 8 * (o & 3)) & cmask;
                }
                s_patch[pr * g.PWD + pc] = (int)v;
            }
        }
    }
    __syncthreads();
    const bool float_path = s_float != 0;
    if (float_path && tid >= 1 && tid < NCODE) s_T[tid] = code_threshold(tid, out_scale[0]);
    if (float_path) __syncthreads();
    const bool has_bias = bias != nullptr;

    const i64 rows = (i64)g.N * g.PO * g.QO;
    const i64 plane = rows * ldo;
    const int ksteps = g.KW / 8;
    const int upr = g.TQO / UW;          // units a row of the tile
    const int units = g.TPO * upr;

    for (int u = warp; u < units; u += WARPS) {
        const int pol = u / upr, qb = (u - pol * upr) * UW;  // the unit's output row and first column in the tile
        // this thread's four conv pixels (rows g + 8 h of tiles mt): their corners' patch words, as byte addresses
        const char* pb[2][2];
#pragma unroll
        for (int mt = 0; mt < 2; ++mt)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int pl = PF == 2 ? 2 * pol + mt : pol;
                const int ql = PF == 2 ? 2 * (qb + gq) + h : qb + mt * 16 + h * 8 + gq;
                pb[mt][h] = reinterpret_cast<const char*>(s_patch + pl * g.sh * g.PWD + ql * g.sw);
            }
        // the output rows of this thread's values: PF 2 one (its window), PF 1 four (mt, h)
        constexpr int NR = PF == 2 ? 1 : 4;
        int orow[NR];  // (N * PO * QO < 2^31: conv_stem checks)
        bool ok[NR];
#pragma unroll
        for (int r = 0; r < NR; ++r) {
            const int po = po0 + pol;
            const int qo = qo0 + (PF == 2 ? qb + gq : qb + (r >> 1) * 16 + (r & 1) * 8 + gq);
            ok[r] = po < g.PO && qo < g.QO;
            orow[r] = (n * g.PO + po) * g.QO + qo;
        }
#pragma unroll 1
        for (int w = 0; w < NBW; ++w) {  // the unit's 32-channel words: MMAs, then the word's epilogue
            int acc[2][4][4];
#pragma unroll
            for (int mt = 0; mt < 2; ++mt)
#pragma unroll
                for (int j = 0; j < 4; ++j)
#pragma unroll
                    for (int e = 0; e < 4; ++e) acc[mt][j][e] = 0;
            // a k-step: this lane's two tap offsets (one 8-byte load), 8 A words, its B pairs of the 4 tiles (8-byte
            // loads at fixed offsets: wq's fragment order)
            const int2* tp2 = reinterpret_cast<const int2*>(s_tap) + t;
            const int2* wb = reinterpret_cast<const int2*>(s_w) + w * ksteps * 128 + lane;
#pragma unroll 2
            for (int ks = 0; ks < ksteps; ++ks) {
                const int2 o = tp2[4 * ks];
                u32 a[2][4];
#pragma unroll
                for (int mt = 0; mt < 2; ++mt) {
                    a[mt][0] = *reinterpret_cast<const u32*>(pb[mt][0] + o.x);
                    a[mt][1] = *reinterpret_cast<const u32*>(pb[mt][1] + o.x);
                    a[mt][2] = *reinterpret_cast<const u32*>(pb[mt][0] + o.y);
                    a[mt][3] = *reinterpret_cast<const u32*>(pb[mt][1] + o.y);
                }
#pragma unroll
                for (int j = 0; j < 4; ++j) {
                    const int2 b = wb[(4 * ks + j) * 32];
                    mma_s8(acc[0][j], a[0], (u32)b.x, (u32)b.y);
                    mma_s8(acc[1][j], a[1], (u32)b.x, (u32)b.y);
                }
            }
            // ---- the word's epilogue: (the float output,) C, (pool,) code bits, the quad's words ----
            if constexpr (FOUT != FOUT_NONE) {  // the float output
                // this lane's pairs of columns (tiles j, rows r); a word inside K with 16-byte aligned rows is stored
                // with one 16-byte store a row (the quad transposes its pairs so that lane t holds tile t's 8 columns:
                // 4-byte stores filled half sectors), else one 4-byte store a pair
                u32 hv[NR][4];
#pragma unroll
                for (int j = 0; j < 4; ++j) {
                    const int cl = (4 * w + j) * 8 + 2 * t;  // this lane's columns cl, cl + 1
                    const float cs0 = s_cs[cl], cs1 = s_cs[cl + 1], bi0 = s_bias[cl], bi1 = s_bias[cl + 1];
                    const u32 ad0 = (u32)s_add[cl], ad1 = (u32)s_add[cl + 1];
#pragma unroll
                    for (int r = 0; r < NR; ++r) {
                        const int e0 = 2 * (r & 1);
                        hv[r][j] = pack16x2(stem_yf((int)((u32)acc[r >> 1][j][e0] + ad0), cs0, bi0, act, slope),
                                            stem_yf((int)((u32)acc[r >> 1][j][e0 + 1] + ad1), cs1, bi1, act, slope));
                    }
                }
                const int kw0 = k0 + 32 * w;  // the word's first channel
                if ((g.K & 7) == 0 && kw0 + 32 <= g.K) {
#pragma unroll
                    for (int r = 0; r < NR; ++r) {
                        quad_transpose(hv[r], t);  // (every lane of the quad takes part; rows are the quad's)
                        if (ok[r]) st_global_v4(fout + (i64)orow[r] * g.K + kw0 + 8 * t, hv[r]);
                    }
                } else {
                    const bool pairs = (g.K & 1) == 0;  // (aligned)
#pragma unroll
                    for (int j = 0; j < 4; ++j) {
                        const int k = kw0 + j * 8 + 2 * t;
#pragma unroll
                        for (int r = 0; r < NR; ++r) {
                            const u32 h = hv[r][j];
                            if (ok[r]) {
                                unsigned short* o = fout + (i64)orow[r] * g.K + k;
                                if (pairs && k + 1 < g.K) {
                                    *reinterpret_cast<u32*>(o) = h;
                                } else {
                                    if (k < g.K) o[0] = (unsigned short)(h & 0xFFFFu);
                                    if (k + 1 < g.K) o[1] = (unsigned short)(h >> 16);
                                }
                            }
                        }
                    }
                }
            }
            if constexpr (!PLANES) continue;
            // the planes (of the stored float with TCP_FOUT: the integer words include its rounding, threshold_word<FOUT>),
            // an output row at a time (one row's code bits live at once: the registers of four rows spilled) into
            // this lane's share of the plane words V[r * OB + b]; then the quad ORs them, a lane a word
            const int gw = blockIdx.y * NBW + w;
            constexpr int NV = NR * OB;
            u32 V[NV];
#pragma unroll
            for (int r = 0; r < NR; ++r) {
                // sg[b][j][e]: bit b of the code of column (j, e) of the word, in its sign bit (integer path) or as 0 / 1
                // (float path)
                u32 sg[OB][4][2];
                if (!float_path) {
#pragma unroll
                    for (int j = 0; j < 4; ++j)
#pragma unroll
                        for (int e = 0; e < 2; ++e) {
                            const int cl = (4 * w + j) * 8 + 2 * t + e;
                            int th[NCODE];  // f (pool) or m (none), u_1 .. u_{2^OB - 1}
                            if constexpr (NCODE == 2) {
                                const int2 v = *reinterpret_cast<const int2*>(s_thr + cl * NCODE);
                                th[0] = v.x, th[1] = v.y;
                            } else {
#pragma unroll
                                for (int q = 0; q < NCODE / 4; ++q) {
                                    const int4 v = reinterpret_cast<const int4*>(s_thr + cl * NCODE)[q];
                                    th[4 * q] = v.x, th[4 * q + 1] = v.y, th[4 * q + 2] = v.z, th[4 * q + 3] = v.w;
                                }
                            }
                            u32 x[NCODE];  // sign bit: C' reaches threshold i
                            if constexpr (PF == 2) {
                                const int f = th[0];
                                const int c = max(max(acc[0][j][e] ^ f, acc[0][j][2 + e] ^ f),
                                                  max(acc[1][j][e] ^ f, acc[1][j][2 + e] ^ f));
#pragma unroll
                                for (int i = 1; i < NCODE; ++i) x[i] = (u32)(th[i] - c);
                            } else {
                                const int a = acc[r >> 1][j][2 * (r & 1) + e];
#pragma unroll
                                for (int i = 1; i < NCODE; ++i) x[i] = (u32)(th[i] + th[0] * a);
                            }
#pragma unroll
                            for (int b = 0; b < OB; ++b) {  // bit b of the index (index_bit, in the sign bits)
                                const u32 v = index_bit(x, b);
                                sg[b][j][e] = OENC == ENC_TWOS && b == OB - 1 ? ~v : v;
                            }
                        }
                } else {
#pragma unroll
                    for (int j = 0; j < 4; ++j)
#pragma unroll
                        for (int e = 0; e < 2; ++e) {
                            const int cl = (4 * w + j) * 8 + 2 * t + e;
                            const bool inside = k0 + cl < g.K;
                            const float cs = s_cs[cl];
                            const int f = cs >= 0.0f ? 0 : -1, add = s_add[cl];  // as the Triton conv pools: by the scale's sign
                            const int c = PF == 2 ? max(max(acc[0][j][e] ^ f, acc[0][j][2 + e] ^ f),
                                                        max(acc[1][j][e] ^ f, acc[1][j][2 + e] ^ f)) ^ f
                                                  : acc[r >> 1][j][2 * (r & 1) + e];
                            float y = stem_y((int)((u32)c + (u32)add), cs, s_bias[cl], has_bias, act, slope);
                            if constexpr (FOUT != FOUT_NONE) y = stem_load16(stem_round16(y));  // (NaN was 0: the same codes)
                            const u32 pat = inside ? code_pattern(y, s_T) : 0u;
#pragma unroll
                            for (int b = 0; b < OB; ++b) sg[b][j][e] = ((pat >> b) & 1u) << 31;
                        }
                }
#pragma unroll
                for (int b = 0; b < OB; ++b) {
                    // the sign bits of the 8 columns to bits 8 j + e: the top bytes gathered by byte permutes, then
                    // bit 7 of byte j moved to bit e
                    u32 v = 0;
#pragma unroll
                    for (int e = 0; e < 2; ++e) {
                        const u32 lo = __byte_perm(sg[b][0][e], sg[b][1][e], 0x0073);
                        const u32 hi = __byte_perm(sg[b][2][e], sg[b][3][e], 0x7300);
                        v |= (__byte_perm(lo, hi, 0x7610) >> (7 - e)) & (0x01010101u << e);
                    }
                    V[r * OB + b] = v << 2 * t;  // this lane's columns 8 j + 2 t + e
                }
            }
            // the quad's words, ORed four (or two) at a time and scattered a lane a word (3 shuffles for 4 words, not
            // 8), so one store instruction writes four rows' or planes' words
#pragma unroll
            for (int n0 = 0; n0 < NV; n0 += 4) {
                const int cnt = min(4, NV - n0);
                u32 word;
                int n;       // this lane's word, -1: none to store
                if (cnt >= 3) {
                    word = cnt == 4 ? quad_or_scatter<4>(V + n0, t) : quad_or_scatter<3>(V + n0, t);
                    n = t < cnt ? n0 + t : -1;
                } else if (cnt == 2) {
                    word = quad_or_scatter<2>(V + n0, t);
                    n = (t >> 1) == (w & 1) ? n0 + (t & 1) : -1;
                } else {
                    word = quad_or_scatter<1>(V + n0, t);
                    n = t == (w & 3) ? n0 : -1;
                }
                const int r = n / OB, b = n - r * OB;
                int o = orow[0];
                bool okr = ok[0];
#pragma unroll
                for (int q = 1; q < NR; ++q)
                    if (r == q) o = orow[q], okr = ok[q];
                if (n >= 0 && okr && gw < ldo) out[b * plane + (i64)o * ldo + gw] = word;
            }
        }
        // the row's padding words past the channels (rows of packed_words(K) words), by the last channel block
        if (PLANES && blockIdx.y == gridDim.y - 1) {
            const int first = (g.K + 31) / 32;
#pragma unroll
            for (int r = 0; r < NR; ++r)
                if (ok[r] && t == 0)
                    for (int b = 0; b < OB; ++b)
                        for (int wd = first; wd < ldo; ++wd) out[b * plane + (i64)orow[r] * ldo + wd] = 0u;
        }
    }
}
