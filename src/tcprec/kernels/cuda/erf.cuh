// erf_f32(a): CUDA's erff(a) bit for bit (libdevice's __nv_erff as NVRTC compiles it for sm_90), written so that the
// two polynomials are evaluated on the FMA pipe and one select picks the result.
//
// libdevice evaluates one degree-6 polynomial whose argument and seven coefficients are selected per element by
// |a| >= 1.00375843 (s = a^2 below, t = |a| above): seven FSELs an element on the SM's ALU pipe, which a GELU epilogue
// already fills (i8_gemm.cu's erf GELU: ncu put the ALU pipe at 57% and ~16 of its ~40 instructions an element on it,
// decision 0169).  Here both polynomials run (the same coefficients, the same Horner order, every step one IEEE-rounded
// fma), so each result is the one libdevice's selected polynomial gives, and one select chooses:
//   |a| <  1.00375843:  a + a p(a^2)
//   |a| >= 1.00375843:  copysign(1 - 2^-|a + a q(|a|)|, a)    (ex2.approx.ftz, as libdevice's MUFU.EX2)
// NaN takes the first branch (the comparison is false) and stays NaN; +-inf the second (+-1).  The GPU test
// (tests/gpu/test_i8_gemm_gpu.py) checks erf_f32 against erff on every one of the 2^32 float32 bit patterns.
// Included (textually, by runtime.compile_source); needs nothing else.

__device__ __forceinline__ float ex2_approx_ftz(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

__device__ __forceinline__ float erf_f32(float a) {
    const float t = fabsf(a), s = __fmul_rn(a, a);
    float p = __fmaf_rn(s, __int_as_float(0x388d8e09), __int_as_float(0xba487a7d));  // |a| < 1.00375843: in a^2
    p = __fmaf_rn(s, p, __int_as_float(0x3ba886c1));
    p = __fmaf_rn(s, p, __int_as_float(0xbcdbc4cf));
    p = __fmaf_rn(s, p, __int_as_float(0x3de712bb));
    p = __fmaf_rn(s, p, __int_as_float(0xbec09388));
    p = __fmaf_rn(s, p, __int_as_float(0x3e0375d4));
    float q = __fmaf_rn(t, __int_as_float(0x388e49b7), __int_as_float(0xba73c723));  // above: in |a|
    q = __fmaf_rn(t, q, __int_as_float(0x3be3e044));
    q = __fmaf_rn(t, q, __int_as_float(0xbd19b6f7));
    q = __fmaf_rn(t, q, __int_as_float(0x3e2072ab));
    q = __fmaf_rn(t, q, __int_as_float(0x3f6a18f3));
    q = __fmaf_rn(t, q, __int_as_float(0x3f20f3eb));
    const float small = __fmaf_rn(a, p, a);
    const float big = copysignf(__fadd_rn(1.0f, -ex2_approx_ftz(-fabsf(__fmaf_rn(a, q, a)))), a);
    return t >= __int_as_float(0x3f807b28) ? big : small;
}
