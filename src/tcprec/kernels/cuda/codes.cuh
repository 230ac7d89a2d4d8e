// Output codes of the packed epilogues (bmma_gemm.cu, stem_conv.cu): y -> the stored OB-bit code pattern, the float
// thresholds T_i that replace the division, and the integer threshold words that replace the float arithmetic; and the
// helpers their 16-bit float outputs use (bmma_gemm.cu's fp16x2 steps; both kernels' quad transpose to 16-byte stores).
// Included (textually, by runtime.compile_source) inside a namespace that defines OB, OENC, NCODE = 1 << OB and the
// types u32 / i64.

// The values of OENC (TCP_OENC): how an OB-bit code is stored (kernels/cuda/codes.py: Encoding).
enum : int { ENC_TWOS = 0, ENC_UNSIGNED = 1, ENC_PM1 = 2 };

// 16-bit float conversions (round to nearest even), as the bits a float16 / bfloat16 tensor stores.
__device__ __forceinline__ unsigned short f32_to_f16(float x) {
    unsigned short h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(x));
    return h;
}
__device__ __forceinline__ unsigned short f32_to_bf16(float x) {
    unsigned short h;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(x));
    return h;
}
__device__ __forceinline__ float f16_to_f32(unsigned short h) {
    float x;
    asm("cvt.f32.f16 %0, %1;" : "=f"(x) : "h"(h));
    return x;
}
__device__ __forceinline__ float bf16_to_f32(unsigned short h) { return __uint_as_float((u32)h << 16); }

// fp16x2 arithmetic on two outputs at once (bmma_gemm.cu's 16-byte fp16 epilogue with TCP_RES / TCP_DUAL).  Exact
// replacements of the float path's steps, so the outputs stay bit-identical:
//  * add.rn.f16x2 of two float16 values equals rounding their float32 sum to float16 (bmma_gemm's rd(rd(y0) + r)): the
//    sum is rounded twice, to float32 then float16, and with 24 >= 2 * 11 + 2 significand bits the first rounding
//    never changes the second (Figueroa's double-rounding theorem); float16 subnormals are sums of multiples of
//    2^-24, exact in both, and overflow rounds to inf in both.
//  * ReLU as a mask: set.lt gives 0xFFFF for the halves below zero (not -0, not NaN: they stay, as v < 0.0f keeps them).
//  * y >= T for a float16 y and a float T (the planes' thresholds) is y >= f16_ceil(T), the least float16 >= T.
__device__ __forceinline__ u32 hadd2_rn(u32 a, u32 b) {
    u32 d;
    asm("add.rn.f16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
    return d;
}
__device__ __forceinline__ u32 hlt2_mask(u32 a, u32 b) {  // per half: 0xFFFF where a < b (ordered), else 0
    u32 d;
    asm("set.lt.u32.f16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
    return d;
}
__device__ __forceinline__ u32 hge2_mask(u32 a, u32 b) {  // per half: 0xFFFF where a >= b (ordered), else 0
    u32 d;
    asm("set.ge.u32.f16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
    return d;
}
__device__ __forceinline__ u32 f16_ceil(float x) {  // x not NaN: the least float16 >= x, as a bit pattern
    u32 h = f32_to_f16(x);
    if (f16_to_f32((unsigned short)h) < x) h = (h & 0x8000u) ? (h == 0x8000u ? 1u : h - 1u) : h + 1u;
    return h;
}
// The 8 masks of 4 fp16x2 words (half e of word j: 0xFFFF or 0) -> bit 2 j + e of a byte: the halves' low bytes side
// by side (two byte permutes), then each byte's top bit gathered by one multiply (bits 7, 15, 23, 31 -> 28 .. 31).
__device__ __forceinline__ u32 mask_bits8(const u32 (&m)[4]) {
    const u32 lo = __byte_perm(m[0], m[1], 0x6420), hi = __byte_perm(m[2], m[3], 0x6420);
    return (((lo & 0x80808080u) * 0x00204081u) >> 28) | (((hi & 0x80808080u) * 0x00204081u) >> 24);
}

// Bit b of an index that is the count of monotone comparisons ge[1 .. N - 1] (ge[i] = (index >= i)): the parity of
// those at i = m 2^b, so the bits need no count.  T: bool, or u32 masks / sign bits compared bitwise (ge[0] unread).
template <typename T, int N>
__device__ __forceinline__ T index_bit(const T (&ge)[N], int b) {
    T v = 0;
#pragma unroll
    for (int m = 1; (m << b) < N; ++m) v ^= ge[m << b];
    return v;
}

// The index bits of two float16 values h (fp16x2) against the thresholds T16[1 .. 2^OB - 1] (f16_ceil of T_i, both halves):
// pm[b] is 0xFFFF in the halves whose index has bit b set (index_bit; the stored pattern of two's complement flips the
// top bit: the caller's, on the gathered bits).
__device__ __forceinline__ void index_masks2(u32 h, const u32 (&T16)[NCODE], u32 (&pm)[OB]) {
    u32 ge[NCODE];
#pragma unroll
    for (int i = 1; i < NCODE; ++i) ge[i] = hge2_mask(h, T16[i]);
#pragma unroll
    for (int b = 0; b < OB; ++b) pm[b] = index_bit(ge, b);
}

// One 16-byte store (a uint4 assignment let the compiler split it into four 4-byte stores where the words did not sit in
// four aligned registers: four times the store instructions and partial sectors; the asm keeps it one st.v4.  No
// memory clobber: nothing this kernel reads aliases the output)
__device__ __forceinline__ void st_global_v4(void* p, const u32 (&v)[4]) {
    asm volatile("st.global.v4.b32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(v[0]), "r"(v[1]), "r"(v[2]), "r"(v[3]));
}

// The OR over the quad (lanes t = lane & 3) of each of the NW <= 4 words x[0 .. NW), scattered: lane t gets x[t]'s
// (t < NW; with NW = 2 lanes t ^ 2 get it too, with NW = 1 every lane).  Butterfly stages, each lane sending the half
// it does not keep: 2 shuffles for one or two words, 3 for three or four (all-reducing each word took 2 a word).
template <int NW>
__device__ __forceinline__ u32 quad_or_scatter(const u32* x, int t) {
    static_assert(NW >= 1 && NW <= 4, "quad_or_scatter: 1..4 words");
    if constexpr (NW == 1) {
        const u32 v = x[0] | __shfl_xor_sync(0xffffffffu, x[0], 1);
        return v | __shfl_xor_sync(0xffffffffu, v, 2);
    } else if constexpr (NW == 2) {
        const bool h1 = (t & 1) != 0;
        const u32 y = (h1 ? x[1] : x[0]) | __shfl_xor_sync(0xffffffffu, h1 ? x[0] : x[1], 1);  // word h1
        return y | __shfl_xor_sync(0xffffffffu, y, 2);
    } else {
        const bool h1 = (t & 1) != 0, h2 = (t & 2) != 0;
        u32 x3 = 0u;
        if constexpr (NW == 4) x3 = x[3];
        const u32 y0 = (h1 ? x[1] : x[0]) | __shfl_xor_sync(0xffffffffu, h1 ? x[0] : x[1], 1);  // word h1
        const u32 y1 = (h1 ? x3 : x[2]) | __shfl_xor_sync(0xffffffffu, h1 ? x[2] : x3, 1);      // word 2 + h1
        return (h2 ? y1 : y0) | __shfl_xor_sync(0xffffffffu, h2 ? y0 : y1, 2);
    }
}

// 4 x 4 transpose of u32s across a quad (lane t = lane & 3): afterwards x[s] is what lane s held in x[t].  Two
// butterfly stages (lane bit 0, then bit 1), each swapping the off-diagonal halves of 2 x 2 blocks: 4 shuffles.
__device__ __forceinline__ void quad_transpose(u32 (&x)[4], int t) {
#pragma unroll
    for (int bit = 1; bit <= 2; bit <<= 1) {
        const bool hi = (t & bit) != 0;
#pragma unroll
        for (int p = 0; p < 4; ++p) {
            if (p & bit) continue;  // the pair (p, p + bit)
            const u32 r = __shfl_xor_sync(0xffffffffu, hi ? x[p] : x[p + bit], bit);
            if (hi) x[p] = r; else x[p + bit] = r;
        }
    }
}

// y -> OB-bit code, as tcprec.encode(y / s, fmt, "nearest") after quantize's saturation.
__device__ __forceinline__ u32 encode_code(float y, float s) {
    const float v = __fdiv_rn(y, s);
    constexpr int NC = 1 << OB;
    if (OENC == ENC_PM1) {  // pm1: index u = round_half_even((v + (2^OB - 1)) / 2), exactly as kernels/reference.py:
        // v = n + g (n = trunc(v), g = v - n exact), T = n + 2^OB - 1 - [g < 0], u = T / 2 + (T odd and (g != 0
        // or T / 2 odd)).  (Adding 2^OB - 1 to v in floating point would lose a tiny v that decides a tie.)
        const float c = fminf(fmaxf(v, -(float)(NC + 3)), (float)(NC + 3));  // saturates; NaN -> the low end
        const float n = truncf(c), g = c - n;
        const int T = (int)n + (NC - 1) - (g < 0.0f ? 1 : 0);
        const int h = T >> 1;
        const int u = h + ((T & 1) && (g != 0.0f || (h & 1)) ? 1 : 0);
        return (u32)min(max(u, 0), NC - 1);
    }
    const int lo = OENC == ENC_TWOS ? -(NC / 2) : 0;
    const int hi = OENC == ENC_TWOS ? NC / 2 - 1 : NC - 1;
    float r = rintf(fminf(fmaxf(v, (float)lo - 4.0f), (float)hi + 4.0f));  // ties to even value
    int val = min(max((int)r, lo), hi);
    return (u32)val & (u32)(NC - 1);  // two's complement pattern, or the index
}

// The packed epilogue does not divide.  encode_code's index (its code, with two's complement's sign bit
// flipped: 0 .. 2^OB - 1) is a non-decreasing step function of y -- correctly rounded division by s > 0,
// clamping and rounding to an integer are all monotone -- so  index(y) = #{i >= 1 : y >= T_i}  with
// T_i the least float whose index is >= i (NaN compares false: index 0, as encode_code gives it).  Each
// T_i is found once a block by bisection over the floats in order (32 steps of encode_code itself), so the
// comparison is bit-exact with the division it replaces.
__device__ __forceinline__ u32 code_index(float y, float s) {
    const u32 c = encode_code(y, s);
    return OENC == ENC_TWOS ? c ^ (u32)(NCODE / 2) : c;
}
__device__ __forceinline__ i64 float_key(float f) {  // the floats (no NaN) -> integers, order kept
    const int b = __float_as_int(f);
    return b >= 0 ? b : (b ^ 0x7FFFFFFF);
}
__device__ __forceinline__ float key_float(i64 k) {
    const int b = (int)k;
    return __int_as_float(b >= 0 ? b : (b ^ 0x7FFFFFFF));
}
__device__ float code_threshold(int i, float s) {  // T_i, 1 <= i < 2^OB
    i64 lo = float_key(-__int_as_float(0x7F800000)), hi = float_key(__int_as_float(0x7F800000));  // index(-inf) = 0 < i <= 2^OB - 1 = index(inf)
    while (hi - lo > 1) {
        const i64 mid = lo + (hi - lo) / 2;
        if ((int)code_index(key_float(mid), s) >= i) hi = mid; else lo = mid;
    }
    return key_float(hi);
}

// The stored code pattern of y from the float thresholds T_1 .. T_{2^OB - 1} (code_threshold): its index is the count
// of thresholds y reaches (NaN none), two's complement flips the index's top bit (code_index inverted).
__device__ __forceinline__ u32 code_pattern(float y, const float* T) {
    u32 idx = 0;
#pragma unroll
    for (int i = 1; i < NCODE; ++i) idx += y >= T[i] ? 1u : 0u;
    return OENC == ENC_TWOS ? idx ^ (u32)(NCODE / 2) : idx;
}

// y of an output whose int32 value is C: ((float(C) * rs) * cs) + bias, one IEEE rounding each (no FMA
// contraction), then ReLU or LeakyReLU (y < 0 -> slope * y, one multiply; NaN stays NaN, as torch).  RS = false:
// no row scale (rs is 1: float(C) * 1 is float(C), so the multiply is left out).
template <bool RS = true>
__device__ __forceinline__ float y_of(int cv, float rs, float cs, float bi, bool has_bias, bool relu, float slope) {
    float v = __fmul_rn(RS ? __fmul_rn(__int2float_rn(cv), rs) : __int2float_rn(cv), cs);
    v = has_bias ? __fadd_rn(v, bi) : v;  // (not + 0.0f: -0.0 must stay -0.0)
    const float neg = slope == 0.0f ? 0.0f : __fmul_rn(v, slope);
    return relu && v < 0.0f ? neg : v;
}

// Integer code thresholds (packed epilogue, OB <= 3, no row scale: rs = 1).  With a finite column scale cs and
// bias and a slope >= 0, y(C) is monotone in the int32 C -- non-decreasing for cs >= 0, non-increasing below --
// and so is index(y) = #{i : y >= T_i}.  With f = -1 for a non-increasing column (else 0), index is
// non-decreasing in C' = C ^ f (~C reverses the int32 order), so  index = #{i : C' >= t_i}  where t_i is the
// least int32 C' whose index is >= i (INT_MIN when every C' reaches it).  The epilogue then spends one xor and
// 2^OB - 1 integer compares on a value instead of the float arithmetic and float compares.  A column that breaks
// the conditions, or whose index never reaches 2^OB - 1 (a t_i that no int32 reaches), gets word 0 = 1: its
// warp's words take the float path.  bmma_code_thresholds computes the words, (f, t_1 .. t_{2^OB - 1}) a column.
__device__ __forceinline__ int index_of_y(float y, const float* T) {
    int k = 0;
#pragma unroll
    for (int i = 1; i < NCODE; ++i) k += y >= T[i] ? 1 : 0;
    return k;
}

// A column's integer threshold word i (see index_of_y): i = 0 -> f (0 or -1; 1 marks the column for the float path),
// 1 <= i < 2^OB -> t_i, by bisection over the int32 values of C' with y_of (rs = 1) and the float thresholds T_i, so
// the words give the float path's codes.  RD 1 / 2: the codes of y rounded to float16 / bfloat16 first (a kernel that
// stores that float and the planes of the stored value; rounding to nearest is monotone, so the steps stay steps).
template <int RD = 0>
__device__ int threshold_word(float cs, float bi, bool has_bias, bool relu, float slope, int i, const float* T) {
    constexpr int I32_MIN = (int)0x80000000, I32_MAX = 0x7FFFFFFF;
    auto index_of = [&](int c) {
        const float y = y_of(c, 1.0f, cs, bi, has_bias, relu, slope);
        return index_of_y(RD == 1 ? f16_to_f32(f32_to_f16(y)) : RD == 2 ? bf16_to_f32(f32_to_bf16(y)) : y, T);
    };
    const int at_min = index_of(I32_MIN), at_max = index_of(I32_MAX);
    const int f = at_min > at_max ? -1 : 0, lo_index = min(at_min, at_max), hi_index = max(at_min, at_max);
    if (i == 0) {
        const bool ok = isfinite(cs) && isfinite(bi) && (!relu || slope >= 0.0f) && hi_index == NCODE - 1;
        return ok ? f : 1;
    }
    int t = I32_MAX;  // (hi_index < i: the column is marked)
    if (lo_index >= i) {
        t = I32_MIN;
    } else if (hi_index >= i) {  // index(C' = lo ^ f) < i <= index(C' = hi ^ f), index non-decreasing in C'
        i64 lo = I32_MIN, hi = I32_MAX;
        while (hi - lo > 1) {
            const i64 mid = lo + (hi - lo) / 2;
            if (index_of((int)mid ^ f) >= i) hi = mid; else lo = mid;
        }
        t = (int)hi;
    }
    return t;
}
