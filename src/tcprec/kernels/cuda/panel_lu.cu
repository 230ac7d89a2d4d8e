// One leaf of tcprec.linalg's recursive LU panel, with tournament pivoting (CALU), in one launch.
//
// The fp32 working matrix W is row-major, ld columns, rows 0..n (row n is a scratch row); the leaf
// is the tall panel P = W[k:n, k:k+w] (w <= TCP_W).  What the launch does, in four phases separated
// by grid barriers (so every block of the grid must be resident: the host launches at most one
// block per SM and this kernel needs a whole SM per block):
//
//  A  Tournament (Grigori, Demmel & Xiang's CALU).  The m = n - k panel rows are cut into blocks of
//     R = TCP_THREADS rows; each block picks w pivot rows by partial pivoting (thread t holds row t
//     in registers: per column one warp-shuffle argmax, one barrier, one rank-1 update).  Groups of
//     F = R / TCP_W sibling candidate sets are then factored again, from the *original* rows, level
//     by level, in a reduction tree: the last block to finish a group (an atomic counter per parent)
//     goes on with the parent, so the whole tree is one phase and no block waits.  With m <= R this
//     is exactly partial pivoting.  The root writes the w x w packed L11\U11 of its selection (rows
//     in pivot order, unit L below the diagonal) to `top`, and the row interchanges as index
//     vectors dst, src (2 TCP_W each, int64): W[dst[i]] = W[src[i]] for all i at once moves the
//     selected rows to k..k+w-1 and the rows they displace into the freed slots; unused entries
//     pair the scratch row n with itself.
//  B  Gather: tmp[i, :cols] = W[src[i], :cols], tperm[i] = perm[src[i]].
//  C  Scatter: W[dst[i], :cols] = tmp[i], perm[dst[i]] = tperm[i]; the tree's counters are reset for
//     the next launch.  Columns [cols, ld) are left to the caller (the LU's look-ahead updates them
//     on another stream and applies dst / src after joining).
//  D  Rows k..k+w-1 of the panel get L11\U11; rows below get L21 = A21 U11^-1 (one row a thread,
//     forward substitution against U11 in shared memory, fp32).
//
// No pivot is skipped: a zero pivot column (singular panel) picks a row with a zero pivot and
// leaves its multipliers zero, as LAPACK's getf2 does; the LU's breakdown check reports it.  A NaN
// is taken as the largest magnitude, so it reaches the factors and the check rather than vanishing.
//
// Data written by one block and read by another inside the launch (candidates, top, dst/src, tmp,
// the swapped rows) is read with ld.global.cg (L2; L1 is not coherent across SMs).
//
// Compile-time: TCP_W (leaf width, 32 or 64), TCP_THREADS (R, threads a block = rows a tournament
// block; a step costs every thread O(W) instructions, so fewer rows a block = a faster step, more
// blocks in the first level and more tree levels) and TCP_UNROLL (see eliminate).

#ifndef TCP_W
#define TCP_W 32
#endif
#ifndef TCP_THREADS
#define TCP_THREADS 256
#endif
#ifndef TCP_UNROLL
#define TCP_UNROLL 0
#endif
#if TCP_UNROLL
#define STEP_LOOP _Pragma("unroll")
#else
#define STEP_LOOP _Pragma("unroll 1")
#endif

#define NWARPS (TCP_THREADS / 32)
#define FAN_IN (TCP_THREADS / TCP_W)
#define MAX_LEVELS 16
#define FULL_MASK 0xffffffffu

static_assert(TCP_W % 4 == 0 && TCP_W <= 64, "TCP_W: a multiple of 4, at most 64");
static_assert(TCP_THREADS % 32 == 0 && TCP_THREADS <= 1024 && FAN_IN >= 2, "TCP_THREADS: warps, >= 2 * TCP_W");

typedef long long i64;

// Sense-counting grid barrier: bar[0] counts arrivals, bar[1] is the generation.  Needs every block
// resident (see the top).  Memory written before it is visible (through L2) after it.
__device__ __forceinline__ void grid_sync(unsigned* bar) {
    __syncthreads();
    if (threadIdx.x == 0) {
        volatile unsigned* gen_p = bar + 1;
        const unsigned gen = *gen_p;
        __threadfence();
        if (atomicAdd(bar, 1u) == gridDim.x - 1) {
            atomicExch(bar, 0u);
            __threadfence();
            atomicAdd(bar + 1, 1u);
        } else {
            while (*gen_p == gen) __nanosleep(64);
        }
        __threadfence();
    }
    __syncthreads();
}

// pivot_key (among equal keys the smallest thread wins: ballot + ffs)
#include "panel_common.cuh"

// (max key, first lane holding it) over a warp: one redux and one ballot.
__device__ __forceinline__ unsigned warp_argmax(unsigned key, int& lane_of_max) {
    const unsigned best = __reduce_max_sync(FULL_MASK, key);
    lane_of_max = __ffs(__ballot_sync(FULL_MASK, key == best)) - 1;
    return best;
}

struct Smem {
    alignas(16) float row[2][NWARPS][TCP_W];  // each warp's best row of the step (double-buffered by step parity)
    unsigned key[2][NWARPS];
    int who[2][NWARPS];
    int id[TCP_THREADS];  // global row of each thread's row, -1: none
    int pick[TCP_W];      // thread chosen at step j, -1: none
    alignas(16) float u[TCP_W * TCP_W];
    int nb[MAX_LEVELS];    // tree nodes per level
    int coff[MAX_LEVELS];  // candidate offset of each level
    int noff[MAX_LEVELS];  // counter offset of each level (level >= 1)
    int levels;
    int flag;
    int disp[TCP_W];
};

// x[j] = l and x[c] -= l * row[c] for c > j (row: 16-byte aligned shared memory): one step of the
// elimination, on a row held in registers (static indices, predicated on the step j).
__device__ __forceinline__ void eliminate_row(float (&x)[TCP_W], float l, const float* row, int j) {
    const float4* r4 = reinterpret_cast<const float4*>(row);
#pragma unroll
    for (int c4 = 0; c4 < TCP_W / 4; ++c4) {
        const float4 r = r4[c4];
        const float rc[4] = {r.x, r.y, r.z, r.w};
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int c = 4 * c4 + e;
            x[c] = c > j ? fmaf(-l, rc[e], x[c]) : (c == j ? l : x[c]);
        }
    }
}

// Partial pivoting on the R rows the block holds (thread t: row a, available while not chosen).
// Returns the step at which this thread's row became the pivot, or -1; s.pick[j] names the thread.
// TCP_UNROLL = 0: the step loop stays rolled and the row, in registers, is read and updated through
// predicated selects over its TCP_W entries; 1: unrolled (static indices, (W - j) FMAs a step, but
// tens of KB of straight-line code).
__device__ __forceinline__ int eliminate(float (&a)[TCP_W], bool avail, int wa, Smem& s) {
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    int order = -1;
    STEP_LOOP
    for (int j = 0; j < TCP_W; ++j) {
        if (j >= wa) break;
        const int buf = j & 1;
        float aj = 0.0f;
#pragma unroll
        for (int c = 0; c < TCP_W; ++c) aj = c == j ? a[c] : aj;
        int lane_max;
        const unsigned wkey = warp_argmax(pivot_key(aj, avail), lane_max);
        if (lane == lane_max) {
            s.key[buf][warp] = wkey;
            s.who[buf][warp] = tid;
            float4* dst = reinterpret_cast<float4*>(s.row[buf][warp]);
#pragma unroll
            for (int c = 0; c < TCP_W; c += 4) dst[c / 4] = make_float4(a[c], a[c + 1], a[c + 2], a[c + 3]);
        }
        __syncthreads();
        int bwarp;
        const unsigned bkey = warp_argmax(lane < NWARPS ? s.key[buf][lane] : 0u, bwarp);
        if (bkey == 0u) {  // no row left to choose (a tail block with fewer rows than columns)
            if (tid == 0) s.pick[j] = -1;
            continue;
        }
        const int bw = s.who[buf][bwarp];
        const float* prow = s.row[buf][bwarp];
        if (tid == bw) {
            avail = false;
            order = j;
            s.pick[j] = tid;
        } else if (avail) {
            const float piv = prow[j];
            const float l = piv != 0.0f ? aj * __frcp_rn(piv) : 0.0f;  // getf2 scales by 1 / pivot too
            eliminate_row(a, l, prow, j);
        }
    }
    __syncthreads();  // s.pick complete
    return order;
}

__device__ __forceinline__ void load_row(float (&a)[TCP_W], const float* W, i64 ld, int id, int k, int wa) {
#pragma unroll
    for (int c = 0; c < TCP_W; ++c) a[c] = (id >= 0 && c < wa) ? __ldcg(W + (i64)id * ld + k + c) : 0.0f;
}

extern "C" __global__ void __launch_bounds__(TCP_THREADS, 1)
panel_calu(float* W, i64 ld, i64* perm, int k, int wa, int n, int cols, int* cand, unsigned* cnt, float* top,
           i64* dst, i64* src, float* tmp, i64* tperm, unsigned* bar) {
    __shared__ __align__(16) Smem s;
    const int tid = threadIdx.x;
    const int m = n - k;
    if (tid == 0) {  // the tree: nodes per level, candidate and counter offsets
        int b = (m + TCP_THREADS - 1) / TCP_THREADS, lv = 0, co = 0, no = 0;
        while (true) {
            s.nb[lv] = b;
            s.coff[lv] = co;
            s.noff[lv] = no;
            co += b * TCP_W;
            if (lv > 0) no += b;
            if (b == 1 || lv == MAX_LEVELS - 1) break;
            b = (b + FAN_IN - 1) / FAN_IN;
            ++lv;
        }
        s.levels = lv + 1;
    }
    __syncthreads();

    // ---- A: tournament ----------------------------------------------------------------------
    float a[TCP_W];
    for (int b = blockIdx.x; b < s.nb[0]; b += gridDim.x) {
        int level = 0, node = b;
        int id = k + b * TCP_THREADS + tid;
        if (id >= n) id = -1;
        while (true) {
            s.id[tid] = id;
            load_row(a, W, ld, id, k, wa);
            const int order = eliminate(a, id >= 0, wa, s);
            if (s.nb[level] == 1) {  // the root: L11\U11 of the selection and the interchanges
                if (order >= 0) {
#pragma unroll
                    for (int c = 0; c < TCP_W; ++c) top[order * TCP_W + c] = a[c];
                }
                if (tid == 0) {
                    for (int t = 0; t < TCP_W; ++t) s.disp[t] = 1;  // 1: top slot t gives up its row
                    for (int j = 0; j < wa; ++j) {
                        const int r = s.id[s.pick[j]];
                        if (r < k + wa) s.disp[r - k] = 0;
                        dst[j] = k + j;
                        src[j] = r;
                    }
                    int nd = 0;
                    for (int t = 0; t < wa; ++t)
                        if (s.disp[t]) s.disp[nd++] = k + t;
                    int ni = 0;
                    for (int j = 0; j < wa; ++j) {
                        const int r = s.id[s.pick[j]];
                        if (r >= k + wa) {
                            dst[wa + ni] = r;
                            src[wa + ni] = s.disp[ni];
                            ++ni;
                        }
                    }
                    for (int i = wa + ni; i < 2 * TCP_W; ++i) {  // unused slots: scratch row to itself
                        dst[i] = n;
                        src[i] = n;
                    }
                }
                break;
            }
            if (tid < TCP_W) {
                const int p = tid < wa ? s.pick[tid] : -1;
                cand[s.coff[level] + node * TCP_W + tid] = p >= 0 ? s.id[p] : -1;
            }
            __threadfence();
            __syncthreads();
            const int parent = node / FAN_IN;
            if (tid == 0) {
                const int children = min(FAN_IN, s.nb[level] - parent * FAN_IN);
                s.flag = atomicAdd(cnt + s.noff[level + 1] + parent, 1u) == (unsigned)(children - 1);
            }
            __syncthreads();
            if (!s.flag) break;  // a sibling is still working: the last one to finish goes on
            __threadfence();
            const int child = parent * FAN_IN + tid / TCP_W;
            id = child < s.nb[level] ? __ldcg(cand + s.coff[level] + child * TCP_W + tid % TCP_W) : -1;
            ++level;
            node = parent;
        }
        __syncthreads();
    }
    grid_sync(bar);

    // ---- B: gather the rows that move (a block a row, threads along it) ----------------------
    const i64 gthreads = (i64)gridDim.x * TCP_THREADS;
    const i64 gtid = (i64)blockIdx.x * TCP_THREADS + tid;
    for (int i = blockIdx.x; i < 2 * TCP_W; i += gridDim.x) {
        const float* from = W + __ldcg(src + i) * ld;
        for (int c = tid; c < cols; c += TCP_THREADS) tmp[(i64)i * cols + c] = __ldcg(from + c);
    }
    if (gtid < 2 * TCP_W) tperm[gtid] = __ldcg(perm + __ldcg(src + gtid));
    grid_sync(bar);

    // ---- C: scatter them --------------------------------------------------------------------
    for (int i = blockIdx.x; i < 2 * TCP_W; i += gridDim.x) {
        float* to = W + __ldcg(dst + i) * ld;
        for (int c = tid; c < cols; c += TCP_THREADS) to[c] = __ldcg(tmp + (i64)i * cols + c);
    }
    if (gtid < 2 * TCP_W) perm[__ldcg(dst + gtid)] = __ldcg(tperm + gtid);
    if (blockIdx.x == 0) {
        const int used = s.noff[s.levels - 1] + (s.levels > 1 ? s.nb[s.levels - 1] : 0);
        for (int i = tid; i < used; i += TCP_THREADS) cnt[i] = 0u;
    }
    grid_sync(bar);

    // ---- D: L11\U11 on top, L21 = A21 U11^-1 below -------------------------------------------
    for (int i = tid; i < TCP_W * TCP_W; i += TCP_THREADS) s.u[i] = __ldcg(top + i);
    __syncthreads();
    for (i64 r = k + gtid; r < n; r += gthreads) {
        float* row = W + r * ld + k;
        if (r < k + wa) {
            const float* u = s.u + (r - k) * TCP_W;
            for (int c = 0; c < wa; ++c) row[c] = u[c];
            continue;
        }
        float x[TCP_W];
#pragma unroll
        for (int c = 0; c < TCP_W; ++c) x[c] = c < wa ? __ldcg(row + c) : 0.0f;
        STEP_LOOP
        for (int i = 0; i < TCP_W; ++i) {
            if (i >= wa) break;
            float xi = 0.0f;
#pragma unroll
            for (int c = 0; c < TCP_W; ++c) xi = c == i ? x[c] : xi;
            xi = xi / s.u[i * TCP_W + i];
            eliminate_row(x, xi, s.u + i * TCP_W, i);
        }
#pragma unroll
        for (int c = 0; c < TCP_W; ++c)
            if (c < wa) row[c] = x[c];
    }
}
