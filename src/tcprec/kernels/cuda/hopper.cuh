// Hopper (sm_90a) building blocks shared by the warp-specialised TMA + wgmma kernels (bmma_gemm.cu's wgmma paths,
// i8_gemm.cu): the TMA descriptor parameter, the mbarrier pipeline steps, register reallocation between warpgroups,
// wgmma's fence / commit / wait, and the 128-byte-swizzled K-major shared-memory descriptor.  Included (textually,
// by runtime.compile_source) where the includer has defined the types u32 / u64; it includes nothing.

// A CUtensorMap (cuda.h's opaque 128-byte, 64-byte aligned struct), passed by value as a __grid_constant__ kernel
// parameter: NVRTC has no cuda.h, and only its size and alignment matter here.
struct __align__(64) TensorMap {
    u64 opaque[16];
};

__device__ __forceinline__ void mbar_init(u32 bar, u32 count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count));
}
// this thread's arrival, after raising the phase's expected transaction bytes by `bytes`
__device__ __forceinline__ void mbar_arrive_expect_tx(u32 bar, u32 bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
// spin until the phase of parity `parity` of the barrier has completed
__device__ __forceinline__ void mbar_wait(u32 bar, u32 parity) {
    asm volatile(
        "{\n"
        ".reg .pred done;\n"
        "WAIT:\n"
        "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
        "@!done bra WAIT;\n"
        "}\n" ::"r"(bar),
        "r"(parity)
        : "memory");
}

// setmaxnreg: the MMA warpgroups take registers (inc) that the TMA producer warpgroup gives back (dec)
template <int R>
__device__ __forceinline__ void set_max_regs() {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(R));
}
template <int R>
__device__ __forceinline__ void shrink_regs() {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(R));
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory"); }

// Shared-memory matrix descriptor, K-major, 128-byte swizzle: start address >> 4 in bits 0-13, leading-dimension
// offset (unused for swizzled K-major) 1, stride-dimension offset (8 rows of 128 bytes = 1024) >> 4 in bits 32-45,
// base offset 0 (tiles 1024-byte aligned), swizzle mode 1 (128 B) in bits 62-63.
__device__ __forceinline__ u64 smem_desc(u32 addr) {
    return (u64)((addr & 0x3FFFF) >> 4) | ((u64)1 << 16) | ((u64)(1024 >> 4) << 32) | ((u64)1 << 62);
}
