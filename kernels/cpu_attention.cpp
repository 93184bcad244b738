// Paged decode attention and the KV store for the CPU: compiled and loaded by kernels/cpu_paged_attention.py
// (torch extension, -march=native). Shapes and invariants: kernels/paged_attention.py, cascade_attention.py.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

// exp(x) for the softmax (x <= 0): Cephes' expf polynomial after an exact two-constant ln2 reduction, 2^n built
// from the exponent bits. Branch- and call-free, so the softmax loop vectorises (scalar expf calls were the
// largest part of decode attention over long contexts); relative error ~2 ulp. x below -87 gives ~1e-38
// (expf: a denormal or 0): weights that small vanish in the sum either way.
static inline float exp_nonpositive(float x) {
  x = x < -87.0f ? -87.0f : x;
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  float r = x - n * 0.693359375f;
  r = r + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float y = p * r * r + r + 1.0f;
  const int32_t bits = (int32_t(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return y * scale;
}

template <typename A>
static inline A softmax_exp(A x) {
  if constexpr (std::is_same_v<A, float>) return exp_nonpositive(x);
  else return std::exp(x);  // float64 (exactness runs): the libm exp
}

// Ask for the next block's rows of one kv head while the current block is being read: blocks sit anywhere in
// the cache, and hardware prefetchers stop at page boundaries (a block of one head is one 4 KiB page here).
template <typename T>
static inline void prefetch_block(const T* rows, int64_t n, int64_t stride, int64_t D) {
  for (int64_t r = 0; r < n; ++r)
    for (int64_t off = 0; off < D * int64_t(sizeof(T)); off += 64)
      __builtin_prefetch(reinterpret_cast<const char*>(rows + r * stride) + off);
}

template <typename T, typename A, int DC>
static void decode_kernel(const T* q, const T* kc, const T* vc, const int32_t* bt, const int32_t* lens, T* out,
                          int64_t B, int64_t H, int64_t KVH, int64_t D, int64_t BS, int64_t MB,
                          int64_t s0, int64_t s1, int64_t s2, A scale, int64_t window,
                          const int32_t* starts, const A* prefix_out, const A* prefix_lse) {
  const int64_t G = H / KVH;
  if (DC > 0) D = DC;  // compile-time head dim: lets the compiler fully vectorise the dot products
  at::parallel_for(0, B * KVH, 1, [&](int64_t begin, int64_t end) {
    std::vector<A> scores, acc(G * D), qf(G * D), lse(G);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / KVH, kh = task % KVH;
      const int64_t ctx = lens[b];
      // cascade rows (starts[b] > 0): positions before starts[b] were attended already (prefix_out, prefix_lse)
      const int64_t start = starts ? int64_t(starts[b]) : 0;
      const int64_t first = std::max<int64_t>(window > 0 ? std::max<int64_t>(0, ctx - window) : 0, start);
      const int64_t n = ctx - first;
      scores.assign(G * n, A(0));
      for (int64_t g = 0; g < G; ++g)
        for (int64_t d = 0; d < D; ++d) qf[g * D + d] = A(q[(b * H + kh * G + g) * D + d]) * scale;
      // block by block (no per-token division); within a block, one head's query stays in registers
      for (int64_t blk = first / BS; blk * BS < ctx; ++blk) {
        const T* kb = kc + int64_t(bt[b * MB + blk]) * s0 + kh * s2;
        const int64_t t0 = std::max(first, blk * BS), t1 = std::min(ctx, (blk + 1) * BS);
        if ((blk + 1) * BS < ctx)
          prefetch_block(kc + int64_t(bt[b * MB + blk + 1]) * s0 + kh * s2, std::min(BS, ctx - (blk + 1) * BS), s1, D);
        for (int64_t g = 0; g < G; ++g) {
          const A* qg = &qf[g * D];
          A* sg = &scores[g * n];
          int64_t t = t0;
          for (; t + 4 <= t1; t += 4) {  // four rows at once: four independent sums, each query load used 4x
            const T *k0 = kb + (t - blk * BS) * s1, *k1 = k0 + s1, *k2 = k1 + s1, *k3 = k2 + s1;
            A a0 = 0, a1 = 0, a2 = 0, a3 = 0;
#pragma omp simd reduction(+ : a0, a1, a2, a3)
            for (int64_t d = 0; d < D; ++d) {
              const A qd = qg[d];
              a0 += qd * A(k0[d]); a1 += qd * A(k1[d]); a2 += qd * A(k2[d]); a3 += qd * A(k3[d]);
            }
            sg[t - first] = a0; sg[t + 1 - first] = a1; sg[t + 2 - first] = a2; sg[t + 3 - first] = a3;
          }
          for (; t < t1; ++t) {
            const T* k = kb + (t - blk * BS) * s1;
            A s = 0;
#pragma omp simd reduction(+ : s)
            for (int64_t d = 0; d < D; ++d) s += qg[d] * A(k[d]);
            sg[t - first] = s;
          }
        }
      }
      std::fill(acc.begin(), acc.end(), A(0));
      for (int64_t g = 0; g < G; ++g) {
        A* sg = &scores[g * n];
        A m = sg[0];
#pragma omp simd reduction(max : m)
        for (int64_t i = 1; i < n; ++i) m = std::max(m, sg[i]);
        A sum = 0;
#pragma omp simd reduction(+ : sum)
        for (int64_t i = 0; i < n; ++i) { sg[i] = softmax_exp(sg[i] - m); sum += sg[i]; }
        const A inv = A(1) / sum;
        for (int64_t i = 0; i < n; ++i) sg[i] *= inv;
        lse[g] = m + std::log(sum);
      }
      // one head at a time over the whole context: its D accumulators stay in registers (V rows come from L1/L2)
      for (int64_t g = 0; g < G; ++g) {
        const A* __restrict pg = &scores[g * n];
        A* __restrict ag = &acc[g * D];
        for (int64_t blk = first / BS; blk * BS < ctx; ++blk) {
          const T* __restrict vb = vc + int64_t(bt[b * MB + blk]) * s0 + kh * s2;
          const int64_t t0 = std::max(first, blk * BS), t1 = std::min(ctx, (blk + 1) * BS);
          if (g == 0 && (blk + 1) * BS < ctx)
            prefetch_block(vc + int64_t(bt[b * MB + blk + 1]) * s0 + kh * s2, std::min(BS, ctx - (blk + 1) * BS), s1, D);
          int64_t t = t0;
          for (; t + 4 <= t1; t += 4) {  // four rows per pass over the accumulators: a quarter of their traffic
            const T *__restrict v0 = vb + (t - blk * BS) * s1, *__restrict v1 = v0 + s1, *__restrict v2 = v1 + s1,
                    *__restrict v3 = v2 + s1;
            const A p0 = pg[t - first], p1 = pg[t + 1 - first], p2 = pg[t + 2 - first], p3 = pg[t + 3 - first];
#pragma omp simd
            for (int64_t d = 0; d < D; ++d) ag[d] += (p0 * A(v0[d]) + p1 * A(v1[d])) + (p2 * A(v2[d]) + p3 * A(v3[d]));
          }
          for (; t < t1; ++t) {
            const T* __restrict v = vb + (t - blk * BS) * s1;
            const A p = pg[t - first];
#pragma omp simd
            for (int64_t d = 0; d < D; ++d) ag[d] += p * A(v[d]);
          }
        }
      }
      for (int64_t g = 0; g < G; ++g) {
        const int64_t row = b * H + kh * G + g;
        if (start > 0) {  // merge with the prefix part by log-sum-exp: softmax over both parts at once
          const A lp = A(prefix_lse[row]), big = std::max(lp, lse[g]);
          const A wp = std::exp(lp - big), ws = std::exp(lse[g] - big), inv = A(1) / (wp + ws);
          for (int64_t d = 0; d < D; ++d) out[row * D + d] = T((wp * A(prefix_out[row * D + d]) + ws * acc[g * D + d]) * inv);
        } else {
          for (int64_t d = 0; d < D; ++d) out[row * D + d] = T(acc[g * D + d]);
        }
      }
    }
  });
}

// starts [B] int32 (empty: none): row b attends positions [starts[b], ctx) and merges the result with
// prefix_out [B,H,D] / prefix_lse [B,H] (attention over positions [0, starts[b]) and its log-sum-exp), rows
// with starts[b] == 0 ignore them. Requires starts[b] < ctx and no sliding window on cascade rows. prefix_out and
// prefix_lse are in the accumulator's dtype (float32 for bfloat16 q), so the merge rounds to q's dtype once.
// key/value [T,KVH,D] into k_cache/v_cache [NB,BS,KVH,D] (strided views, rows contiguous) at slots [T] int64
// (slot = block * BS + offset; -1: padding, skipped). Same dtype on both sides.
void store_kv(torch::Tensor key, torch::Tensor value, torch::Tensor k_cache, torch::Tensor v_cache,
              torch::Tensor slots) {
  TORCH_CHECK(key.dim() == 3 && key.sizes() == value.sizes() && k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes()
              && key.size(1) == k_cache.size(2) && key.size(2) == k_cache.size(3) && slots.numel() == key.size(0),
              "key/value [T,KVH,D], caches [NB,BS,KVH,D], slots [T]");
  TORCH_CHECK(key.scalar_type() == k_cache.scalar_type() && value.scalar_type() == v_cache.scalar_type() &&
              key.stride(2) == 1 && value.stride(2) == 1 && k_cache.stride(3) == 1 && v_cache.stride(3) == 1,
              "same dtype on both sides, contiguous rows");
  auto s = slots.to(torch::kLong).contiguous();
  const int64_t T = key.size(0), KVH = key.size(1), D = key.size(2), BS = k_cache.size(1);
  const int64_t capacity = k_cache.size(0) * BS;
  const int64_t* sp = s.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) TORCH_CHECK(sp[t] >= -1 && sp[t] < capacity, "slot out of range: ", sp[t]);
  const int64_t bytes = D * key.element_size();
  auto copy = [&](const torch::Tensor& src, torch::Tensor& dst) {
    const char* sb = static_cast<const char*>(src.data_ptr());
    char* db = static_cast<char*>(dst.data_ptr());
    const int64_t es = src.element_size();
    for (int64_t t = 0; t < T; ++t) {
      if (sp[t] < 0) continue;
      const int64_t blk = sp[t] / BS, off = sp[t] % BS;
      for (int64_t h = 0; h < KVH; ++h)
        std::memcpy(db + (blk * dst.stride(0) + off * dst.stride(1) + h * dst.stride(2)) * es,
                    sb + (t * src.stride(0) + h * src.stride(1)) * es, bytes);
    }
  };
  copy(key, k_cache);
  copy(value, v_cache);
}

torch::Tensor paged_decode(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                           torch::Tensor block_tables, torch::Tensor context_lens, double scale, int64_t window,
                           torch::Tensor starts, torch::Tensor prefix_out, torch::Tensor prefix_lse) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4, "q [B,H,D], k_cache [NB,BS,KVH,D]");
  TORCH_CHECK(k_cache.stride(3) == 1 && k_cache.strides() == v_cache.strides(), "cache rows must be contiguous");
  q = q.contiguous();
  auto bt = block_tables.to(torch::kInt32).contiguous();
  auto lens = context_lens.to(torch::kInt32).contiguous();
  auto out = torch::empty_like(q);
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2), BS = k_cache.size(1), KVH = k_cache.size(2);
  const bool cascade = starts.numel() > 0;
  if (cascade) {
    TORCH_CHECK(starts.numel() == B && prefix_out.sizes() == q.sizes() && prefix_lse.numel() == B * H &&
                prefix_out.scalar_type() == prefix_lse.scalar_type() &&
                prefix_out.scalar_type() == (q.scalar_type() == torch::kBFloat16 ? torch::kFloat : q.scalar_type()),
                "starts [B], prefix_out [B,H,D], prefix_lse [B,H] in the accumulator dtype (q's; float32 for bfloat16)");
    TORCH_CHECK(window == 0, "cascade rows take no sliding window");
    starts = starts.to(torch::kInt32).contiguous();
    for (int64_t b = 0; b < B; ++b)
      TORCH_CHECK(starts.data_ptr<int32_t>()[b] >= 0 && starts.data_ptr<int32_t>()[b] < lens.data_ptr<int32_t>()[b],
                  "a cascade row keeps at least its newest position: 0 <= starts[b] < context_lens[b]");
    prefix_out = prefix_out.contiguous();
    prefix_lse = prefix_lse.contiguous();
  }
// T: the stored dtype; A: the accumulator (bfloat16 rows are widened to float on load, results rounded once)
#define DEEPINFER_CALL(T, A, DC) decode_kernel<T, A, DC>(q.data_ptr<T>(), k_cache.data_ptr<T>(), \
      v_cache.data_ptr<T>(), bt.data_ptr<int32_t>(), lens.data_ptr<int32_t>(), out.data_ptr<T>(), B, H, KVH, D, BS, \
      bt.size(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), A(scale), window, \
      cascade ? starts.data_ptr<int32_t>() : nullptr, cascade ? prefix_out.data_ptr<A>() : nullptr, \
      cascade ? prefix_lse.data_ptr<A>() : nullptr)
  if (q.scalar_type() == torch::kDouble) {
    DEEPINFER_CALL(double, double, 0);
  } else if (q.scalar_type() == torch::kBFloat16) {
    if (D == 64) DEEPINFER_CALL(at::BFloat16, float, 64);
    else if (D == 128) DEEPINFER_CALL(at::BFloat16, float, 128);
    else DEEPINFER_CALL(at::BFloat16, float, 0);
  } else {
    TORCH_CHECK(q.scalar_type() == torch::kFloat, "cpu paged_decode supports float32, bfloat16 and float64");
    if (D == 64) DEEPINFER_CALL(float, float, 64);
    else if (D == 128) DEEPINFER_CALL(float, float, 128);
    else DEEPINFER_CALL(float, float, 0);
  }
  return out;
}
