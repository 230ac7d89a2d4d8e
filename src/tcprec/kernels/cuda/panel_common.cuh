// Device helpers of the LU panel kernels (panel_lu.cu, panel_pivot.cu, panel_cluster.cu), included textually by
// loader.compile_source (the cubin cache key covers this file).

// Pivot search key: 0 for a row that is not available, else 1 + the bits of |a| (non-negative floats order as their
// bit patterns), NaN above +inf.  The largest key wins; the kernels break ties by the smallest row, as LAPACK's isamax
// takes the first maximum.
__device__ __forceinline__ unsigned pivot_key(float x, bool avail = true) {
    if (!avail) return 0u;
    const float v = fabsf(x);
    return v >= 0.0f ? __float_as_uint(v) + 1u : 0x7f800002u;
}

// The optional in-kernel profile: adds the cycles since the last lap to acc[slot] (thread 0 of each block calls it).
template <int N>
__device__ __forceinline__ void lap(bool on, long long (&acc)[N], int slot, long long& t) {
    if (on) {
        const long long now = clock64();
        acc[slot] += now - t;
        t = now;
    }
}
