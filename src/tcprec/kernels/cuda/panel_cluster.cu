// One leaf of tcprec.linalg's partially pivoted LU panel in one launch of ONE thread-block cluster.
//
// The leaf is L = W[r0:n, c0:c0+w] of the fp32 row-major working matrix W (ld columns), m = n - r0 rows,
// w <= TCP_W columns.  The grid is a single cluster of TCP_C blocks (one an SM): block c owns the rows at
// positions [c RB, min((c+1) RB, m)) (position = row - r0, RB = ceil(m / TCP_C)), thread t of it the local
// rows r TCP_T + t (r < TCP_R), which stay in its registers for the whole launch.  Rows never move while
// the leaf is factored: each keeps `st` = its position in LAPACK's row order (getf2 swaps the row at the
// diagonal position j with the pivot row at step j, so the row whose st is j takes the pivot's position),
// or -1 - j once it has been picked as step j's pivot (it is then row j of U11 and never changes again).
//
// Step j:
//   1. each thread its best available row (largest |a_j|, NaN above all; ties: the lowest LAPACK position,
//      as isamax): a 64-bit order (key, (0xffff - position) << 16 | local row) reduced with two hardware
//      warp reductions; the lane holding the warp's best stores that row to shared memory; __syncthreads;
//   2. warp q (q < TCP_C) reduces the warp bests to the block's and stores the block's candidate (key,
//      position / row word, the row's w values) into the candidate slot of block q, through distributed
//      shared memory (st.shared::cluster);
//   3. cluster barrier (arrive.release / wait.acquire): every block now holds all TCP_C candidates locally;
//   4. every warp reduces the candidates to the winner and reads the pivot row into registers; each thread
//      eliminates column j from its rows in code specialised for j (a switch over w cases: every register
//      index static, only the columns right of j touched).
// One cluster barrier and one block barrier a column, no global-memory round trip.  Candidate slots
// alternate by column parity: a block is at most one barrier ahead of any reader.
//
// After the steps the leaf is written back already permuted (row -> r0 + its final LAPACK position; the
// whole leaf was read before the first step, so no block can overwrite rows another still needs), and the
// leaf's interchanges -- 2 w slots W[dst] = W[src]: slot j moves step j's pivot row to r0 + j, slot w + t
// the row that started at position t < w (when it was no pivot) to its final position; unused slots pair the
// `scratch` row with itself -- are applied to the columns [pc0, pc1) other than the leaf's (each block a
// share of the columns: 2 w rows x 32 columns gathered into shared memory, then scattered), and returned in
// idx (dst, src) when idx is not null.  ipiv[j] = r0 + LAPACK position of step j's pivot (0-based global
// rows: getf2's pivots).  A zero pivot leaves its multipliers zero (as getf2); the LU's breakdown check
// reports it.
//
// Compile-time: TCP_W (16 or 32: most leaf columns), TCP_T (threads a block), TCP_R (rows a thread; the
// leaf has at most TCP_C TCP_T TCP_R rows), TCP_C (blocks in the cluster, <= 16; more than 8 needs the
// non-portable cluster size attribute).  Static shared memory only.  prof (optional): block c adds the
// clock cycles of its phases to prof[c * 8 + phase] (0 load, 1 search, 2 publish, 3 cluster barriers,
// 4 winner, 5 elimination, 6 write back, 7 interchanges).

#ifndef TCP_W
#define TCP_W 16
#endif
#ifndef TCP_T
#define TCP_T 512
#endif
#ifndef TCP_R
#define TCP_R 4
#endif
#ifndef TCP_C
#define TCP_C 16
#endif

#define NW (TCP_T / 32)
#define FULL 0xffffffffu
#define SWC 32  // columns a block interchanges at a time

static_assert(TCP_W == 16 || TCP_W == 32, "TCP_W: 16 or 32");
static_assert(TCP_T % 32 == 0 && TCP_T <= 1024, "TCP_T: whole warps, at most 1024");
static_assert(TCP_R >= 1 && TCP_R * TCP_W <= 64, "TCP_R: the rows a thread holds in registers, R W <= 64");
static_assert(TCP_C >= 1 && TCP_C <= 16, "TCP_C: 1..16 blocks");
static_assert(NW >= TCP_C && NW <= 32, "a block publishes its candidate to each block of the cluster by one warp");
static_assert(TCP_T * TCP_R <= 65536, "local rows are packed in 16 bits");

typedef long long i64;

struct Cand {  // one block's candidate for one column, as stored into every block's shared memory (byte
               // offsets 0, 4, 16: the remote stores below use them)
    unsigned key;  // 0: no available row; else 1 + bits of |a_j| (NaN: above +inf)
    unsigned lo;   // (0xffff - LAPACK position) << 16 | local row: the larger wins a tie of keys
    unsigned pad[2];
    float row[TCP_W];
};

struct Smem {
    Cand cand[2][TCP_C];
    unsigned wkey[NW];
    unsigned wlo[NW];
    alignas(16) float wrow[NW][TCP_W];  // each warp's best row
    i64 dst[2 * TCP_W];  // the leaf's interchanges (global rows)
    i64 src[2 * TCP_W];
    float sw[2 * TCP_W][SWC];  // a block's interchange buffer
};

// pivot_key, lap
#include "panel_common.cuh"

__device__ __forceinline__ unsigned cta_rank() {
    unsigned r;
    asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
    return r;
}
__device__ __forceinline__ unsigned smem_u32(const void* p) { return (unsigned)__cvta_generic_to_shared(p); }
__device__ __forceinline__ unsigned map_rank(unsigned addr, unsigned rank) {
    unsigned r;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(r) : "r"(addr), "r"(rank));
    return r;
}
__device__ __forceinline__ void st_cluster(unsigned addr, unsigned v) {
    asm volatile("st.shared::cluster.u32 [%0], %1;" ::"r"(addr), "r"(v) : "memory");
}
__device__ __forceinline__ void st_cluster64(unsigned addr, i64 v) {
    asm volatile("st.shared::cluster.u64 [%0], %1;" ::"r"(addr), "l"(v) : "memory");
}
__device__ __forceinline__ void cluster_sync() {
    asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}

#define NPROF 8

// The largest (key, lo) over the warp: two hardware reductions.
__device__ __forceinline__ void warp_best(unsigned& key, unsigned& lo) {
    const unsigned bk = __reduce_max_sync(FULL, key);
    lo = __reduce_max_sync(FULL, key == bk ? lo : 0u);
    key = bk;
}

// Step J's elimination of this thread's rows (J a compile-time constant: every register index is static).
template <int J>
__device__ __forceinline__ void eliminate(float (&a)[TCP_R][TCP_W], float (&cur)[TCP_R], int (&st)[TCP_R],
                                          const float (&u)[TCP_W], float rinv, bool own, int wr, int lpos) {
    if constexpr (J < TCP_W) {
#pragma unroll
        for (int r = 0; r < TCP_R; ++r) {
            if (st[r] < 0) continue;  // used (a pivot row) or no row
            if (own && r == wr) {
                st[r] = -1 - J;
                continue;
            }
            if (st[r] == J) st[r] = lpos;
            const float l = a[r][J] * rinv;
            a[r][J] = l;
#pragma unroll
            for (int i = J + 1; i < TCP_W; ++i) a[r][i] = fmaf(-l, u[i], a[r][i]);
            if constexpr (J + 1 < TCP_W) cur[r] = a[r][J + 1];
        }
    }
}

#define ELIM(J) \
    case J:     \
        eliminate<J>(a, cur, st, u, rinv, own, wr, lpos); \
        break;

extern "C" __global__ void __launch_bounds__(TCP_T, 1)
panel_cluster(float* W, i64 ld, int r0, int c0, int n, int w, int pc0, int pc1, int scratch, int* ipiv,
              i64* idx, long long* prof) {
    __shared__ Smem s;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int c = (int)cta_rank();
    const int m = n - r0;
    const int rb = (m + TCP_C - 1) / TCP_C;
    const int lo = c * rb, nrow = max(0, min(lo + rb, m) - lo);
    long long t0 = clock64();
    long long pacc[NPROF];
#pragma unroll
    for (int i = 0; i < NPROF; ++i) pacc[i] = 0;
    const bool profiling = prof != nullptr && tid == 0;
    const bool vec = (w & 3) == 0 && (c0 & 3) == 0 && (ld & 3) == 0;

    // ---- load this thread's rows into registers (all loads issued before the first use) ---------------
    float a[TCP_R][TCP_W];
    float cur[TCP_R];
    int st[TCP_R];
#pragma unroll
    for (int r = 0; r < TCP_R; ++r) {
        const int lr = r * TCP_T + tid;
        st[r] = lr < nrow ? lo + lr : -0x40000000;
        const float* g = W + (i64)(r0 + lo + min(lr, max(nrow - 1, 0))) * ld + c0;
#pragma unroll
        for (int q = 0; q < TCP_W / 4; ++q) {
            float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
            if (lr < nrow && 4 * q < w) {
                if (vec) {
                    v = __ldcg(reinterpret_cast<const float4*>(g + 4 * q));
                } else {
                    v.x = __ldcg(g + 4 * q);
                    if (4 * q + 1 < w) v.y = __ldcg(g + 4 * q + 1);
                    if (4 * q + 2 < w) v.z = __ldcg(g + 4 * q + 2);
                    if (4 * q + 3 < w) v.w = __ldcg(g + 4 * q + 3);
                }
            }
            a[r][4 * q] = v.x;
            a[r][4 * q + 1] = v.y;
            a[r][4 * q + 2] = v.z;
            a[r][4 * q + 3] = v.w;
        }
        cur[r] = a[r][0];
    }
    lap(profiling, pacc, 0, t0);
    cluster_sync();  // every block has started (DSMEM needs it)
    lap(profiling, pacc, 3, t0);

#pragma unroll 1
    for (int j = 0; j < w; ++j) {
        const int par = j & 1;
        // 1. this thread's best available row, the warp's (its owner stores the row), __syncthreads
        unsigned key = 0u, klo = 0u;
        int br = -1;
#pragma unroll
        for (int r = 0; r < TCP_R; ++r) {
            if (st[r] >= 0) {
                const unsigned k = pivot_key(cur[r]);
                const unsigned l = ((0xffffu - (unsigned)st[r]) << 16) | (unsigned)(r * TCP_T + tid);
                if (k > key || (k == key && l > klo)) {
                    key = k;
                    klo = l;
                    br = r;
                }
            }
        }
        unsigned wk = key, wl = klo;
        warp_best(wk, wl);
        if (wk != 0u && key == wk && klo == wl) {  // this lane holds the warp's best row
#pragma unroll
            for (int r = 0; r < TCP_R; ++r) {
                if (r == br) {
#pragma unroll
                    for (int q = 0; q < TCP_W / 4; ++q)
                        reinterpret_cast<float4*>(s.wrow[warp])[q] =
                            make_float4(a[r][4 * q], a[r][4 * q + 1], a[r][4 * q + 2], a[r][4 * q + 3]);
                }
            }
        }
        if (lane == 0) {
            s.wkey[warp] = wk;
            s.wlo[warp] = wl;
        }
        __syncthreads();
        lap(profiling, pacc, 1, t0);
        // 2. the block's candidate, to every block of the cluster (warp q -> block q)
        if (warp < TCP_C) {
            unsigned k = lane < NW ? s.wkey[lane] : 0u, l = lane < NW ? s.wlo[lane] : 0u;
            warp_best(k, l);
            const int ow = (int)((l & 0xffffu) % TCP_T) >> 5;  // the warp that owns the row
            const unsigned base = map_rank(smem_u32(&s.cand[par][c]), (unsigned)warp);
            if (lane < w) st_cluster(base + 16u + 4u * lane, k ? __float_as_uint(s.wrow[ow][lane]) : 0u);
            if (lane == 31) st_cluster(base, k);
            if (lane == 30) st_cluster(base + 4u, l);
        }
        lap(profiling, pacc, 2, t0);
        // 3. all candidates are here
        cluster_sync();
        lap(profiling, pacc, 3, t0);
        // 4. the winner (every warp), the pivot row to registers, then the elimination
        unsigned gk = lane < TCP_C ? s.cand[par][lane].key : 0u, gl = lane < TCP_C ? s.cand[par][lane].lo : 0u;
        const unsigned mk = gk, ml = gl;
        warp_best(gk, gl);
        const int gb = __ffs(__ballot_sync(FULL, mk == gk && ml == gl && lane < TCP_C)) - 1;  // winning block
        const int lpos = (int)(0xffffu - (gl >> 16)), wlr = (int)(gl & 0xffffu);
        const Cand& win = s.cand[par][gb];
        float u[TCP_W];
#pragma unroll
        for (int q = 0; q < TCP_W / 4; ++q) {
            const float4 v = reinterpret_cast<const float4*>(win.row)[q];
            u[4 * q] = v.x;
            u[4 * q + 1] = v.y;
            u[4 * q + 2] = v.z;
            u[4 * q + 3] = v.w;
        }
        const float piv = win.row[j];
        const float rinv = (gk > 1u && piv != 0.0f) ? 1.0f / piv : 0.0f;  // key 1: |a| = 0
        if (tid == 0 && gk != 0u) {
            s.dst[j] = r0 + j;
            s.src[j] = r0 + gb * rb + wlr;
            if (c == 0) ipiv[j] = r0 + lpos;
        }
        const bool own = c == gb && wlr % TCP_T == tid;
        const int wr = wlr / TCP_T;
        lap(profiling, pacc, 4, t0);
        switch (j) {
            ELIM(0) ELIM(1) ELIM(2) ELIM(3) ELIM(4) ELIM(5) ELIM(6) ELIM(7)
            ELIM(8) ELIM(9) ELIM(10) ELIM(11) ELIM(12) ELIM(13) ELIM(14) ELIM(15)
#if TCP_W > 16
            ELIM(16) ELIM(17) ELIM(18) ELIM(19) ELIM(20) ELIM(21) ELIM(22) ELIM(23)
            ELIM(24) ELIM(25) ELIM(26) ELIM(27) ELIM(28) ELIM(29) ELIM(30) ELIM(31)
#endif
            default: break;
        }
        lap(profiling, pacc, 5, t0);
    }

    // ---- write back, permuted; the top rows' interchange slots to every block --------------------------
#pragma unroll
    for (int r = 0; r < TCP_R; ++r) {
        const int lr = r * TCP_T + tid;
        if (lr >= nrow) continue;
        const int dest = st[r] >= 0 ? st[r] : -1 - st[r];
        float* g = W + (i64)(r0 + dest) * ld + c0;
#pragma unroll
        for (int q = 0; q < TCP_W / 4; ++q) {
            if (4 * q >= w) break;
            if (vec) {
                *reinterpret_cast<float4*>(g + 4 * q) = make_float4(a[r][4 * q], a[r][4 * q + 1], a[r][4 * q + 2],
                                                                    a[r][4 * q + 3]);
            } else {
                g[4 * q] = a[r][4 * q];
                if (4 * q + 1 < w) g[4 * q + 1] = a[r][4 * q + 1];
                if (4 * q + 2 < w) g[4 * q + 2] = a[r][4 * q + 2];
                if (4 * q + 3 < w) g[4 * q + 3] = a[r][4 * q + 3];
            }
        }
        const int pos = lo + lr;  // slot w + pos for a row that started at a top position: to every block
        if (pos < w) {
            const i64 d = st[r] >= 0 ? (i64)(r0 + st[r]) : (i64)scratch;
            const i64 sr = st[r] >= 0 ? (i64)(r0 + pos) : (i64)scratch;
            for (int q = 0; q < TCP_C; ++q) {
                st_cluster64(map_rank(smem_u32(&s.dst[w + pos]), (unsigned)q), d);
                st_cluster64(map_rank(smem_u32(&s.src[w + pos]), (unsigned)q), sr);
            }
        }
    }
    lap(profiling, pacc, 6, t0);
    cluster_sync();
    if (idx != nullptr && c == 0 && tid < 2 * w) {
        idx[tid] = s.dst[tid];
        idx[2 * w + tid] = s.src[tid];
    }

    // ---- the interchanges on the columns [pc0, pc1) other than the leaf's -----------------------------
    {
        const int ncol = max(0, pc1 - pc0 - w);
        const int per = (ncol + TCP_C - 1) / TCP_C;
        const int q0 = c * per, q1 = min(q0 + per, ncol);
        const int nsl = 2 * w;
        for (int qa = q0; qa < q1; qa += SWC) {
            // gather: thread (slot, column) pairs, a warp reads 32 consecutive columns of one row
            for (int e = tid; e < nsl * SWC; e += TCP_T) {
                const int sl = e / SWC, cc = e - sl * SWC, q = qa + cc;
                if (q < q1) {
                    const int col = pc0 + q < c0 ? pc0 + q : pc0 + q + w;
                    s.sw[sl][cc] = __ldcg(W + s.src[sl] * ld + col);
                }
            }
            __syncthreads();
            for (int e = tid; e < nsl * SWC; e += TCP_T) {
                const int sl = e / SWC, cc = e - sl * SWC, q = qa + cc;
                if (q < q1) {
                    const int col = pc0 + q < c0 ? pc0 + q : pc0 + q + w;
                    W[s.dst[sl] * ld + col] = s.sw[sl][cc];
                }
            }
            __syncthreads();
        }
    }
    lap(profiling, pacc, 7, t0);
    if (profiling) {
#pragma unroll
        for (int i = 0; i < NPROF; ++i) atomicAdd(reinterpret_cast<unsigned long long*>(prof + c * NPROF + i),
                                                 (unsigned long long)pacc[i]);
    }
}
