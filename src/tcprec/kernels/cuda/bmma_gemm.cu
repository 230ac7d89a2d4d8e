// Bit-serial integer GEMM on the binary tensor cores (APNN-TC's decomposition, for sm_90a).
//
//   C[m, n] = sum_k  a[m, k] * w[n, k]          a: P-bit codes (M, K), w: Q-bit codes (N, K)
//
// Both operands arrive as bit planes (tcprec.packing): A planes (P, M, Kw), W planes (Q, N, Kw),
// int32 words, LSB-first, K zero-padded to a multiple of 512 bits.  Plane i holds bit i of the
// stored code pattern.  With plane weights  wt_i = 2^i  (and wt_{P-1} = -2^(P-1) for two's
// complement codes) the weighted code  v = sum_i wt_i * bit_i  is the value for twos / unsigned
// codes and the code index u for pm1 codes (value = 2u - (2^P - 1)); the affine part of pm1 is
// the host's row / column correction (ops/matmul.py), added here in the epilogue:
//
//   S[m, n]  = sum_{i<P, j<Q} wt_i wt_j popc(A_i[m, :] AND W_j[n, :])      (the MMA part)
//   C[m, n]  = ss * S[m, n] + row_term[m] + col_term[n]                      (int32, wraps mod 2^32;
//                                                                              exact when |C| < 2^31)
//
// Two tensor-core paths, chosen at compile time (TCP_WGMMA), both AND+popc only:
//   0  mma.sync.aligned.m16n8k256.row.col.s32.b1.b1.s32.and.popc   (SASS BMMA.168256.AND.POPC; sm_80+)
//   1  wgmma.mma_async.sync.aligned.m64nNk256.s32.b1.b1.and.popc    (Hopper warpgroup MMA; sm_90a only;
//      ~1.5x mma.sync's peak: 15,500 vs 10,250 T op/s measured on an H200, tcprec.bench.gemm)
// Never XOR+popc or INT4 MMA: sm_90 has no hardware path for either (they run emulated, far below AND+popc).
//
// Accumulators.  mma.sync cannot scale its product, so every plane pair needs an accumulator
// that carries one weight.  Pairs of equal weight (e.g. (0,1) and (1,0), weight 2) share one:
// a "weight class".  Unsigned codes have P+Q-1 classes (P*Q pairs); two's complement adds a
// sign to the weight, so a few more.  The epilogue combines the classes with shifts:
// S = sum_c weight_c * acc_c.  A warp's output tile is MT x NT MMA tiles (16 x 8 each), so the
// accumulators cost NCLASS * MT * NT * 4 registers; the loader picks MT, NT to keep that <= 128.
// Folded (TCP_FOLD, wgmma path, every pair weight positive): one accumulator, and pair (i, j) of
// weight w issues its wgmma w times into it (w1a2: 3 wgmmas instead of 2 into 2 accumulators).  More
// MMAs, half the accumulator registers, so a larger block tile.  It paid on the cp.async wgmma kernel;
// on the TMA kernel it is slower than the unfolded tile (w1a2 8192^3: 337 vs 266 us) and is an option only.
//
// Pipeline.  A block owns a BM x BN output tile and streams K in BK-bit steps (BK = 512 or 1024:
// BK/8 bytes a row a plane, BK/256 MMA k-steps): a STAGES-deep cp.async.cg (16 bytes, L2 only)
// ring in shared memory, one __syncthreads per step.  K is padded to 512 bits only, so with
// BK = 1024 the last step's missing half is zero-filled (cp.async src-size 0).  Shared rows are
// BK/8 bytes; chunk c (16 bytes) of row r sits at c ^ ((r >> 1) & 3) (64-byte rows) or c ^ (r & 7)
// (128-byte rows), so the 8 row addresses of every ldmatrix phase hit 8 different 16-byte bank
// groups (no conflicts), and the cp.async writes stay conflict-free too.  With FRAG_DB the
// fragments of k-step kk+1 are loaded before the MMAs of k-step kk are issued.
// Fragments come from ldmatrix.x4: a b16 8x8 matrix row is 16 bytes = 4 words of K, and lane
// l receives word l%4 of row l/4, which is exactly the b1 m16n8k256 fragment
// (a0 = A[g][t], a1 = A[g+8][t], a2 = A[g][t+4], a3 = A[g+8][t+4]; b0 = B[n g][t], b1 = B[n g][t+4]).
//
// wgmma path.  A warpgroup (4 consecutive warps) owns a 64 x WN output slab (WN = BN / WARPS_N; the
// warps of a block form WARPS_M/4 x WARPS_N warpgroups, BM = 16 * WARPS_M).  Both operands come from
// shared memory through matrix descriptors: BK = 1024, so a stage row is 128 bytes and the loader's
// chunk swizzle c ^ (r & 7) is exactly the 128-byte swizzle wgmma reads (K-major, 8-row groups
// 1024 bytes apart, every plane tile 1024-byte aligned); k-step kk (256 bits = 32 bytes) is the
// descriptor's start address + 32 kk, as for any K-major 128-byte-swizzled wgmma operand.  The
// accumulator fragment of m64nN is the mma.sync one stacked per warp (warp w of the group holds rows
// 16w..16w+15, element [nt][e] at column 8 nt + 2t + (e & 1), row g + 8 (e >> 1)), so the
// epilogue is shared.  Pipeline: cp.async ring as above, then fence.proxy.async (cp.async writes
// through the generic proxy, wgmma reads through the async proxy), barrier, issue all wgmmas of
// the step, commit, and wait until only that group is in flight (wgmma.wait_group 1): the slot
// refilled at step kt is the one step kt-2 used, so STAGES-2 loads run ahead of the MMAs.
//
// TMA path (TCP_TMA, sm_90a; what the loader picks for large shapes).  Persistent and warp-specialised:
// warpgroups 0 .. WARPS_M/4 - 1 multiply (warpgroup g: rows 64 g.., all BN columns), the last one is the
// producer, whose one elected thread loads every stage with cp.async.bulk.tensor (one box of BM or BN rows
// x 128 bytes per plane, 128-byte swizzled exactly as above, out-of-bounds rows and words read as zeros)
// onto a "full" mbarrier; the MMA warps arrive on an "empty" mbarrier once their wgmmas on a stage are
// done.  Steps are counted across the tiles a block walks, so the producer loads the next tile while the
// MMA warps run this one's epilogue.  Optional clusters (TCP_CM x TCP_CN blocks) load a tile shared along
// M or N once and multicast it (every block's consumers then release the stage in every partner block).
// The descriptors arrive as __grid_constant__ parameters.  Measured on an H200 (tcprec bench gemm): 1.9x the
// cp.async wgmma kernel at 8192^3; clusters and folding made it slower, so no default uses them.
// Two consumer groups on alternate tiles (ping-pong) measured slower on the networks' GEMMs: docs/decisions/0003.
//
// Epilogues (compile-time EPI):
//   0  int32 C                              out: int32 (M, ldo)
//   1  float: y = ((float(C) * row_scale[m]) * col_scale[n]) + bias[n], optional ReLU (or LeakyReLU:
//      y < 0 -> slope * y, as torch.nn.functional.leaky_relu), stored
//      as fp32 / fp16 / bf16 (OUT_T 0 / 1 / 2); every scale / bias pointer may be null.  Each step
//      is one IEEE-rounded op (no FMA contraction), so torch reproduces it bit for bit.
//      With TCP_RES (a ResNet block's add fused): residual (M, ldo) of the output dtype, and
//      y = act(rd(float(rd(y0)) + float(residual[m, n])))  with y0 the value above before the activation
//      and rd the rounding to the output dtype -- the unfused graph's roundings (branch, sum), then the
//      activation on the sum (its one multiply for LeakyReLU rounded by the store).
//   2  packed: y as in 1, then encoded to an OB-bit integer format (OENC: 0 twos, 1 unsigned,
//      2 pm1) as tcprec.encode(y / out_scale, fmt, "nearest") does, and written as bit planes
//      (OB, M, ldo) int32 (ldo = packed words of N, or ceil(N / 32) for the compact rows a gathering consumer reads),
//      ready to be the next layer's A operand.  Every word is written, the padding past N included (the output needs
//      no zeroing).  Without a division:
//      the code is a count of precomputed thresholds (code_threshold), the planes are built in registers.
//      With OB <= 3 and no row scale (convolutions) the thresholds are integers, one set a column
//      (bmma_code_thresholds, launched first; col_thr), compared with C itself: no float arithmetic.
//
// Compile-time parameters (the loader passes them as -D defines; one source serves all variants):
//   TCP_P, TCP_Q            activation / weight bits (1..8)
//   TCP_A_TWOS, TCP_W_TWOS  1 if that operand is two's complement (its top plane has weight -2^(b-1))
//   TCP_BM, TCP_BN          block tile (output rows, output columns)
//   TCP_WARPS_M, TCP_WARPS_N  warp grid; the warp tile is (BM / WARPS_M) x (BN / WARPS_N)
//   TCP_STAGES              cp.async pipeline depth
//   TCP_BK                  K bits per pipeline step (512 or 1024)
//   TCP_FRAG_DB             1: double-buffer the register fragments across MMA k-steps (mma.sync)
//   TCP_WGMMA               1: the wgmma path (sm_90a; BK = 1024, WARPS_M a multiple of 4)
//   TCP_FOLD                1: one accumulator, each pair's wgmma repeated `weight` times (wgmma only)
//   TCP_TMA                 1: the warp-specialised TMA pipeline (wgmma only; WARPS_N = 1; one producer
//                           warpgroup after the WARPS_M / 4 consumer warpgroups)
//   TCP_CM, TCP_CN          TMA: cluster of CM x CN blocks (CM blocks along M share, by multicast, the W
//                           tile; CN along N the A tile)
//   TCP_EPI, TCP_OUT_T, TCP_OB, TCP_OENC   epilogue (above)
//   TCP_SMEM                the dynamic shared memory the host allocates (checked against the layout)
//   TCP_CONV                1: implicit-GEMM convolution (below)
//   TCP_RES                 1: the float epilogue adds a residual before the activation (above)
//   TCP_SPLIT               1: split-K (cp.async paths, no TCP_CONV; below)
//   TCP_ROWSUM              1: the row term computed in the kernel (below), not read from row_term
//   TCP_RSCALE              0: no row scale compiled in (y = float(C) * cs: one multiply fewer an output, the same
//                           values, as rs = 1 multiplies exactly); -1 (default): read at run time (1.0 where null)
//   TCP_ACT, TCP_BIAS       the epilogue's activation (0 none, 1 ReLU, 2 LeakyReLU) and bias (0 / 1) compiled in;
//                           -1 (default): read from relu / slope / bias at run time, every path compiled (twice the
//                           epilogue code: ResNet-50 w1a2's conv3 variant 12,832 -> 6,536 SASS instructions with both)
//
// Implicit-GEMM convolution (TCP_CONV = 1; no row scale: the host refuses one).  A is not a matrix but the NHWC input planes (P, N*H*W, Kin) of a
// convolution, gathered as the loads go: GEMM row m = (n, p, q) is output pixel m, and K word kw = tap * CWT + wi
// (tap = r * S + s, CWT = the tap's words, even) is word wi of input pixel (n, p*sh - ph + r*dh,
// q*sw - pw + s*dw), or zero when that pixel lies outside the image or tap >= R*S (the weight planes use the same
// K layout, zero past R*S*CWT).  Kin is an even number of words >= CWT, and the words of a pixel past its C
// channels are zero, so a tap is whole 8-byte halves of 16-byte chunks: a chunk is one cp.async of 16 bytes where
// CWT and Kin are multiples of 4, else two of 8 (zero-filled when outside).
// The mma.sync / cp.async wgmma paths gather in their load loop; the TMA path's producer warpgroup gathers A with
// cp.async (each thread waits for its own copies RING - 2 steps later, fences them for the tensor cores' async
// proxy and arrives on the stage's "full" barrier) while one thread still loads W by TMA.  No cluster, one consumer
// group.  No im2col buffer: the gathered rows are read from L2, and the loads never leave the 512-bit word grid.
// Measured (H200, w1a2 packed, batch 256): the gathering producer feeds the wgmmas slower
// than TMA boxes of an im2col'd operand (VGG 256x256@56: 681 vs 527 us for the GEMM alone; the im2col pass it saves
// costs 261 us).  With the pm1 row sums in the kernel (TCP_ROWSUM, below) it is one launch and wins on
// every layer of unpadded taps except those of > 2 column tiles on the large TMA tiles (each column tile gathers the
// windows again): ops/qconv takes it there (qconv.implicit_conv; docs/decisions/0008).

// In-kernel row sums (TCP_ROWSUM = 1; not with split-K).  The pm1 correction's row term
//   row_term[m] = row_mul * R[m] + row_add,   R[m] = sum_i wt_i popc(A_i[m, :])
// comes from the tensor cores instead of a pass over A before the GEMM (for an implicit convolution it took two: the
// pixels' sums, then the windows'): each plane's A fragments are also multiplied against an all-ones B -- a constant register pair on
// mma.sync, one m64n8k256 wgmma against a 1 KB tile of ones in shared memory on the wgmma paths -- whose int32
// result in every column is popc(A_i[m, :]) over the K steps.  Zero words (padding, taps outside the image) add
// nothing, so R is the sum over the row as gathered.  Cost: P MMAs of n8 a k-step next to the P*Q*NT of the tile,
// and P x 4 registers a thread.

// Split-K (TCP_SPLIT = 1; the cp.async paths without TCP_CONV).  For problems of few tiles and a long K (a linear layer
// at batch 8: 128 tiles of 32 x 32 walking 25 1024-bit steps each, one after another, bound by each step's load
// latency), `splits` blocks share a tile, block b of the grid taking tile b % tiles and the (b / tiles)-th run of K
// steps.  Each adds its weighted sum S (before ss, the row / column terms and the epilogue) into the int32 workspace
// split_ws (SPLIT_COUNTERS arrival counters, one a tile, then M x N sums; all zero on entry) with atomicAdd and counts
// its arrival; the block that arrives last (threadfence-reduction pattern) reads the totals from L2, zeroes them and
// its counter for the next launch, and runs the epilogue.  Integer sums are exact in any order, so the result is the
// unsplit kernel's bit for bit.  Measured (H200): scattered 4-byte atomics cost ~15 us per million, so
// split-K pays only for small outputs (the loader splits one-row-tile GEMMs); per-run slices that the last block adds
// up were slower there (its dependent reads: VGG's 25088 -> 4096 at batch 8, 4 runs, 17.9 us against 13.7).

#ifndef TCP_P
#define TCP_P 2
#endif
#ifndef TCP_Q
#define TCP_Q 1
#endif
#ifndef TCP_A_TWOS
#define TCP_A_TWOS 0
#endif
#ifndef TCP_W_TWOS
#define TCP_W_TWOS 0
#endif
#ifndef TCP_BM
#define TCP_BM 64
#endif
#ifndef TCP_BN
#define TCP_BN 256
#endif
#ifndef TCP_WARPS_M
#define TCP_WARPS_M 2
#endif
#ifndef TCP_WARPS_N
#define TCP_WARPS_N 4
#endif
#ifndef TCP_STAGES
#define TCP_STAGES 4
#endif
#ifndef TCP_BK
#define TCP_BK 512
#endif
#ifndef TCP_FRAG_DB
#define TCP_FRAG_DB 0
#endif
#ifndef TCP_WGMMA
#define TCP_WGMMA 0
#endif
#ifndef TCP_FOLD
#define TCP_FOLD 0
#endif
#ifndef TCP_TMA
#define TCP_TMA 0
#endif
#ifndef TCP_CM
#define TCP_CM 1
#endif
#ifndef TCP_CN
#define TCP_CN 1
#endif
#ifndef TCP_RES
#define TCP_RES 0
#endif
#ifndef TCP_EPI
#define TCP_EPI 0
#endif
#ifndef TCP_OUT_T
#define TCP_OUT_T 0
#endif
#ifndef TCP_OB
#define TCP_OB 1
#endif
#ifndef TCP_OENC
#define TCP_OENC 1
#endif
#ifndef TCP_CONV
#define TCP_CONV 0
#endif
#ifndef TCP_DUAL
#define TCP_DUAL 0
#endif
#ifndef TCP_ACT
#define TCP_ACT -1
#endif
#ifndef TCP_BIAS
#define TCP_BIAS -1
#endif
#ifndef TCP_RSCALE
#define TCP_RSCALE -1
#endif
#ifndef TCP_SPLIT
#define TCP_SPLIT 0
#endif
#ifndef TCP_SPLIT_COUNTERS
#define TCP_SPLIT_COUNTERS 4096
#endif
#ifndef TCP_ROWSUM
#define TCP_ROWSUM 0
#endif

typedef unsigned int u32;
typedef long long i64;
typedef unsigned long long u64;

namespace tcp {

constexpr int P = TCP_P, Q = TCP_Q;
constexpr bool A_TWOS = TCP_A_TWOS != 0, W_TWOS = TCP_W_TWOS != 0;
constexpr int BM = TCP_BM, BN = TCP_BN, WARPS_M = TCP_WARPS_M, WARPS_N = TCP_WARPS_N;
constexpr int STAGES = TCP_STAGES, EPI = TCP_EPI, OUT_T = TCP_OUT_T, OB = TCP_OB, OENC = TCP_OENC;
// The values of TCP_EPI and TCP_OUT_T (kernels/cuda/codes.py: Epilogue, OutType); TCP_OENC's are codes.cuh's
// ENC_*.  Enumerators, not constexpr variables: NVRTC emits a .global for each of those, and the PTX is unchanged.
enum : int { EPI_INT32 = 0, EPI_FLOAT = 1, EPI_PACKED = 2 };
enum : int { OUT_F32 = 0, OUT_F16 = 1, OUT_BF16 = 2 };
constexpr bool RES = TCP_RES != 0;
static_assert(!RES || EPI == EPI_FLOAT, "a residual is added by the float epilogue only");
static_assert(!(TCP_SPLIT != 0 && (TCP_TMA != 0 || TCP_CONV != 0)), "split-K: the cp.async paths without TCP_CONV");
constexpr bool DUAL = TCP_DUAL != 0;  // the 16-bit float output and, of the same values, OB-bit planes (compact rows)
constexpr bool SPLIT = TCP_SPLIT != 0;  // split-K: `splits` blocks a tile, int32 partial sums added in split_ws
constexpr int SPLIT_COUNTERS = TCP_SPLIT_COUNTERS;  // split-K: the arrival counters (one a tile) before the sums
constexpr bool TMA = TCP_TMA != 0;
constexpr bool ROWSUM = TCP_ROWSUM != 0;  // the row term from the tensor cores (A against all-ones B), not row_term
static_assert(!(ROWSUM && SPLIT), "in-kernel row sums: not with split-K");
constexpr bool CONV = TCP_CONV != 0;  // implicit-GEMM convolution: A gathered from NHWC planes
constexpr int CM = TCP_CM, CN = TCP_CN, CS = CM * CN;  // TMA cluster shape / size
constexpr int MMA_THREADS = WARPS_M * WARPS_N * 32;    // threads that multiply and store one tile
constexpr int CONS_THREADS = MMA_THREADS;              // the consumer (MMA) threads, before the TMA producer
constexpr int THREADS = CONS_THREADS + (TMA ? 128 : 0); // + the TMA producer warpgroup
constexpr int MT = BM / (WARPS_M * 16);  // 16-row MMA tiles per warp
constexpr int NT = BN / (WARPS_N * 8);   // 8-column MMA tiles per warp
constexpr int BK = TCP_BK;               // K bits per pipeline step
[[maybe_unused]] constexpr bool FRAG_DB = TCP_FRAG_DB != 0;
constexpr bool WGMMA = TCP_WGMMA != 0;
constexpr int KCH = BK / 128;            // 16-byte chunks per row per step
constexpr int KK = BK / 256;             // MMA k-steps per pipeline step
constexpr int WPS = BK / 32;             // 32-bit words per row per step
constexpr int ROW_BYTES = BK / 8;        // one K step of one row of one plane
constexpr int A_STAGE = P * BM * ROW_BYTES;
constexpr int W_STAGE = Q * BN * ROW_BYTES;
constexpr int STAGE_BYTES = A_STAGE + W_STAGE;
[[maybe_unused]] constexpr int A_CHUNKS = P * BM * KCH;   // 16-byte cp.async chunks per stage
[[maybe_unused]] constexpr int W_CHUNKS = Q * BN * KCH;
// The block's per-row / per-column epilogue vectors (row term, row scale; column term, scale, bias) are
// staged in shared memory past the pipeline at the start of the kernel: read in the epilogue straight from
// global memory they cost 12% of w1a2 8192^3 (latency-bound loads, one per element).  The packed epilogue
// adds its 2^OB code thresholds (code_threshold) after them.
constexpr int PIPE_RAW = STAGES * STAGE_BYTES;
// wgmma with in-kernel row sums: the all-ones B tile (8 rows x 128 bytes, 1024-byte aligned) after the stages
[[maybe_unused]] constexpr int ONES_OFF = (PIPE_RAW + 1023) / 1024 * 1024;
constexpr int PIPE_BYTES = ROWSUM && WGMMA ? ONES_OFF + 1024 : PIPE_RAW;
constexpr int VEC_OFF = (WGMMA ? 1024 : 0) + (PIPE_BYTES + 15) / 16 * 16;
constexpr int NCODE = 1 << OB;                 // packed epilogue: codes of the output format
// packed epilogue with OB <= 3: a column's integer code thresholds (bmma_code_thresholds), staged after the vectors
constexpr int ITHR = (EPI == EPI_PACKED && NCODE <= 8) ? NCODE : 0;
constexpr int VEC_N = 2 * BM + 3 * BN + ITHR * BN;
constexpr int THR_N = EPI == EPI_PACKED || DUAL ? NCODE : 0;  // its (or the dual planes') thresholds, after the vectors
// one copy of the vectors (and thresholds) a block; the copies 16-byte aligned for the int4 loads
// TMA (WG_VEC): each MMA warpgroup stages its own copy and syncs only with itself (named barrier 1 + its copy), so
// the warpgroups of a block are not held together at every tile: one's epilogue runs while the other multiplies
// (as far as the ring of stages lets them drift apart).  Measured on an H200 (same process against
// one copy a group): w1a2 8192^3 238 -> 225 us, w2a2 449 -> 407 us.  Taken where the copies fit in shared memory
// (loader.Variant.smem_bytes makes the same choice), else one copy synced by all MMA warps.
constexpr int SMEM_LIMIT = 232448;  // 227 KB: the most dynamic shared memory a block of sm_90 may have
constexpr int VEC_ROUNDED = (VEC_N + THR_N + 3) / 4 * 4;
constexpr bool WG_VEC = TMA && WARPS_M / 4 > 1 &&
                        (VEC_OFF + (WARPS_M / 4) * VEC_ROUNDED * 4 + 7) / 8 * 8 + 2 * STAGES * 8 <= SMEM_LIMIT;
constexpr int VEC_COPIES = WG_VEC ? WARPS_M / 4 : 1;  // copies of the vectors: one a warpgroup (WG_VEC) or one
constexpr int VEC_STRIDE = VEC_COPIES > 1 ? VEC_ROUNDED : VEC_N + THR_N;
constexpr int VEC_BYTES = VEC_COPIES * VEC_STRIDE * 4;
[[maybe_unused]] constexpr int BAR_OFF = (VEC_OFF + VEC_BYTES + 7) / 8 * 8;  // TMA: STAGES "full" then STAGES "empty" mbarriers
#ifdef TCP_SMEM  // the dynamic shared memory the host allocates (loader.Variant.smem_bytes) holds this layout
static_assert(BAR_OFF + (TMA ? 16 * STAGES : 0) <= TCP_SMEM, "loader.Variant.smem_bytes disagrees with the layout");
#endif

static_assert(P >= 1 && P <= 8 && Q >= 1 && Q <= 8, "bits must be 1..8");
static_assert(MT >= 1 && MT * WARPS_M * 16 == BM, "BM must be a multiple of 16 * WARPS_M");
static_assert(NT >= 2 && NT % 2 == 0 && NT * WARPS_N * 8 == BN, "BN must be a multiple of 16 * WARPS_N");
static_assert(STAGES >= 2, "the pipeline needs >= 2 stages");
static_assert(BK == 512 || BK == 1024, "BK must be 512 or 1024 bits");
static_assert(!WGMMA || (BK == 1024 && WARPS_M % 4 == 0 && MT == 1),
              "wgmma: BK = 1024 (128-byte swizzled rows) and BM = 16 * WARPS_M with WARPS_M a multiple of 4");
static_assert(!WGMMA || STAGES >= 3, "wgmma: >= 3 stages (one slot stays with the wgmmas in flight)");
static_assert(!WGMMA || NT == 4 || NT == 8 || NT == 12 || NT == 16 || NT == 24 || NT == 32,
              "wgmma: the warpgroup's N = BN / WARPS_N must be 32, 64, 96, 128, 192 or 256");
static_assert(EPI != EPI_PACKED || (BN % 32 == 0 && 512 % BN == 0 && NT % 4 == 0),
              "packed output needs BN | 512, 32 | BN and whole 32-column words a warp (NT a multiple of 4)");
static_assert(!TMA || (WGMMA && WARPS_N == 1), "TMA: the wgmma path with one warpgroup per 64 rows (WARPS_N = 1)");
static_assert(!DUAL || (EPI == EPI_FLOAT && OUT_T != OUT_F32 && NCODE <= 8 && BN % 32 == 0 && NT % 4 == 0),
              "dual output: the fp16 / bf16 epilogue, OB <= 3, whole 32-column words a warp");
static_assert(!CONV || !TMA || (CS == 1 && STAGES >= 3), "implicit conv on TMA: no cluster, >= 3 stages");
constexpr int RING = STAGES;  // TMA: the ring of stages
static_assert(!TMA || (CM >= 1 && CM <= 2 && CN >= 1 && CN <= 2 && (BM / CN) % 8 == 0 && (BN / CM) % 8 == 0),
              "TMA: clusters of 1..2 x 1..2 blocks; each block's slice of a shared tile a multiple of 8 rows");

__host__ __device__ constexpr int plane_weight(int i, int bits, bool twos) {
    return (twos && i == bits - 1) ? -(1 << i) : (1 << i);
}
__host__ __device__ constexpr int pair_weight(int i, int j) {
    return plane_weight(i, P, A_TWOS) * plane_weight(j, Q, W_TWOS);
}

// Weight classes: pair (i, j) -> accumulator index; pairs of equal weight share one.
struct ClassTable {
    int cls[P * Q];
    int weight[P * Q];
    int n;
    __host__ __device__ constexpr ClassTable() : cls(), weight(), n(0) {
        for (int p = 0; p < P * Q; ++p) {
            const int w = pair_weight(p / Q, p % Q);
            int found = -1;
            for (int c = 0; c < n; ++c)
                if (weight[c] == w) found = c;
            if (found < 0) {
                weight[n] = w;
                found = n++;
            }
            cls[p] = found;
        }
    }
};
constexpr bool FOLD = TCP_FOLD != 0;
constexpr int NCLASS = FOLD ? 1 : ClassTable().n;  // accumulators an output element keeps

__host__ __device__ constexpr bool all_weights_positive() {
    for (int p = 0; p < P * Q; ++p)
        if (pair_weight(p / Q, p % Q) <= 0) return false;
    return true;
}
static_assert(!FOLD || (WGMMA && all_weights_positive()),
              "TCP_FOLD needs the wgmma path and positive pair weights (unsigned codes)");

// ---------------------------------------------------------------------------------------------
// PTX wrappers
// ---------------------------------------------------------------------------------------------

__device__ __forceinline__ u32 swz(int row, int chunk) {  // byte offset of (row, 16-byte chunk)
    const int sw = KCH == 8 ? (row & 7) : ((row >> 1) & 3);
    return (u32)(row * ROW_BYTES + ((chunk ^ sw) << 4));
}

__device__ __forceinline__ u32 cluster_rank_() {  // this block's rank in its cluster (0 without clusters)
    u32 r = 0;
    if (CS > 1) asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(r));
    return r;
}

// a barrier among the threads that multiply and store one tile (all threads without TMA; with TMA named
// barrier 1, the MMA warps only, where the producer warpgroup does not take part)
__device__ __forceinline__ void mma_sync_all() {
    if (TMA) {
        asm volatile("bar.sync %0, %1;\n" ::"r"(1), "n"(MMA_THREADS) : "memory");
    } else {
        __syncthreads();
    }
}

// Programmatic dependent launch (sm_90+; the loader launches with programmatic stream serialization): a grid
// may start while the previous kernel of the stream is still running, so every kernel here first waits for that
// grid to complete and flush (griddepcontrol.wait, before any global memory access: reads of its outputs and
// writes to buffers it may still read).  A non-persistent GEMM lets the next such grid be scheduled once its
// own main loop is done (griddepcontrol.launch_dependents, before the epilogue); the persistent TMA kernel only
// at its exit (implicitly).  What overlaps is the next kernel's launch and block scheduling (~0.4 us a call of
// a small GEMM in a CUDA graph).  Both are no-ops for a launch without the attribute.
__device__ __forceinline__ void grid_dependency_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void grid_dependents_launch() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

__device__ __forceinline__ void cp_async16(u32 dst, const void* src, bool valid) {
    const int n = valid ? 16 : 0;  // src-size 0: the 16 bytes are zero-filled, nothing is read
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(n));
}
// 8 bytes (the implicit conv's taps of 2 mod 4 words); .ca, the only cp.async form below 16 bytes
__device__ __forceinline__ void cp_async8(u32 dst, const void* src, bool valid) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 8, %2;\n" ::"r"(dst), "l"(src), "r"(valid ? 8 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

__device__ __forceinline__ void ldmatrix_x4(u32& r0, u32& r1, u32& r2, u32& r3, u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
                 : "r"(addr));
}

__device__ __forceinline__ void bmma_and_popc(int (&c)[4], const u32 (&a)[4], const u32 (&b)[2]) {
    asm volatile(
        "mma.sync.aligned.m16n8k256.row.col.s32.b1.b1.s32.and.popc "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

#if TCP_WGMMA
// wgmma (sm_90a): D(64 x 8NT, int32) += popc(A(64 x 256 bits) AND B(8NT x 256 bits)), both from
// shared memory.  The accumulators are named one by one (the asm needs NT*4 register operands).
#define TCP_R4(d, i) "+r"(d[i][0]), "+r"(d[i][1]), "+r"(d[i][2]), "+r"(d[i][3])
#define TCP_A4(d, o) TCP_R4(d, (o)), TCP_R4(d, (o) + 1), TCP_R4(d, (o) + 2), TCP_R4(d, (o) + 3)
#define TCP_ACC4(d) TCP_A4(d, 0)
#define TCP_ACC8(d) TCP_ACC4(d), TCP_A4(d, 4)
#define TCP_ACC12(d) TCP_ACC8(d), TCP_A4(d, 8)
#define TCP_ACC16(d) TCP_ACC12(d), TCP_A4(d, 12)
#define TCP_ACC24(d) TCP_ACC16(d), TCP_A4(d, 16), TCP_A4(d, 20)
#define TCP_ACC32(d) TCP_ACC24(d), TCP_A4(d, 24), TCP_A4(d, 28)
template <int NT_>
struct Wgmma;
// m64n8k256 (4 accumulators a thread): the row sums of A against the all-ones tile (TCP_ROWSUM)
__device__ __forceinline__ void wgmma_rowsum(int (&d)[4], u64 da, u64 db) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %6, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n8k256.s32.b1.b1.and.popc {%0, %1, %2, %3}, %4, %5, p;\n}\n"
                 : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3])
                 : "l"(da), "l"(db), "n"(1));
}
template <> struct Wgmma<4> {  // m64n32k256: 16 accumulators a thread
    static __device__ __forceinline__ void run(int (&d)[4][4], u64 da, u64 db) {
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n"
                     "wgmma.mma_async.sync.aligned.m64n32k256.s32.b1.b1.and.popc {"
                     "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15"
                     "}, %16, %17, p;\n}\n"
                     : TCP_ACC4(d)
                     : "l"(da), "l"(db), "n"(1));
    }
};
template <> struct Wgmma<8> {  // m64n64k256: 32 accumulators a thread
    static __device__ __forceinline__ void run(int (&d)[8][4], u64 da, u64 db) {
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
                     "wgmma.mma_async.sync.aligned.m64n64k256.s32.b1.b1.and.popc {"
                     "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
                     "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
                     "}, %32, %33, p;\n}\n"
                     : TCP_ACC8(d)
                     : "l"(da), "l"(db), "n"(1));
    }
};
template <> struct Wgmma<12> {  // m64n96k256: 48 accumulators a thread
    static __device__ __forceinline__ void run(int (&d)[12][4], u64 da, u64 db) {
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %50, 0;\n"
                     "wgmma.mma_async.sync.aligned.m64n96k256.s32.b1.b1.and.popc {"
                     "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
                     "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
                     "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47"
                     "}, %48, %49, p;\n}\n"
                     : TCP_ACC12(d)
                     : "l"(da), "l"(db), "n"(1));
    }
};
template <> struct Wgmma<16> {  // m64n128k256: 64 accumulators a thread
    static __device__ __forceinline__ void run(int (&d)[16][4], u64 da, u64 db) {
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
                     "wgmma.mma_async.sync.aligned.m64n128k256.s32.b1.b1.and.popc {"
                     "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
                     "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
                     "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
                     "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
                     "}, %64, %65, p;\n}\n"
                     : TCP_ACC16(d)
                     : "l"(da), "l"(db), "n"(1));
    }
};
template <> struct Wgmma<24> {  // m64n192k256: 96 accumulators a thread
    static __device__ __forceinline__ void run(int (&d)[24][4], u64 da, u64 db) {
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %98, 0;\n"
                     "wgmma.mma_async.sync.aligned.m64n192k256.s32.b1.b1.and.popc {"
                     "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
                     "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
                     "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
                     "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, "
                     "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, "
                     "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95"
                     "}, %96, %97, p;\n}\n"
                     : TCP_ACC24(d)
                     : "l"(da), "l"(db), "n"(1));
    }
};
template <> struct Wgmma<32> {  // m64n256k256: 128 accumulators a thread
    static __device__ __forceinline__ void run(int (&d)[32][4], u64 da, u64 db) {
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"
                     "wgmma.mma_async.sync.aligned.m64n256k256.s32.b1.b1.and.popc {"
                     "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
                     "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
                     "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
                     "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, "
                     "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, "
                     "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, "
                     "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, "
                     "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127"
                     "}, %128, %129, p;\n}\n"
                     : TCP_ACC32(d)
                     : "l"(da), "l"(db), "n"(1));
    }
};

#include "hopper.cuh"
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }
#endif  // TCP_WGMMA

#if TCP_TMA
// one arrival on the barrier at the same offset in cluster block `cta` (this block's own when CS = 1)
__device__ __forceinline__ void mbar_arrive_cta(u32 bar, u32 cta) {
    if (CS == 1) {
        asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
    } else {
        asm volatile(
            "{\n"
            ".reg .b32 remote;\n"
            "mapa.shared::cluster.u32 remote, %0, %1;\n"
            "mbarrier.arrive.release.cluster.shared::cluster.b64 _, [remote];\n"
            "}\n" ::"r"(bar),
            "r"(cta)
            : "memory");
    }
}
__device__ __forceinline__ void cluster_sync() {  // every thread of every block of the cluster
    if (CS > 1) {
        asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n" ::: "memory");
    } else {
        __syncthreads();
    }
}
// box (c0 words of K, c1 rows, c2 plane) of a (planes, rows, Kw) tensor -> shared memory at `dst`,
// completing `bytes` on `bar`; with mask != 0 the box lands at the same offset (and completes on the
// barrier at the same offset) in every cluster block of the mask
__device__ __forceinline__ void tma_load(u32 dst, const TensorMap& map, int c0, int c1, int c2, u32 bar,
                                         unsigned short mask) {
    const u64 m = reinterpret_cast<u64>(&map);
    if (mask == 0) {
        asm volatile(
            "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes"
            " [%0], [%1, {%2, %3, %4}], [%5];\n" ::"r"(dst),
            "l"(m), "r"(c0), "r"(c1), "r"(c2), "r"(bar)
            : "memory");
    } else {
        asm volatile(
            "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster"
            " [%0], [%1, {%2, %3, %4}], [%5], %6;\n" ::"r"(dst),
            "l"(m), "r"(c0), "r"(c1), "r"(c2), "r"(bar), "h"(mask)
            : "memory");
    }
}
// The 128-byte lines of rows [m0, m0 + BM) x columns [n0, n0 + BN) of a row-major (M, ld) tensor of esz-byte elements
// -> L2, a line a thread (threads t0, t0 + step, ..): one prefetch instruction each, any address (not a bulk prefetch,
// whose operands are uniform)
__device__ __forceinline__ void prefetch_tile_l2(const void* base, int m0, int n0, int M, int N, int ld, int esz, int t0,
                                                 int step) {
    const int bytes = min(BN, N - n0) * esz, lines = (bytes + 127) / 128;
    for (int i = t0; i < BM * lines; i += step) {
        const int r = i / lines, c = i - r * lines;
        if (m0 + r >= M) break;
        const char* p = reinterpret_cast<const char*>(base) + ((i64)(m0 + r) * ld + n0) * esz + 128 * c;
        asm volatile("prefetch.global.L2 [%0];\n" ::"l"(p));
    }
}
#endif  // TCP_TMA

#include "codes.cuh"

// rd: a float32 rounded to the output dtype and back (OUT_T 0: itself); its 16-bit pattern (OUT_T 1 / 2)
__device__ __forceinline__ unsigned short out_bits16(float x) { return OUT_T == OUT_F16 ? f32_to_f16(x) : f32_to_bf16(x); }
__device__ __forceinline__ float out_of16(unsigned short h) { return OUT_T == OUT_F16 ? f16_to_f32(h) : bf16_to_f32(h); }
__device__ __forceinline__ float rd_out(float x) { return OUT_T == OUT_F32 ? x : out_of16(out_bits16(x)); }
// TCP_RES: the sum of the branch y0 (before its activation) and the residual r, both as the output dtype stores them,
// rounded to it, then the activation (y < 0 -> slope * y, or 0; NaN stays NaN, as torch)
__device__ __forceinline__ float residual_sum(float y0, float r, bool relu, float slope) {
    const float v = rd_out(__fadd_rn(rd_out(y0), r));
    return relu && v < 0.0f ? (slope == 0.0f ? 0.0f : __fmul_rn(v, slope)) : v;
}

// Outputs (r, c) and (r, c + 1) of a row-major (M, ldo) matrix: one paired store where both lie inside M x N
// and an even pitch keeps the pair aligned (always so in an interior tile), else each store checked.
__device__ __forceinline__ int2 pair_of(int a, int b) { return make_int2(a, b); }
__device__ __forceinline__ float2 pair_of(float a, float b) { return make_float2(a, b); }
__device__ __forceinline__ u32 pair_of(unsigned short a, unsigned short b) { return (u32)a | ((u32)b << 16); }
template <typename T>
__device__ __forceinline__ void store_pair(T* o, T v0, T v1, bool interior, int r, int c, int M, int N, int ldo) {
    if (interior || (r < M && c + 1 < N && (ldo & 1) == 0)) {
        *reinterpret_cast<decltype(pair_of(v0, v1))*>(o) = pair_of(v0, v1);
    } else if (r < M) {
        if (c < N) o[0] = v0;
        if (c + 1 < N) o[1] = v1;
    }
}

// ---- implicit-GEMM convolution (TCP_CONV): the geometry, a row's window origin, a chunk's source ----
// n / d for 0 <= n < 2^31 and a runtime d >= 1 without a division instruction: q = (n * mul) >> sh, sh = 31 +
// ceil(log2 d), mul = ceil(2^sh / d) < 2^32 (Granlund-Montgomery: mul * d - 2^sh = e < d <= 2^(sh - 31), so
// n e < 2^sh and the error term stays below 1 / d).  Set up once a kernel (one 64-bit division a divisor); a quotient
// is then one wide multiply and a shift where the generic int division was ~25 instructions.  The gathering
// producer did 20 of those a tile (a row's n, p and a K word's tap, r): 40% of its instructions (ncu, H200).
struct FastDiv {
    u32 mul;
    int sh;
    __device__ __forceinline__ int div(int n) const { return (int)(((unsigned long long)(u32)n * mul) >> sh); }
};
__device__ __forceinline__ FastDiv fast_div(int d) {
    const int sh = 31 + (d > 1 ? 32 - __clz(d - 1) : 0);
    return {(u32)(((1ull << sh) + (unsigned long long)d - 1ull) / (unsigned long long)d), sh};
}
struct ConvGeo {
    int H, W, Kin, CWT, S, RS, sh, sw, ph, pw, dh, dw, PQ, Q;
    i64 plane;  // words of one input plane (N*H*W*Kin)
    FastDiv by_PQ, by_Q, by_CWT, by_S;  // (conv_geo sets them up)
};
__device__ __forceinline__ ConvGeo conv_geo(int H, int W, int Kin, int CWT, int S, int RS, int sh, int sw, int ph,
                                            int pw, int dh, int dw, int PQ, int Q, i64 plane) {
    ConvGeo g{H, W, Kin, CWT, S, RS, sh, sw, ph, pw, dh, dw, PQ, Q, plane, {}, {}, {}, {}};
    if (CONV) g.by_PQ = fast_div(PQ), g.by_Q = fast_div(Q), g.by_CWT = fast_div(CWT), g.by_S = fast_div(S);
    return g;
}
// output row m -> pix = n*H*W and its window origin (ih0, iw0) packed as two int16 in hw (rows past M: never inside)
__device__ __forceinline__ void conv_row(const ConvGeo& g, int m, int M, int& pix, int& hw) {
    if (m >= M) {
        pix = 0;
        hw = (int)0x80008000u;  // ih0 = iw0 = -32768
        return;
    }
    const int n = g.by_PQ.div(m), pq = m - n * g.PQ, p = g.by_Q.div(pq), q = pq - p * g.Q;
    pix = n * g.H * g.W;
    hw = (int)(((u32)(p * g.sh - g.ph) << 16) | ((u32)(q * g.sw - g.pw) & 0xffffu));
}
// K word kw -> (r * dh, s * dw, wi); ok = false past the R*S taps
struct ConvTap {
    int dr, ds, wi;
    bool ok;
};
__device__ __forceinline__ ConvTap conv_tap(const ConvGeo& g, int kw) {
    const int t = g.by_CWT.div(kw), r = g.by_S.div(t);
    return {r * g.dh, (t - r * g.S) * g.dw, kw - t * g.CWT, t < g.RS};
}
// byte offset (in one plane) of the chunk of row (pix, hw) at tap k, and whether it lies inside the image (outside:
// word wi of pixel 0, which the zero-filling copy does not read).  One wide multiply-add: the pixel index is 32-bit
// (N*H*W < 2^31 pixels), only the byte offset 64-bit.
__device__ __forceinline__ bool conv_src(const ConvGeo& g, int pix, int hw, const ConvTap& k,
                                         unsigned long long& off) {
    const int ih = (hw >> 16) + k.dr, iw = (int)(short)(hw & 0xffff) + k.ds;
    const bool ok = k.ok && (unsigned)ih < (unsigned)g.H && (unsigned)iw < (unsigned)g.W;
    const u32 px = ok ? (u32)(pix + ih * g.W + iw) : 0u;
    off = (unsigned long long)px * (u32)(4 * g.Kin) + (u32)(4 * k.wi);
    return ok;
}
// A chunks of one BM-row plane tile that thread ptid of NTHR loaders issues: RI of them, at rows conv_rows gives
template <int NTHR>
struct ConvLoader {
    static constexpr int RI = (BM * KCH + NTHR - 1) / NTHR;
    static_assert(NTHR % KCH == 0, "a loader thread keeps one chunk column");
    int pix[RI], hw[RI];
    // thread ptid's rows are ptid / KCH + j NTHR / KCH: the KCH lanes of a chunk row share them, so where a warp's rows
    // number <= 32 each lane finds one and the others read it by shuffle (KCH times fewer conv_row a tile)
    static constexpr int RPW = 32 / KCH;  // a warp's rows per j
    __device__ __forceinline__ void rows(const ConvGeo& g, int m0, int M, int ptid) {
        if constexpr (NTHR % 32 == 0 && 32 % KCH == 0 && RPW * RI <= 32 && RI * NTHR == BM * KCH) {
            const int lane = ptid & 31, first = (ptid - lane) / KCH;  // the warp's first row
            int p0 = 0, h0 = (int)0x80008000u;
            if (lane < RPW * RI) conv_row(g, m0 + first + lane % RPW + (lane / RPW) * (NTHR / KCH), M, p0, h0);
#pragma unroll
            for (int j = 0; j < RI; ++j) {
                pix[j] = __shfl_sync(0xffffffffu, p0, j * RPW + lane / KCH);
                hw[j] = __shfl_sync(0xffffffffu, h0, j * RPW + lane / KCH);
            }
        } else {
#pragma unroll
            for (int j = 0; j < RI; ++j) conv_row(g, m0 + (ptid + j * NTHR) / KCH, M, pix[j], hw[j]);
        }
    }
    // the P planes' chunks of K step kt into the stage at sA (128-byte rows swizzled as swz): one 16-byte cp.async a
    // chunk where taps and rows are whole chunks (CWT and Kin multiples of 4 words), else two 8-byte halves, each
    // within one tap (CWT and Kin even: C = 64 is 2 words a tap, compact rows of 2 words a pixel)
    __device__ __forceinline__ void load(const ConvGeo& g, const u32* A, u32 sA, int kt, int ptid) const {
        const int c = ptid % KCH, kw = kt * WPS + c * 4;
        if (((g.CWT | g.Kin) & 3) != 0) {
            copies<8>(g, A, sA, kw, c, 0, ptid);
            copies<8>(g, A, sA, kw + 2, c, 8, ptid);
        } else {
            copies<16>(g, A, sA, kw, c, 0, ptid);
        }
    }
    // BYTES-byte copies of K word kw (chunk column c, byte0 into the chunk) of this thread's rows, every plane
    template <int BYTES>
    __device__ __forceinline__ void copies(const ConvGeo& g, const u32* A, u32 sA, int kw, int c, u32 byte0,
                                           int ptid) const {
        const ConvTap k = conv_tap(g, kw);
        // the rows of thread ptid step by NTHR / KCH; a multiple of the swizzle's 8-row period keeps the chunk's swizzled
        // position, so every destination is one base plus a constant
        constexpr bool STEP_KEEPS_SWZ = (NTHR / KCH) % 8 == 0;
        const int r0 = ptid / KCH;
        const u32 base = sA + swz(r0, c) + byte0;
#pragma unroll
        for (int j = 0; j < RI; ++j) {
            const int r = r0 + j * (NTHR / KCH);
            if (RI * NTHR > BM * KCH && r >= BM) break;
            unsigned long long off;
            const bool ok = conv_src(g, pix[j], hw[j], k, off);
#pragma unroll
            for (int pl = 0; pl < P; ++pl) {
                const u32 dst = STEP_KEEPS_SWZ ? base + (u32)((pl * BM + j * (NTHR / KCH)) * ROW_BYTES)
                                               : sA + pl * (BM * ROW_BYTES) + swz(r, c) + byte0;
                const void* src = (const char*)(A + pl * g.plane) + off;
                if (BYTES == 16) cp_async16(dst, src, ok); else cp_async8(dst, src, ok);
            }
        }
    }
};

}  // namespace tcp

using namespace tcp;

#if TCP_TMA
// registers a thread after setmaxnreg: the producer keeps 40, the MMA warpgroups share the rest (<= 232)
constexpr int PRODUCER_REGS = CONV ? 64 : 40;  // conv: 128 gathering threads keep their rows' window origins
// setmaxnreg moves registers within what the block was launched with: THREADS x (65536 / THREADS rounded down to
// 8), not the SM's 65536 (asking for more waits forever)
constexpr int REG_POOL = 65536 / THREADS / 8 * 8 * THREADS;
constexpr int MMA_REGS_ = (REG_POOL - PRODUCER_REGS * 128) / CONS_THREADS / 8 * 8;
constexpr int MMA_REGS = MMA_REGS_ > 232 ? 232 : MMA_REGS_;
#define TCP_CLUSTER __cluster_dims__(CS, 1, 1)
#else
#define TCP_CLUSTER
#endif

extern "C" __global__ void TCP_CLUSTER __launch_bounds__(THREADS, 1)
bmma_gemm(
#if TCP_TMA
          const __grid_constant__ TensorMap tmA,  // (P, M, Kw) int32 planes of a, box (1, BM / CN, 32), 128 B swizzle
          const __grid_constant__ TensorMap tmW,  // (Q, N, Kw) int32 planes of w, box (1, BN / CM, 32)
#endif
          const u32* __restrict__ A,            // (P, M, Kw) bit planes of a
          const u32* __restrict__ W,            // (Q, N, Kw) bit planes of w
          void* __restrict__ out,               // EPI 0: int32 (M, ldo); 1: float (M, ldo); 2: (OB, M, ldo)
          const int* __restrict__ row_term,     // (M,) int32 or null
          const int* __restrict__ col_term,     // (N,) int32 or null
          const float* __restrict__ row_scale,  // (M,) or null
          const float* __restrict__ col_scale,  // (N,) or null
          const float* __restrict__ bias,       // (N,) or null
          const float* __restrict__ out_scale,  // (1,) packed epilogue's scale
          const int* __restrict__ col_thr,      // packed, OB <= 3: (N, 2^OB) integer threshold words, or null
          const void* __restrict__ residual,    // TCP_RES: (M, ldo) of the output dtype, added before the activation
          int M, int N, int Kw, int ldo, int ss, int relu,
          float slope,                          // relu: y < 0 -> slope * y (0: ReLU; else LeakyReLU)
          // TCP_CONV: the convolution (ConvGeo; A is then the (P, N*H*W, Kin) input planes); ignored otherwise
          int cv_H, int cv_W, int cv_Kin, int cv_CWT, int cv_S, int cv_RS, int cv_sh, int cv_sw, int cv_ph,
          int cv_pw, int cv_dh, int cv_dw, int cv_PQ, int cv_Q, long long cv_plane,
          u32* __restrict__ dual_out,  // TCP_DUAL: (OB, M, ldp) planes of the stored float output (out_scale, OENC)
          int ldp,
          int* __restrict__ split_ws,  // TCP_SPLIT: a counter a tile, then M x N sums (all zero on entry and exit)
          int splits,                  // TCP_SPLIT: blocks a tile (K runs)
          int row_mul, int row_add) {  // TCP_ROWSUM: row term = row_mul * R[m] + row_add (int32, wrapping)
    extern __shared__ __align__(128) unsigned char smem[];
    if (TCP_ACT >= 0) {  // the activation compiled in (the host checks that the call's relu / slope are these)
        relu = TCP_ACT != 0;
        if (TCP_ACT != 2) slope = 0.0f;
    }
    [[maybe_unused]] const ConvGeo geo = conv_geo(cv_H, cv_W, cv_Kin, cv_CWT, cv_S, cv_RS, cv_sh, cv_sw, cv_ph, cv_pw,
                                                  cv_dh, cv_dw, cv_PQ, cv_Q, cv_plane);
    grid_dependency_wait();
    constexpr ClassTable CT{};
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int tid = threadIdx.x, cwarp = tid >> 5;
    // warp (wm, wn) owns output rows wm*16*MT.. and columns wn*8*NT.. of the block tile; on the wgmma
    // path warpgroup (cwarp / 4) owns a 64-row slab, its warp (cwarp % 4) the 16-row part of it
    const int wm = WGMMA ? (cwarp >> 2) / WARPS_N * 4 + (cwarp & 3) : cwarp / WARPS_N;
    const int wn = WGMMA ? (cwarp >> 2) % WARPS_N : cwarp % WARPS_N;

    // ---- which output tile: grouped raster, GROUP_M row tiles share their W tiles in L2.  With TMA
    // clusters the raster walks clusters (CM x CN tiles); block `rank` of a cluster takes tile
    // (rank % CM, rank / CM) of it.  A cluster may overhang the grid: its blocks past M or N load zeros
    // (TMA fills out-of-bounds boxes with zeros), still feed their partners, and store nothing.  The TMA
    // kernel is persistent: cluster c of the grid takes tiles c, c + clusters, ... ----
    constexpr int GROUP_M = (8 + CM - 1) / CM;
    const int rank = TMA ? (int)cluster_rank_() : 0, rm = rank % CM, rn = rank / CM;
    const int grid_m = ((M + BM - 1) / BM + CM - 1) / CM, grid_n = ((N + BN - 1) / BN + CN - 1) / CN;
    const int in_group = GROUP_M * grid_n;
    // the persistent (TMA) kernel finds an origin a tile: its division by in_group without a division instruction
    [[maybe_unused]] const FastDiv by_group = TMA ? fast_div(in_group) : FastDiv{};
    auto tile_origin = [&](int pid, int& m0, int& n0) {  // cluster tile pid -> this block's output origin
        const int gi = TMA ? by_group.div(pid) : pid / in_group, in = pid - gi * in_group, first_m = gi * GROUP_M;
        const int gm = min(grid_m - first_m, GROUP_M);
        const bool full = gm == GROUP_M;  // (all groups but the last: a constant divisor)
        m0 = ((first_m + (full ? in % GROUP_M : in % gm)) * CM + rm) * BM;
        n0 = ((full ? in / GROUP_M : in / gm) * CN + rn) * BN;
    };

    const int k_tiles = (Kw + WPS - 1) / WPS;  // BK-bit steps (Kw is a multiple of 16 words)
    // wgmma's 128-byte swizzle needs 1024-byte aligned tiles (the loader allocates 1 KB extra)
    const u32 smem_raw = (u32)__cvta_generic_to_shared(smem);
    const u32 smem_base = WGMMA ? (smem_raw + 1023u) & ~1023u : smem_raw;
#if TCP_WGMMA
    if (ROWSUM) {  // the all-ones B tile: written through the generic proxy, fenced for the wgmmas' async proxy
        // before the first barrier (cluster_sync on TMA, the main loop's first __syncthreads otherwise)
        u32* const ones = reinterpret_cast<u32*>(smem + (smem_base - smem_raw) + ONES_OFF);
        for (int i = threadIdx.x; i < 256; i += THREADS) ones[i] = 0xffffffffu;
        fence_proxy_async();
    }
#endif

    // The epilogue's per-row / per-column vectors, VEC_N values staged in shared memory at VEC_OFF: row scale,
    // row term (BM each), column scale, bias, column term (BN each).  Rows / columns past M / N and null
    // pointers read as neutral values (scale 1, bias 0, term 0), so the epilogue's arithmetic needs no bounds
    // checks: x * 1.0f and integer + 0 are exact.
    auto vec_value = [&](int i, int m0, int n0) -> u32 {
        if (i < BM) return __float_as_uint(row_scale != nullptr && m0 + i < M ? row_scale[m0 + i] : 1.0f);
        i -= BM;
        if (i < BM) return (u32)(row_term != nullptr && m0 + i < M ? row_term[m0 + i] : 0);
        i -= BM;
        if (i < BN) return __float_as_uint(col_scale != nullptr && n0 + i < N ? col_scale[n0 + i] : 1.0f);
        i -= BN;
        if (i < BN) return __float_as_uint(bias != nullptr && n0 + i < N ? bias[n0 + i] : 0.0f);
        i -= BN;
        if (i < BN) return (u32)(col_term != nullptr && n0 + i < N ? col_term[n0 + i] : 0);
        i -= BN;  // packed, OB <= 3: the columns' integer threshold words (f, t_1 ..), ITHR a column; zeros past N
        constexpr int IT = ITHR > 0 ? ITHR : 1;
        const int c = i / IT;
        return (u32)(col_thr != nullptr && n0 + c < N ? col_thr[(i64)(n0 + c) * IT + i % IT] : 0);
    };
    const int vcopy = WG_VEC ? cwarp >> 2 : 0;  // this thread's copy of the vectors
    u32* const s_vec = reinterpret_cast<u32*>(smem + VEC_OFF) + vcopy * VEC_STRIDE;

    int acc[NCLASS][MT][NT][4];
    [[maybe_unused]] int rsa[ROWSUM ? P : 1][MT][4];  // TCP_ROWSUM: popc of each plane's rows, every column alike
    auto zero_acc = [&]() {
#pragma unroll
        for (int i = 0; i < (ROWSUM ? P : 0); ++i)
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                for (int e = 0; e < 4; ++e) rsa[i][mt][e] = 0;
#pragma unroll
        for (int c = 0; c < NCLASS; ++c)
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                    for (int e = 0; e < 4; ++e) acc[c][mt][nt][e] = 0;
    };
    // S of accumulator element [mt][nt][e4]: the weight classes combined (unsigned: wraps mod 2^32 like int32)
    auto class_sum = [&](int mt, int nt, int e4) -> u32 {
        u32 v = 0;
#pragma unroll
        for (int k = 0; k < NCLASS; ++k) v += (u32)acc[k][mt][nt][e4] * (FOLD ? 1u : (u32)CT.weight[k]);
        return v;
    };

    // ---- epilogue of the tile at (m0, n0), by the MMA threads (tid < MMA_THREADS), vectors staged ----
    const bool has_bias = TCP_BIAS >= 0 ? TCP_BIAS != 0 : bias != nullptr;  // (compiled in, or read at run time)
    // TCP_DUAL, float16 output: the planes' thresholds as float16 pairs (f16_ceil), made on the first tile (the float
    // thresholds are the kernel's, staged once) and kept in registers across the block's tiles
    [[maybe_unused]] u32 dthr16[NCODE];
    [[maybe_unused]] bool have16 = false;
    float* const s_thr = reinterpret_cast<float*>(s_vec + VEC_N);  // packed: T_1 .. T_{2^OB - 1} at [1..]
    auto epilogue = [&](int m0, int n0) {
        const float* s_rs = reinterpret_cast<const float*>(s_vec);
        const int* s_rt = reinterpret_cast<const int*>(s_rs + BM);
        const float* s_cs = reinterpret_cast<const float*>(s_rt + BM);
        const float* s_bias = s_cs + BN;
        const int* s_ct = reinterpret_cast<const int*>(s_bias + BN);
        // the row term of row rl (= row g + 8 h of MMA row tile mt): staged, or from the row sums (TCP_ROWSUM)
        auto row_t = [&](int mt, int h, int rl) -> int {
            if constexpr (ROWSUM) {
                u32 r = 0;
#pragma unroll
                for (int i = 0; i < P; ++i) r += (u32)rsa[i][mt][2 * h] * (u32)plane_weight(i, P, A_TWOS);
                return (int)(r * (u32)row_mul + (u32)row_add);
            } else {
                return s_rt[rl];
            }
        };
        // C of accumulator element [mt][nt][e4] with its row and column terms (unsigned: wraps mod 2^32 like int32)
        auto c_value = [&](int mt, int nt, int e4, int rt, int ct) -> int {
            const u32 v = SPLIT ? (u32)acc[0][mt][nt][e4] : class_sum(mt, nt, e4);  // split: S read back into class 0
            return (int)(v * (u32)ss + (u32)rt + (u32)ct);
        };
        auto y_value = [&](int cv, float rs, float cs, float bi) -> float {  // RES: the activation after the sum
            // (a convolution has no row scale; TCP_RSCALE = 0: none compiled in)
            return y_of<!CONV && TCP_RSCALE != 0>(cv, rs, cs, bi, has_bias, !RES && relu != 0, slope);
        };
        // a tile inside M x N (with an even row pitch for the paired stores) stores without bounds checks
        const bool interior = m0 + BM <= M && n0 + BN <= N && (ldo & 1) == 0;
        [[maybe_unused]] float dthr[DUAL ? NCODE : 1];  // TCP_DUAL: the planes' thresholds in registers
        if (DUAL) {
#pragma unroll
            for (int i = 1; i < NCODE; ++i) dthr[i] = s_thr[i];
            if (OUT_T == OUT_F16 && !have16) {
#pragma unroll
                for (int i = 1; i < NCODE; ++i) dthr16[i] = f16_ceil(dthr[i]) * 0x00010001u;
                have16 = true;
            }
        }
        // TCP_DUAL (OB <= 3): the quad ORs its lanes' bits of one 32-column word of row r per plane and scatters them
        // (codes.cuh quad_or_scatter; every lane takes part in the shuffles); lane b stores plane b's word
        constexpr int DOB = DUAL ? OB : 1;  // (the lambdas below compile in every variant; DUAL has OB <= 3)
        [[maybe_unused]] auto store_dual_word = [&](const u32* bits, int r, int gw) {
            const int b = lane & 3;
            const u32 v = quad_or_scatter<DOB>(bits, b);
            if (b < OB && r < M && gw < ldp) dual_out[(i64)b * M * ldp + (i64)r * ldp + gw] = v;
        };
        // TCP_DUAL, the fast path: a warp's DW = NT / 4 words of row r per plane are ORed across the quad word by word,
        // lane b keeping plane b's (dw[q]), then stored at once -- one 8- or 16-byte store a plane where the row's words
        // are aligned to it (one store a word touched a sector a word: as many L2 sector writes as the 16-bit output's,
        // ResNet-50 w1a2's conv3 on an H200), else a word at a time
        constexpr int DW = NT / 4 > 0 ? NT / 4 : 1;
        [[maybe_unused]] auto dual_or = [&](const u32* bits, u32 (&dw)[DW], int q) {
            const u32 v = quad_or_scatter<DOB>(bits, lane & 3);
            if ((lane & 3) < OB) dw[q] = v;
        };
        [[maybe_unused]] auto dual_store_row = [&](const u32 (&dw)[DW], int r, int gw0) {
            constexpr int VW = DW % 4 == 0 ? 4 : (DW % 2 == 0 ? 2 : 1);  // words a store
            if ((lane & 3) >= OB) return;
            u32* const row = dual_out + (i64)(lane & 3) * M * ldp + (i64)r * ldp + gw0;
            if (VW > 1 && (ldp % VW) == 0 && (gw0 % VW) == 0) {
#pragma unroll
                for (int q = 0; q < DW; q += VW) {
                    if (VW == 4) *reinterpret_cast<uint4*>(row + q) = make_uint4(dw[q], dw[q + 1 < DW ? q + 1 : q],
                                                                         dw[q + 2 < DW ? q + 2 : q], dw[q + 3 < DW ? q + 3 : q]);
                    else *reinterpret_cast<uint2*>(row + q) = make_uint2(dw[q], dw[q + 1 < DW ? q + 1 : q]);
                }
            } else {
#pragma unroll
                for (int q = 0; q < DW; ++q) row[q] = dw[q];
            }
        };
        if (EPI == EPI_FLOAT && OUT_T != OUT_F32 && NT % 4 == 0 && interior && (ldo & 7) == 0) {
            // 16-bit output inside M x N: a lane's fragment pair is 4 bytes, half a 32-byte sector, and the
            // fp16 epilogue was bound by L2 store transactions.  The quad transposes its pairs of 4 MMA tiles
            // so that lane t stores tile 4 q + t's 8 columns of the row with one 16-byte store.  (Extending it
            // to tiles that N cuts, with a checked path for the cut group, measured 10-15% slower everywhere.)
            const int t = lane & 3;
            // TCP_RES: the residual's 16-byte reads of PF_H rows (both halves of an MMA row tile when NT <= 16) are
            // issued together before any is used, so their latencies overlap (one after another, the reads of a
            // 128 x 64 tile cost more than its MMAs: ResNet stage 0 at batch 256, 113 -> 209 us with the add)
            constexpr int PF_H = NT <= 16 ? 2 : 1;
            [[maybe_unused]] uint4 rpre[PF_H][NT >= 4 ? NT / 4 : 1];
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const int rl = wm * (MT * 16) + mt * 16 + (lane >> 2) + h * 8;
                    const int rt = row_t(mt, h, rl);
                    const float rs = s_rs[rl];
                    unsigned short* const orow = (unsigned short*)out + (i64)(m0 + rl) * ldo + n0 + wn * (NT * 8);
                    [[maybe_unused]] u32 dw[DW];  // TCP_DUAL: the row's words of plane lane % 4 (< OB)
                    if (RES && h % PF_H == 0) {
#pragma unroll
                        for (int hh = 0; hh < PF_H; ++hh)
#pragma unroll
                            for (int q = 0; q < NT / 4; ++q)
                                rpre[hh][q] = *reinterpret_cast<const uint4*>(
                                    (const unsigned short*)residual + (i64)(m0 + rl + hh * 8) * ldo + n0 + wn * (NT * 8)
                                    + (4 * q + t) * 8);
                    }
#pragma unroll
                    for (int q = 0; q < NT / 4; ++q) {
                        u32 pk[4];
#pragma unroll
                        for (int j = 0; j < 4; ++j) {
                            const int nt = 4 * q + j, cl = wn * (NT * 8) + nt * 8 + 2 * t;
                            const float y0 = y_value(c_value(mt, nt, 2 * h, rt, s_ct[cl]), rs, s_cs[cl], s_bias[cl]);
                            const float y1 = y_value(c_value(mt, nt, 2 * h + 1, rt, s_ct[cl + 1]), rs, s_cs[cl + 1],
                                                     s_bias[cl + 1]);
                            pk[j] = pair_of(OUT_T == OUT_F16 ? f32_to_f16(y0) : f32_to_bf16(y0),
                                            OUT_T == OUT_F16 ? f32_to_f16(y1) : f32_to_bf16(y1));
                        }
                        quad_transpose(pk, t);
                        if (RES) {  // this lane's 8 columns of the row: one 16-byte read of the residual
                            const uint4 rv = rpre[h % PF_H][q];
                            const u32 rw[4] = {rv.x, rv.y, rv.z, rv.w};
                            if (OUT_T == OUT_F16 && (relu == 0 || slope == 0.0f)) {  // fp16, ReLU or none: in fp16x2
#pragma unroll
                                for (int j = 0; j < 4; ++j) {
                                    const u32 v = hadd2_rn(pk[j], rw[j]);
                                    pk[j] = relu != 0 ? v & ~hlt2_mask(v, 0u) : v;
                                }
                            } else {
#pragma unroll
                            for (int j = 0; j < 4; ++j) {
                                const float a = residual_sum(out_of16((unsigned short)(pk[j] & 0xffffu)),
                                                             out_of16((unsigned short)(rw[j] & 0xffffu)), relu != 0, slope);
                                const float b = residual_sum(out_of16((unsigned short)(pk[j] >> 16)),
                                                             out_of16((unsigned short)(rw[j] >> 16)), relu != 0, slope);
                                pk[j] = pair_of(out_bits16(a), out_bits16(b));
                            }
                            }
                        }
                        st_global_v4(orow + (4 * q + t) * 8, pk);
                        if (DUAL) {  // lane t has columns 8 t .. 8 t + 7 of the quad's 32: one word a plane
                            u32 bits[OB];
                            if (OUT_T == OUT_F16) {  // fp16: per threshold one compare of both halves; bit b of the index is
                                // the parity of the comparisons at i = m 2^b (see bits_of), then 8 masks -> 8 bits
                                u32 pm[OB][4];
#pragma unroll
                                for (int j = 0; j < 4; ++j) {
                                    u32 m2[OB];
                                    index_masks2(pk[j], dthr16, m2);
#pragma unroll
                                    for (int b = 0; b < OB; ++b) pm[b][j] = m2[b];
                                }
#pragma unroll
                                for (int b = 0; b < OB; ++b) bits[b] = mask_bits8(pm[b]);
                                if (OENC == ENC_TWOS) bits[OB - 1] ^= 0xFFu;  // two's complement: the index's top bit flipped
                            } else {
#pragma unroll
                            for (int b = 0; b < OB; ++b) bits[b] = 0;
#pragma unroll
                            for (int j = 0; j < 4; ++j)
#pragma unroll
                                for (int e = 0; e < 2; ++e) {
                                    const u32 c = code_pattern(out_of16((unsigned short)(pk[j] >> (16 * e))), dthr);
#pragma unroll
                                    for (int b = 0; b < OB; ++b) bits[b] |= ((c >> b) & 1u) << (2 * j + e);  // constant
                                }
                            }
#pragma unroll
                            for (int b = 0; b < OB; ++b) bits[b] <<= 8 * t;  // the lane's byte of the word
                            dual_or(bits, dw, q);
                        }
                    }
                    if (DUAL) dual_store_row(dw, m0 + rl, (n0 + wn * (NT * 8)) / 32);  // (interior: rows, words inside)
                }
            return;
        }
        if (EPI != EPI_PACKED) {
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                    for (int h = 0; h < 2; ++h) {
                        const int rl = wm * (MT * 16) + mt * 16 + (lane >> 2) + h * 8;  // row in the tile
                        const int cl = wn * (NT * 8) + nt * 8 + (lane & 3) * 2;          // first of 2 columns
                        const int r = m0 + rl, c = n0 + cl, rt = row_t(mt, h, rl);
                        const int c0 = c_value(mt, nt, 2 * h, rt, s_ct[cl]);
                        const int c1 = c_value(mt, nt, 2 * h + 1, rt, s_ct[cl + 1]);
                        if (EPI == EPI_INT32) {
                            store_pair((int*)out + (i64)r * ldo + c, c0, c1, interior, r, c, M, N, ldo);
                        } else {
                            float y0 = y_value(c0, s_rs[rl], s_cs[cl], s_bias[cl]);
                            float y1 = y_value(c1, s_rs[rl], s_cs[cl + 1], s_bias[cl + 1]);
                            if (RES) {  // the residual of the outputs inside M x N (the others are not stored)
                                const i64 o = (i64)r * ldo + c;
                                auto res_at = [&](i64 i) -> float {
                                    return OUT_T == OUT_F32 ? ((const float*)residual)[i]
                                                      : out_of16(((const unsigned short*)residual)[i]);
                                };
                                if (r < M && c < N) y0 = residual_sum(y0, res_at(o), relu != 0, slope);
                                if (r < M && c + 1 < N) y1 = residual_sum(y1, res_at(o + 1), relu != 0, slope);
                            }
                            if (OUT_T == OUT_F32) {
                                store_pair((float*)out + (i64)r * ldo + c, y0, y1, interior, r, c, M, N, ldo);
                            } else {
                                const unsigned short h0 = OUT_T == OUT_F16 ? f32_to_f16(y0) : f32_to_bf16(y0);
                                const unsigned short h1 = OUT_T == OUT_F16 ? f32_to_f16(y1) : f32_to_bf16(y1);
                                store_pair((unsigned short*)out + (i64)r * ldo + c, h0, h1, interior, r, c, M, N, ldo);
                            }
                        }
                    }
            if (DUAL) {  // (a tile N or M cuts) the planes of the stored values, recomputed: the packed epilogue's words
                const int t = lane & 3;
#pragma unroll
                for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                    for (int h = 0; h < 2; ++h) {
                        const int rl = wm * (MT * 16) + mt * 16 + (lane >> 2) + h * 8, r = m0 + rl;
#pragma unroll
                        for (int wg = 0; wg < NT / 4; ++wg) {
                            u32 bits[OB];
#pragma unroll
                            for (int b = 0; b < OB; ++b) bits[b] = 0;
#pragma unroll
                            for (int j = 0; j < 4; ++j)
#pragma unroll
                                for (int e = 0; e < 2; ++e) {
                                    const int nt = 4 * wg + j, cl = wn * (NT * 8) + nt * 8 + 2 * t + e, c = n0 + cl;
                                    if (r >= M || c >= N) continue;
                                    float y = y_value(c_value(mt, nt, 2 * h + e, row_t(mt, h, rl), s_ct[cl]), s_rs[rl], s_cs[cl],
                                                      s_bias[cl]);
                                    if (RES) {
                                        const float rv = out_of16(((const unsigned short*)residual)[(i64)r * ldo + c]);
                                        y = residual_sum(y, rv, relu != 0, slope);
                                    }
                                    const u32 code = code_pattern(rd_out(y), dthr);
#pragma unroll
                                    for (int b = 0; b < OB; ++b) bits[b] |= ((code >> b) & 1u) << (8 * j + 2 * t + e);
                                }
                            store_dual_word(bits, r, (n0 + wn * (NT * 8)) / 32 + wg);
                        }
                    }
            }
            return;
        }
        // EPI == 2: codes straight from the accumulator registers into bit-plane words.  A 32-column word of
        // a row is 4 MMA tiles (nt) of one warp: lane t of the row's quad holds its columns 8 j + 2 t + e,
        // so each lane sets its 8 bits, two xor-shuffles OR the quad's together, and the quad's lanes take
        // turns storing the row's words (no shared memory, no barrier).  Columns past N get code 0.
        float thr[NCODE > 8 ? 1 : NCODE];  // OB <= 3: the thresholds in registers, else bisect in shared memory
        if (NCODE <= 8) {
#pragma unroll
            for (int i = 1; i < NCODE; ++i) thr[i] = s_thr[i];
        }
        // the stored pattern's bits from the index's comparisons ge[i] = (index >= i), 1 <= i < 2^OB <= 8 (index_bit)
        constexpr int NGE = NCODE <= 8 ? NCODE : 1;
        auto bits_of = [&](const bool (&ge)[NGE], bool (&bit)[OB]) {
#pragma unroll
            for (int b = 0; b < OB; ++b) bit[b] = index_bit(ge, b);
            if (OENC == ENC_TWOS) bit[OB - 1] = !bit[OB - 1];  // two's complement: the index with its sign bit flipped
        };
        // bit b of the stored pattern of y (the float path): OB <= 3 by comparisons, else a binary search
        auto code_bits = [&](float y, bool (&bit)[OB]) {
            if (NCODE <= 8) {
                bool ge[NGE];
#pragma unroll
                for (int i = 1; i < NGE; ++i) ge[i] = y >= thr[i];
                bits_of(ge, bit);
            } else {
                u32 idx = 0;
#pragma unroll
                for (int b = OB - 1; b >= 0; --b) {
                    const u32 cand = idx | (1u << b);
                    idx = y >= s_thr[cand] ? cand : idx;
                }
#pragma unroll
                for (int b = 0; b < OB; ++b) bit[b] = (idx >> b) & 1u;
                if (OENC == ENC_TWOS) bit[OB - 1] = !bit[OB - 1];
            }
        };
        const int* const s_ith = reinterpret_cast<const int*>(s_ct + BN);  // (BN, ITHR) integer threshold words
        const int t = lane & 3;
        const i64 plane = (i64)M * ldo;
        u32* const o = (u32*)out;
        // word group wg (32 columns) of MMA row tile mt: this lane's 8 columns of both its rows, by the integer thresholds
        // (int_path) or the float path, OR-ed across the quad and stored.  `checked`: columns past N get code 0, rows
        // past M and words past ldo are not stored (a tile that M or N cuts); inside M x N no check is compiled in.
        auto words = [&](int mt, int wg, const int (&rl)[2], const int (&rt)[2], const float (&rs)[2], bool int_path,
                         bool checked) {
            u32 word[2][OB];
#pragma unroll
            for (int h = 0; h < 2; ++h)
#pragma unroll
                for (int b = 0; b < OB; ++b) word[h][b] = 0;
            // column (j, e) of the word into both rows' words
            auto column = [&](int j, int e, bool ip) {
                const int nt = 4 * wg + j, cl = wn * (NT * 8) + nt * 8 + 2 * t + e;
                const int ct = s_ct[cl];
                const bool inside = !checked || n0 + cl < N;
                bool bit[2][OB];
                if (ip) {
                    int it[NGE];  // f, t_1 .. t_{2^OB - 1}
                    if (NGE % 4 == 0) {
#pragma unroll
                        for (int q4 = 0; q4 < NGE / 4; ++q4) {
                            const int4 v4 = reinterpret_cast<const int4*>(s_ith + cl * NGE)[q4];
                            it[4 * q4] = v4.x, it[4 * q4 + 1] = v4.y, it[4 * q4 + 2] = v4.z, it[4 * q4 + 3] = v4.w;
                        }
                    } else {
                        const int2 v2 = *reinterpret_cast<const int2*>(s_ith + cl * NGE);
                        it[0] = v2.x, it[NGE > 1 ? 1 : 0] = v2.y;
                    }
#pragma unroll
                    for (int h = 0; h < 2; ++h) {
                        const int cv = c_value(mt, nt, 2 * h + e, rt[h], ct) ^ it[0];
                        bool ge[NGE];
#pragma unroll
                        for (int i = 1; i < NGE; ++i) ge[i] = cv >= it[i];
                        bits_of(ge, bit[h]);
                    }
                } else {
                    const float cs = s_cs[cl], bi = s_bias[cl];
#pragma unroll
                    for (int h = 0; h < 2; ++h) code_bits(y_value(c_value(mt, nt, 2 * h + e, rt[h], ct), rs[h], cs, bi), bit[h]);
                }
#pragma unroll
                for (int h = 0; h < 2; ++h)
#pragma unroll
                    for (int b = 0; b < OB; ++b) word[h][b] |= bit[h][b] && inside ? 1u << (8 * j + e) : 0u;
            };
            if (ITHR > 0 && int_path) {
#pragma unroll
                for (int j = 0; j < 4; ++j)
#pragma unroll
                    for (int e = 0; e < 2; ++e) column(j, e, true);
            } else {
#pragma unroll
                for (int j = 0; j < 4; ++j)
#pragma unroll
                    for (int e = 0; e < 2; ++e) column(j, e, false);
            }
            const int gw = (n0 + wn * (NT * 8)) / 32 + wg;
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int r = m0 + rl[h];
#pragma unroll
                for (int b = 0; b < OB; ++b) {
                    u32 v = word[h][b] << (2 * t);  // this lane's columns 8 j + 2 t + e
                    v |= __shfl_xor_sync(0xffffffffu, v, 1);
                    v |= __shfl_xor_sync(0xffffffffu, v, 2);
                    if (((wg * OB + b) & 3) == t && (!checked || (r < M && gw < ldo))) o[b * plane + (i64)r * ldo + gw] = v;
                }
            }
        };
        // whether one of this lane's columns of word group wg is marked (word 0 = 1: its warp's words take the float path)
        auto marked = [&](int wg) {
            bool m = false;
            if (ITHR > 0) {
#pragma unroll
                for (int j = 0; j < 4; ++j)
#pragma unroll
                    for (int e = 0; e < 2; ++e) m |= s_ith[(wn * (NT * 8) + (4 * wg + j) * 8 + 2 * t + e) * ITHR] == 1;
            }
            return m;
        };
        // The common case -- integer thresholds for every column of the warp and a tile inside M x N -- is decided once
        // a tile (one vote), so the words of all groups are one branch-free block the compiler interleaves (a vote and a
        // branch a word group had serialised them); other tiles decide a word group at a time, with the checks.
        bool fast = false;
        if (ITHR > 0 && col_thr != nullptr && interior) {
            bool m = false;
#pragma unroll
            for (int wg = 0; wg < NT / 4; ++wg) m |= marked(wg);
            fast = !__any_sync(0xffffffffu, m);
        }
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
            int rl[2], rt[2];
            float rs[2];
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                rl[h] = wm * (MT * 16) + mt * 16 + (lane >> 2) + h * 8;
                rt[h] = row_t(mt, h, rl[h]);
                rs[h] = s_rs[rl[h]];
            }
            if (fast) {
#pragma unroll
                for (int wg = 0; wg < NT / 4; ++wg) words(mt, wg, rl, rt, rs, true, false);
            } else {
#pragma unroll
                for (int wg = 0; wg < NT / 4; ++wg) {
                    const bool use_int = ITHR > 0 && col_thr != nullptr && !__any_sync(0xffffffffu, marked(wg));
                    words(mt, wg, rl, rt, rs, use_int, true);
                }
            }
        }
        if (n0 + BN >= N) {  // the last column tile also zeroes the row's padding words (none in compact rows)
            const int first = (n0 + BN) / 32, pad = ldo - first;
            // Rows padded to whole 512-bit words (pad < 16, ldo a multiple of 4 words, 16-byte aligned planes): four
            // lanes a (plane, row), lane 0 the words up to the next 16-byte boundary, lanes 1..3 one 16-byte chunk
            // each -- a warp's store covers 8 rows' padding.  (A thread a row storing its words one at a time touched
            // a sector a word: 28% of ResNet-50 w1a2's 56x56 3x3 conv, 14 padding words a row, on an H200.)
            const int f4 = (first + 3) & ~3;
            if (pad > 0 && pad < 16 && (ldo & 3) == 0 && (reinterpret_cast<u64>(o) & 15) == 0) {
                const int part = tid & 3;
                for (int br = tid >> 2; br < OB * BM; br += MMA_THREADS / 4) {
                    const int rl = br % BM, b = br / BM;
                    if (m0 + rl >= M) continue;
                    u32* const row = o + b * plane + (i64)(m0 + rl) * ldo;
                    if (part == 0) {
                        for (int w = first; w < f4 && w < ldo; ++w) row[w] = 0u;
                    } else if (f4 + 4 * part <= ldo) {
                        *reinterpret_cast<uint4*>(row + f4 + 4 * (part - 1)) = make_uint4(0u, 0u, 0u, 0u);
                    }
                }
            } else if (pad > 0) {  // a thread a (plane, row): its padding words in a row (no division by pad a word)
                for (int br = tid; br < OB * BM; br += MMA_THREADS) {
                    const int rl = br % BM, b = br / BM;
                    if (m0 + rl < M) {
                        u32* const row = o + b * plane + (i64)(m0 + rl) * ldo + first;
                        for (int w = 0; w < pad; ++w) row[w] = 0u;
                    }
                }
            }
        }
    };

#if TCP_WGMMA
    // ---- one pipeline stage on the tensor cores (both wgmma pipelines): every plane pair's wgmmas over the
    // stage's KK k-steps from the A / W descriptors dA, dW (the warpgroup's slabs), committed as one group ----
    [[maybe_unused]] const u64 d_ones = smem_desc(smem_base + ONES_OFF);  // TCP_ROWSUM: the all-ones B tile
    auto mma_stage = [&](u64 dA, u64 dW) {
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < KK; ++kk)
#pragma unroll
            for (int i = 0; i < P; ++i)
#pragma unroll
                for (int j = 0; j < Q; ++j) {  // (descriptor addresses count 16-byte units: 32 bytes = 2)
                    const u64 da = dA + (u64)((i * BM * ROW_BYTES + kk * 32) >> 4);
                    if (ROWSUM && j == 0) wgmma_rowsum(rsa[ROWSUM ? i : 0][0], da, d_ones);  // every 256-bit slice of it is ones
                    const u64 dw = dW + (u64)((j * BN * ROW_BYTES + kk * 32) >> 4);
                    if (FOLD) {
#pragma unroll
                        for (int rep = 0; rep < pair_weight(i, j); ++rep) Wgmma<NT>::run(acc[0][0], da, dw);
                    } else {
                        Wgmma<NT>::run(acc[CT.cls[i * Q + j]][0], da, dw);
                    }
                }
        wgmma_commit();
    };
#endif

#if TCP_TMA
    // ---- warp-specialised, persistent TMA pipeline.  Stage s has a "full" barrier (1 arrival, the local
    // producer's, plus STAGE_BYTES of TMA transactions, some of them multicast by partner blocks) and an
    // "empty" one (an arrival from every MMA warp of every block of the cluster: a block may refill stage s
    // only when all the blocks it multicasts into have finished reading it).  Steps are counted across the
    // block's tiles (g), so the producer runs ahead into the next tile while the MMA warps store this one;
    // phase n of a barrier has parity n & 1. ----
    const u32 full0 = (u32)__cvta_generic_to_shared(smem + BAR_OFF), empty0 = full0 + 8 * STAGES;
    const int tiles = grid_m * grid_n, stride = gridDim.x / CS;
    if (tid == 0) {
#pragma unroll
        for (int s = 0; s < STAGES; ++s) {
            mbar_init(full0 + 8 * s, CONV ? 1 + 128 : 1);  // conv: + every producer thread's A arrival
            mbar_init(empty0 + 8 * s, (MMA_THREADS / 32) * CS);
        }
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    cluster_sync();  // barriers initialised in every block before any multicast or remote arrival

    if (CONV && warp >= CONS_THREADS / 32) {  // ---- producer warpgroup, conv: 128 threads gather A, one loads W ----
        shrink_regs<PRODUCER_REGS>();
        const int ptid = tid - CONS_THREADS;
        ConvLoader<128> ld;
        // step g's A copies are this thread's cp.async group g; it waits for them LAG steps later (so LAG steps of
        // gathers stay in flight), fences them for the async proxy and arrives on step g's "full" barrier.
        // LAG = RING - 2: before refilling step g's slot the producer waits for the MMA warps to release step
        // g - RING, which they do once step g - RING + 1 is full (they keep one step's wgmmas in flight), and the
        // producer arrived for that step one iteration earlier (with LAG = RING - 1 it would wait forever).
        constexpr int LAG = RING - 2;
        static_assert(LAG >= 1, "conv on TMA: >= 3 stages");
        int g = 0;
        for (int pid = blockIdx.x; pid < tiles; pid += stride) {
            int m0, n0;
            tile_origin(pid, m0, n0);
            ld.rows(geo, m0, M, ptid);
            for (int kt = 0; kt < k_tiles; ++kt, ++g) {
                const int s = g % RING;
                if (g >= RING) mbar_wait(empty0 + 8 * s, ((g / RING) + 1) & 1);
                const u32 sA = smem_base + s * STAGE_BYTES, sW = sA + A_STAGE;
                if (ptid == 0) {
                    mbar_arrive_expect_tx(full0 + 8 * s, W_STAGE);
#pragma unroll
                    for (int pl = 0; pl < Q; ++pl)
                        tma_load(sW + pl * BN * ROW_BYTES, tmW, kt * WPS, n0, pl, full0 + 8 * s, 0);
                }
                ld.load(geo, A, sA, kt, ptid);
                cp_async_commit();
                if (g >= LAG) {
                    cp_async_wait<LAG>();
                    fence_proxy_async();
                    mbar_arrive_cta(full0 + 8 * ((g - LAG) % RING), 0);
                }
            }
        }
        cp_async_wait<0>();
        fence_proxy_async();
        for (int d = g - LAG < 0 ? 0 : g - LAG; d < g; ++d) mbar_arrive_cta(full0 + 8 * (d % RING), 0);
    } else if (warp >= CONS_THREADS / 32) {  // ---- producer warpgroup: one thread issues every TMA load ----
        shrink_regs<PRODUCER_REGS>();
        if (warp == CONS_THREADS / 32 && lane == 0) {
            // this block loads rows [a_r0, a_r0 + BM / CN) of the A tile for the CN blocks of its cluster row
            // (same m0) and rows [w_r0, w_r0 + BN / CM) of the W tile for the CM blocks of its cluster column
            const int a_r0 = rn * (BM / CN), w_r0 = rm * (BN / CM);
            unsigned short a_mask = 0, w_mask = 0;
            if (CN > 1)
                for (int j = 0; j < CN; ++j) a_mask |= (unsigned short)(1u << (rm + CM * j));
            if (CM > 1)
                for (int i = 0; i < CM; ++i) w_mask |= (unsigned short)(1u << (i + CM * rn));
            int step = 0;  // steps loaded, counted across the block's tiles
            for (int pid = blockIdx.x / CS; pid < tiles; pid += stride) {
                int m0, n0;
                tile_origin(pid, m0, n0);
                for (int kt = 0; kt < k_tiles; ++kt) {
                    const int g = step++, s = g % RING;
                    if (g >= RING) mbar_wait(empty0 + 8 * s, ((g / RING) + 1) & 1);
                    mbar_arrive_expect_tx(full0 + 8 * s, STAGE_BYTES);
                    const u32 sA = smem_base + s * STAGE_BYTES, sW = sA + A_STAGE;
#pragma unroll
                    for (int pl = 0; pl < P; ++pl)
                        tma_load(sA + (pl * BM + a_r0) * ROW_BYTES, tmA, kt * WPS, m0 + a_r0, pl, full0 + 8 * s,
                                 a_mask);
#pragma unroll
                    for (int pl = 0; pl < Q; ++pl)
                        tma_load(sW + (pl * BN + w_r0) * ROW_BYTES, tmW, kt * WPS, n0 + w_r0, pl, full0 + 8 * s,
                                 w_mask);
                    // (the residual is not prefetched here: this one thread's bulk prefetches, a row each, held the
                    // loads of the next tiles back, and the MMA warps waited on them; they prefetch it themselves, a
                    // tile ahead, decision 0173)
                }
            }
        }
    } else {  // ---- MMA warpgroups: warpgroup g multiplies rows 64 g .. 64 g + 63 by the W tile ----
        set_max_regs<MMA_REGS>();
        // the threads that stage one copy of the vectors and sync on it: a warpgroup (WG_VEC) or all MMA warps
        constexpr int STAGERS = WG_VEC ? 128 : MMA_THREADS;
        const int wtid = WG_VEC ? tid & 127 : tid;
        auto wg_sync = [&]() {
            if (WG_VEC) {
                asm volatile("bar.sync %0, 128;\n" ::"r"(1 + vcopy) : "memory");
            } else {
                mma_sync_all();
            }
        };
        if (EPI == EPI_PACKED || DUAL)  // the code thresholds, visible after the first tile's barrier
            for (int i = wtid + 1; i < NCODE; i += STAGERS) s_thr[i] = code_threshold(i, out_scale[0]);
        const int slab = cwarp >> 2;
        auto release = [&](int g) {  // one arrival per warp on step g's "empty" barrier in every cluster block
            if (lane == 0) {
                const u32 e = empty0 + 8 * (g % RING);
#pragma unroll
                for (int c = 0; c < CS; ++c) mbar_arrive_cta(e, (u32)c);
            }
        };
        // a convolution with the row sums in the kernel reads no row vector (no row scale, no row term): its tiles
        // stage the column vectors only
        constexpr int VEC_LO = CONV && ROWSUM ? 2 * BM : 0;
        constexpr int VPT = (VEC_N - VEC_LO + STAGERS - 1) / STAGERS;
        // the block's tiles are pid = blockIdx.x / CS + t * stride, t = 0, 1, ..; steps g counted across them
        int g = 0;
        for (int pid = blockIdx.x / CS; pid < tiles; pid += stride) {
            int m0, n0;
            tile_origin(pid, m0, n0);
            u32 vec[VPT];  // this tile's epilogue vectors, loaded now, stored to shared memory after the MMAs
#pragma unroll
            for (int j = 0; j < VPT; ++j) {
                const int i = VEC_LO + wtid + j * STAGERS;
                vec[j] = i < VEC_N ? vec_value(i, m0, n0) : 0u;
            }
            zero_acc();
            for (int kt = 0; kt < k_tiles; ++kt, ++g) {
                const int s = g % RING;
                mbar_wait(full0 + 8 * s, (g / RING) & 1);
                const u32 sA = smem_base + s * STAGE_BYTES, sW = sA + A_STAGE;
                const u64 dA = smem_desc(sA + slab * 64 * ROW_BYTES), dW = smem_desc(sW);
                mma_stage(dA, dW);
                wgmma_wait<1>();  // step g-1's wgmmas are done: release its stage in every block that fills it
                if (kt > 0) release(g - 1);
            }
            wgmma_wait<0>();
            release(g - 1);
            wg_sync();  // every thread of the warpgroup is past its previous tile's epilogue: restage
#pragma unroll
            for (int j = 0; j < VPT; ++j) {
                const int i = VEC_LO + wtid + j * STAGERS;
                if (i < VEC_N) s_vec[i] = vec[j];
            }
            wg_sync();
            // the next tile's residual -> L2 while this one's epilogue runs (a line a thread).  Not on the conv
            // path, where the gathering producer reads A from L2 too: ResNet-34 w1a2 2.695 -> 2.703 ms with it
            // (decision 0173)
            if (RES && !CONV && pid + stride < tiles) {
                int m1, n1;
                tile_origin(pid + stride, m1, n1);
                prefetch_tile_l2(residual, m1, n1, M, N, ldo, OUT_T == OUT_F32 ? 4 : 2, tid, MMA_THREADS);
            }
            epilogue(m0, n0);
        }
    }
    cluster_sync();  // no block leaves while a partner may still arrive on its barriers
#else
    // split-K: block b takes tile b % tiles and the (b / tiles)-th run of K steps, [kt0, kt1)
    const int n_tiles = grid_m * grid_n;
    const int pid = SPLIT ? (int)blockIdx.x % n_tiles : (int)blockIdx.x;
    int kt0 = 0, kt1 = k_tiles;
    if (SPLIT) {
        const int per = (k_tiles + splits - 1) / splits;
        kt0 = min(k_tiles, (int)blockIdx.x / n_tiles * per);
        kt1 = min(k_tiles, kt0 + per);
    }
    int m0, n0;
    tile_origin(pid, m0, n0);
    // The epilogue vectors: loaded into registers now, stored to shared memory (visible after the first
    // barrier) only once the prologue's cp.asyncs are issued, so the operand loads do not queue behind them.
    constexpr int VPB = (VEC_N + THREADS - 1) / THREADS;
    u32 vec[VPB];
#pragma unroll
    for (int j = 0; j < VPB; ++j) {
        const int i = tid + j * THREADS;
        vec[j] = i < VEC_N ? vec_value(i, m0, n0) : 0u;
    }
    auto stage_vectors = [&]() {
#pragma unroll
        for (int j = 0; j < VPB; ++j) {
            const int i = tid + j * THREADS;
            if (i < VEC_N) s_vec[i] = vec[j];
        }
        if (EPI == EPI_PACKED || DUAL)
            for (int i = tid + 1; i < NCODE; i += THREADS) s_thr[i] = code_threshold(i, out_scale[0]);
    };
    zero_acc();
    const i64 a_plane = (i64)M * Kw, w_plane = (i64)N * Kw;

    // ---- producer: one BK-bit K step of every plane of the A and W tiles into stage `stage` ----
    [[maybe_unused]] ConvLoader<THREADS> ld;
    if (CONV) ld.rows(geo, m0, M, tid);
    auto load_tile = [&](int stage, int kt) {
        const u32 sA = smem_base + stage * STAGE_BYTES, sW = sA + A_STAGE;
        if (CONV) ld.load(geo, A, sA, kt, tid);
#pragma unroll
        for (int idx = tid; idx < (CONV ? 0 : A_CHUNKS); idx += THREADS) {
            const int c = idx % KCH, r = (idx / KCH) % BM, pl = idx / (KCH * BM);
            const int m = m0 + r, kw = kt * WPS + c * 4;
            const bool ok = m < M && kw < Kw;
            const u32* src = A + pl * a_plane + (ok ? (i64)m * Kw + kw : 0);
            cp_async16(sA + pl * (BM * ROW_BYTES) + swz(r, c), src, ok);
        }
#pragma unroll
        for (int idx = tid; idx < W_CHUNKS; idx += THREADS) {
            const int c = idx % KCH, r = (idx / KCH) % BN, pl = idx / (KCH * BN);
            const int n = n0 + r, kw = kt * WPS + c * 4;
            const bool ok = n < N && kw < Kw;
            const u32* src = W + pl * w_plane + (ok ? (i64)n * Kw + kw : 0);
            cp_async16(sW + pl * (BN * ROW_BYTES) + swz(r, c), src, ok);
        }
    };

#if TCP_WGMMA
    // ---- prologue: STAGES-2 steps in flight (the slot of step kt-1 may still be read by wgmma) ----
#pragma unroll
    for (int s = 0; s < STAGES - 2; ++s) {
        if (kt0 + s < kt1) load_tile((kt0 + s) % STAGES, kt0 + s);
        cp_async_commit();
    }
    stage_vectors();
    const int slab = (warp >> 2) / WARPS_N;  // this warpgroup's 64-row slab of A, its N slab is wn
    for (int kt = kt0; kt < kt1; ++kt) {
        cp_async_wait<STAGES - 3>();
        fence_proxy_async();  // this thread's cp.async data -> visible to the tensor cores' async proxy
        __syncthreads();      // step kt landed for all; every warpgroup has retired step kt-2's wgmmas
        const int next = kt + STAGES - 2;
        if (next < kt1) load_tile(next % STAGES, next);
        cp_async_commit();

        const u32 sA = smem_base + (kt % STAGES) * STAGE_BYTES, sW = sA + A_STAGE;
        const u64 dA = smem_desc(sA + slab * 64 * ROW_BYTES), dW = smem_desc(sW + wn * (NT * 8) * ROW_BYTES);
        mma_stage(dA, dW);
        wgmma_wait<1>();  // step kt-1's wgmmas are done: its slot may be refilled after the next barrier
    }
    wgmma_wait<0>();
#else
    // ---- prologue: STAGES-1 steps in flight ----
#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {
        if (kt0 + s < kt1) load_tile((kt0 + s) % STAGES, kt0 + s);
        cp_async_commit();
    }
    stage_vectors();

    // ---- main loop: wait for step kt, refill the slot step kt-1 used, multiply step kt ----
    for (int kt = kt0; kt < kt1; ++kt) {
        cp_async_wait<STAGES - 2>();
        __syncthreads();  // step kt visible to all; every warp is done with step kt-1's slot
        const int next = kt + STAGES - 1;
        if (next < kt1) load_tile(next % STAGES, next);
        cp_async_commit();  // (an empty group at the tail keeps wait_group's count aligned)

        const u32 sA = smem_base + (kt % STAGES) * STAGE_BYTES, sW = sA + A_STAGE;
        // fragments of k-step kk (lane addresses: see the ldmatrix note at the top)
        auto load_frags = [&](u32 (&a)[P][MT][4], u32 (&b)[Q][NT][2], int kk) {
#pragma unroll
            for (int j = 0; j < Q; ++j)
#pragma unroll
                for (int np = 0; np < NT / 2; ++np) {
                    const int row = wn * (NT * 8) + np * 16 + (lane & 7) + ((lane >> 4) << 3);
                    const int chunk = 2 * kk + ((lane >> 3) & 1);
                    ldmatrix_x4(b[j][2 * np][0], b[j][2 * np][1], b[j][2 * np + 1][0], b[j][2 * np + 1][1],
                                sW + j * (BN * ROW_BYTES) + swz(row, chunk));
                }
#pragma unroll
            for (int i = 0; i < P; ++i)
#pragma unroll
                for (int mt = 0; mt < MT; ++mt) {
                    const int row = wm * (MT * 16) + mt * 16 + (lane & 15);
                    const int chunk = 2 * kk + (lane >> 4);
                    ldmatrix_x4(a[i][mt][0], a[i][mt][1], a[i][mt][2], a[i][mt][3],
                                sA + i * (BM * ROW_BYTES) + swz(row, chunk));
                }
        };
        auto mma_all = [&](const u32 (&a)[P][MT][4], const u32 (&b)[Q][NT][2]) {
            if (ROWSUM) {  // each plane's rows against all-ones B (a constant fragment): the row sums
                const u32 ones[2] = {0xffffffffu, 0xffffffffu};
#pragma unroll
                for (int i = 0; i < P; ++i)
#pragma unroll
                    for (int mt = 0; mt < MT; ++mt) bmma_and_popc(rsa[ROWSUM ? i : 0][mt], a[i][mt], ones);
            }
#pragma unroll
            for (int i = 0; i < P; ++i)
#pragma unroll
                for (int j = 0; j < Q; ++j)
#pragma unroll
                    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                        for (int nt = 0; nt < NT; ++nt) bmma_and_popc(acc[CT.cls[i * Q + j]][mt][nt], a[i][mt], b[j][nt]);
        };
        if (FRAG_DB) {  // load k-step kk+1 while k-step kk multiplies
            u32 a[2][P][MT][4], b[2][Q][NT][2];
            load_frags(a[0], b[0], 0);
#pragma unroll
            for (int kk = 0; kk < KK; ++kk) {
                if (kk + 1 < KK) load_frags(a[(kk + 1) & 1], b[(kk + 1) & 1], kk + 1);
                mma_all(a[kk & 1], b[kk & 1]);
            }
        } else {
#pragma unroll
            for (int kk = 0; kk < KK; ++kk) {
                u32 a[P][MT][4], b[Q][NT][2];
                load_frags(a, b, kk);
                mma_all(a, b);
            }
        }
    }

#endif  // TCP_WGMMA
    grid_dependents_launch();
    if constexpr (SPLIT) {  // add this K run's sums; the tile's last block reads the totals into class 0 (see the top)
        __shared__ int s_last;
        int* const counter = split_ws + pid;
        int* const sums = split_ws + SPLIT_COUNTERS;
        // output (mt, nt, e4) of this thread -> its index in M x N, or -1 outside
        auto out_index = [&](int mt, int nt, int e4) -> i64 {
            const int r = m0 + wm * (MT * 16) + mt * 16 + (lane >> 2) + (e4 >> 1) * 8;
            const int c = n0 + wn * (NT * 8) + nt * 8 + 2 * (lane & 3) + (e4 & 1);
            return r < M && c < N ? (i64)r * N + c : (i64)-1;
        };
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                for (int e4 = 0; e4 < 4; ++e4) {
                    const i64 o = out_index(mt, nt, e4);
                    if (o >= 0) atomicAdd(sums + o, (int)class_sum(mt, nt, e4));
                }
        __threadfence();  // this block's sums are in L2 before its arrival is counted
        __syncthreads();
        if (tid == 0) s_last = atomicAdd(counter, 1) == splits - 1;
        __syncthreads();
        if (!s_last) return;
        __threadfence();
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                for (int e4 = 0; e4 < 4; ++e4) {
                    const i64 o = out_index(mt, nt, e4);
                    int v = 0;
                    if (o >= 0) {
                        v = __ldcg(sums + o);  // from L2, where the atomics landed
                        sums[o] = 0;           // zero again for the next launch
                    }
                    acc[0][mt][nt][e4] = v;
                }
        if (tid == 0) *counter = 0;
    }
    epilogue(m0, n0);
#endif  // TCP_TMA
}

#if TCP_EPI == 2 && TCP_OB <= 3
// The packed epilogue's integer threshold words (codes.cuh, threshold_word), (N, 2^OB) int32: one thread a word.
extern "C" __global__ void __launch_bounds__(128)
bmma_code_thresholds(const float* __restrict__ col_scale,  // (N,) or null
                     const float* __restrict__ bias,       // (N,) or null
                     const float* __restrict__ out_scale,  // (1,)
                     int relu, float slope, int N,
                     int* __restrict__ thr) {              // (N, 2^OB)
    grid_dependency_wait();
    grid_dependents_launch();
    __shared__ float T[NCODE];
    if (threadIdx.x >= 1 && threadIdx.x < NCODE) T[threadIdx.x] = code_threshold(threadIdx.x, out_scale[0]);
    __syncthreads();
    const int idx = blockIdx.x * blockDim.x + threadIdx.x, n = idx / NCODE, i = idx % NCODE;
    if (n >= N) return;
    const float cs = col_scale != nullptr ? col_scale[n] : 1.0f, bi = bias != nullptr ? bias[n] : 0.0f;
    thr[idx] = threshold_word(cs, bi, bias != nullptr, relu != 0, slope, i, T);
}
#endif
