// Paged prefill attention for the CPU, flash-style: compiled into the same extension as cpu_attention.cpp (loaded by
// kernels/cpu_paged_attention.py; the dispatch is kernels/prefill_attention.py and shared/model/attention.py, whose
// SDPA path is the fallback; tests/unit/test_prefill_attention.py checks this against a float64 softmax).
//
// Every prefill chunk of a step in one call: a task is (chunk, kv head, tile of query positions) and takes all G
// query heads of its kv head, so each K/V row read from the paged cache (in place, through the block table) serves
// G x positions query rows. Keys are visited in tiles of KT positions aligned to absolute positions, with an online
// softmax (running max m, sum l, output O rescaled when m grows); only the keys some row of the task can see are
// read (a sliding window skips the rest). Scores, softmax and the output accumulate in float32; bfloat16 storage on
// a CPU with AVX512_BF16 multiplies bfloat16 pairs natively (kBf16Dot), and in bfloat16 the softmax weights are
// rounded before they meet V, as in torch's flash kernel. A second entry serves cascade decode's shared prefix
// (paged_prefix_attention: rows of many sequences over one prefix, unmasked, with the log-sum-exp).
//
// Invariant: a query row's result depends only on its position and the keys it sees, never on how the prompt was
// chunked, which rows share its task, or how many tiles the task visits — tiles a row cannot see are skipped for
// it, keys it cannot see weigh exactly 0 — so chunked prefill, a prefix-cache hit and one-shot prefill give
// bit-identical attention outputs.

#include <algorithm>
#include <array>
#include <atomic>
#include <limits>

namespace prefill {

constexpr int64_t KT = 64;  // keys per tile (four 16-float vectors)
constexpr int64_t RB = 4;   // query rows per micro-kernel block
typedef float v16 __attribute__((vector_size(64)));
typedef int32_t vi16 __attribute__((vector_size(64)));
static const vi16 kLanes = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};

static inline v16 load16(const float* p) { v16 x; std::memcpy(&x, p, sizeof x); return x; }
static inline void store16(float* p, v16 x) { std::memcpy(p, &x, sizeof x); }

// S[r][0..KT) = Q[r] . Kt[:, 0..KT) for RB rows: Q [RB][D] row-major, Kt [D][KT] (keys transposed).
static inline void qk_block(const float* __restrict Q, int64_t D, const float* __restrict Kt, float* __restrict S) {
  v16 a[RB][4] = {};
  for (int64_t d = 0; d < D; ++d) {
    const float* k = Kt + d * KT;
    const v16 k0 = load16(k), k1 = load16(k + 16), k2 = load16(k + 32), k3 = load16(k + 48);
    for (int64_t r = 0; r < RB; ++r) {
      const float q = Q[r * D + d];
      a[r][0] += q * k0; a[r][1] += q * k1; a[r][2] += q * k2; a[r][3] += q * k3;
    }
  }
  for (int64_t r = 0; r < RB; ++r)
    for (int64_t v = 0; v < 4; ++v) store16(S + r * KT + v * 16, a[r][v]);
}

// O[r][0..16 NV) += sum_j P[r][j] Vf[j][0..16 NV) for RB rows and nk keys: P [RB][KT], Vf [KT][D], O [RB][D]
// (both already offset to the 16 NV-wide slice of D).
template <int NV>
static inline void pv_block(const float* __restrict P, const float* __restrict Vf, int64_t D, int64_t nk,
                            float* __restrict O) {
  v16 a[RB][NV];
  for (int64_t r = 0; r < RB; ++r)
    for (int v = 0; v < NV; ++v) a[r][v] = load16(O + r * D + v * 16);
  for (int64_t j = 0; j < nk; ++j) {
    v16 x[NV];
    for (int v = 0; v < NV; ++v) x[v] = load16(Vf + j * D + v * 16);
    for (int64_t r = 0; r < RB; ++r) {
      const float p = P[r * KT + j];
      for (int v = 0; v < NV; ++v) a[r][v] += p * x[v];
    }
  }
  for (int64_t r = 0; r < RB; ++r)
    for (int v = 0; v < NV; ++v) store16(O + r * D + v * 16, a[r][v]);
}

static void pv_rows(const float* P, const float* Vf, int64_t D, int64_t nk, float* O) {
  int64_t d = 0;
  for (; d + 64 <= D; d += 64) pv_block<4>(P, Vf + d, D, nk, O + d);
  switch ((D - d) / 16) {
    case 3: pv_block<3>(P, Vf + d, D, nk, O + d); break;
    case 2: pv_block<2>(P, Vf + d, D, nk, O + d); break;
    case 1: pv_block<1>(P, Vf + d, D, nk, O + d); break;
    default: break;
  }
}

#if defined(__AVX512BF16__)
#include <immintrin.h>
// bfloat16 storage on CPUs with native bfloat16 dot products (AVX512_BF16, also every AMX CPU): VDPBF16PS adds
// the products of 16 pairs of bfloat16 to 16 float32 lanes, twice the float32 FMA's multiply-adds per
// instruction. Operands go in as 32-bit words holding a pair: K as pairs of dims per key (Kp [D/2][KT]), V as
// pairs of keys per dim (Vp [KT/2][D]), the rounded weights P as pairs of keys per row (Pw [RB][KT/2]).
constexpr bool kBf16Dot = true;

static inline uint16_t bf16_bits(at::BFloat16 x) { return x.x; }

// S[r][0..KT) = Q[r] . K[0..KT) for RB rows from Qw [RB][D/2] and Kp [D/2][KT].
static inline void qk_block_bf16(const uint32_t* __restrict Qw, int64_t D2, const uint32_t* __restrict Kp,
                                 float* __restrict S) {
  __m512 a[RB][4];
  for (int64_t r = 0; r < RB; ++r)
    for (int v = 0; v < 4; ++v) a[r][v] = _mm512_setzero_ps();
  for (int64_t p = 0; p < D2; ++p) {
    const uint32_t* k = Kp + p * KT;
    const __m512bh k0 = (__m512bh)_mm512_loadu_si512(k), k1 = (__m512bh)_mm512_loadu_si512(k + 16),
                   k2 = (__m512bh)_mm512_loadu_si512(k + 32), k3 = (__m512bh)_mm512_loadu_si512(k + 48);
    for (int64_t r = 0; r < RB; ++r) {
      const __m512bh q = (__m512bh)_mm512_set1_epi32(int(Qw[r * D2 + p]));
      a[r][0] = _mm512_dpbf16_ps(a[r][0], q, k0); a[r][1] = _mm512_dpbf16_ps(a[r][1], q, k1);
      a[r][2] = _mm512_dpbf16_ps(a[r][2], q, k2); a[r][3] = _mm512_dpbf16_ps(a[r][3], q, k3);
    }
  }
  for (int64_t r = 0; r < RB; ++r)
    for (int v = 0; v < 4; ++v) _mm512_storeu_ps(S + r * KT + v * 16, a[r][v]);
}

// O[r][0..16 NV) += P[r] . V for RB rows and np key pairs: Pw [RB][KT/2], Vp [KT/2][D], O [RB][D] (slices of D).
template <int NV>
static inline void pv_block_bf16(const uint32_t* __restrict Pw, const uint32_t* __restrict Vp, int64_t D, int64_t np,
                                 float* __restrict O) {
  __m512 a[RB][NV];
  for (int64_t r = 0; r < RB; ++r)
    for (int v = 0; v < NV; ++v) a[r][v] = _mm512_loadu_ps(O + r * D + v * 16);
  for (int64_t j = 0; j < np; ++j) {
    __m512bh x[NV];
    for (int v = 0; v < NV; ++v) x[v] = (__m512bh)_mm512_loadu_si512(Vp + j * D + v * 16);
    for (int64_t r = 0; r < RB; ++r) {
      const __m512bh p = (__m512bh)_mm512_set1_epi32(int(Pw[r * (KT / 2) + j]));
      for (int v = 0; v < NV; ++v) a[r][v] = _mm512_dpbf16_ps(a[r][v], p, x[v]);
    }
  }
  for (int64_t r = 0; r < RB; ++r)
    for (int v = 0; v < NV; ++v) _mm512_storeu_ps(O + r * D + v * 16, a[r][v]);
}

static void pv_rows_bf16(const uint32_t* Pw, const uint32_t* Vp, int64_t D, int64_t np, float* O) {
  int64_t d = 0;
  for (; d + 64 <= D; d += 64) pv_block_bf16<4>(Pw, Vp + d, D, np, O + d);
  switch ((D - d) / 16) {
    case 3: pv_block_bf16<3>(Pw, Vp + d, D, np, O + d); break;
    case 2: pv_block_bf16<2>(Pw, Vp + d, D, np, O + d); break;
    case 1: pv_block_bf16<1>(Pw, Vp + d, D, np, O + d); break;
    default: break;
  }
}

// One row of KT softmax weights (float32) as KT/2 words of two bfloat16, rounded to nearest even: bfloat16 element
// j of the row is key j's weight, so word w holds keys 2w (low half) and 2w + 1.
static inline void pack_weights_bf16(const float* __restrict s, uint32_t* __restrict w) {
  for (int64_t v = 0; v < KT; v += 32)
    _mm512_storeu_si512(w + v / 2, (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(s + v + 16), _mm512_loadu_ps(s + v)));
}
#else
// Without native bfloat16 dot products the float32 path runs; these are never called (kBf16Dot is false).
constexpr bool kBf16Dot = false;
static inline uint16_t bf16_bits(at::BFloat16 x) { return x.x; }
static inline void qk_block_bf16(const uint32_t*, int64_t, const uint32_t*, float*) { TORCH_CHECK(false, "no bf16 dot"); }
static inline void pv_rows_bf16(const uint32_t*, const uint32_t*, int64_t, int64_t, float*) {
  TORCH_CHECK(false, "no bf16 dot");
}
static inline void pack_weights_bf16(const float*, uint32_t*) { TORCH_CHECK(false, "no bf16 dot"); }
#endif

struct Task {
  int64_t chunk, kh, q_begin, q_end, keys;  // batch rows [q_begin, q_end) of `chunk`, kv head kh; keys: its cost
};

// prefix (cascade decode's shared part): every row of chunk c sees exactly positions [0, ctx[c]) — no causal mask,
// no window — and the result goes to out_acc (float32, normalised) and lse (m + log l) instead of out.
template <typename T>
static void kernel(const T* q, const T* kc, const T* vc, T* out, float* out_acc, float* lse, const int64_t* starts,
                   const int64_t* ends, const int64_t* ctx, const int32_t* bt, int64_t C, int64_t MB, int64_t H,
                   int64_t KVH, int64_t D, int64_t BS, int64_t s0, int64_t s1, int64_t s2, float scale,
                   int64_t window, bool prefix) {
  const int64_t G = H / KVH;
  // Query positions per task: each task reads its keys' K/V once for all its rows, so as many rows as keep its
  // buffers in L2 (256 rows of 64 dims), halved while there are fewer than 4 tasks per thread.
  int64_t positions = 0;
  for (int64_t c = 0; c < C; ++c) positions += ends[c] - starts[c];
  const int64_t rows_wanted = std::max<int64_t>(RB, std::min<int64_t>(256, 32768 / D));
  int64_t QT = std::max<int64_t>(1, rows_wanted / G);
  while (QT > 1 && KVH * (positions / QT + C) < 4 * int64_t(at::get_num_threads())) QT /= 2;
  std::vector<Task> tasks;
  for (int64_t c = 0; c < C; ++c)
    for (int64_t b = starts[c]; b < ends[c]; b += QT) {
      const int64_t e = std::min(ends[c], b + QT);
      const int64_t last = prefix ? ctx[c] - 1 : ctx[c] - (ends[c] - e) - 1;  // the tile's last query's keys
      const int64_t keys = window > 0 ? std::min(last + 1, window + (e - b)) : last + 1;
      for (int64_t kh = 0; kh < KVH; ++kh) tasks.push_back({c, kh, b, e, keys});
    }
  // longest first, taken one by one from a shared counter: the threads finish together
  std::stable_sort(tasks.begin(), tasks.end(), [](const Task& a, const Task& b) { return a.keys > b.keys; });
  std::atomic<int64_t> next{0};
  const int64_t n_tasks = int64_t(tasks.size());
  at::parallel_for(0, std::min<int64_t>(at::get_num_threads(), n_tasks), 1, [&](int64_t, int64_t) {
    const int64_t R_max = ((QT * G + RB - 1) / RB) * RB;
    // the bfloat16-dot path's operands (see kBf16Dot): Q, K, V and P as 32-bit words of two bfloat16; the float32
    // path's: Qf, Kt (K transposed), Vf. Each path allocates only its own.
    constexpr bool dot = kBf16Dot && std::is_same_v<T, at::BFloat16>;
    const int64_t D2 = D / 2;
    std::vector<float> Qf(dot ? 0 : R_max * D), Kt(dot ? 0 : D * KT), Vf(dot ? 0 : KT * D);
    std::vector<float> O(R_max * D), S(R_max * KT), m(R_max), l(R_max);
    std::vector<int64_t> rpos(R_max);
    std::vector<uint32_t> Qw(dot ? R_max * D2 : 0), Kp(dot ? D2 * KT : 0), Vp(dot ? KT / 2 * D : 0),
        Pw(dot ? R_max * KT / 2 : 0);
    for (int64_t i; (i = next.fetch_add(1)) < n_tasks;) {
      const Task& t = tasks[i];
      const int64_t nq = t.q_end - t.q_begin, rows = nq * G, R = ((rows + RB - 1) / RB) * RB;
      // position of the tile's first query (prefix: every row's keys end at ctx - 1, as a query there would see)
      const int64_t pos0 = prefix ? ctx[t.chunk] - 1 : ctx[t.chunk] - (ends[t.chunk] - t.q_begin);
      const int32_t* table = bt + t.chunk * MB;
      if constexpr (dot) {
        std::fill(Qw.begin(), Qw.begin() + R * D2, 0u);
        for (int64_t qi = 0; qi < nq; ++qi)
          for (int64_t g = 0; g < G; ++g)  // a bfloat16 row read as words: dims 2p (low half) and 2p + 1
            std::memcpy(&Qw[(qi * G + g) * D2], q + ((t.q_begin + qi) * H + t.kh * G + g) * D, D * sizeof(T));
      } else {
        std::fill(Qf.begin(), Qf.begin() + R * D, 0.f);
        for (int64_t qi = 0; qi < nq; ++qi)
          for (int64_t g = 0; g < G; ++g) {
            const T* src = q + ((t.q_begin + qi) * H + t.kh * G + g) * D;
            float* dst = &Qf[(qi * G + g) * D];
            for (int64_t d = 0; d < D; ++d) dst[d] = float(src[d]);
          }
      }
      for (int64_t r = 0; r < R; ++r) rpos[r] = r < rows ? pos0 + (prefix ? 0 : r / G) : -1;
      std::fill(O.begin(), O.begin() + R * D, 0.f);
      std::fill(m.begin(), m.begin() + R, -std::numeric_limits<float>::infinity());
      std::fill(l.begin(), l.begin() + R, 0.f);
      const int64_t k_hi = prefix ? pos0 : pos0 + nq - 1, k_lo = window > 0 ? std::max<int64_t>(0, pos0 - window + 1) : 0;
      for (int64_t t0 = (k_lo / KT) * KT; t0 <= k_hi; t0 += KT) {
        const int64_t lo = std::max(t0, k_lo), hi = std::min(t0 + KT - 1, k_hi);  // keys read in this tile
        for (int64_t p = t0 + KT; p <= std::min(t0 + 2 * KT - 1, k_hi); ++p) {  // the next tile's rows, ahead
          const int64_t off = int64_t(table[p / BS]) * s0 + (p % BS) * s1 + t.kh * s2;
          for (int64_t b = 0; b < D * int64_t(sizeof(T)); b += 64) {
            __builtin_prefetch(reinterpret_cast<const char*>(kc + off) + b);
            __builtin_prefetch(reinterpret_cast<const char*>(vc + off) + b);
          }
        }
        if constexpr (dot) {  // Kp[p][j]: key j's dims 2p, 2p + 1; Vp[j/2][d]: dim d of keys j, j + 1 (even j)
          std::fill(Kp.begin(), Kp.end(), 0u);
          std::fill(Vp.begin(), Vp.end(), 0u);
          uint16_t* v16p = reinterpret_cast<uint16_t*>(Vp.data());
          for (int64_t p = lo; p <= hi; ++p) {
            const int64_t j = p - t0, off = int64_t(table[p / BS]) * s0 + (p % BS) * s1 + t.kh * s2;
            uint32_t kw[256];
            std::memcpy(kw, kc + off, D * sizeof(T));
            for (int64_t w = 0; w < D2; ++w) Kp[w * KT + j] = kw[w];
            const T* vr = vc + off;
            uint16_t* vd = v16p + (j / 2) * D * 2 + (j % 2);
            for (int64_t d = 0; d < D; ++d) vd[2 * d] = bf16_bits(vr[d]);
          }
        } else for (int64_t j = 0; j < KT; ++j) {  // K transposed, V as rows; keys outside [lo, hi] zero (never NaN)
          const int64_t p = t0 + j;
          if (p < lo || p > hi) {
            for (int64_t d = 0; d < D; ++d) Kt[d * KT + j] = 0.f;
            std::fill(&Vf[j * D], &Vf[j * D] + D, 0.f);
            continue;
          }
          const int64_t off = int64_t(table[p / BS]) * s0 + (p % BS) * s1 + t.kh * s2;
          const T* kr = kc + off;
          const T* vr = vc + off;
          for (int64_t d = 0; d < D; ++d) Kt[d * KT + j] = float(kr[d]);
          float* vd = &Vf[j * D];
          for (int64_t d = 0; d < D; ++d) vd[d] = float(vr[d]);
        }
        for (int64_t r = 0; r < R; r += RB) {
          if constexpr (dot) qk_block_bf16(&Qw[r * D2], D2, Kp.data(), &S[r * KT]);
          else qk_block(&Qf[r * D], D, Kt.data(), &S[r * KT]);
        }
        for (int64_t r = 0; r < R; ++r) {
          float* s = &S[r * KT];
          const int64_t p = rpos[r];
          const int64_t a = std::max(lo, window > 0 ? p - window + 1 : lo) - t0, b = std::min(hi, p) - t0;
          if (p < 0 || a > b) {  // the row sees nothing here: weight 0, its state untouched
            std::fill(s, s + KT, 0.f);
            continue;
          }
          // scores outside [a, b] to -inf, then their max, four vectors at a time
          const float ninf = -std::numeric_limits<float>::infinity();
          v16 mx = ninf - v16{};
          for (int64_t v = 0; v < KT / 16; ++v) {
            const vi16 j = kLanes + int32_t(v * 16);
            const v16 x = load16(s + v * 16) * scale;
            const v16 y = (j >= int32_t(a)) & (j <= int32_t(b)) ? x : ninf - v16{};
            store16(s + v * 16, y);
            mx = mx > y ? mx : y;
          }
          float mt = mx[0];
          for (int i = 1; i < 16; ++i) mt = std::max(mt, mx[i]);
          const float m_new = std::max(m[r], mt);
          float sum = 0.f;
#pragma omp simd reduction(+ : sum)
          for (int64_t j = 0; j < KT; ++j) {
            const float e = (j >= a && j <= b) ? exp_nonpositive(s[j] - m_new) : 0.f;
            // bfloat16: the weights meet V rounded (here, or when packed for the dot products), as in torch's
            // flash kernel; the sum is not
            s[j] = dot ? e : rnd<T>(e);
            sum += e;
          }
          if (m_new > m[r]) {
            const float corr = exp_nonpositive(m[r] - m_new);  // m = -inf: 0 (clamped argument), O and l are 0
            l[r] *= corr;
            float* o = &O[r * D];
            for (int64_t d = 0; d < D; ++d) o[d] *= corr;
            m[r] = m_new;
          }
          l[r] += sum;
        }
        const int64_t nk = hi - t0 + 1;
        if constexpr (dot) {
          for (int64_t r = 0; r < R; ++r) pack_weights_bf16(&S[r * KT], &Pw[r * (KT / 2)]);
          for (int64_t r = 0; r < R; r += RB) pv_rows_bf16(&Pw[r * (KT / 2)], Vp.data(), D, (nk + 1) / 2, &O[r * D]);
        } else {
          for (int64_t r = 0; r < R; r += RB) pv_rows(&S[r * KT], Vf.data(), D, nk, &O[r * D]);
        }
      }
      for (int64_t qi = 0; qi < nq; ++qi)
        for (int64_t g = 0; g < G; ++g) {
          const int64_t r = qi * G + g;
          const float inv = 1.f / l[r];
          const int64_t row = (t.q_begin + qi) * H + t.kh * G + g;
          if (prefix) {
            for (int64_t d = 0; d < D; ++d) out_acc[row * D + d] = O[r * D + d] * inv;
            lse[row] = m[r] + std::log(l[r]);
          } else {
            for (int64_t d = 0; d < D; ++d) out[row * D + d] = T(O[r * D + d] * inv);
          }
        }
    }
  });
}

}  // namespace prefill

// Checks shared by both entries; returns (H, D, BS, KVH, MB).
static std::array<int64_t, 5> check_chunks(const torch::Tensor& q, const torch::Tensor& k_cache,
                                           const torch::Tensor& v_cache, const torch::Tensor& starts,
                                           const torch::Tensor& ends, const torch::Tensor& ctx,
                                           const torch::Tensor& block_tables, bool prefix) {
  TORCH_CHECK(q.device().is_cpu() && q.dim() == 3 && k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes(),
              "q [T,H,D] on the CPU, caches [NB,BS,KVH,D]");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && q.scalar_type() == v_cache.scalar_type() &&
              (q.scalar_type() == torch::kFloat || q.scalar_type() == torch::kBFloat16),
              "paged prefill attention takes float32 or bfloat16 q and caches, one dtype");
  TORCH_CHECK(q.is_contiguous() && k_cache.stride(3) == 1 && k_cache.strides() == v_cache.strides(),
              "q contiguous, cache rows contiguous");
  const int64_t H = q.size(1), D = q.size(2), BS = k_cache.size(1), KVH = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == D && H % KVH == 0 && D % 16 == 0 && D <= 512,
              "head dim a multiple of 16 up to 512, H % KVH == 0");
  TORCH_CHECK(starts.scalar_type() == torch::kLong && ends.scalar_type() == torch::kLong &&
              ctx.scalar_type() == torch::kLong && block_tables.scalar_type() == torch::kInt &&
              starts.is_contiguous() && ends.is_contiguous() && ctx.is_contiguous() && block_tables.is_contiguous(),
              "starts/ends/ctx int64, block_tables int32, contiguous");
  const int64_t C = starts.numel(), MB = block_tables.size(1);
  TORCH_CHECK(ends.numel() == C && ctx.numel() == C && block_tables.dim() == 2 && block_tables.size(0) == C,
              "one start, end, context length and block-table row per chunk");
  const int64_t *sp = starts.data_ptr<int64_t>(), *ep = ends.data_ptr<int64_t>(), *cp = ctx.data_ptr<int64_t>();
  const int32_t* btp = block_tables.data_ptr<int32_t>();
  for (int64_t c = 0; c < C; ++c) {
    TORCH_CHECK(0 <= sp[c] && sp[c] < ep[c] && ep[c] <= q.size(0) && cp[c] >= 1 && (prefix || ep[c] - sp[c] <= cp[c])
                && (cp[c] + BS - 1) / BS <= MB, "chunk ", c, ": rows within q, no more rows than its context");
    for (int64_t b = 0; b < (cp[c] + BS - 1) / BS; ++b)
      TORCH_CHECK(0 <= btp[c * MB + b] && btp[c * MB + b] < k_cache.size(0), "chunk ", c, ": block id out of range");
  }
  return {H, D, BS, KVH, MB};
}

#define DEEPINFER_PREFILL(T, OUT, ACC, LSE, PREFIX) prefill::kernel<T>(q.data_ptr<T>(), k_cache.data_ptr<T>(), \
      v_cache.data_ptr<T>(), OUT, ACC, LSE, starts.data_ptr<int64_t>(), ends.data_ptr<int64_t>(), \
      ctx.data_ptr<int64_t>(), block_tables.data_ptr<int32_t>(), starts.numel(), MB, H, KVH, D, BS, \
      k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), float(scale), window, PREFIX)

// q [T,H,D] (rows contiguous) over k_cache/v_cache [NB,BS,KVH,D] (strided views, rows contiguous; the chunks' own
// K/V already stored); chunk c is batch rows [starts[c], ends[c]) at positions ending at ctx[c] - 1, its blocks
// block_tables[c] (int32 [C, MB]). Writes those rows of out [T,H,D] (q's dtype); other rows are left alone.
// window 0: causal only; W > 0: position j visible from p iff j <= p and p - j < W.
void paged_prefill_(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor out,
                    torch::Tensor starts, torch::Tensor ends, torch::Tensor ctx, torch::Tensor block_tables,
                    double scale, int64_t window) {
  const auto [H, D, BS, KVH, MB] = check_chunks(q, k_cache, v_cache, starts, ends, ctx, block_tables, false);
  TORCH_CHECK(out.sizes() == q.sizes() && out.scalar_type() == q.scalar_type() && out.is_contiguous(),
              "out: q's shape and dtype, contiguous");
  TORCH_CHECK(window >= 0, "window >= 0");
  if (q.scalar_type() == torch::kBFloat16) DEEPINFER_PREFILL(at::BFloat16, out.data_ptr<at::BFloat16>(), nullptr, nullptr, false);
  else DEEPINFER_PREFILL(float, out.data_ptr<float>(), nullptr, nullptr, false);
}

// Cascade decode's shared part: rows [starts[c], ends[c]) of q (decode queries of different sequences) all attend
// positions [0, ctx[c]) of block_tables[c], unmasked. Returns (out [T,H,D] float32, lse [T,H] float32) —
// normalised attention and its log-sum-exp, the accumulator's dtype, for paged_decode's merge; rows outside every
// chunk are zero.
std::vector<torch::Tensor> paged_prefix_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                                  torch::Tensor starts, torch::Tensor ends, torch::Tensor ctx,
                                                  torch::Tensor block_tables, double scale) {
  const auto [H, D, BS, KVH, MB] = check_chunks(q, k_cache, v_cache, starts, ends, ctx, block_tables, true);
  auto acc = torch::zeros(q.sizes(), q.options().dtype(torch::kFloat));
  auto lse = torch::zeros({q.size(0), H}, q.options().dtype(torch::kFloat));
  const int64_t window = 0;
  if (q.scalar_type() == torch::kBFloat16)
    DEEPINFER_PREFILL(at::BFloat16, nullptr, acc.data_ptr<float>(), lse.data_ptr<float>(), true);
  else DEEPINFER_PREFILL(float, nullptr, acc.data_ptr<float>(), lse.data_ptr<float>(), true);
  return {acc, lse};
}
#undef DEEPINFER_PREFILL
