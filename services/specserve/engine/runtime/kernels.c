/* Row-invariant CPU kernels for the runtime (see kernels.py and native.py).

   Each output element is computed by one fixed sequence of operations that depends only on
   its own inputs: a token's result is the same bits whether it is alone in the call, one of
   a verify's K + 1, or a row of a batch. Invariance holds by construction here, not by a
   library's choice of kernel, and tests/engine/test_kernels.py checks it on whatever CPU
   runs the suite.

   - linear_rows: y = x W^T + b. A weight row and an input row meet in one vector
     accumulator of VL floats (a fused multiply-add per VL inputs, in input order), reduced
     by a fixed pairwise sum. Tiles of 4 weight rows x 4 input rows share loads; the tile a
     pair falls in changes nothing in its arithmetic. A decode (one row) streams the weight
     once at close to memory bandwidth, the tiles prefetching the rows ahead; a prefill's
     passes of 24 input rows take tiles of 8 x 3 with AVX512 (24 accumulators of its 32
     registers, 11 loads for 24 multiply-adds where 4 x 4 needs 8 for 16; no prefetch: the
     rows are reused from cache), at matrix-multiply speed.
   - attention_rows: each query against its visible keys [lo, hi) straight from the KV cache
     storage: scores (a group's 1-4 queries x 4 keys at a time, each pair a dot as above, so a
     decode's query heads of one key/value head share their key loads too), a max, exp
     and its sum (VL keys at a time from the query's first key), and the weighted values in
     key order (4 queries sharing each value row's loads, each query's sums its own).
   - linear_rows_q4_0, _q4_1, _q8_0: linear_rows over a GGUF's own blocks, each
     weight vector formed in registers exactly as the dequantizer forms it (below).
   - rms_norm_rows, silu_mul_rows, rope_and_store: a token's elementwise work in one call
     each (a layer's small torch ops cost more in dispatch than in arithmetic at batch 1).

   Built at first use with the machine's C compiler (-O3 -march=native), so VL is the
   machine's widest vector; results are reproducible on one machine and one build, not across
   CPUs. Contraction is off (-ffp-contract=off) and every fused multiply-add is written out
   (fmadd), so which operations run is fixed here, not by a compiler's heuristics: with
   contraction on, GCC's tuning for AMD Zen (avoid-fma-chains) split the FMAs of dot()'s one
   accumulator into multiply + add but kept the 4x4 tiles' FMAs, and a token's attention
   differed between a lone decode and a verify (tests/engine/test_kernels.py, on an EPYC). */
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>

#if defined(__AVX512F__)
#define VL 16
#else
#define VL 8
#endif
/* A tile asks for the weight rows PREFETCH_ROWS ahead while it computes: the hardware
   prefetcher alone left a verify's linears well below bandwidth (4 measured best of 4-16). */
#define PREFETCH_ROWS 4
typedef float vf __attribute__((vector_size(VL * sizeof(float))));

static inline vf load(const float *p) { vf v; __builtin_memcpy(&v, p, sizeof v); return v; }
/* A vector a tile uses `uses` times, loaded once into a register: GCC otherwise folds it into
   each multiply-add as a memory operand, reading it again for each (8 x 3 made 27 loads for
   its 24 FMAs: the prefill load-bound at 65% of the FMA peak on an EPYC; a verify's 2 x 8
   read each input vector twice). The empty asm only pins the value; no arithmetic changes. */
static inline vf held(int uses, const float *p) {
  vf v = load(p);
#if defined(__AVX512F__)
  if (uses > 1) __asm__("" : "+v"(v));
#elif defined(__AVX__)
  if (uses > 1) __asm__("" : "+x"(v));
#endif
  return v;
}
static inline void store(float *p, vf v) { __builtin_memcpy(p, &v, sizeof v); }

/* a * b + c, rounded once where the CPU has FMA (an explicit instruction the compiler keeps);
   elsewhere a multiply and an add, the same everywhere since contraction is off. */
#if VL == 16
#include <immintrin.h>
static inline vf fmadd(vf a, vf b, vf c) { return (vf)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c); }
#elif defined(__FMA__) && defined(__AVX__)
#include <immintrin.h>
static inline vf fmadd(vf a, vf b, vf c) { return (vf)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c); }
#else
static inline vf fmadd(vf a, vf b, vf c) { return a * b + c; }
#endif

/* x in every lane, one broadcast. The softmax's weights were formed as (vf){0} + x: an add,
   then the broadcast (about 5% of a decode's attention); the add gives x itself unless x is
   -0, which an exp never is, so the same bits. */
#if VL == 16
static inline vf splat(float x) { return (vf)_mm512_set1_ps(x); }
#elif defined(__FMA__) && defined(__AVX__)
static inline vf splat(float x) { return (vf)_mm256_set1_ps(x); }
#else
static inline vf splat(float x) { return (vf){0} + x; }
#endif

#if VL == 16
typedef float vf8 __attribute__((vector_size(8 * sizeof(float))));
#endif
typedef float vf4 __attribute__((vector_size(4 * sizeof(float))));
typedef int vi __attribute__((vector_size(VL * sizeof(int))));

/* The lanes of v summed by one fixed pairwise tree: halves (16 lanes), quarters, then
   (h[0] + h[2]) + (h[1] + h[3]). */
static inline float hsum(vf v) {
#if VL == 16
  vf8 h8 = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
           __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
#else
  vf h8 = v;
#endif
  vf4 h4 = __builtin_shufflevector(h8, h8, 0, 1, 2, 3) + __builtin_shufflevector(h8, h8, 4, 5, 6, 7);
  float a = h4[0] + h4[2], b = h4[1] + h4[3];
  return a + b;
}

/* out[i] = hsum(v[i]) for 16 vectors at once: the same additions of the same pairs, level by
   level, with each level's adds done for several vectors in one vector add (so the bits are
   hsum's). About a third of the work of 16 hsum calls. */
static inline void hsum16(const vf *v, float *out) {
#if VL == 16
  vf u[8], w[4], x[2];
  for (int k = 0; k < 8; k++)  /* u[k]: halves of v[2k] in lanes 0-7, of v[2k+1] in 8-15 */
    u[k] = __builtin_shufflevector(v[2 * k], v[2 * k + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18,
                                   19, 20, 21, 22, 23) +
           __builtin_shufflevector(v[2 * k], v[2 * k + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25,
                                   26, 27, 28, 29, 30, 31);
  for (int k = 0; k < 4; k++)  /* w[k]: quarters of v[4k + q] in lanes 4q..4q+3 */
    w[k] = __builtin_shufflevector(u[2 * k], u[2 * k + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18,
                                   19, 24, 25, 26, 27) +
           __builtin_shufflevector(u[2 * k], u[2 * k + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22,
                                   23, 28, 29, 30, 31);
  for (int k = 0; k < 2; k++)  /* x[k]: (h[0] + h[2], h[1] + h[3]) of v[8k + q] in 2q, 2q+1 */
    x[k] = __builtin_shufflevector(w[2 * k], w[2 * k + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20,
                                   21, 24, 25, 28, 29) +
           __builtin_shufflevector(w[2 * k], w[2 * k + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22,
                                   23, 26, 27, 30, 31);
  store(out, __builtin_shufflevector(x[0], x[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24,
                                     26, 28, 30) +
             __builtin_shufflevector(x[0], x[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25,
                                     27, 29, 31));
#else
  vf w[8], x[4];
  for (int k = 0; k < 8; k++)  /* w[k]: halves of v[2k] in lanes 0-3, of v[2k+1] in 4-7 */
    w[k] = __builtin_shufflevector(v[2 * k], v[2 * k + 1], 0, 1, 2, 3, 8, 9, 10, 11) +
           __builtin_shufflevector(v[2 * k], v[2 * k + 1], 4, 5, 6, 7, 12, 13, 14, 15);
  for (int k = 0; k < 4; k++)  /* x[k]: (h[0] + h[2], h[1] + h[3]) of v[4k + q] in 2q, 2q+1 */
    x[k] = __builtin_shufflevector(w[2 * k], w[2 * k + 1], 0, 1, 4, 5, 8, 9, 12, 13) +
           __builtin_shufflevector(w[2 * k], w[2 * k + 1], 2, 3, 6, 7, 10, 11, 14, 15);
  for (int k = 0; k < 2; k++)
    store(out + 8 * k,
          __builtin_shufflevector(x[2 * k], x[2 * k + 1], 0, 2, 4, 6, 8, 10, 12, 14) +
          __builtin_shufflevector(x[2 * k], x[2 * k + 1], 1, 3, 5, 7, 9, 11, 13, 15));
#endif
}

static inline vf blend(vi mask, vf a, vf b) { /* a where mask, else b */
  vi ai, bi;
  __builtin_memcpy(&ai, &a, sizeof a);
  __builtin_memcpy(&bi, &b, sizeof b);
  vi r = (mask & ai) | (~mask & bi);
  vf out;
  __builtin_memcpy(&out, &r, sizeof out);
  return out;
}

/* exp(x) for x <= 0, VL lanes at once: 2^n * p(f) with x = n ln2 + f, |f| <= ln2 / 2, and p
   a degree-6 Taylor polynomial (relative error ~2e-7); below -87 it is 0. */
static inline vf vexp(vf x) {
  const vf lo = (vf){0} - 87.0f;
  vi under = x <= lo;
  x = blend(under, lo, x);
  vf t = x * 1.44269504088896341f + 12582912.0f;  /* round(x / ln2) in the low mantissa */
  vf n = t - 12582912.0f;
  vf f = x - n * 0.693145751953125f - n * 1.42860682030941723e-6f;
  vf p = 1.0f / 720 + (vf){0};
  p = fmadd(p, f, (vf){0} + 1.0f / 120);
  p = fmadd(p, f, (vf){0} + 1.0f / 24);
  p = fmadd(p, f, (vf){0} + 1.0f / 6);
  p = fmadd(p, f, (vf){0} + 0.5f);
  p = fmadd(p, f, (vf){0} + 1.0f);
  p = fmadd(p, f, (vf){0} + 1.0f);
  vi bits = (__builtin_convertvector(n, vi) + 127) << 23;
  vf scale;
  __builtin_memcpy(&scale, &bits, sizeof scale);
  vf out = p * scale;
  return blend(under, (vf){0}, out);
}

static inline float dot(const float *a, const float *b, int n) {
  vf acc = (vf){0};
  int nv = n - n % VL;
  for (int i = 0; i < nv; i += VL) acc = fmadd(load(a + i), load(b + i), acc);
  float s = hsum(acc);
  for (int i = nv; i < n; i++) s += a[i] * b[i];
  return s;
}

/* sums[i * MR + j] = hsum(acc[i][j]) of a tile's NR x MR accumulators, 16 at a time where
   they come in sixteens (hsum16: the same bits); more than 8 left over (a decode's score
   tile of 3 queries x 4 keys, the float path's 4 x 3 tile: 12) go as sixteen too, padded with
   zeros (p is a multiple of 16 there). */
#define HSUMS(acc, sums, NR, MR)                                                              \
  do {                                                                                        \
    int p = 0;                                                                                \
    for (; p + 16 <= NR * MR; p += 16) hsum16(&acc[0][0] + p, sums + p);                      \
    if (NR * MR - p > 8) {                                                                    \
      vf pad_[16];                                                                            \
      float out_[16];                                                                         \
      for (int i_ = 0; i_ < 16; i_++) pad_[i_] = p + i_ < NR * MR ? (&acc[0][0])[p + i_] : (vf){0}; \
      hsum16(pad_, out_);                                                                     \
      for (; p < NR * MR; p++) sums[p] = out_[p % 16];                                        \
    }                                                                                         \
    for (; p < NR * MR; p++) sums[p] = hsum(acc[p / MR][p % MR]);                             \
  } while (0)

/* NR weight rows (from n) x MR input rows (from m). Every (n, m) pair gets the arithmetic of
   dot() above whatever NR and MR are. PF: prefetch the weight rows PREFETCH_ROWS ahead (for
   rows streamed once, as a decode's). */
#define TILE(NR, MR, PF)                                                                      \
  static inline void tile_##NR##_##MR(const float *x, const float *w, const float *bias,     \
                                      float *y, int N, int K, int n, int m) {                \
    vf acc[NR][MR];                                                                           \
    for (int i = 0; i < NR; i++)                                                              \
      for (int j = 0; j < MR; j++) acc[i][j] = (vf){0};                                       \
    int kv = K - K % VL;                                                                      \
    for (int k = 0; k < kv; k += VL) {                                                        \
      vf xs[MR];                                                                              \
      for (int j = 0; j < MR; j++) xs[j] = held(NR, x + (size_t)(m + j) * K + k);            \
      for (int i = 0; i < NR; i++) {                                                          \
        if (PF) __builtin_prefetch(w + (size_t)(n + i + PREFETCH_ROWS) * K + k);              \
        vf wv = held(MR, w + (size_t)(n + i) * K + k);                                        \
        for (int j = 0; j < MR; j++) acc[i][j] = fmadd(wv, xs[j], acc[i][j]);                 \
      }                                                                                       \
    }                                                                                         \
    float sums[NR * MR];                                                                      \
    HSUMS(acc, sums, NR, MR);                                                                 \
    for (int i = 0; i < NR; i++)                                                              \
      for (int j = 0; j < MR; j++) {                                                          \
        const float *wr = w + (size_t)(n + i) * K, *xr = x + (size_t)(m + j) * K;            \
        float s = sums[i * MR + j];                                                           \
        for (int k = kv; k < K; k++) s += wr[k] * xr[k];                                      \
        if (bias) s += bias[n + i];                                                           \
        y[(size_t)(m + j) * N + n + i] = s;                                                   \
      }                                                                                       \
  }
TILE(4, 4, 1) TILE(4, 3, 1) TILE(4, 2, 1) TILE(4, 1, 1)
TILE(1, 4, 1) TILE(1, 3, 1) TILE(1, 2, 1) TILE(1, 1, 1)
TILE(8, 3, 0) TILE(8, 2, 0) TILE(8, 1, 0)

/* Input rows m0..m1 against weight rows n.. in tiles of 8 x 3 (ROWS_OF8) or NR x 4, the
   last tile of what is left; TILE_ names the tiles (tile_ for float32 weights, qtile_T_
   for blocks of type T). */
#define ROWS_OF8(TILE_, x, w, bias, y, N, K, n, m0, m1)                                       \
  do {                                                                                        \
    int m = m0;                                                                               \
    for (; m + 3 <= m1; m += 3) TILE_##8_3(x, w, bias, y, N, K, n, m);                        \
    switch (m1 - m) {                                                                         \
      case 2: TILE_##8_2(x, w, bias, y, N, K, n, m); break;                                   \
      case 1: TILE_##8_1(x, w, bias, y, N, K, n, m); break;                                   \
    }                                                                                         \
  } while (0)

#define ROWS_OF(TILE_, NR, x, w, bias, y, N, K, n, m0, m1)                                    \
  do {                                                                                        \
    int m = m0;                                                                               \
    for (; m + 4 <= m1; m += 4) TILE_##NR##_4(x, w, bias, y, N, K, n, m);                     \
    switch (m1 - m) {                                                                         \
      case 3: TILE_##NR##_3(x, w, bias, y, N, K, n, m); break;                                \
      case 2: TILE_##NR##_2(x, w, bias, y, N, K, n, m); break;                                \
      case 1: TILE_##NR##_1(x, w, bias, y, N, K, n, m); break;                                \
    }                                                                                         \
  } while (0)

/* A task's passes: input rows in groups of INPUT_ROWS_PER_PASS against weight rows n0..n1,
   in tiles of 8 x 3 where a pass is full (AVX512's 32 registers), then WIDE's (a quantized
   verify's: QROWS_WIDE), then NR x 4 and what is left. T names the block type for WIDE. */
#define PASSES(TILE_, WIDE, T, x, w, bias, y, N, K, M, n0, n1)                                \
  for (int m0 = 0; m0 < M; m0 += INPUT_ROWS_PER_PASS) {                                       \
    int m1 = m0 + INPUT_ROWS_PER_PASS < M ? m0 + INPUT_ROWS_PER_PASS : M;                     \
    int n = n0;                                                                               \
    if (VL == 16 && m1 - m0 == INPUT_ROWS_PER_PASS)                                           \
      for (; n + 8 <= n1; n += 8) ROWS_OF8(TILE_, x, w, bias, y, N, K, n, m0, m1);            \
    WIDE(T, x, w, bias, y, N, K, n, n1, m0, m1);                                              \
    for (; n + 4 <= n1; n += 4) ROWS_OF(TILE_, 4, x, w, bias, y, N, K, n, m0, m1);            \
    for (; n < n1; n++) ROWS_OF(TILE_, 1, x, w, bias, y, N, K, n, m0, m1);                    \
  }
#define NO_WIDE(...) ((void)0)

/* 24 input rows a pass: whole 8 x 3 and 4 x 4 tiles (measured: 24, 32, 48 and 96 within noise). */
enum { WEIGHT_ROWS_PER_TASK = 64, INPUT_ROWS_PER_PASS = 24 };

/* Work (multiply-adds or elements) below which a kernel runs on the calling thread: waking
   the other threads costs microseconds, and far more when a neighbour holds a core (every
   parallel region waits for its slowest thread). */
#define PARALLEL_MIN_WORK 32768

/* y[M, N] = x[M, K] W[N, K]^T (+ bias[N]). Threads split the weight rows into a multiple of
   `threads` tasks of at most about 64 rows (a multiple of 4), so no thread idles at the end;
   a task's weight rows stay in cache while the input rows pass in groups of 24. */
void linear_rows(const float *x, const float *w, const float *bias, float *y, int M, int N,
                 int K, int threads) {
  int per_thread = (N + threads * WEIGHT_ROWS_PER_TASK - 1) / (threads * WEIGHT_ROWS_PER_TASK);
  int rows = (N + threads * per_thread - 1) / (threads * per_thread);
  rows = (rows + 3) / 4 * 4;
  int tasks = (N + rows - 1) / rows;
#pragma omp parallel for schedule(static) num_threads(threads) \
    if ((long)M * N * K >= PARALLEL_MIN_WORK)
  for (int t = 0; t < tasks; t++) {
    int n0 = t * rows;
    int n1 = n0 + rows < N ? n0 + rows : N;
    PASSES(tile_, NO_WIDE, f32, x, w, bias, y, N, K, M, n0, n1)
  }
}

/* Quantized linears: y = x W^T + b with W held as the GGUF's own blocks of 32
   weights, packed once at load (native.pack_blocks): each block's scales as float32 (the
   half-precision values converted, exactly), then its quants as the file holds them. A
   vector of VL weights is formed in registers with the arithmetic of the dequantizer the
   float32 path loads through (gguf-py's: Q4_0 d * (q - 8), Q4_1 (d * q) + m, Q8_0 q * d,
   each operation rounded to float32, none fused), so it is that float32 weight bit for bit,
   and it meets the input rows in linear_rows' own accumulation (the same tiles, the same
   order over k): the same outputs from about a fifth of the bytes. A tile forms each weight
   vector once for all of its input rows. K is a multiple of 32. */
typedef struct { float d; uint8_t qs[16]; } q4_0_block;    /* 20 bytes (18 in the file) */
typedef struct { float d, m; uint8_t qs[16]; } q4_1_block; /* 24 bytes (20 in the file) */
typedef struct { float d; int8_t qs[32]; } q8_0_block;     /* 36 bytes (34 in the file) */
/* Quants o .. o + VL - 1 of a 4-bit block (o a multiple of VL) as ints: quant j < 16 is the
   low nibble of byte j, quant j >= 16 the high nibble of byte j - 16. And VL int8 quants.
   The widening is written with the ISA's instructions: GCC's generic conversion of a byte
   vector extracted and converted each byte alone (7x slower than the float32 kernel). */
#if VL == 16
static inline vi nibbles(const uint8_t *qs, int o) {
  __m128i b = _mm_loadu_si128((const __m128i *)qs);
  if (o >= 16) b = _mm_srli_epi16(b, 4);
  return (vi)_mm512_cvtepu8_epi32(_mm_and_si128(b, _mm_set1_epi8(15)));
}
static inline vi bytes_i8(const int8_t *p) {
  return (vi)_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p));
}
#elif defined(__AVX2__)
#include <immintrin.h>
static inline vi nibbles(const uint8_t *qs, int o) {
  __m128i b = _mm_loadl_epi64((const __m128i *)(qs + (o & 15)));
  if (o >= 16) b = _mm_srli_epi16(b, 4);
  return (vi)_mm256_cvtepu8_epi32(_mm_and_si128(b, _mm_set1_epi8(15)));
}
static inline vi bytes_i8(const int8_t *p) {
  return (vi)_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p));
}
#else
typedef uint8_t vu8 __attribute__((vector_size(VL)));
typedef int8_t vi8 __attribute__((vector_size(VL)));
static inline vi nibbles(const uint8_t *qs, int o) {
  vu8 b;
  __builtin_memcpy(&b, qs + (o & 15), sizeof b);
  return __builtin_convertvector(o < 16 ? (b & 15) : (b >> 4), vi);
}
static inline vi bytes_i8(const int8_t *p) {
  vi8 b;
  __builtin_memcpy(&b, p, sizeof b);
  return __builtin_convertvector(b, vi);
}
#endif
static inline vf q4_0_weights(const q4_0_block *blk, int o) {
  return blk->d * __builtin_convertvector(nibbles(blk->qs, o) - 8, vf);
}
static inline vf q4_1_weights(const q4_1_block *blk, int o) {
  return blk->d * __builtin_convertvector(nibbles(blk->qs, o), vf) + blk->m;
}
static inline vf q8_0_weights(const q8_0_block *blk, int o) {
  return __builtin_convertvector(bytes_i8(blk->qs + o), vf) * blk->d;
}

/* A tile forms a block's weights in two steps: T_prepare once per block and weight row, then
   T_form per vector of VL. With AVX512 a 4-bit block's 16 possible weights are one vector,
   made once per block with the dequantizer's arithmetic (d * (q - 8), d * q + m, for q =
   0..15: the same operations on the same values, so the same bits), and each vector of
   weights is one permute of it by the quants (vpermps): about a quarter fewer instructions
   a formed vector than converting and scaling each (a verify's 8 rows and a decode both form
   every weight). Elsewhere the prepared block is the block, formed as above. */
#if VL == 16
static inline vf iota16(void) {
  return (vf){0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
}
typedef struct { vf table; __m512i q; } q4_prep;  /* the 16 weights; the 16 bytes widened */
typedef q4_prep q4_0_prep;
typedef q4_prep q4_1_prep;
static inline q4_prep q4_prep_of(vf table, const uint8_t *qs) {
  return (q4_prep){table, _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)qs))};
}
static inline q4_0_prep q4_0_prepare(const q4_0_block *blk) {
  return q4_prep_of(blk->d * (iota16() - 8.0f), blk->qs);
}
static inline q4_1_prep q4_1_prepare(const q4_1_block *blk) {
  return q4_prep_of(blk->d * iota16() + blk->m, blk->qs);
}
/* table[q] for quants o .. o + 15: vpermps reads an index's low 4 bits, so a byte is its low
   nibble's index as it is and its high nibble's after a shift by 4 (no mask, and the bytes
   widened once a block, not once a vector). */
static inline vf permuted(q4_prep p, int o) {
  return (vf)_mm512_permutexvar_ps(o < 16 ? p.q : _mm512_srli_epi32(p.q, 4), (__m512)p.table);
}
static inline vf q4_0_form(q4_0_prep p, const q4_0_block *blk, int o) { (void)blk; return permuted(p, o); }
static inline vf q4_1_form(q4_1_prep p, const q4_1_block *blk, int o) { (void)blk; return permuted(p, o); }
#else
typedef const q4_0_block *q4_0_prep;
typedef const q4_1_block *q4_1_prep;
static inline q4_0_prep q4_0_prepare(const q4_0_block *blk) { return blk; }
static inline q4_1_prep q4_1_prepare(const q4_1_block *blk) { return blk; }
static inline vf q4_0_form(q4_0_prep p, const q4_0_block *blk, int o) { (void)p; return q4_0_weights(blk, o); }
static inline vf q4_1_form(q4_1_prep p, const q4_1_block *blk, int o) { (void)p; return q4_1_weights(blk, o); }
#endif
typedef const q8_0_block *q8_0_prep;
static inline q8_0_prep q8_0_prepare(const q8_0_block *blk) { return blk; }
static inline vf q8_0_form(q8_0_prep p, const q8_0_block *blk, int o) { (void)p; return q8_0_weights(blk, o); }

/* TILE's arithmetic over blocks of type T: NR weight rows x MR input rows. */
#define QTILE(T, NR, MR, PF)                                                                  \
  static inline void qtile_##T##_##NR##_##MR(const float *x, const T##_block *w,             \
                                             const float *bias, float *y, int N, int K,      \
                                             int n, int m) {                                 \
    vf acc[NR][MR];                                                                           \
    for (int i = 0; i < NR; i++)                                                              \
      for (int j = 0; j < MR; j++) acc[i][j] = (vf){0};                                       \
    int nb = K / 32;                                                                          \
    for (int b = 0; b < nb; b++) {                                                            \
      T##_prep prep[NR];                                                                      \
      for (int i = 0; i < NR; i++) {                                                          \
        const T##_block *blk = w + (size_t)(n + i) * nb + b;                                  \
        if (PF) __builtin_prefetch(blk + (size_t)PREFETCH_ROWS * nb);                         \
        prep[i] = T##_prepare(blk);                                                           \
      }                                                                                       \
      for (int o = 0; o < 32; o += VL) {                                                      \
        vf xs[MR];                                                                            \
        for (int j = 0; j < MR; j++) /* a decode's one row: as found (held: AVX2 9% slower) */ \
          xs[j] = held(MR > 1 ? NR : 1, x + (size_t)(m + j) * K + b * 32 + o);                \
        for (int i = 0; i < NR; i++) {                                                        \
          vf wv = T##_form(prep[i], w + (size_t)(n + i) * nb + b, o);                         \
          for (int j = 0; j < MR; j++) acc[i][j] = fmadd(wv, xs[j], acc[i][j]);               \
        }                                                                                     \
      }                                                                                       \
    }                                                                                         \
    float sums[NR * MR];                                                                      \
    HSUMS(acc, sums, NR, MR);                                                                 \
    for (int i = 0; i < NR; i++)                                                              \
      for (int j = 0; j < MR; j++) {                                                          \
        float s = sums[i * MR + j];                                                           \
        if (bias) s += bias[n + i];                                                           \
        y[(size_t)(m + j) * N + n + i] = s;                                                   \
      }                                                                                       \
  }

/* Where a call has this many input rows or more (a prefill's), a task forms its weight rows
   once, into a float32 buffer of its thread, and runs linear_rows' own tiles on them: forming
   a weight vector costs about five instructions, which a decode's one or a verify's few
   input rows cannot amortise in registers but a prefill's passes of 24 can (0.5x the float32
   kernel's prefill when every tile formed its own). The same float32 weights either way. */
#define DEQUANT_MIN_ROWS 16

/* *buf grown to at least `bytes` (a thread's buffer, kept between calls), 64-byte aligned: a
   row of K floats is then whole cache lines. NULL where it cannot be allocated. */
static void *grown(void **buf, size_t *cap, size_t bytes) {
  if (bytes > *cap) {
    free(*buf);
    *buf = aligned_alloc(64, (bytes + 63) / 64 * 64);
    *cap = *buf ? bytes : 0;
  }
  return *buf;
}

static __thread void *task_buf;
static __thread size_t task_cap;

static float *task_buffer(size_t floats) {
  return grown(&task_buf, &task_cap, floats * sizeof(float));
}

/* A verify's 5 to 8 input rows in one tile of NR weight rows: each weight vector formed once
   for all of them (tiles of 4 would form it twice: a verify of 8 cost 2.0 decodes). */
#define QROWS_WIDE(T, NR, x, w, bias, y, N, K, n, m0, m1)                                     \
  do {                                                                                        \
    switch (m1 - m0) {                                                                        \
      case 8: qtile_##T##_##NR##_8(x, w, bias, y, N, K, n, m0); break;                        \
      case 7: qtile_##T##_##NR##_7(x, w, bias, y, N, K, n, m0); break;                        \
      case 6: qtile_##T##_##NR##_6(x, w, bias, y, N, K, n, m0); break;                        \
      case 5: qtile_##T##_##NR##_5(x, w, bias, y, N, K, n, m0); break;                        \
    }                                                                                         \
  } while (0)

/* The wide tiles where a pass has 5 to 8 rows (AVX2's 16 registers hold one weight row's 8
   sums, not two). */
#define QWIDE(T, x, w, bias, y, N, K, n, n1, m0, m1)                                          \
  do {                                                                                        \
    if (m1 - m0 >= 5 && m1 - m0 <= 8) {                                                       \
      if (VL == 16)                                                                           \
        for (; n + 2 <= n1; n += 2) QROWS_WIDE(T, 2, x, w, bias, y, N, K, n, m0, m1);         \
      for (; n < n1; n++) QROWS_WIDE(T, 1, x, w, bias, y, N, K, n, m0, m1);                   \
    }                                                                                         \
  } while (0)

/* linear_rows over blocks of type T: the same tasks, passes and tiles (and the wide ones). */
#define LINEAR_Q(T)                                                                           \
  QTILE(T, 4, 4, 1) QTILE(T, 4, 3, 1) QTILE(T, 4, 2, 1) QTILE(T, 4, 1, 1)                     \
  QTILE(T, 1, 4, 1) QTILE(T, 1, 3, 1) QTILE(T, 1, 2, 1) QTILE(T, 1, 1, 1)                     \
  QTILE(T, 8, 3, 0) QTILE(T, 8, 2, 0) QTILE(T, 8, 1, 0)                                       \
  QTILE(T, 2, 8, 1) QTILE(T, 2, 7, 1) QTILE(T, 2, 6, 1) QTILE(T, 2, 5, 1)                     \
  QTILE(T, 1, 8, 1) QTILE(T, 1, 7, 1) QTILE(T, 1, 6, 1) QTILE(T, 1, 5, 1)                     \
  void linear_rows_##T(const float *x, const T##_block *w, const float *bias, float *y, int M, \
                       int N, int K, int threads) {                                          \
    int per_thread = (N + threads * WEIGHT_ROWS_PER_TASK - 1) / (threads * WEIGHT_ROWS_PER_TASK); \
    int rows = (N + threads * per_thread - 1) / (threads * per_thread);                       \
    rows = (rows + 3) / 4 * 4;                                                                \
    int tasks = (N + rows - 1) / rows;                                                        \
    _Pragma("omp parallel for schedule(static) num_threads(threads) if ((long)M * N * K >= PARALLEL_MIN_WORK)") \
    for (int t = 0; t < tasks; t++) {                                                         \
      int n0 = t * rows;                                                                      \
      int n1 = n0 + rows < N ? n0 + rows : N;                                                 \
      float *wf = M >= DEQUANT_MIN_ROWS ? task_buffer((size_t)(n1 - n0) * K) : NULL;          \
      if (wf) { /* the task's rows formed once; then linear_rows' tiles over them */          \
        int nb = K / 32;                                                                      \
        for (int i = n0; i < n1; i++)                                                         \
          for (int b = 0; b < nb; b++)                                                        \
            for (int o = 0; o < 32; o += VL)                                                  \
              store(wf + (size_t)(i - n0) * K + b * 32 + o, T##_weights(w + (size_t)i * nb + b, o)); \
        const float *bt = bias ? bias + n0 : NULL;                                            \
        float *yt = y + n0;                                                                   \
        PASSES(tile_, NO_WIDE, f32, x, wf, bt, yt, N, K, M, 0, n1 - n0)                       \
        continue;                                                                             \
      }                                                                                       \
      PASSES(qtile_##T##_, QWIDE, T, x, w, bias, y, N, K, M, n0, n1)                         \
    }                                                                                         \
  }
LINEAR_Q(q4_0) LINEAR_Q(q4_1) LINEAR_Q(q8_0)

/* p[r][j .. j + 4) = scale * q[r] . k[j + c] for NQ queries and 4 keys: each pair one vector
   accumulator with dot()'s arithmetic (D a multiple of VL), the tile sharing the keys' and
   queries' loads and its horizontal sums (HSUMS: hsum's bits). Its NQ x 4 chains of FMAs
   are independent, where one dot() at a time is one chain waiting on each FMA's latency. */
#define SCORE_TILE(NQ)                                                                        \
  static inline void score_tile_##NQ(const float *const *q, const float *const *k, int D,    \
                                     int j, float scale, float *const *p) {                  \
    vf acc[NQ][4];                                                                            \
    for (int r = 0; r < NQ; r++)                                                              \
      for (int c = 0; c < 4; c++) acc[r][c] = (vf){0};                                        \
    for (int d = 0; d < D; d += VL) {                                                         \
      vf ks[4];                                                                               \
      for (int c = 0; c < 4; c++) ks[c] = held(NQ, k[j + c] + d);                             \
      for (int r = 0; r < NQ; r++) {                                                          \
        vf qv = held(4, q[r] + d);                                                            \
        for (int c = 0; c < 4; c++) acc[r][c] = fmadd(qv, ks[c], acc[r][c]);                  \
      }                                                                                       \
    }                                                                                         \
    float sums[NQ * 4];                                                                       \
    HSUMS(acc, sums, NQ, 4);                                                                  \
    for (int r = 0; r < NQ; r++)                                                              \
      for (int c = 0; c < 4; c++) p[r][j + c] = sums[r * 4 + c] * scale;                      \
  }
SCORE_TILE(1) SCORE_TILE(2) SCORE_TILE(3) SCORE_TILE(4)

/* Keys (and value rows) read ahead of the one in use: a decode's keys and values are read
   from memory (the layer's weights streamed through the caches since the last token), their
   rows scattered over the cache's blocks; fetched on demand, the attention waited on each
   row's misses (about a quarter of its time at 200 keys, on a Zen 3). A prefetch changes no
   arithmetic. */
enum { KV_AHEAD = 16 };

static inline void fetch_row(const float *row, int floats) {
  for (int d = 0; d < floats; d += 16) __builtin_prefetch(row + d, 0, 3);  /* 64-byte lines */
}

/* p[r][j] = scale * q[r] . k[j] for the nq (<= 4) queries q[r] and keys j0 <= j < j1 (key j's
   D floats at k[j]: wherever its block put it), each pair with dot()'s arithmetic: 4 keys at
   a time in a tile of all nq queries, the last j1 - j0 % 4 keys one dot() each. */
static void scores(const float *const *q, int nq, const float *const *k, int D, int j0, int j1,
                   float scale, float *const *p) {
  int j = j0;
  if (D % VL == 0) {
    for (; j + 4 <= j1; j += 4) {
      if (j + KV_AHEAD + 4 <= j1)
        for (int c = 0; c < 4; c++) fetch_row(k[j + KV_AHEAD + c], D);
      switch (nq) {  /* a constant query count: registers */
        case 4: score_tile_4(q, k, D, j, scale, p); break;
        case 3: score_tile_3(q, k, D, j, scale, p); break;
        case 2: score_tile_2(q, k, D, j, scale, p); break;
        default: score_tile_1(q, k, D, j, scale, p); break;
      }
    }
  }
  for (; j < j1; j++)
    for (int r = 0; r < nq; r++) p[r][j] = dot(q[r], k[j], D) * scale;
}

/* p[j0..j1) -> exp(p - max) in place, the maximum exact in any order (VL keys at a time: a
   key at a time it was a chain of dependent compares, half of this function's time at 9
   query rows), exp and its sum VL keys at a time from j0 (lanes past j1 computed and left
   out); returns the sum. p holds j1 - j0 + VL floats from j0. Where the lanes' maximum is a
   zero its sign may differ from the one a key at a time kept; exp(p - top) is the same. */
static float exp_scores(float *p, int j0, int j1) {
  vi lane;
  for (int i = 0; i < VL; i++) lane[i] = i;
  vf tops = (vf){0} - INFINITY;
  for (int j = j0; j < j1; j += VL) {
    vf v = blend(lane < j1 - j, load(p + j), tops);
    tops = blend(v > tops, v, tops);
  }
  float top = -INFINITY;
  for (int i = 0; i < VL; i++) top = tops[i] > top ? tops[i] : top;
  vf sums = (vf){0};
  for (int j = j0; j < j1; j += VL) {
    vf e = blend(lane < j1 - j, vexp(load(p + j) - top), (vf){0});
    store(p + j, e);
    sums += e;
  }
  return hsum(sums);
}

/* out = softmax(p[j0..j1)) @ v[j0..j1) for one query (a token tree's: exp_scores, then the
   weighted values in key order). With `keys`, p[j0 + m] is the score of key keys[m] (its
   visible keys gathered in order), and its value row is read from there; the arithmetic is
   the same as for keys that were contiguous. Value j's D floats: v[j]. */
static void softmax_values(float *p, int j0, int j1, const int32_t *keys, const float *const *v,
                           int D, float *out, vf *acc) {
  float total = exp_scores(p, j0, j1);
  int dv = D / VL;
  for (int c = 0; c < dv; c++) acc[c] = (vf){0};
  for (int d = dv * VL; d < D; d++) out[d] = 0.0f;
  for (int j = j0; j < j1; j++) {
    const float *vj = v[keys ? keys[j - j0] : j];
    vf pj = splat(p[j]);
    for (int c = 0; c < dv; c++) acc[c] = fmadd(pj, load(vj + c * VL), acc[c]);
    for (int d = dv * VL; d < D; d++) out[d] += p[j] * vj[d];
  }
  for (int c = 0; c < dv; c++) store(out + c * VL, acc[c] / total);
  for (int d = dv * VL; d < D; d++) out[d] /= total;
}

/* Value vectors per pass of weighted_values: 64 floats, a whole head of the usual size, so
   each key's row and pointer are read once per query group (measured on AVX2 code: passes
   of 2 vectors made a decode's attention 25% slower than one pass over the head, whose
   accumulators partly spill). */
#define PV_CHUNK (64 / VL)

/* Key j's weighted values for queries r < NQ, value vectors c0 .. c0 + CW (constants where
   inlined, so the accumulators stay in registers); `all`: every query's range holds j. */
static inline void weighted_key(vf acc[4][PV_CHUNK], float *const *p, const int *j0,
                                const int *j1, const float *vj, int j, int c0, int all,
                                const int NQ, const int CW) {
  vf vv[PV_CHUNK];
  for (int c = 0; c < CW; c++) vv[c] = held(NQ, vj + (c0 + c) * VL);
  for (int r = 0; r < NQ; r++) {
    if (!all && (j < j0[r] || j >= j1[r])) continue;
    vf pj = splat(p[r][j]);
    for (int c = 0; c < CW; c++) acc[r][c] = fmadd(pj, vv[c], acc[r][c]);
  }
}

/* Value vectors c0 .. c0 + CW of weighted_values for NQ queries: keys in order, those inside
   every query's range without a check. */
static inline void weighted_pass(float *const *p, const int *j0, const int *j1,
                                 const float *const *v, float *const *out, const float *total,
                                 int c0, const int NQ, const int CW) {
  vf acc[4][PV_CHUNK];
  int lo = j0[0], hi = j1[0], first = j0[0], last = j1[0];  /* the union, and the shared part */
  for (int r = 0; r < NQ; r++) {
    for (int c = 0; c < CW; c++) acc[r][c] = (vf){0};
    lo = j0[r] < lo ? j0[r] : lo;
    hi = j1[r] > hi ? j1[r] : hi;
    first = j0[r] > first ? j0[r] : first;
    last = j1[r] < last ? j1[r] : last;
  }
  last = last > first ? last : first;
  int j = lo;
  for (; j < first; j++) weighted_key(acc, p, j0, j1, v[j], j, c0, 0, NQ, CW);
  for (; j < last; j++) {
    if (j + KV_AHEAD < last) fetch_row(v[j + KV_AHEAD] + c0 * VL, CW * VL);
    weighted_key(acc, p, j0, j1, v[j], j, c0, 1, NQ, CW);
  }
  for (; j < hi; j++) weighted_key(acc, p, j0, j1, v[j], j, c0, 0, NQ, CW);
  for (int r = 0; r < NQ; r++)
    for (int c = 0; c < CW; c++) store(out[r] + (c0 + c) * VL, acc[r][c] / total[r]);
}

/* weighted_pass over value vectors c0 .. END for NQ queries, CW vectors a pass, then one. */
#define VALUE_PASSES(NQ, CW, END)                                                             \
  do {                                                                                        \
    for (; c0 + (CW) <= (END); c0 += (CW)) weighted_pass(p, j0, j1, v, out, total, c0, NQ, CW); \
    for (; c0 < (END); c0++) weighted_pass(p, j0, j1, v, out, total, c0, NQ, 1);              \
  } while (0)

/* weighted_values' value vectors c0 .. c1 (a part of a head, passes of half a chunk). */
static void weighted_part(float *const *p, int nq, const int *j0, const int *j1,
                          const float *const *v, float *const *out, const float *total, int c0,
                          int c1) {
  enum { CW = PV_CHUNK / 2 > 0 ? PV_CHUNK / 2 : 1 };
  switch (nq) {
    case 4: VALUE_PASSES(4, CW, c1); break;
    case 3: VALUE_PASSES(3, CW, c1); break;
    case 2: VALUE_PASSES(2, CW, c1); break;
    default: VALUE_PASSES(1, CW, c1); break;
  }
}

/* softmax_values for nq <= 4 chain queries at once, their exp'd scores in p[r] (exp_scores)
   and sums in total: each query's value vector c gets the FMAs of softmax_values in key order
   (a key outside a query's range adds nothing to it), so a query's bits do not depend on
   the others; the queries share each value row's loads. */
static void weighted_values(float *const *p, int nq, const int *j0, const int *j1,
                            const float *const *v, int D, float *const *out, const float *total) {
  int dv = D / VL, c0 = 0;
  switch (nq) {  /* a constant query count: the accumulators in registers */
    case 4: VALUE_PASSES(4, PV_CHUNK, dv); break;
    case 3: VALUE_PASSES(3, PV_CHUNK, dv); break;
    case 2: VALUE_PASSES(2, PV_CHUNK, dv); break;
    default: VALUE_PASSES(1, PV_CHUNK, dv); break;
  }
  for (int r = 0; r < nq; r++)
    for (int d = dv * VL; d < D; d++) {
      float s = 0.0f;
      for (int j = j0[r]; j < j1[r]; j++) s += p[r][j] * v[j][d];
      out[r][d] = s / total[r];
    }
}

/* The query rows of attention_rows' work item `item` (a key/value head of a row b, its query
   rows first .. first + nq of T * group): their q, out and scores rows, key ranges, tokens,
   and the union of the ranges [*lowest, *highest); returns nq. */
static int item_rows(int item, const float *q, int q_stride, float *out, float *p, size_t stride,
                     const int32_t *lo, const int32_t *hi, int T, int H, int Hk, int D, int rows,
                     int blocks, const float **qs, float **os, float **ps, int *j0, int *j1,
                     int *bts, int *b, int *kh, int *lowest, int *highest) {
  int block = item % blocks, group = H / Hk, first = block * 4;
  int nq = rows - first < 4 ? rows - first : 4;
  *kh = item / blocks % Hk;
  *b = item / blocks / Hk;
  *lowest = INT32_MAX;
  *highest = 0;
  for (int r = 0; r < nq; r++) {
    int row = first + r, h = *kh * group + row % group, bt = *b * T + row / group;
    qs[r] = q + (size_t)bt * q_stride + (size_t)h * D;
    os[r] = out + ((size_t)bt * H + h) * D;
    ps[r] = p + r * stride;
    j0[r] = lo[bt];
    j1[r] = hi[bt];
    bts[r] = bt;
    *lowest = j0[r] < *lowest ? j0[r] : *lowest;
    *highest = j1[r] > *highest ? j1[r] : *highest;
  }
  return nq;
}

/* krow[j], vrow[j] (either may be NULL): where key/value head kh of row b keeps position j,
   for from <= j < to. */
static void key_rows(const float *k, const float *v, const int32_t *table, int W, int Hk, int BS,
                     int D, int b, int kh, int from, int to, const float **krow,
                     const float **vrow) {
  for (int j = from; j < to;) {  /* a block at a time */
    int off = j % BS;
    size_t at = (((size_t)table[(size_t)b * W + j / BS] * Hk + kh) * BS + off) * D;
    for (; off < BS && j < to; off++, j++, at += D) {
      if (krow) krow[j] = k + at;
      if (vrow) vrow[j] = v + at;
    }
  }
}

/* attention_rows for chains when its work items are too few for its threads (a decode: one
   item per key/value head): each item's scores split by keys, its exp'd sums one per query,
   and its weighted values split by value vectors, phase by phase across the threads. Each
   query's arithmetic is the one item's in attention_rows (which keys or value vectors a
   thread takes changes no operation of a query), so the bits are the same. */
static void attention_split(const float *q, int q_stride, const float *k, const float *v,
                            const int32_t *table, int W, const int32_t *lo, const int32_t *hi,
                            float *out, int T, int H, int Hk, int BS, int D, float scale,
                            int threads, int rows, int blocks, int n) {
  int S = W * BS, parts = (2 * threads + n - 1) / n;  /* each item's share of the threads */
  int dv = D / VL, half = (dv + 1) / 2;
  size_t stride = (size_t)S + VL;
  float *p = malloc(sizeof(float) * (size_t)n * 4 * stride), *totals = malloc(sizeof(float) * (size_t)n * 4);
#pragma omp parallel num_threads(threads)
  {
    const float **krow = malloc(sizeof(float *) * (size_t)S), **vrow = malloc(sizeof(float *) * (size_t)S);
    const float *qs[4];
    float *ps[4], *os[4];
    int j0[4], j1[4], bts[4], b, kh, lowest, highest;
#pragma omp for schedule(static)
    for (int w = 0; w < n * parts; w++) {  /* scores: keys [from, to) of item w / parts */
      int item = w / parts, part = w % parts;
      int nq = item_rows(item, q, q_stride, out, p + (size_t)item * 4 * stride, stride, lo, hi, T,
                         H, Hk, D, rows, blocks, qs, os, ps, j0, j1, bts, &b, &kh, &lowest, &highest);
      int span = highest - lowest;
      int from = lowest + (int)((long)span * part / parts);
      int to = lowest + (int)((long)span * (part + 1) / parts);
      key_rows(k, v, table, W, Hk, BS, D, b, kh, from, to, krow, NULL);
      scores(qs, nq, krow, D, from, to, scale, ps);
    }
#pragma omp for schedule(static)
    for (int w = 0; w < n * 4; w++) {  /* exp'd scores and their sum: query w % 4 of item w / 4 */
      int nq = item_rows(w / 4, q, q_stride, out, p + (size_t)(w / 4) * 4 * stride, stride, lo, hi,
                         T, H, Hk, D, rows, blocks, qs, os, ps, j0, j1, bts, &b, &kh, &lowest, &highest);
      if (w % 4 < nq) totals[w] = exp_scores(ps[w % 4], j0[w % 4], j1[w % 4]);
    }
#pragma omp for schedule(static)
    for (int w = 0; w < n * 2; w++) {  /* weighted values: half w % 2 of item w / 2's vectors */
      int item = w / 2, c0 = w % 2 ? half : 0, c1 = w % 2 ? dv : half;
      int nq = item_rows(item, q, q_stride, out, p + (size_t)item * 4 * stride, stride, lo, hi, T,
                         H, Hk, D, rows, blocks, qs, os, ps, j0, j1, bts, &b, &kh, &lowest, &highest);
      key_rows(k, v, table, W, Hk, BS, D, b, kh, lowest, highest, NULL, vrow);
      weighted_part(ps, nq, j0, j1, vrow, os, totals + (size_t)item * 4, c0, c1);
    }
    free(krow);
    free(vrow);
  }
  free(totals);
  free(p);
}

/* out[b, t, h, :] = softmax(scale * q[b, t, h] . keys) @ values over the keys [lo, hi) of
   the query (b, t), read from the cache storage through row b's block table and key/value
   head h / (H / Hk): position j is at offset j % BS of block table[b * W + j / BS].
   q: B * T tokens of H heads of D floats, q_stride floats apart (the q heads of the fused
   projection's rows); k, v: [blocks, Hk, BS, D]; table: [B, W]; lo, hi: [B * T] (at most
   W * BS); out: [B, T, H, D]. A slot cache is the case W = 1, BS = its slot length.
   Where a key lives changes no arithmetic: the same keys give the same bits.
   The T * (H / Hk) query rows of one (b, key/value head) go 4 at a time (sharing key loads);
   a query's arithmetic is the same in any group (see scores and softmax_values).
   Token trees (tree non-NULL): query (b, t) of a row with start[b] >= 0 reads the keys
   [lo, start[b]) and, of the row's new tokens stored from start[b], those whose bit is set in
   tree[b * T + t] (its ancestors and itself; hi is then its own position + 1); a row with
   start[b] = -1 is a chain. Its visible keys are gathered in order, so
   a node computes exactly what the same token computes in a chain of its path. */
void attention_rows(const float *q, int q_stride, const float *k, const float *v,
                    const int32_t *table, int W, const int32_t *lo, const int32_t *hi,
                    const uint64_t *tree, const int32_t *start, float *out,
                    int B, int T, int H, int Hk, int BS, int D, float scale, int threads) {
  int group = H / Hk, rows = T * group, blocks = (rows + 3) / 4, n = B * Hk * blocks;
  int S = W * BS;
  size_t stride = (size_t)S + VL;
  long work = 0;
  for (int bt = 0; bt < B * T; bt++) work += (long)(hi[bt] - lo[bt]) * H * D;
  if (!tree && threads > 1 && n < 2 * threads && D % VL == 0 && work >= PARALLEL_MIN_WORK) {
    attention_split(q, q_stride, k, v, table, W, lo, hi, out, T, H, Hk, BS, D, scale, threads,
                    rows, blocks, n);
    return;
  }
#pragma omp parallel num_threads(threads) if (work >= PARALLEL_MIN_WORK)
  {
    float *p = malloc(sizeof(float) * 4 * stride);
    int32_t *keys = tree ? malloc(sizeof(int32_t) * (size_t)S) : NULL;
    const float **krow = malloc(sizeof(float *) * (size_t)S), **vrow = malloc(sizeof(float *) * (size_t)S);
    vf *acc = aligned_alloc(sizeof(vf), sizeof(vf) * (size_t)(D / VL + 1));
#pragma omp for schedule(static)
    for (int item = 0; item < n; item++) {
      const float *qs[4];
      float *ps[4], *os[4];
      int j0[4], j1[4], bts[4], b, kh, lowest, highest;
      int nq = item_rows(item, q, q_stride, out, p, stride, lo, hi, T, H, Hk, D, rows, blocks, qs,
                         os, ps, j0, j1, bts, &b, &kh, &lowest, &highest);
      key_rows(k, v, table, W, Hk, BS, D, b, kh, lowest, highest, krow, vrow);
      scores(qs, nq, krow, D, lowest, highest, scale, ps);
      if (!tree || start[b] < 0) {  /* chains (start -1: a chain row beside trees) */
        float total[4];
        for (int r = 0; r < nq; r++) total[r] = exp_scores(ps[r], j0[r], j1[r]);
        weighted_values(ps, nq, j0, j1, vrow, D, os, total);
        continue;
      }
      for (int r = 0; r < nq; r++) {
        int n = 0, first_new = start[b];  /* gather the visible keys' scores to j0 + m */
        for (int j = j0[r]; j < first_new && j < j1[r]; j++) keys[n++] = j;
        uint64_t bits = tree[bts[r]];
        for (int i = 0; i < 64 && first_new + i < j1[r]; i++)
          if (bits >> i & 1) keys[n++] = first_new + i;
        for (int m = 0; m < n; m++) ps[r][j0[r] + m] = ps[r][keys[m]];
        softmax_values(ps[r], j0[r], j0[r] + n, keys, vrow, D, os[r], acc);
      }
    }
    free(krow);
    free(vrow);
    free(keys);
    free(acc);
    free(p);
  }
}

/* out[m] = weight * x[m] / sqrt(mean(x[m]^2) + eps) for M rows of n floats. */
void rms_norm_rows(const float *x, const float *weight, float *out, int M, int n, float eps,
                   int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) \
    if (M > 1 && (long)M * n >= PARALLEL_MIN_WORK)
  for (int m = 0; m < M; m++) {
    const float *xm = x + (size_t)m * n;
    float *om = out + (size_t)m * n;
    float r = 1.0f / sqrtf(dot(xm, xm, n) / (float)n + eps);
    for (int i = 0; i < n; i++) om[i] = weight[i] * (xm[i] * r);
  }
}

/* silu(g) * u, VL lanes at once: g * sigmoid(g) with sigmoid from e = exp(-|g|) (vexp's
   domain), 1 / (1 + e) for g >= 0 and e / (1 + e) below. */
static inline vf silu_mul(vf g, vf u) {
  vi negative = g < 0;
  vf e = vexp(blend(negative, g, -g));
  vf sigmoid = blend(negative, e, (vf){0} + 1.0f) / (1.0f + e);
  return g * sigmoid * u;
}

/* out[m] = silu(gate_up[m, :n]) * gate_up[m, n:] for M rows of 2n floats, in pieces of
   SILU_PIECE values split over the threads from SILU_MIN_WORK values (a verify's 9 rows of
   1,536: 14 us on one core of a Zen 4, where the threads' fork costs about half a
   microsecond; a decode's one row stays on the calling thread). A row's last n % VL elements
   go through the same vector arithmetic from a zero-padded copy; each element's arithmetic is
   its own, so the pieces change no bits. */
enum { SILU_PIECE = 256, SILU_MIN_WORK = 8192 };
void silu_mul_rows(const float *gate_up, float *out, int M, int n, int threads) {
  int pieces = (n + SILU_PIECE - 1) / SILU_PIECE;
#pragma omp parallel for schedule(static) num_threads(threads) \
    if ((long)M * n >= SILU_MIN_WORK)
  for (long item = 0; item < (long)M * pieces; item++) {
    int m = (int)(item / pieces), i = (int)(item % pieces) * SILU_PIECE;
    int end = i + SILU_PIECE < n ? i + SILU_PIECE : n;
    const float *g = gate_up + (size_t)m * 2 * n, *u = g + n;
    float *o = out + (size_t)m * n;
    for (; i + VL <= end; i += VL) store(o + i, silu_mul(load(g + i), load(u + i)));
    if (i < end) {
      float gt[VL] = {0}, ut[VL] = {0}, ot[VL];
      __builtin_memcpy(gt, g + i, sizeof(float) * (end - i));
      __builtin_memcpy(ut, u + i, sizeof(float) * (end - i));
      store(ot, silu_mul(load(gt), load(ut)));
      __builtin_memcpy(o + i, ot, sizeof(float) * (end - i));
    }
  }
}

/* The fused projection's rows [q heads | k heads | v heads] (H + 2 Hk heads of D floats per
   token, B * T tokens): rotate-half RoPE on the q and k heads in place (cos, sin: [B * T, D]),
   then the k and v heads of each row's first lens[b] tokens stored at position start[b] + t
   of the cache storage [blocks, Hk, BS, D] through row b's block table [B, W] (as in
   attention_rows). */
void rope_and_store(float *qkv, const float *cos, const float *sin, float *k_cache,
                    float *v_cache, const int32_t *table, int W, const int32_t *start,
                    const int32_t *lens, int B, int T, int H, int Hk, int BS, int D,
                    int threads) {
  int heads = H + 2 * Hk, half = D / 2;
#pragma omp parallel for schedule(static) num_threads(threads) \
    if (B * T > 1 && (long)B * T * (H + 2 * Hk) * D >= PARALLEL_MIN_WORK)
  for (int bt = 0; bt < B * T; bt++) {
    int b = bt / T, t = bt % T;
    float *row = qkv + (size_t)bt * heads * D;
    const float *c = cos + (size_t)bt * D, *s = sin + (size_t)bt * D;
    for (int h = 0; h < H + Hk; h++) {
      float *x = row + (size_t)h * D;
      for (int d = 0; d < half; d++) {
        float lo = x[d], hi = x[d + half];
        x[d] = lo * c[d] - hi * s[d];
        x[d + half] = hi * c[d + half] + lo * s[d + half];
      }
    }
    if (t >= lens[b]) continue;
    size_t pos = (size_t)start[b] + t;
    for (int h = 0; h < Hk; h++) {
      size_t at = (((size_t)table[(size_t)b * W + pos / BS] * Hk + h) * BS + pos % BS) * D;
      __builtin_memcpy(k_cache + at, row + (size_t)(H + h) * D, sizeof(float) * D);
      __builtin_memcpy(v_cache + at, row + (size_t)(H + Hk + h) * D, sizeof(float) * D);
    }
  }
}

/* A decoder layer in one call (decoder_layer): what a token's layer runs between two
   residual streams, the calls above in the order the layer's modules make them from Python
   (layers.py: DecoderLayer, Attention._native, MLP), so the same bits; one call instead of
   about seven kernels and their modules' Python a layer (at batch 1 that Python cost about
   a third of a decode on the 4-bit weights). */
enum { W_F32, W_Q4_0, W_Q4_1, W_Q8_0 };  /* native.WEIGHT_KINDS */
enum { W_X8 = 8 };  /* added to a block kind: its inputs in 8 bits (native.X8_INPUTS) */
void linear_rows_q4_0_x8(const float *, const uint8_t *, const float *, float *, int, int, int, int);
void linear_rows_q4_1_x8(const float *, const uint8_t *, const float *, float *, int, int, int, int);
void linear_rows_q8_0_x8(const float *, const uint8_t *, const float *, float *, int, int, int, int);

typedef struct {          /* a linear's weight: float32 [n, k], or a GGUF's packed blocks */
  int kind, n, k;
  const void *w;
  const float *bias;      /* or NULL */
} weight_ref;

typedef struct {          /* one layer: its weights, norms, shapes and cache storage */
  weight_ref qkv, o, gate_up, down;
  const float *input_norm, *post_norm;
  float *keys, *values;   /* [blocks, Hk, BS, D] */
  int H, Hk, D, hidden, intermediate, window;  /* window: reads lo_window, not lo */
  float eps, scale;
} layer_ref;

typedef struct {          /* one forward: its rows and what every layer reads of them */
  int B, T, BS, W, threads;
  const float *cos, *sin;                                         /* [B * T, D] */
  const int32_t *table, *start, *lens, *lo, *lo_window, *hi, *tree_start;
  const uint64_t *tree;
  float *scratch;         /* decoder_layer_scratch(layer, B * T) floats */
} forward_ref;

static void linear_any(const float *x, const weight_ref *w, float *y, int M, int threads) {
  switch (w->kind) {
    case W_Q4_0: linear_rows_q4_0(x, w->w, w->bias, y, M, w->n, w->k, threads); break;
    case W_Q4_1: linear_rows_q4_1(x, w->w, w->bias, y, M, w->n, w->k, threads); break;
    case W_Q8_0: linear_rows_q8_0(x, w->w, w->bias, y, M, w->n, w->k, threads); break;
    case W_X8 + W_Q4_0: linear_rows_q4_0_x8(x, w->w, w->bias, y, M, w->n, w->k, threads); break;
    case W_X8 + W_Q4_1: linear_rows_q4_1_x8(x, w->w, w->bias, y, M, w->n, w->k, threads); break;
    case W_X8 + W_Q8_0: linear_rows_q8_0_x8(x, w->w, w->bias, y, M, w->n, w->k, threads); break;
    default: linear_rows(x, w->w, w->bias, y, M, w->n, w->k, threads);
  }
}

/* y[i] = a[i] + y[i]: a residual add (torch's x + h, one IEEE add each). */
static void add_into(float *y, const float *a, long n, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if (n >= PARALLEL_MIN_WORK)
  for (long i = 0; i < n; i++) y[i] = a[i] + y[i];
}

long decoder_layer_scratch(const layer_ref *l, int M) {
  return (long)M * (2 * l->hidden + (l->H + 2 * l->Hk) * l->D + l->H * l->D + 3 * l->intermediate);
}

/* out[M, hidden] = the layer over x[M, hidden] (M = B * T tokens); the new keys and values
   stored in the cache as rope_and_store stores them. */
void decoder_layer(const float *x, float *out, const layer_ref *l, const forward_ref *f) {
  int M = f->B * f->T, qkv_n = (l->H + 2 * l->Hk) * l->D, th = f->threads;
  float *normed = f->scratch, *mlp_out = normed + (size_t)M * l->hidden;
  float *qkv = mlp_out + (size_t)M * l->hidden, *attn = qkv + (size_t)M * qkv_n;
  float *gate_up = attn + (size_t)M * l->H * l->D, *act = gate_up + (size_t)M * 2 * l->intermediate;
  rms_norm_rows(x, l->input_norm, normed, M, l->hidden, l->eps, th);
  linear_any(normed, &l->qkv, qkv, M, th);
  rope_and_store(qkv, f->cos, f->sin, l->keys, l->values, f->table, f->W, f->start, f->lens,
                 f->B, f->T, l->H, l->Hk, f->BS, l->D, th);
  attention_rows(qkv, qkv_n, l->keys, l->values, f->table, f->W, l->window ? f->lo_window : f->lo,
                 f->hi, f->tree, f->tree_start, attn, f->B, f->T, l->H, l->Hk, f->BS, l->D,
                 l->scale, th);
  linear_any(attn, &l->o, out, M, th);
  add_into(out, x, (long)M * l->hidden, th);                      /* x + attn(norm(x)) */
  rms_norm_rows(out, l->post_norm, normed, M, l->hidden, l->eps, th);
  linear_any(normed, &l->gate_up, gate_up, M, th);
  silu_mul_rows(gate_up, act, M, l->intermediate, th);
  linear_any(act, &l->down, mlp_out, M, th);
  add_into(out, mlp_out, (long)M * l->hidden, th);                /* x + mlp(norm(x)) */
}

/* out = the layers l[0] .. l[L - 1] over x, each as decoder_layer runs it, through out and
   spare in turn (the last layer writes out): a forward's whole layer stack in one call, the
   same calls in the same order, so the same bits (at batch 1 the Python between 30 layers'
   calls cost about 0.5 ms of a 10 ms 4-bit decode on an EPYC). */
void decoder_layers(const float *x, float *out, float *spare, const layer_ref *const *l, int L,
                    const forward_ref *f) {
  const float *in = x;
  for (int i = 0; i < L; i++) {
    float *dst = (L - 1 - i) % 2 == 0 ? out : spare;
    decoder_layer(in, dst, l[i], f);
    in = dst;
  }
}

/* Exp(1) noise, N rows of V (sampling.exponential_noise's formula, which the torch path
   computes op by op): entry j of row i is SplitMix64's finaliser of keys[i] + (j + 1) *
   golden, its top 53 bits a uniform u in (0, 1), the noise -log(u) in double, then float.
   The integer steps are the same bits anywhere; the log is libm's, whose double may differ
   from torch's in the last place (so, rarely, the float too). Not row-invariance but speed:
   one pass instead of a dozen [N, V] int64 tensors. */
void exponential_noise_rows(const int64_t *keys, int N, int V, float *out, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) \
    if (N > 1 && (long)N * V >= PARALLEL_MIN_WORK)
  for (int i = 0; i < N; i++) {
    uint64_t key = (uint64_t)keys[i];
    float *o = out + (size_t)i * V;
    for (int j = 0; j < V; j++) {
      uint64_t z = key + (uint64_t)(j + 1) * 0x9E3779B97F4A7C15ULL;
      z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
      z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
      z ^= z >> 31;
      double u = ((double)(z >> 11) + 0.5) * 0x1p-53;
      o[j] = (float)(-log(u));
    }
  }
}

/* Integer dot products (kernels: integer): a GGUF's blocks met by 8-bit inputs, the
   arithmetic of llama.cpp's CPU backend, with 16 bits where a block holds an outlier.

   Each input row is quantized block by block from its own values only (quantize_x8): d = max
   |x| / 127 and q = x * (1 / d) rounded to nearest, ties to even, so q is in [-127, 127]. A
   block whose largest |x| is over X8_OUTLIER times its mean |x| is wide instead: 8 bits would
   round most of its values to a few steps of the outlier's, so d = max |x| / (127 * 254) and q
   = 254 * hi + lo, hi and lo both in [-127, 127]; its sums take a second pass of multiply-adds
   (lo), joined to the first (hi) in int32. A weight block and an input block meet in integer
   multiply-adds, which are exact. Then, for each (weight row, input row) pair, block after
   block in order, one float32 accumulator: acc = fma(d_w * d_x, sum, acc), and for Q4_1 acc =
   fma(m, d_x * sum q_x, acc); the bias last. So a token's outputs are the same bits alone, in
   a verify or in a batch (row invariance by construction), and, every operation being
   IEEE-defined (fmaf where there is no FMA instruction), the same bits on every build. They
   are not the float32 path's bits: the inputs are rounded (tests/engine/test_integer_kernels.py).

   The weights are packed in groups of 16 rows (native.interleave_rows): per block, the 16
   rows' d, then their m (Q4_1), then their quants in chunks of 4 (chunk c of rows 0..15, then
   chunk c + 1): one 64-byte load holds 4 quants of each of 16 rows, so a broadcast of 4 input
   bytes and one multiply-add instruction give 16 rows' partial sums in 16 lanes (AVX512; two
   halves of 8 lanes with AVX2), and a lane ends the block holding its row's whole sum: no
   horizontal adds, and a vector of the pairs' scales. A group's blocks are read once for the
   input rows of a pass: up to 9 with AVX512 (a verify of 8 drafts), 4 elsewhere. Until
   session 60 the groups were of 8 rows, in 8 lanes everywhere: AVX512's 16 lanes halve the
   broadcasts a product, and two groups of 8 read side by side were two streams the memory
   served slower (docs/BENCHMARKS.md). */
typedef struct {
  float d, s;          /* s = d * sum */
  int32_t sum, wide;   /* sum of q; wide: q = 254 * qs + lo, else q = qs */
  int8_t qs[32], lo[32];
} x8_block;
#ifndef X8_OUTLIER
#define X8_OUTLIER 8  /* max |x| over mean |x| that makes a block wide (docs/BENCHMARKS.md) */
#endif
#ifndef X8_PF
/* bytes a group's blocks are prefetched ahead: with groups of 8 rows into L1, on a Zen 3,
   1 KB was 6% slower at one row from memory than 2 to 4 KB (alike), none 10%; on a Zen 4,
   0 to 8 KB alike. With groups of 16 on a Zen 4, 8 KB into L2 against 4 KB into L1: the LM
   head from memory (Q8_0, 28 MB) at 9 rows 0.63x the time, where its reads had not
   overlapped its multiply-adds at all; the layers' linears at 1 to 9 rows 0.9-1.07x (within
   the machine's noise); 4 KB into L2 1.1x slower than 8, 16 KB like 8. On a Zen 5, fetched
   non-temporal (X8_PREFETCH): 4 KB ahead 1.08-1.12x slower than 8, 16 KB 0.93x at one row
   and 1.02-1.04x at 4 to 9 */
#define X8_PF 8192
#endif
/* A weight's bytes are read once a forward: fetched as non-temporal, they displace less of
   what the layer reads again (its inputs and scratch, the cache's keys and values). On a
   Zen 5 against prefetcht1: the 30 layers' linears from memory 0.98-0.99x at 1 to 9 rows,
   the LM head 0.95x at one row and 0.89x at four (AVX2 build 0.97-1.0x, the head 0.8x at
   one row); in the forward, a decode 0.97-0.98x, a verify of 8 0.95-0.97x. Where the data
   goes changes no arithmetic. */
#define X8_PREFETCH(p) __builtin_prefetch(p, 0, 0)

#if defined(__AVX2__) && defined(__FMA__)
/* quantize_x8's block in 8-lane vectors, the same operations in the same order (lane i holds
   v[i], v[8 + i], v[16 + i], v[24 + i]'s max and sum; the lanes' sum as its tree; a product
   rounded to nearest, ties to even, as nearbyintf): 1 where it quantized the block, 0 where
   the block is wide (quantize_x8's own loop does those). */
static inline int quantize_narrow(const float *v, x8_block *o) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 a0 = _mm256_andnot_ps(sign, _mm256_loadu_ps(v)), a1 = _mm256_andnot_ps(sign, _mm256_loadu_ps(v + 8));
  __m256 a2 = _mm256_andnot_ps(sign, _mm256_loadu_ps(v + 16)), a3 = _mm256_andnot_ps(sign, _mm256_loadu_ps(v + 24));
  __m256 mx = _mm256_max_ps(_mm256_max_ps(a0, a1), _mm256_max_ps(a2, a3));
  __m256 sm = _mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3));
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  float amax = _mm_cvtss_f32(_mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 1)));
  __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(sm), _mm256_extractf128_ps(sm, 1)); /* l_i + l_i+4 */
  s4 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));        /* (l0 + l4) + (l2 + l6), (l1 + l5) + (l3 + l7) */
  float total = _mm_cvtss_f32(_mm_add_ss(s4, _mm_shuffle_ps(s4, s4, 1)));
  if (amax * 32.0f > X8_OUTLIER * total) return 0;
  float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
  __m256 scale = _mm256_set1_ps(id);
  __m256i q[4];
  for (int i = 0; i < 4; i++)
    q[i] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(v + 8 * i), scale),
                                              _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  __m256i total_q = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
  __m128i t4 = _mm_add_epi32(_mm256_castsi256_si128(total_q), _mm256_extracti128_si256(total_q, 1));
  t4 = _mm_add_epi32(t4, _mm_shuffle_epi32(t4, 0x4e));
  int sum = _mm_cvtsi128_si32(_mm_add_epi32(t4, _mm_shuffle_epi32(t4, 0xb1)));
  /* int32 -> int8 in order: packs interleave 128-bit lanes, the permute puts them back */
  __m256i w16 = _mm256_packs_epi32(q[0], q[1]), w16b = _mm256_packs_epi32(q[2], q[3]);
  __m256i b8 = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(w16, w16b),
                                           _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  _mm256_storeu_si256((__m256i *)o->qs, b8);
  _mm256_storeu_si256((__m256i *)o->lo, _mm256_setzero_si256());
  o->d = d;
  o->sum = sum;
  o->wide = 0;
  o->s = d * (float)sum;
  return 1;
}
#endif

/* The M rows' blocks, split over the threads of the team it is called in (a worksharing loop,
   and its barrier), on the calling thread alone outside one. */
static void quantize_x8(const float *x, x8_block *out, int M, int K) {
  int nb = K / 32;
#pragma omp for schedule(static)
  for (long r = 0; r < (long)M * nb; r++) {
    const float *v = x + r * 32;
#if defined(__AVX2__) && defined(__FMA__) && !defined(SPECSERVE_PLANTED_SHARED_SCALE)
    if (quantize_narrow(v, out + r)) continue;
#endif
    /* max and sum of |x|: 8 lanes of 4 values each, then the lanes in a fixed order (a tree,
       not one chain of 32 adds: the same on every build) */
    float lane_max[8], lane_sum[8];
    for (int i = 0; i < 8; i++) {
      float a0 = fabsf(v[i]), a1 = fabsf(v[8 + i]), a2 = fabsf(v[16 + i]), a3 = fabsf(v[24 + i]);
      float m01 = a0 > a1 ? a0 : a1, m23 = a2 > a3 ? a2 : a3;  /* (fmaxf: a library call) */
      lane_max[i] = m01 > m23 ? m01 : m23;
      lane_sum[i] = (a0 + a1) + (a2 + a3);
    }
    float amax = 0.0f;
    for (int i = 0; i < 8; i++) amax = lane_max[i] > amax ? lane_max[i] : amax;
    float total = ((lane_sum[0] + lane_sum[4]) + (lane_sum[2] + lane_sum[6])) +
                  ((lane_sum[1] + lane_sum[5]) + (lane_sum[3] + lane_sum[7]));
#ifdef SPECSERVE_PLANTED_SHARED_SCALE /* a mistake the tests plant: one scale for all rows */
    for (long o = r % nb; o < (long)M * nb; o += nb)
      for (int i = 0; i < 32; i++) amax = fmaxf(amax, fabsf(x[o * 32 + i]));
#endif
    int wide = amax * 32.0f > X8_OUTLIER * total;  /* max over X8_OUTLIER times the mean */
    float d = amax / (wide ? 127.0f * 254.0f : 127.0f), id = d != 0.0f ? 1.0f / d : 0.0f;
    int sum = 0;
    for (int i = 0; i < 32; i++) {
      int q = (int)nearbyintf(v[i] * id), hi = wide ? (q + (q < 0 ? -127 : 127)) / 254 : q;
      out[r].qs[i] = (int8_t)hi;
      out[r].lo[i] = (int8_t)(wide ? q - 254 * hi : 0);  /* 0 in a narrow block */
      sum += q;
    }
    out[r].d = d;
    out[r].sum = sum;
    out[r].wide = wide;
    out[r].s = d * (float)sum;
  }
}

static __thread void *x8_buf;  /* the calling thread's quantized inputs, apart from task_buf */
static __thread size_t x8_cap;

/* A group's rows, and the bytes of one of its blocks: X8_SCALES 64-byte vectors of the 16 rows'
   scales (d, then m for Q4_1), then X8_CHUNKS chunks of 64 bytes, each 4 bytes of every row. */
#define X8_ROWS 16
#define X8_SCALES_q4_0 1
#define X8_SCALES_q4_1 2
#define X8_SCALES_q8_0 1
#define X8_CHUNKS_q4_0 4  /* a 4-bit chunk c: quants 4c .. 4c + 3 in the low nibbles, 16 + 4c .. in the high */
#define X8_CHUNKS_q4_1 4
#define X8_CHUNKS_q8_0 8
#define X8_GROUP(T) (64 * (X8_SCALES_##T + X8_CHUNKS_##T))
#define X8_ZERO_q4_0 8  /* Q4_0's quants are w_q - 8 */
#define X8_ZERO_q4_1 0
#if defined(__AVX2__) && defined(__FMA__) && \
    (defined(__AVXVNNI__) || (defined(__AVX512VNNI__) && defined(__AVX512VL__)))
#define X8_ZERO_q8_0 128  /* VNNI meets Q8_0's quants as w + 128, unsigned (X8_DOTS_q8_0) */
#else
#define X8_ZERO_q8_0 0
#endif

/* Row r's quant k of a group's block (q: its quants; T_bits 4 or 8): the portable kernels and
   an embedding's lookup read the layout through this. */
static inline int x8_quant(const uint8_t *q, int T_bits, int r, int k) {  /* row r's quant k */
  if (T_bits == 8) return ((const int8_t *)q)[64 * (k / 4) + 4 * r + k % 4];
  int c = k % 16 / 4, byte = q[64 * c + 4 * r + k % 4];
  return k < 16 ? byte & 15 : byte >> 4;
}

/* A group's outputs for one input row (its y row): the rows from n that the weight has, each
   with its bias. */
static inline void x8_store(const float *out, const float *bias, float *y, int N, int n) {
  int rows = N - n < X8_ROWS ? N - n : X8_ROWS;
  for (int r = 0; r < rows; r++) y[n + r] = bias ? out[r] + bias[n + r] : out[r];
}

/* A wide block's sums: the first pass's (hi) and the second's (lo) joined as 254 * hi + lo,
   exact in int32. */
#define X8_WIDE(W, hi, lo) _mm##W##_add_epi32(_mm##W##_mullo_epi32(hi, _mm##W##_set1_epi32(254)), lo)
/* Input row a's float epilogue for one block into acc, from its integer sums `sums` (a wide
   block's joined): Q4_0's 8 (and VNNI Q8_0's 128) times the inputs' sum taken off, then acc =
   fma(d_w * d_x, sum, acc) and for Q4_1 acc = fma(m, s_x, acc); d: the lanes' d_w, m: where
   their m are. */
#define X8_EPILOGUE(T, W, d, m, a, sums, acc)                                                 \
  do {                                                                                        \
    __m##W##i s_ = (sums);                                                                    \
    if (X8_ZERO_##T) s_ = _mm##W##_sub_epi32(s_, _mm##W##_set1_epi32(X8_ZERO_##T * (a)->sum)); \
    acc = _mm##W##_fmadd_ps(_mm##W##_mul_ps(d, _mm##W##_set1_ps((a)->d)),                     \
                            _mm##W##_cvtepi32_ps(s_), acc);                                   \
    if (X8_SCALES_##T == 2)                                                                   \
      acc = _mm##W##_fmadd_ps(_mm##W##_loadu_ps(m), _mm##W##_set1_ps((a)->s), acc);           \
  } while (0)
/* One block of a group against a pass's MR input rows a[j], in W-bit vectors (256 or 512):
   the rows' integer sums (DOTS: the weight type's multiply-adds, from its quants q), a wide
   block's second pass (its lo bytes) joined to the first as 254 * hi + lo, exact in int32,
   Q4_0's 8 (and VNNI Q8_0's 128) times the inputs' sum taken off, then the float epilogue into
   acc: the lanes' d and m are `lane` floats into the block's vectors of them. FENCE between
   the sums and a wide block's pass. */
#define X8_BLOCK(T, W, DOTS, FENCE, blk, q, lane, a, MR, acc)                                 \
  do {                                                                                        \
    const int8_t *qs[MR];                                                                     \
    __m##W##i sums[MR];                                                                       \
    for (int j = 0; j < MR; j++) qs[j] = a[j]->qs;                                            \
    DOTS(q, qs, MR, sums);                                                                    \
    FENCE;                                                                                    \
    for (int j = 0; j < MR; j++)                                                              \
      if (a[j]->wide) {                                                                       \
        __m##W##i lows[1];                                                                    \
        const int8_t *lo_qs[1] = {a[j]->lo};                                                  \
        DOTS(q, lo_qs, 1, lows);                                                              \
        sums[j] = X8_WIDE(W, sums[j], lows[0]);                                               \
      }                                                                                       \
    __m##W d = _mm##W##_loadu_ps((const float *)(blk) + (lane));                              \
    for (int j = 0; j < MR; j++)                                                              \
      X8_EPILOGUE(T, W, d, (const float *)(blk) + 16 + (lane), a[j], sums[j], acc[j]);        \
  } while (0)

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
/* With AVX512-VNNI a group's 16 rows in the 16 lanes of 512-bit vectors: each chunk one load,
   each 4-byte broadcast of the inputs met by 16 rows' quants in one multiply-add. The 8-lane
   kernels below are bound by their broadcasts (half as many products each); these by the
   multiply-adds and the float epilogue, which share two pipes on a Zen 4 (docs/BENCHMARKS.md;
   a Zen 5's pipes are 512 bits wide).
   A lane's operations are the 8-lane kernels', in the same order: the same bits. */
/* acc + u . (the 4 input bytes at p, in every lane): one multiply-add with the bytes as its
   broadcast memory operand ({1to16}), not a broadcast and then a multiply-add. */
static inline __m512i x16_dot(__m512i acc, __m512i u, const int8_t *p) {
  __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(u), "m"(*(const int32_t *)p));
  return acc;
}
/* x8_store from a vector: the lanes of the rows the weight has (a masked store), each plus its
   bias in one IEEE add, as x8_store adds it. Without a call: stored through x8_store's array,
   GCC made each group's row a call of memcpy, after a vzeroupper (at 9 input rows about a
   tenth of a verify's linears). */
static inline void x16_store(__m512 out, const float *bias, float *y, int N, int n) {
  int rows = N - n < X8_ROWS ? N - n : X8_ROWS;
  __mmask16 keep = (__mmask16)((1u << rows) - 1);
  if (bias) out = _mm512_add_ps(out, _mm512_maskz_loadu_ps(keep, bias + n));
  _mm512_mask_storeu_ps(y + n, keep, out);
}
/* A block's quants in registers, for every input row of a pass (q4: chunk c's low nibbles as
   w[c], its high ones as w[c + 4]; Q8_0: chunk c as w[c], unsigned): w[k] meets the input
   bytes 4k .. 4k + 3. */
#define X16_PREP_q4(q, w)                                                                     \
  __m512i w[8];                                                                               \
  for (int c = 0; c < 4; c++) {                                                               \
    __m512i raw = _mm512_loadu_si512((const void *)((q) + 64 * c));                           \
    w[c] = _mm512_and_si512(raw, _mm512_set1_epi8(15));                                       \
    w[c + 4] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), _mm512_set1_epi8(15));             \
  }
#define X16_PREP_q8_0(q, w)                                                                   \
  __m512i w[8];                                                                               \
  for (int c = 0; c < 8; c++)                                                                 \
    w[c] = _mm512_xor_si512(_mm512_loadu_si512((const void *)((q) + 64 * c)),                 \
                            _mm512_set1_epi8((char)0x80));
#define X16_PREP_q4_0 X16_PREP_q4
#define X16_PREP_q4_1 X16_PREP_q4
/* One input row's integer sums against a prepared block, in 16 lanes: two chains of 4
   multiply-adds (the rows' chains are in flight together). */
static inline __m512i x16_row(const __m512i *w, const int8_t *qs) {
  __m512i s0 = _mm512_setzero_si512(), s1 = _mm512_setzero_si512();
  for (int k = 0; k < 8; k += 2) {
    s0 = x16_dot(s0, w[k], qs + 4 * k);
    s1 = x16_dot(s1, w[k + 1], qs + 4 * (k + 1));
  }
  return _mm512_add_epi32(s0, s1);
}
/* A pass: MR input rows (from m) against the groups g0 .. g1 of 16 weight rows, one group after
   another (one call a task: a call a group cost its return's vzeroupper). Each block's quants
   are prepared once, then each row in turn takes its sums, a wide block's second pass from the
   same registers, and its float epilogue (X8_BLOCK's operations, in its order: the same bits).
   Until session 62 all the rows' sums were taken first and then their epilogues: with 9 rows
   GCC kept the sums and half the accumulators on the stack; row by row, 8 prepared vectors,
   MR accumulators and a row's two chains fit AVX512's 32 registers (on a Zen 5, 0.87-0.89x
   the time at 9 rows: one layer, the 30 from memory, the Q8_0 head; 0.91-0.95x at one). */
#define XROWS(T, MR)                                                                          \
  static inline void xrows_##T##_##MR(const x8_block *x, const uint8_t *w, const float *bias, \
                                      float *y, int N, int nb, int g0, int g1, int m) {       \
    for (int gi = g0; gi < g1; gi++) {                                                        \
      const uint8_t *g = w + (size_t)gi * nb * X8_GROUP(T);                                   \
      __m512 acc[MR];                                                                         \
      for (int j = 0; j < MR; j++) acc[j] = _mm512_setzero_ps();                              \
      for (int b = 0; b < nb; b++) {                                                          \
        const uint8_t *blk = g + (size_t)b * X8_GROUP(T);                                     \
        for (int l = 0; l < X8_GROUP(T); l += 64) X8_PREFETCH(blk + X8_PF + l);               \
        X16_PREP_##T(blk + X8_SCALES_##T * 64, wq)                                            \
        __m512 d = _mm512_loadu_ps((const float *)blk);                                       \
        _Pragma("GCC unroll 16")  /* acc[j] in registers */                                   \
        for (int j = 0; j < MR; j++) {                                                        \
          const x8_block *a = x + (size_t)(m + j) * nb + b;                                   \
          __m512i sum = x16_row(wq, a->qs);                                                   \
          if (a->wide) sum = X8_WIDE(512, sum, x16_row(wq, a->lo));                           \
          X8_EPILOGUE(T, 512, d, (const float *)blk + 16, a, sum, acc[j]);                    \
        }                                                                                     \
      }                                                                                       \
      for (int j = 0; j < MR; j++)                                                            \
        x16_store(acc[j], bias, y + (size_t)(m + j) * N, N, gi * X8_ROWS);                    \
    }                                                                                         \
  }
/* Up to 9 input rows a pass (a verify of 8 drafts reads its weights once); more split evenly. */
#define X8_PASS 9
#define X8_PASSES(T)                                                                          \
  XROWS(T, 1) XROWS(T, 2) XROWS(T, 3) XROWS(T, 4) XROWS(T, 5) XROWS(T, 6) XROWS(T, 7)         \
  XROWS(T, 8) XROWS(T, 9)                                                                     \
  static inline void xpass_##T(const x8_block *x, const uint8_t *w, const float *bias,        \
                               float *y, int N, int nb, int g0, int g1, int m, int rows) {    \
    switch (rows) {                                                                           \
      case 1: xrows_##T##_1(x, w, bias, y, N, nb, g0, g1, m); break;                          \
      case 2: xrows_##T##_2(x, w, bias, y, N, nb, g0, g1, m); break;                          \
      case 3: xrows_##T##_3(x, w, bias, y, N, nb, g0, g1, m); break;                          \
      case 4: xrows_##T##_4(x, w, bias, y, N, nb, g0, g1, m); break;                          \
      case 5: xrows_##T##_5(x, w, bias, y, N, nb, g0, g1, m); break;                          \
      case 6: xrows_##T##_6(x, w, bias, y, N, nb, g0, g1, m); break;                          \
      case 7: xrows_##T##_7(x, w, bias, y, N, nb, g0, g1, m); break;                          \
      case 8: xrows_##T##_8(x, w, bias, y, N, nb, g0, g1, m); break;                          \
      default: xrows_##T##_9(x, w, bias, y, N, nb, g0, g1, m);                                \
    }                                                                                         \
  }
#elif defined(__AVX2__) && defined(__FMA__)
/* acc + u . s in int32 lanes, 4 byte products a lane (u unsigned, s signed) */
static inline __m256i x8_madd(__m256i acc, __m256i u, __m256i s) {
#if defined(__AVXVNNI__)
  return _mm256_dpbusd_avx_epi32(acc, u, s);
#elif defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(acc, u, s);
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
#endif
}
static inline __m256i x8_chunk(const int8_t *qs, int c) {  /* input quants 4c .. 4c + 3, 8 times */
  int32_t v;
  __builtin_memcpy(&v, qs + 4 * c, 4);
  return _mm256_set1_epi32(v);
}
/* The 8 rows' sums of half a group (q: its first chunk's half, 32 of each 64 bytes) against MR
   input blocks' bytes qs[j]. A 4-bit chunk c holds quants 4c .. 4c + 3 of each row in its low
   nibbles and 16 + 4c .. 16 + 4c + 3 in its high ones. Q8_0: below. */
#if defined(__AVXVNNI__) || (defined(__AVX512VNNI__) && defined(__AVX512VL__))
/* One input row: the high nibbles' sums apart, two chains of adds, not one; more rows: one
   chain a row (the rows' chains are in flight together, and the registers go to more rows).
   The sums are exact in int32 either way. */
#define X8_DOTS_q4(q, qs, MR, sums)                                                           \
  do {                                                                                        \
    __m256i his[MR];                                                                          \
    for (int j = 0; j < MR; j++) sums[j] = his[j] = _mm256_setzero_si256();                   \
    for (int c = 0; c < 4; c++) {                                                             \
      __m256i raw = _mm256_loadu_si256((const __m256i *)(q + 64 * c));                        \
      __m256i lo = _mm256_and_si256(raw, _mm256_set1_epi8(15));                               \
      __m256i hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), _mm256_set1_epi8(15));         \
      for (int j = 0; j < MR; j++) {                                                          \
        sums[j] = x8_madd(sums[j], lo, x8_chunk(qs[j], c));                                   \
        if (MR == 1) his[j] = x8_madd(his[j], hi, x8_chunk(qs[j], c + 4));                    \
        else sums[j] = x8_madd(sums[j], hi, x8_chunk(qs[j], c + 4));                          \
      }                                                                                       \
    }                                                                                         \
    if (MR == 1) sums[0] = _mm256_add_epi32(sums[0], his[0]);                                 \
  } while (0)
#else
/* Without VNNI (maddubs) a row's 8 vectors of pairs of products add up in one chain of int16
   lanes, widened once a block (exact: at most 8 x 2 x 15 x 127 < 2^15). The empty asm keeps
   each add where it is written: GCC otherwise reassociated the chain, computed all 32 of a
   4-row pass's products first and spilled them to the stack (20% slower on a Zen 3). */
#define X8_DOTS_q4(q, qs, MR, sums)                                                           \
  do {                                                                                        \
    __m256i s16[MR];                                                                          \
    for (int j = 0; j < MR; j++) s16[j] = _mm256_setzero_si256();                             \
    for (int c = 0; c < 4; c++) {                                                             \
      __m256i raw = _mm256_loadu_si256((const __m256i *)(q + 64 * c));                        \
      __m256i lo = _mm256_and_si256(raw, _mm256_set1_epi8(15));                               \
      __m256i hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), _mm256_set1_epi8(15));         \
      for (int j = 0; j < MR; j++) {                                                          \
        s16[j] = _mm256_add_epi16(s16[j], _mm256_maddubs_epi16(lo, x8_chunk(qs[j], c)));      \
        s16[j] = _mm256_add_epi16(s16[j], _mm256_maddubs_epi16(hi, x8_chunk(qs[j], c + 4)));  \
        __asm__("" : "+x"(s16[j]));                                                           \
      }                                                                                       \
    }                                                                                         \
    for (int j = 0; j < MR; j++) sums[j] = _mm256_madd_epi16(s16[j], _mm256_set1_epi16(1));   \
  } while (0)
#endif
#if X8_ZERO_q8_0
/* VNNI's products do not saturate: w + 128 (w xor 0x80) is the unsigned side, once a chunk for
   every input row, and the 128 * sum q it adds comes off as Q4_0's 8 does (X8_BLOCK; a wide
   block's sums stay under 255 * 127 * 32 * 255 < 2^31). */
#define X8_DOTS_q8_0(q, qs, MR, sums)                                                         \
  do {                                                                                        \
    for (int j = 0; j < MR; j++) sums[j] = _mm256_setzero_si256();                            \
    for (int c = 0; c < 8; c++) {                                                             \
      __m256i u = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(q + 64 * c)),        \
                                   _mm256_set1_epi8((char)0x80));                             \
      for (int j = 0; j < MR; j++) sums[j] = x8_madd(sums[j], u, x8_chunk(qs[j], c));        \
    }                                                                                         \
  } while (0)
#else
/* maddubs saturates pairs in int16: |w| against x carrying w's sign keeps them under 2^15. */
#define X8_DOTS_q8_0(q, qs, MR, sums)                                                         \
  do {                                                                                        \
    for (int j = 0; j < MR; j++) sums[j] = _mm256_setzero_si256();                            \
    for (int c = 0; c < 8; c++) {                                                             \
      __m256i w = _mm256_loadu_si256((const __m256i *)(q + 64 * c)), u = _mm256_sign_epi8(w, w); \
      for (int j = 0; j < MR; j++)                                                            \
        sums[j] = x8_madd(sums[j], u, _mm256_sign_epi8(x8_chunk(qs[j], c), w));               \
    }                                                                                         \
  } while (0)
#endif
#define X8_DOTS_q4_0 X8_DOTS_q4
#define X8_DOTS_q4_1 X8_DOTS_q4
/* Between a half's sums and a wide block's second pass: its weights loaded again, not held
   (GCC held them, with the inputs' broadcasts across the halves, and spilled: the Q8_0 head
   1.16-1.27x slower on a Zen 4's AVX2 build). AVX512 holds a block's quants for all its rows
   (XROWS). */
#define X8_FENCE __asm__ volatile("" ::: "memory")
/* x8_store for half a group from its vector (8 lanes, rows n .. n + 8 of y): a whole half as a
   vector (each plus its bias in one IEEE add, as x8_store adds it), a last group's rows through
   x8_store (none past N). */
static inline void x8_store_half(__m256 out, const float *bias, float *y, int N, int n) {
  if (N - n < 8) {
    float lanes[8];
    _mm256_storeu_ps(lanes, out);
    if (N > n) x8_store(lanes, bias, y, N, n);
    return;
  }
  if (bias) out = _mm256_add_ps(out, _mm256_loadu_ps(bias + n));
  _mm256_storeu_ps(y + n, out);
}
/* A pass: MR input rows (from m) against the groups g0 .. g1 of 16 weight rows, each as two
   halves of 8 rows in 8 lanes, block by block (a group's bytes read as one stream; a last
   group's padding rows are zero blocks). */
#define XHALVES(T, MR)                                                                        \
  static inline void xhalves_##T##_##MR(const x8_block *x, const uint8_t *w, const float *bias, \
                                        float *y, int N, int nb, int g0, int g1, int m) {     \
    for (int gi = g0; gi < g1; gi++) {                                                        \
      const uint8_t *g = w + (size_t)gi * nb * X8_GROUP(T);                                   \
      __m256 acc0[MR], acc1[MR];                                                              \
      for (int j = 0; j < MR; j++) acc0[j] = acc1[j] = _mm256_setzero_ps();                   \
      for (int b = 0; b < nb; b++) {                                                          \
        const uint8_t *blk = g + (size_t)b * X8_GROUP(T);                                     \
        for (int l = 0; l < X8_GROUP(T); l += 64) X8_PREFETCH(blk + X8_PF + l);               \
        const x8_block *a[MR];                                                                \
        for (int j = 0; j < MR; j++) a[j] = x + (size_t)(m + j) * nb + b;                     \
        X8_BLOCK(T, 256, X8_DOTS_##T, X8_FENCE, blk, blk + X8_SCALES_##T * 64, 0, a, MR, acc0); \
        X8_FENCE;                                                                             \
        X8_BLOCK(T, 256, X8_DOTS_##T, X8_FENCE, blk, blk + X8_SCALES_##T * 64 + 32, 8, a, MR, acc1); \
      }                                                                                       \
      for (int j = 0; j < MR; j++) {                                                          \
        x8_store_half(acc0[j], bias, y + (size_t)(m + j) * N, N, gi * X8_ROWS);               \
        x8_store_half(acc1[j], bias, y + (size_t)(m + j) * N, N, gi * X8_ROWS + 8);           \
      }                                                                                       \
    }                                                                                         \
  }
/* A pass of MR input rows (from m) against the groups g0 .. g1, a group's two halves one
   after the other: one accumulator and one chain of sums a row, so AVX2's 16 registers hold a
   pass of 5 rows. A verify's 9 rows go as 5 + 4, not as xhalves' 3 + 3 + 3, each pass
   splitting every block's nibbles again (on a Zen 5 that verify's linears were 2.2x AVX512's;
   this pass took 0.9x their time, the LM head's 0.93x). The second half's bytes come from the
   caches (a group is at most 27 KB). Fewer rows stay with xhalves, both halves from one read of
   the block (xhalf at 4 rows: 1.03x its time, the head from memory 1.1x). A lane's operations
   are xhalves': the same bits. */
#define XHALF(T, MR)                                                                          \
  static inline void xhalf_##T##_##MR(const x8_block *x, const uint8_t *w, const float *bias, \
                                      float *y, int N, int nb, int g0, int g1, int m) {       \
    for (int gi = g0; gi < g1; gi++) {                                                        \
      const uint8_t *g = w + (size_t)gi * nb * X8_GROUP(T);                                   \
      for (int h = 0; h < 2; h++) {                                                           \
        __m256 acc[MR];                                                                       \
        for (int j = 0; j < MR; j++) acc[j] = _mm256_setzero_ps();                            \
        for (int b = 0; b < nb; b++) {                                                        \
          const uint8_t *blk = g + (size_t)b * X8_GROUP(T);                                   \
          if (!h)                                                                             \
            for (int l = 0; l < X8_GROUP(T); l += 64) X8_PREFETCH(blk + X8_PF + l);           \
          const x8_block *a[MR];                                                              \
          for (int j = 0; j < MR; j++) a[j] = x + (size_t)(m + j) * nb + b;                   \
          X8_BLOCK(T, 256, X8_DOTS_##T, X8_FENCE, blk, blk + X8_SCALES_##T * 64 + 32 * h,     \
                   8 * h, a, MR, acc);                                                        \
        }                                                                                     \
        for (int j = 0; j < MR; j++)                                                          \
          x8_store_half(acc[j], bias, y + (size_t)(m + j) * N, N, gi * X8_ROWS + 8 * h);      \
      }                                                                                       \
    }                                                                                         \
  }
#define X8_PASS 5  /* xhalf's 5 accumulators and 5 sums: AVX2's 16 registers */
#define X8_PASSES(T)                                                                          \
  XHALVES(T, 1) XHALVES(T, 2) XHALVES(T, 3) XHALVES(T, 4) XHALF(T, 5)                         \
  static inline void xpass_##T(const x8_block *x, const uint8_t *w, const float *bias,        \
                               float *y, int N, int nb, int g0, int g1, int m, int rows) {    \
    switch (rows) {                                                                           \
      case 1: xhalves_##T##_1(x, w, bias, y, N, nb, g0, g1, m); break;                        \
      case 2: xhalves_##T##_2(x, w, bias, y, N, nb, g0, g1, m); break;                        \
      case 3: xhalves_##T##_3(x, w, bias, y, N, nb, g0, g1, m); break;                        \
      case 4: xhalves_##T##_4(x, w, bias, y, N, nb, g0, g1, m); break;                        \
      default: xhalf_##T##_5(x, w, bias, y, N, nb, g0, g1, m);                                \
    }                                                                                         \
  }
#else
/* Elsewhere each pair on its own, the same operations (fmaf: one rounding, as the FMA). */
#define X8_BITS_q4_0 4
#define X8_BITS_q4_1 4
#define X8_BITS_q8_0 8
#define X8_PASS 4
#define X8_PASSES(T)                                                                          \
  static inline void xpass_##T(const x8_block *x, const uint8_t *w, const float *bias,        \
                               float *y, int N, int nb, int g0, int g1, int m, int rows) {    \
    for (int gi = g0; gi < g1; gi++) {                                                        \
      const uint8_t *g = w + (size_t)gi * nb * X8_GROUP(T);                                   \
      int n = gi * X8_ROWS, group_rows = N - n < X8_ROWS ? N - n : X8_ROWS;                   \
      for (int j = 0; j < rows; j++)                                                          \
        for (int r = 0; r < group_rows; r++) {                                                \
          float acc = 0.0f;                                                                   \
          for (int b = 0; b < nb; b++) {                                                      \
            const uint8_t *blk = g + (size_t)b * X8_GROUP(T);                                 \
            const x8_block *a = x + (size_t)(m + j) * nb + b;                                 \
            const uint8_t *q = blk + X8_SCALES_##T * 64;                                      \
            int sum = 0;                                                                      \
            for (int k = 0; k < 32; k++)                                                      \
              sum += x8_quant(q, X8_BITS_##T, r, k) * (a->wide ? 254 * a->qs[k] + a->lo[k] : a->qs[k]); \
            sum -= X8_ZERO_##T * a->sum;                                                      \
            acc = fmaf(((const float *)blk)[r] * a->d, (float)sum, acc);                      \
            if (X8_SCALES_##T == 2) acc = fmaf(((const float *)blk)[16 + r], a->s, acc);      \
          }                                                                                   \
          y[(size_t)(m + j) * N + n + r] = bias ? acc + bias[n + r] : acc;                    \
        }                                                                                     \
    }                                                                                         \
  }
#endif

/* Input values from which the threads quantize a call's blocks together, in the team that then
   does its multiply-adds (one fork, a barrier between); fewer, the calling thread before the
   fork (a decode's 576 or 1,536: the barrier would cost more than the blocks). */
#define X8_QUANTIZE_TOGETHER 2048

/* linear_rows_T_x8: the inputs quantized once (quantize_x8), then the groups of 16 weight rows
   split into a multiple of `threads` tasks (36 groups on 2 threads: 18 each, not 20 and 16),
   each group against the input rows X8_PASS at a time (more split evenly: 13 rows as 7 and
   6, not 9 and 4). */
#define LINEAR_X8(T)                                                                          \
  X8_PASSES(T)                                                                                \
  void linear_rows_##T##_x8(const float *x, const uint8_t *w, const float *bias, float *y,    \
                            int M, int N, int K, int threads) {                               \
    int nb = K / 32, groups = (N + X8_ROWS - 1) / X8_ROWS;                                    \
    x8_block *xq = grown(&x8_buf, &x8_cap, (size_t)M * nb * sizeof(x8_block));                \
    if (!xq) abort();                                                                         \
    int per_task = WEIGHT_ROWS_PER_TASK / X8_ROWS;                                            \
    int tasks = (groups + per_task - 1) / per_task;                                           \
    tasks = (tasks + threads - 1) / threads * threads; /* each thread as many groups, +-1 */  \
    if (tasks > groups) tasks = groups;                                                       \
    int team = (long)M * N * K >= PARALLEL_MIN_WORK;                                          \
    int together = team && (long)M * K >= X8_QUANTIZE_TOGETHER;                               \
    if (!together) quantize_x8(x, xq, M, K);                                                  \
    _Pragma("omp parallel num_threads(threads) if (team)")                                    \
    {                                                                                         \
      if (together) quantize_x8(x, xq, M, K);                                                 \
      _Pragma("omp for schedule(static)")                                                     \
      for (int t = 0; t < tasks; t++) {                                                       \
        int g0 = (int)((long)groups * t / tasks), g1 = (int)((long)groups * (t + 1) / tasks); \
        for (int m = 0; m < M;) {                                                             \
          int left = M - m, passes = (left + X8_PASS - 1) / X8_PASS;                            \
          int rows = (left + passes - 1) / passes;                                            \
          xpass_##T(xq, w, bias, y, N, nb, g0, g1, m, rows);                                  \
          m += rows;                                                                          \
        }                                                                                     \
      }                                                                                       \
    }                                                                                         \
  }
LINEAR_X8(q4_0) LINEAR_X8(q4_1) LINEAR_X8(q8_0)

/* Rows rows[0 .. R) of a packed weight of `kind` (W_Q4_0, W_Q4_1, W_Q8_0; + W_X8 where its rows
   are interleaved in groups of 16) with K inputs a row, dequantized into out[R, K]: an
   embedding's lookup. The dequantizer's arithmetic, each operation rounded to float32 (fp
   contraction off): d * (q - 8), d * q + m, q * d: the float32 table's bits
   (native.dequantize_blocks, which the tests hold it to). Returns 1, writing nothing, where
   a row is not in [0, N). */
int dequantize_rows(int kind, const uint8_t *w, int N, const int64_t *rows, int R, int K, float *out) {
  for (int i = 0; i < R; i++)
    if (rows[i] < 0 || rows[i] >= N) return 1;
  int x8 = kind >= W_X8, type = kind % W_X8, nb = K / 32;
  int scales = type == W_Q4_1 ? 2 : 1, quants = type == W_Q8_0 ? 32 : 16;
  int block = 4 * scales + quants;                                  /* a standard row's block */
  for (int i = 0; i < R; i++) {
    long r = rows[i];
    float *o = out + (size_t)i * K;
    for (int b = 0; b < nb; b++, o += 32) {
      float d, m = 0.0f;
      int q[32];
      if (x8) {  /* group r / 16, lane r % 16: its scales, then its 4 bytes of each chunk */
        const uint8_t *g = w + ((size_t)(r / X8_ROWS) * nb + b) * (size_t)(64 * scales + X8_ROWS * quants);
        int lane = (int)(r % X8_ROWS);
        __builtin_memcpy(&d, g + 4 * lane, 4);
        if (scales == 2) __builtin_memcpy(&m, g + 64 + 4 * lane, 4);
        for (int k = 0; k < 32; k++) q[k] = x8_quant(g + scales * 64, type == W_Q8_0 ? 8 : 4, lane, k);
      } else {   /* row r's blocks in order: d (and m), then the quants as the file has them */
        const uint8_t *p = w + ((size_t)r * nb + b) * block;
        __builtin_memcpy(&d, p, 4);
        if (scales == 2) __builtin_memcpy(&m, p + 4, 4);
        const uint8_t *qs = p + 4 * scales;
        for (int k = 0; k < 32; k++)
          q[k] = type == W_Q8_0 ? ((const int8_t *)qs)[k] : k < 16 ? qs[k] & 15 : qs[k - 16] >> 4;
      }
      for (int k = 0; k < 32; k++)
        o[k] = type == W_Q8_0 ? (float)q[k] * d : type == W_Q4_0 ? d * (float)(q[k] - 8) : d * (float)q[k] + m;
    }
  }
  return 0;
}
