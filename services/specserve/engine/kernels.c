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
     once at close to memory bandwidth.
   - attention_rows: one query at a time against its visible keys [lo, hi) straight from the
     KV cache storage: scores, a max, exp and its sum (VL keys at a time from the query's
     first key), and the weighted values in key order.
   - rms_norm_rows, silu_mul_rows, rope_and_store: a token's elementwise work in one call
     each (a layer's small torch ops cost more in dispatch than in arithmetic at batch 1).

   Built at first use with the machine's C compiler (-O3 -march=native, FMA contraction on),
   so VL is the machine's widest vector; results are reproducible on one machine and one
   build, not across CPUs. */
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
static inline void store(float *p, vf v) { __builtin_memcpy(p, &v, sizeof v); }

#if VL == 16
typedef float vf8 __attribute__((vector_size(8 * sizeof(float))));
#endif
typedef float vf4 __attribute__((vector_size(4 * sizeof(float))));
typedef int vi __attribute__((vector_size(VL * sizeof(int))));

/* The lanes of v summed by one fixed pairwise tree: halves, quarters, ... */
static inline float hsum(vf v) {
#if VL == 16
  vf8 h8 = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
           __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
#else
  vf v8 = v;
#define h8 v8
#endif
  vf4 h4 = __builtin_shufflevector(h8, h8, 0, 1, 2, 3) + __builtin_shufflevector(h8, h8, 4, 5, 6, 7);
  float a = h4[0] + h4[2], b = h4[1] + h4[3];
  return a + b;
}

/* exp(x) for x <= 0, VL lanes at once: 2^n * p(f) with x = n ln2 + f, |f| <= ln2 / 2, and p
   a degree-6 Taylor polynomial (relative error ~2e-7); below -87 it is 0. */
static inline vf blend(vi mask, vf a, vf b) { /* a where mask, else b */
  vi ai, bi;
  __builtin_memcpy(&ai, &a, sizeof a);
  __builtin_memcpy(&bi, &b, sizeof b);
  vi r = (mask & ai) | (~mask & bi);
  vf out;
  __builtin_memcpy(&out, &r, sizeof out);
  return out;
}

static inline vf vexp(vf x) {
  const vf lo = (vf){0} - 87.0f;
  vi under = x <= lo;
  x = blend(under, lo, x);
  vf t = x * 1.44269504088896341f + 12582912.0f;  /* round(x / ln2) in the low mantissa */
  vf n = t - 12582912.0f;
  vf f = x - n * 0.693145751953125f - n * 1.42860682030941723e-6f;
  vf p = 1.0f / 720 + (vf){0};
  p = p * f + 1.0f / 120;
  p = p * f + 1.0f / 24;
  p = p * f + 1.0f / 6;
  p = p * f + 0.5f;
  p = p * f + 1.0f;
  p = p * f + 1.0f;
  vi bits = (__builtin_convertvector(n, vi) + 127) << 23;
  vf scale;
  __builtin_memcpy(&scale, &bits, sizeof scale);
  vf out = p * scale;
  return blend(under, (vf){0}, out);
}

static inline float dot(const float *a, const float *b, int n) {
  vf acc = (vf){0};
  int nv = n - n % VL;
  for (int i = 0; i < nv; i += VL) acc += load(a + i) * load(b + i);
  float s = hsum(acc);
  for (int i = nv; i < n; i++) s += a[i] * b[i];
  return s;
}

/* NR weight rows (from n) x MR input rows (from m). Every (n, m) pair gets the arithmetic of
   dot() above whatever NR and MR are. */
#define TILE(NR, MR)                                                                          \
  static inline void tile_##NR##_##MR(const float *x, const float *w, const float *bias,     \
                                      float *y, int N, int K, int n, int m) {                \
    vf acc[NR][MR];                                                                           \
    for (int i = 0; i < NR; i++)                                                              \
      for (int j = 0; j < MR; j++) acc[i][j] = (vf){0};                                       \
    int kv = K - K % VL;                                                                      \
    for (int k = 0; k < kv; k += VL) {                                                        \
      vf xs[MR];                                                                              \
      for (int j = 0; j < MR; j++) xs[j] = load(x + (size_t)(m + j) * K + k);                 \
      for (int i = 0; i < NR; i++) {                                                          \
        __builtin_prefetch(w + (size_t)(n + i + PREFETCH_ROWS) * K + k);                      \
        vf wv = load(w + (size_t)(n + i) * K + k);                                            \
        for (int j = 0; j < MR; j++) acc[i][j] += wv * xs[j];                                 \
      }                                                                                       \
    }                                                                                         \
    for (int i = 0; i < NR; i++)                                                              \
      for (int j = 0; j < MR; j++) {                                                          \
        const float *wr = w + (size_t)(n + i) * K, *xr = x + (size_t)(m + j) * K;            \
        float s = hsum(acc[i][j]);                                                            \
        for (int k = kv; k < K; k++) s += wr[k] * xr[k];                                      \
        if (bias) s += bias[n + i];                                                           \
        y[(size_t)(m + j) * N + n + i] = s;                                                   \
      }                                                                                       \
  }
TILE(4, 4) TILE(4, 3) TILE(4, 2) TILE(4, 1)
TILE(1, 4) TILE(1, 3) TILE(1, 2) TILE(1, 1)

#define ROWS_OF(NR, x, w, bias, y, N, K, n, m0, m1)                                           \
  do {                                                                                        \
    int m = m0;                                                                               \
    for (; m + 4 <= m1; m += 4) tile_##NR##_4(x, w, bias, y, N, K, n, m);                     \
    switch (m1 - m) {                                                                         \
      case 3: tile_##NR##_3(x, w, bias, y, N, K, n, m); break;                                \
      case 2: tile_##NR##_2(x, w, bias, y, N, K, n, m); break;                                \
      case 1: tile_##NR##_1(x, w, bias, y, N, K, n, m); break;                                \
    }                                                                                         \
  } while (0)

enum { WEIGHT_ROWS_PER_TASK = 64, INPUT_ROWS_PER_PASS = 32 };

/* y[M, N] = x[M, K] W[N, K]^T (+ bias[N]). Threads split the weight rows into a multiple of
   `threads` tasks of at most about 64 rows (a multiple of 4), so no thread idles at the end;
   a task's weight rows stay in cache while the input rows pass in groups of 32. */
void linear_rows(const float *x, const float *w, const float *bias, float *y, int M, int N,
                 int K, int threads) {
  int per_thread = (N + threads * WEIGHT_ROWS_PER_TASK - 1) / (threads * WEIGHT_ROWS_PER_TASK);
  int rows = (N + threads * per_thread - 1) / (threads * per_thread);
  rows = (rows + 3) / 4 * 4;
  int tasks = (N + rows - 1) / rows;
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int t = 0; t < tasks; t++) {
    int n0 = t * rows;
    int n1 = n0 + rows < N ? n0 + rows : N;
    for (int m0 = 0; m0 < M; m0 += INPUT_ROWS_PER_PASS) {
      int m1 = m0 + INPUT_ROWS_PER_PASS < M ? m0 + INPUT_ROWS_PER_PASS : M;
      int n = n0;
      for (; n + 4 <= n1; n += 4) ROWS_OF(4, x, w, bias, y, N, K, n, m0, m1);
      for (; n < n1; n++) ROWS_OF(1, x, w, bias, y, N, K, n, m0, m1);
    }
  }
}

/* out[b, t, h, :] = softmax(scale * q[b, t, h] . keys) @ values over the keys [lo, hi) of
   the query (b, t), read from the cache storage of slot[b] and key/value head h / (H / Hk).
   q: B * T tokens of H heads of D floats, q_stride floats apart (the q heads of the fused
   projection's rows); k, v: [slots, Hk, S, D]; lo, hi: [B * T]; out: [B, T, H, D]. */
void attention_rows(const float *q, int q_stride, const float *k, const float *v,
                    const int64_t *slot, const int32_t *lo, const int32_t *hi, float *out,
                    int B, int T, int H, int Hk, int S, int D, float scale, int threads) {
  int group = H / Hk, n = B * T * H;
  vi lane;
  for (int i = 0; i < VL; i++) lane[i] = i;
#pragma omp parallel num_threads(threads)
  {
    float *p = malloc(sizeof(float) * ((size_t)S + VL));
    vf *acc = aligned_alloc(sizeof(vf), sizeof(vf) * (size_t)(D / VL + 1));
#pragma omp for schedule(static)
    for (int i = 0; i < n; i++) {
      int h = i % H, bt = i / H, b = bt / T;
      size_t head = ((size_t)slot[b] * Hk + h / group) * S;
      const float *qi = q + (size_t)bt * q_stride + (size_t)h * D, *ks = k + head * D,
                  *vs = v + head * D;
      int j0 = lo[bt], j1 = hi[bt];
      float top = -INFINITY;
      for (int j = j0; j < j1; j++) {
        p[j] = dot(qi, ks + (size_t)j * D, D) * scale;
        top = p[j] > top ? p[j] : top;
      }
      /* exp in blocks of VL keys from j0; lanes past j1 are computed and left out */
      vf sums = (vf){0};
      for (int j = j0; j < j1; j += VL) {
        vf e = vexp(load(p + j) - top);
        e = blend(lane < j1 - j, e, (vf){0});
        store(p + j, e);
        sums += e;
      }
      float total = hsum(sums);
      int dv = D / VL;
      for (int c = 0; c < dv; c++) acc[c] = (vf){0};
      float *o = out + (size_t)i * D;
      for (int d = dv * VL; d < D; d++) o[d] = 0.0f;
      for (int j = j0; j < j1; j++) {
        const float *vj = vs + (size_t)j * D;
        for (int c = 0; c < dv; c++) acc[c] += p[j] * load(vj + c * VL);
        for (int d = dv * VL; d < D; d++) o[d] += p[j] * vj[d];
      }
      for (int c = 0; c < dv; c++) store(o + c * VL, acc[c] / total);
      for (int d = dv * VL; d < D; d++) o[d] /= total;
    }
    free(acc);
    free(p);
  }
}

/* out[m] = weight * x[m] / sqrt(mean(x[m]^2) + eps) for M rows of n floats. */
void rms_norm_rows(const float *x, const float *weight, float *out, int M, int n, float eps,
                   int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if (M > 1)
  for (int m = 0; m < M; m++) {
    const float *xm = x + (size_t)m * n;
    float *om = out + (size_t)m * n;
    float r = 1.0f / sqrtf(dot(xm, xm, n) / (float)n + eps);
    for (int i = 0; i < n; i++) om[i] = weight[i] * (xm[i] * r);
  }
}

/* out[m] = silu(gate_up[m, :n]) * gate_up[m, n:] for M rows of 2n floats. */
void silu_mul_rows(const float *gate_up, float *out, int M, int n, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int m = 0; m < M; m++) {
    const float *g = gate_up + (size_t)m * 2 * n, *u = g + n;
    float *o = out + (size_t)m * n;
    for (int i = 0; i < n; i++) o[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
  }
}

/* The fused projection's rows [q heads | k heads | v heads] (H + 2 Hk heads of D floats per
   token, B * T tokens): rotate-half RoPE on the q and k heads in place (cos, sin: [B * T, D]),
   then the k and v heads of each row's first lens[b] tokens stored at (slot[b], head,
   start[b] + t) of the cache storage [slots, Hk, S, D]. */
void rope_and_store(float *qkv, const float *cos, const float *sin, float *k_cache,
                    float *v_cache, const int64_t *slot, const int32_t *start,
                    const int32_t *lens, int B, int T, int H, int Hk, int S, int D,
                    int threads) {
  int heads = H + 2 * Hk, half = D / 2;
#pragma omp parallel for schedule(static) num_threads(threads) if (B * T > 1)
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
      size_t at = (((size_t)slot[b] * Hk + h) * S + pos) * D;
      __builtin_memcpy(k_cache + at, row + (size_t)(H + h) * D, sizeof(float) * D);
      __builtin_memcpy(v_cache + at, row + (size_t)(H + Hk + h) * D, sizeof(float) * D);
    }
  }
}
