// erf_f32(a): a float32 erf for the GELU epilogues: the algorithm and coefficients of CUDA 13.5's libdevice erff (read
// from the SASS NVRTC 13.5 makes of erff for sm_90), fixed here, and written so that both polynomials run on the FMA
// pipe and one select picks the result.
//
// Fixed, because libdevice's erff changed between toolkits: NVRTC 13.0 (the H200 machine's) compiles other
// coefficients and threshold (|a| >= 1.00295997), and its erff and this one differ by an ulp on 8% of the float32
// inputs; a GELU epilogue calling erff gave results that depended on the toolkit that compiled it.
//
// Two polynomials, because libdevice evaluates one degree-6 polynomial whose argument and seven coefficients it
// selects per element by |a| >= 1.00375843 (s = a^2 below, t = |a| above): seven FSELs an element on the SM's ALU pipe,
// which i8_gemm.cu's GELU epilogue already fills (ncu: the ALU pipe at 57%, ~16 of the loop's ~40 instructions an
// element on it; decision 0169).  Here both run (each step one IEEE-rounded fma), and one select chooses:
//   |a| <  1.00375843:  a + a p(a^2)
//   |a| >= 1.00375843:  copysign(1 - 2^-|a + a q(|a|)|, a)    (ex2.approx.ftz, as libdevice's MUFU.EX2)
// NaN takes the first branch (the comparison is false) and stays NaN; +-inf the second (+-1).  The GPU test
// (tests/gpu/test_i8_gemm_gpu.py) measures its error against float64 erf on all 2^32 float32 inputs.
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
