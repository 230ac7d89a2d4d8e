// One whole block column ("panel") of tcprec.linalg's LU with partial pivoting, in one launch.
//
// The fp32 working matrix W is row-major, ld columns; the panel is P = W[k:n, k:k+nb], m = n - k rows.
// Positions below are panel rows (0..m-1, global row k + pos).  Block c of the G-block grid owns the
// positions [c RB, min((c+1) RB, m)), RB = ceil(m / G), thread t its rows r T + t (r < TCP_R): every
// row stays with its block for the whole launch, so all the rank-1 and rank-W updates of a row are
// local and the blocks only talk to pick pivots, swap rows and share U.
//
// The panel is cut into leaves of TCP_W columns [j0, j0 + wb).  A leaf:
//
//  steps  For each column j: every block picks its best row (largest |a_j| among positions >= j0 + j,
//         the first one on ties, NaN above everything) and publishes it; every block reads all G
//         candidates, takes the best (ties: lowest block = lowest position, so the pivots are exactly
//         LAPACK's), reads the pivot row and the row at the diagonal position tp = j0 + j, swaps the two
//         (values and "content ids") in registers, and eliminates column j from its rows below tp.
//         The leaf's columns live in registers (thread t: its rows' W values) the whole time.
//         Publishing needs no atomics and no fences: every word is a 64-bit {tag, value} pair stored
//         with st.relaxed.gpu and polled with ld.relaxed.gpu until its tag (launch epoch, column)
//         appears, so a reader sees each value exactly when it is there.  Slots alternate by column
//         parity (a block can be at most one column ahead of any reader).  A column costs two round
//         trips through L2: the G candidate flags, then the winner's row.
//  (1)    The leaf's columns go back to W (rows >= j0: L21 and L11\U11).
//  (2)    Grid barrier.  The leaf's row interchanges, as one permutation of <= 2 W rows (kept in
//         shared memory while the steps run: the content now at each top position, and at each
//         position below the leaf a pivot row left), are applied to every other column of
//         [0, cols) and to perm; a thread a column gathers its <= 2 W values, and on the panel's
//         columns right of the leaf also computes U12 = L11^-1 A12 (forward substitution, L11 from
//         the pivot rows every block kept).  Columns [cols, ld) are the caller's (the LU's
//         look-ahead updates them on another stream and applies the interchanges after joining).
//  (3)    Grid barrier.  Each block updates its rows below the leaf: A22 -= L21 U12 (fp32 FMAs; L21
//         from registers through shared memory, U12 read once a 32-column chunk).
//
// The launch writes ipiv[j] (0-based panel position of column j's pivot row, LAPACK's order).
// A zero pivot (singular panel) leaves its multipliers zero, as LAPACK's getf2; the LU's breakdown
// check reports it.  Grid barriers (and the polls) need every block resident: the host launches at
// most one block per SM.  Data another block wrote is read with ld.global.cg (L1 is not coherent).
//
// Compile-time: TCP_W (leaf width = lanes of the row reads: 16 or 32), TCP_T (threads a block),
// TCP_R (rows a thread: the panel has at most G TCP_T TCP_R rows).  The leaf's rows live in shared
// memory (a thread a row, stride W + 1: no bank conflicts; runtime column indices without selects).
//
// Measured (H200, benchmarks/results/solve_fused_ab.json; per-phase cycles from `prof`): a column
// costs ~3.7 us at m = 32768 (cuSOLVER getrf: ~6 us on the same panel): ~0.7 us for the candidate
// exchange, ~0.4 us for the pivot-row read (the two L2 round trips; a bare all-gather of 128 flags
// 128 bytes apart costs 0.8 us a step on its own, 1.3 us with the flags packed), ~1.5 us of in-block
// work and barrier waits that are not yet understood (the instruction counts predict a few hundred
// cycles), and ~1 us a column of the per-leaf phases (2) and (3), which re-read the panel.
// Two code-shape traps found on the way: a fully unrolled step loop (registers with static indices)
// is ~300 KB of code and no faster; and a loop `if (i > j)` over a row is compiled to a jump table
// of W cases -- use a bit mask.

#ifndef TCP_W
#define TCP_W 32
#endif
#ifndef TCP_T
#define TCP_T 256
#endif
#ifndef TCP_R
#define TCP_R 1
#endif

#define NW (TCP_T / 32)
#define FULL 0xffffffffu
#define LS (TCP_W + 1)  // shared-memory stride of a leaf row (a thread a row: no bank conflicts)
#define NOPOS 0x7fffffff
#define FSTRIDE 16  // words between two blocks' candidate flags (128 bytes: polled by every block)

static_assert(TCP_W == 16 || TCP_W == 32, "TCP_W: 16 or 32 (one lane a column)");
static_assert(TCP_T % 32 == 0 && NW >= 5 && TCP_T <= 1024, "TCP_T: whole warps, at least 5 (a block polls as "
              "many candidates as it has threads)");
static_assert(TCP_R >= 1 && TCP_R <= 4, "TCP_R: 1..4");

typedef long long i64;
typedef unsigned long long u64;

__device__ __forceinline__ u64 ld_relaxed(const u64* p) {
    u64 v;
    asm volatile("ld.relaxed.gpu.global.b64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    return v;
}
__device__ __forceinline__ void st_relaxed(u64* p, u64 v) {
    asm volatile("st.relaxed.gpu.global.b64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
__device__ __forceinline__ unsigned ld_acquire(const unsigned* p) {
    unsigned v;
    asm volatile("ld.acquire.gpu.global.b32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}
__device__ __forceinline__ void red_release(unsigned* p) {
    asm volatile("red.release.gpu.global.add.u32 [%0], 1;" ::"l"(p) : "memory");
}
// pivot_key, lap (the optional profile: thread 0 of each block, NPROF slots)
#include "panel_common.cuh"
#define NPROF 12

__device__ __forceinline__ u64 word(unsigned tag, unsigned lo) { return ((u64)tag << 32) | lo; }

// Wait for the 64-bit word at p to carry `tag` in its high half (bit 31 of it is a flag the caller
// reads); returns it.
__device__ __forceinline__ u64 poll(const u64* p, unsigned tag) {
    u64 v = ld_relaxed(p);
    while ((((unsigned)(v >> 32)) & 0x7fffffffu) != tag) v = ld_relaxed(p);
    return v;
}

// Grid barrier: the counter is zeroed by the host before the launch; barrier number b waits for
// (b + 1) G arrivals.  Writes before it are visible (through L2) after it.
__device__ __forceinline__ void grid_barrier(unsigned* ctr, unsigned& nbar) {
    ++nbar;
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();
        red_release(ctr);
        const unsigned target = nbar * gridDim.x;
        while (ld_acquire(ctr) < target) {
        }
        __threadfence();
    }
    __syncthreads();
}


// Largest key over the warp, then the smallest position among the lanes holding it (LAPACK's isamax
// takes the first maximum).
__device__ __forceinline__ void warp_best(unsigned& key, int& pos) {
    const unsigned bk = __reduce_max_sync(FULL, key);
    pos = (int)__reduce_min_sync(FULL, key == bk ? (unsigned)pos : (unsigned)NOPOS);
    key = bk;
}

struct Smem {
    alignas(16) float lu[TCP_W][TCP_W];  // pivot row of each step = row j of the leaf's L11\U11
    alignas(16) float tr[TCP_W];         // the row at the diagonal position, as every block reads it
    unsigned wkey[NW];  // each warp's best (key, position) among its rows
    int wpos[NW];
    unsigned gkey[NW];  // each warp's best (key, block) among the polled candidates
    int gblk[NW];
    int ppos, prid, trid;  // the step's pivot position, its content id, the top row's content id
    int topsrc[TCP_W];     // content id now at top position j0 + i
    int outpos[TCP_W];     // positions >= j0 + wb that received a row, and its content id
    int outsrc[TCP_W];
    int nout;
    int dst[2 * TCP_W];  // the leaf's permutation: W[k + dst[i]] = old W[k + src[i]]
    int src[2 * TCP_W];
};

extern "C" __global__ void __launch_bounds__(TCP_T, 1)
panel_pivot(float* W, i64 ld, i64* perm, int k, int nb, int n, int cols, int rb, u64* flags, u64* crow,
            u64* trow, unsigned* ctr, int* ipiv, unsigned epoch, u64* prof) {
    __shared__ Smem s;
    // the block's rows of the leaf: local row lr (position lo + lr) at S + lr * LS; then their content ids
    extern __shared__ __align__(16) float S[];
    int* rid = reinterpret_cast<int*>(S + TCP_T * TCP_R * LS);
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int c = blockIdx.x, G = gridDim.x;
    const int m = n - k;
    const int lo = c * rb, hi = min(lo + rb, m);  // this block's positions
    const int nrow = max(0, hi - lo);
    const i64 gtid = (i64)c * TCP_T + tid, gthreads = (i64)G * TCP_T;
    unsigned nbar = 0;
    constexpr int CROW = TCP_W + 2;  // a candidate slot: W values, position, content id
    long long t0 = clock64();
    long long pacc[NPROF];
#pragma unroll
    for (int i = 0; i < NPROF; ++i) pacc[i] = 0;
    const bool profiling = prof != nullptr && tid == 0;

    for (int j0 = 0; j0 < nb; j0 += TCP_W) {
        const int wb = min(TCP_W, nb - j0);
        const int first = max(0, j0 - lo);  // local rows at or below j0
        // ---- load the leaf: a warp a row, a lane a column (coalesced) ----------------------------
        for (int lr = first + warp; lr < nrow; lr += NW) {
            const float* src = W + (i64)(k + lo + lr) * ld + k + j0;
            if (lane < TCP_W) S[lr * LS + lane] = lane < wb ? __ldcg(src + lane) : 0.0f;
        }
        for (int lr = tid; lr < nrow; lr += TCP_T) rid[lr] = lo + lr;  // content ids count from the leaf's
        if (tid == 0) s.nout = 0;                                       // start: (2) permuted rows since
        __syncthreads();
        lap(profiling, pacc, 0, t0);

        // ---- steps -----------------------------------------------------------------------------
#pragma unroll 1
        for (int j = 0; j < wb; ++j) {
            const int tp = j0 + j;
            const int par = tp & 1;
            const unsigned tag = (epoch << 16) | (unsigned)tp;
            // 1. this thread's best row (local rows r T + tid), then the warp's
            unsigned key = 0u;
            int bpos = NOPOS;
#pragma unroll
            for (int r = 0; r < TCP_R; ++r) {
                const int lr = r * TCP_T + tid;
                const bool avail = lr < nrow && lo + lr >= tp;
                const unsigned kk = pivot_key(avail ? S[lr * LS + j] : 0.0f, avail);
                if (kk > key) {
                    key = kk;
                    bpos = lo + lr;
                }
            }
            warp_best(key, bpos);
            if (lane == 0) {
                s.wkey[warp] = key;
                s.wpos[warp] = bpos;
            }
            __syncthreads();
            // 2. publish: warp 0 the block's candidate, warp 1 the top row (its owner only), from S
            if (warp == 0) {
                unsigned ck = lane < NW ? s.wkey[lane] : 0u;
                int cp = lane < NW ? s.wpos[lane] : NOPOS;
                warp_best(ck, cp);
                u64* slot = crow + ((i64)par * G + c) * CROW;
                const float* brow = S + (ck != 0u ? cp - lo : 0) * LS;
                if (ck != 0u) {
                    if (lane < TCP_W) st_relaxed(slot + lane, word(tag, __float_as_uint(brow[lane])));
                    if (lane == 0) st_relaxed(slot + TCP_W, word(tag, (unsigned)cp));
                    if (lane == 1) st_relaxed(slot + TCP_W + 1, word(tag, (unsigned)rid[cp - lo]));
                }
                if (lane == 0)
                    st_relaxed(flags + ((i64)par * G + c) * FSTRIDE,
                               word(tag | (ck != 0u ? 0u : 0x80000000u), ck != 0u ? __float_as_uint(brow[j]) : 0u));
                lap(profiling, pacc, 1, t0);
            } else if (warp == 1 && tp >= lo && tp < hi) {
                u64* slot = trow + (i64)par * (TCP_W + 1);
                if (lane < TCP_W) st_relaxed(slot + lane, word(tag, __float_as_uint(S[(tp - lo) * LS + lane])));
                if (lane == 0) st_relaxed(slot + TCP_W, word(tag, (unsigned)rid[tp - lo]));
            }
            // 3. read every block's candidate (thread t: block t), reduce to the winner
            {
                unsigned gk = 0u;
                int gc = NOPOS;
                if (tid < G) {
                    const u64 f = poll(flags + ((i64)par * G + tid) * FSTRIDE, tag);
                    gk = pivot_key(__uint_as_float((unsigned)f), !((unsigned)(f >> 32) & 0x80000000u));
                    gc = tid;
                }
                warp_best(gk, gc);
                if (lane == 0) {
                    s.gkey[warp] = gk;
                    s.gblk[warp] = gc;
                }
            }
            __syncthreads();
            lap(profiling, pacc, 2, t0);
            unsigned gk = lane < NW ? s.gkey[lane] : 0u;
            int gc = lane < NW ? s.gblk[lane] : NOPOS;
            warp_best(gk, gc);  // every warp: the winning block gc
            // 4. the pivot row (warp 0), the top row (warp 1), their ids (warp 2)
            if (warp == 0) {
                const u64* slot = crow + ((i64)par * G + gc) * CROW;
                if (lane < TCP_W) s.lu[j][lane] = __uint_as_float((unsigned)poll(slot + lane, tag));
            } else if (warp == 1) {
                const u64* slot = trow + (i64)par * (TCP_W + 1);
                if (lane < TCP_W) s.tr[lane] = __uint_as_float((unsigned)poll(slot + lane, tag));
            } else if (warp == 2) {
                const u64* slot = crow + ((i64)par * G + gc) * CROW;
                if (lane == 0) s.ppos = (int)(unsigned)poll(slot + TCP_W, tag);
                if (lane == 1) s.prid = (int)(unsigned)poll(slot + TCP_W + 1, tag);
                if (lane == 2) s.trid = (int)(unsigned)poll(trow + (i64)par * (TCP_W + 1) + TCP_W, tag);
            }
            __syncthreads();
            lap(profiling, pacc, 3, t0);
            // 5. swap (each of the two rows by one warp, a lane a column), then eliminate
            const int p = s.ppos;
            const float* pr = s.lu[j];
            if (tp >= lo && tp < hi && warp == 3) {
                if (lane < TCP_W) S[(tp - lo) * LS + lane] = pr[lane];
                if (lane == 0) rid[tp - lo] = s.prid;
            }
            if (p != tp && p >= lo && p < hi && warp == 4) {
                if (lane < TCP_W) S[(p - lo) * LS + lane] = s.tr[lane];
                if (lane == 0) rid[p - lo] = s.trid;
            }
            __syncthreads();
            lap(profiling, pacc, 10, t0);
            // (the pivot row and each row to registers first: the compiler cannot tell S from s.lu apart,
            //  and would otherwise serialise every load behind the previous store)
            float prv[TCP_W];
#pragma unroll
            for (int i = 0; i < TCP_W; i += 4) {
                const float4 v = *reinterpret_cast<const float4*>(pr + i);
                prv[i] = v.x;
                prv[i + 1] = v.y;
                prv[i + 2] = v.z;
                prv[i + 3] = v.w;
            }
            const float piv = pr[j];
            const float rinv = piv != 0.0f ? 1.0f / piv : 0.0f;
#pragma unroll
            for (int r = 0; r < TCP_R; ++r) {
                const int lr = r * TCP_T + tid;
                if (lr < nrow && lo + lr > tp) {
                    float* row = S + lr * LS;
                    float rv[TCP_W];
#pragma unroll
                    for (int i = 0; i < TCP_W; ++i) rv[i] = row[i];
                    const float l = row[j] * rinv;
                    // columns right of j, as a bit mask (a comparison with the loop index would be
                    // turned into a jump table of W cases: tens of KB of code, an i-cache miss a step)
                    const unsigned right = j + 1 < 32 ? FULL << (j + 1) : 0u;
#pragma unroll
                    for (int i = 0; i < TCP_W; ++i)
                        if ((right >> i) & 1u) row[i] = fmaf(-l, prv[i], rv[i]);
                    row[j] = l;
                }
            }
            lap(profiling, pacc, 11, t0);
            if (warp == 2) {  // the leaf's permutation so far
                if (lane == 0) s.topsrc[j] = s.prid;
                if (p != tp) {
                    if (p < j0 + wb) {
                        if (lane == 0) s.topsrc[p - j0] = s.trid;
                    } else {
                        const int no = s.nout;
                        const unsigned hit = __ballot_sync(FULL, lane < no && s.outpos[lane] == p);
                        if (hit) {
                            if (lane == __ffs(hit) - 1) s.outsrc[lane] = s.trid;
                        } else if (lane == 0) {
                            s.outpos[no] = p;
                            s.outsrc[no] = s.trid;
                            s.nout = no + 1;
                        }
                    }
                }
                __syncwarp();
            }
            if (c == 0 && tid == 0) ipiv[tp] = p;
            lap(profiling, pacc, 4, t0);
        }
        __syncthreads();

        // ---- (1) the leaf back to W (coalesced); the permutation's index lists -----------------
        for (int lr = first + warp; lr < nrow; lr += NW) {
            float* dst = W + (i64)(k + lo + lr) * ld + k + j0;
            if (lane < wb) dst[lane] = S[lr * LS + lane];
        }
        const int nout = s.nout;
        const int nsrc = wb + nout;
        if (tid < 2 * TCP_W) {
            if (tid < wb) {
                s.dst[tid] = j0 + tid;
                s.src[tid] = s.topsrc[tid];
            } else if (tid >= TCP_W && tid - TCP_W < nout) {
                s.dst[tid - TCP_W + wb] = s.outpos[tid - TCP_W];
                s.src[tid - TCP_W + wb] = s.outsrc[tid - TCP_W];
            }
        }
        lap(profiling, pacc, 5, t0);
        grid_barrier(ctr, nbar);
        lap(profiling, pacc, 6, t0);

        // ---- (2) the interchanges on every other column; U12 on the panel's right --------------
        {
            const i64 ncol = (i64)cols - wb;
            for (i64 q = gtid; q < ncol; q += gthreads) {
                const int col = (int)(q < k + j0 ? q : q + wb);
                float x[2 * TCP_W];
#pragma unroll
                for (int i = 0; i < 2 * TCP_W; ++i)
                    x[i] = i < nsrc ? __ldcg(W + (i64)(k + s.src[i]) * ld + col) : 0.0f;
                if (col >= k + j0 + wb && col < k + nb) {
#pragma unroll
                    for (int i = 1; i < TCP_W; ++i) {
                        if (i >= wb) break;  // (entries >= wb are rows below the leaf)
                        float v = x[i];
#pragma unroll
                        for (int q2 = 0; q2 < i; ++q2) v = fmaf(-s.lu[i][q2], x[q2], v);
                        x[i] = v;
                    }
                }
#pragma unroll
                for (int i = 0; i < 2 * TCP_W; ++i)
                    if (i < nsrc) W[(i64)(k + s.dst[i]) * ld + col] = x[i];
            }
            if (c == 0 && warp == 0) {
                const i64 v0 = lane < nsrc ? perm[k + s.src[lane]] : 0;
                const i64 v1 = lane + 32 < nsrc ? perm[k + s.src[lane + 32]] : 0;
                __syncwarp();
                if (lane < nsrc) perm[k + s.dst[lane]] = v0;
                if (lane + 32 < nsrc) perm[k + s.dst[lane + 32]] = v1;
            }
        }
        lap(profiling, pacc, 7, t0);
        if (j0 + wb >= nb) break;
        grid_barrier(ctr, nbar);
        lap(profiling, pacc, 8, t0);

        // ---- (3) A22 -= L21 U12 on this block's rows below the leaf ----------------------------
        // (work items: a 64-column chunk x a share of the rows, spread over the warps; L21 from S)
        {
            const int c0 = j0 + wb;
            const int r0 = max(lo, c0);  // positions r0..hi-1 are updated
            const int nchunk = (nb - c0 + 63) / 64;
            const int segs = max(1, NW / nchunk);
            const int per = (hi - r0 + segs - 1) / segs;
            for (int item = warp; item < nchunk * segs; item += NW) {
                const int col = c0 + (item % nchunk) * 64 + 2 * lane;  // a lane: 2 columns
                const int pa = r0 + (item / nchunk) * per, pb = min(hi, pa + per);
                const bool in0 = col < nb, in1 = col + 1 < nb;
                float2 u[TCP_W];
#pragma unroll
                for (int i = 0; i < TCP_W; ++i) {
                    const float* up = W + (i64)(k + j0 + i) * ld + k + col;
                    u[i] = make_float2((in0 && i < wb) ? __ldcg(up) : 0.0f, (in1 && i < wb) ? __ldcg(up + 1) : 0.0f);
                }
                constexpr int UR = 16;  // rows in flight a warp (the update is bound by their latency)
                for (int p0 = pa; p0 < pb; p0 += UR) {
                    float2 acc[UR];
#pragma unroll
                    for (int e = 0; e < UR; ++e) {
                        const float* ap = W + (i64)(k + p0 + e) * ld + k + col;
                        const bool ok = p0 + e < pb;
                        acc[e] = make_float2((ok && in0) ? __ldcg(ap) : 0.0f, (ok && in1) ? __ldcg(ap + 1) : 0.0f);
                    }
#pragma unroll
                    for (int e = 0; e < UR; ++e) {
                        const float* l = S + (min(p0 + e, pb - 1) - lo) * LS;
#pragma unroll
                        for (int i = 0; i < TCP_W; ++i) {
                            acc[e].x = fmaf(-l[i], u[i].x, acc[e].x);
                            acc[e].y = fmaf(-l[i], u[i].y, acc[e].y);
                        }
                    }
#pragma unroll
                    for (int e = 0; e < UR; ++e) {
                        float* ap = W + (i64)(k + p0 + e) * ld + k + col;
                        if (p0 + e < pb) {
                            if (in0) ap[0] = acc[e].x;
                            if (in1) ap[1] = acc[e].y;
                        }
                    }
                }
            }
        }
        __syncthreads();
        lap(profiling, pacc, 9, t0);
    }
    if (profiling) {
#pragma unroll
        for (int i = 0; i < NPROF; ++i) prof[(i64)c * NPROF + i] = (u64)pacc[i];
    }
}
