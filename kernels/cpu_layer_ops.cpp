// The per-token ops between a decoder layer's matmuls, fused for the CPU: RMSNorm (alone and after the residual
// add), SiLU-gated product, and RoPE in place. Compiled into the same extension as cpu_attention.cpp (loaded by
// kernels/cpu_paged_attention.py); the torch references and the dispatch live in kernels/layer_ops.py.
// Each op reads its input once and writes its output once (torch runs 2-5 passes with temporaries each).
// Rows: the leading dimension, split over the engine's OpenMP threads; every row's last dimension is contiguous.
//
// Storage S and arithmetic A: float32 and float64 compute in their own type; bfloat16 loads widen to float and
// every intermediate the torch reference rounds to bfloat16 is rounded here too (rnd<S>: the identity for float
// and double), so a bfloat16 result equals torch's bfloat16 ops but for the norm's summation order and SiLU's exp.

// exp(-a) for a >= 0: exp_nonpositive from cpu_attention.cpp (the two sources compile as one unit, that one
// first) for float, libm for float64.
static inline float layer_exp_neg(float a) { return exp_nonpositive(-a); }
static inline double layer_exp_neg(double a) { return std::exp(-a); }

static inline int64_t row_grain(int64_t row_elems) { return std::max<int64_t>(1, 8192 / std::max<int64_t>(1, row_elems)); }

// v rounded to the storage type and widened back: what torch does between two ops of a half-precision tensor.
template <typename S, typename A>
static inline A rnd(A v) { return static_cast<A>(static_cast<S>(v)); }

template <typename S, typename A>
static void rms_rows(const S* x, int64_t xs, S* __restrict out, int64_t os, const S* __restrict w, int64_t N, A eps,
                     int64_t begin, int64_t end) {
  for (int64_t t = begin; t < end; ++t) {
    const S* __restrict xr = x + t * xs;
    A ss = 0;
    for (int64_t i = 0; i < N; ++i) { const A v = static_cast<A>(xr[i]); ss += v * v; }
    const A inv = A(1) / std::sqrt(ss / A(N) + eps);
    S* __restrict o = out + t * os;
    for (int64_t i = 0; i < N; ++i) o[i] = static_cast<S>(rnd<S>(static_cast<A>(xr[i]) * inv) * static_cast<A>(w[i]));
  }
}

template <typename S, typename A>
static void add_rows(S* __restrict h, const S* __restrict d, int64_t ds, int64_t N, int64_t begin, int64_t end) {
  for (int64_t t = begin; t < end; ++t) {
    S* __restrict hr = h + t * N;
    const S* __restrict dr = d + t * ds;
    for (int64_t i = 0; i < N; ++i) hr[i] = static_cast<S>(static_cast<A>(hr[i]) + static_cast<A>(dr[i]));
  }
}

// silu(g)·u per element: silu(g) = g / (1 + exp(-g)), taken as (g < 0 ? g·e : g) / (1 + e) with e = exp(-|g|),
// so the exponential never overflows.
template <typename S, typename A>
static void silu_mul_rows(const S* gu, int64_t rs, S* __restrict out, int64_t F, int64_t begin, int64_t end) {
  for (int64_t t = begin; t < end; ++t) {
    const S* __restrict g = gu + t * rs;
    const S* __restrict u = g + F;
    S* __restrict o = out + t * F;
    for (int64_t i = 0; i < F; ++i) {
      const A x = static_cast<A>(g[i]);
      const A e = layer_exp_neg(std::fabs(x));
      o[i] = static_cast<S>(rnd<S>((x < 0 ? x * e : x) / (A(1) + e)) * static_cast<A>(u[i]));
    }
  }
}

static inline bool on_cpu(std::initializer_list<const torch::Tensor*> ts) {
  for (auto* t : ts) if (!t->device().is_cpu()) return false;
  return true;
}

#define DEEPINFER_FLOATING(x, ...) \
  if ((x).scalar_type() == torch::kDouble) { using S = double; using A = double; __VA_ARGS__; } \
  else if ((x).scalar_type() == torch::kBFloat16) { using S = at::BFloat16; using A = float; __VA_ARGS__; } \
  else { TORCH_CHECK((x).scalar_type() == torch::kFloat, "float32, float64 or bfloat16"); using S = float; using A = float; __VA_ARGS__; }

// x [T, N] (rows contiguous), w [N] → x / sqrt(mean(x²) + eps) * w, [T, N] contiguous.
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor w, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && w.dim() == 1 && w.size(0) == x.size(1) && w.is_contiguous() &&
              w.scalar_type() == x.scalar_type() && on_cpu({&x, &w}), "x [T,N] with contiguous rows, w [N] of x's dtype, on CPU");
  auto out = torch::empty({x.size(0), x.size(1)}, x.options());
  const int64_t N = x.size(1);
  DEEPINFER_FLOATING(x, at::parallel_for(0, x.size(0), row_grain(N), [&](int64_t b, int64_t e) {
    rms_rows<S, A>(x.data_ptr<S>(), x.stride(0), out.data_ptr<S>(), N, w.data_ptr<S>(), N, A(eps), b, e);
  }));
  return out;
}

// h [T, N] += delta [T, N] (in place), then rms_norm(h, w, eps) as above. h contiguous.
torch::Tensor add_rms_norm_(torch::Tensor h, torch::Tensor delta, torch::Tensor w, double eps) {
  TORCH_CHECK(h.dim() == 2 && h.is_contiguous() && delta.sizes() == h.sizes() && delta.stride(1) == 1 &&
              w.dim() == 1 && w.size(0) == h.size(1) && w.is_contiguous() && w.scalar_type() == h.scalar_type() &&
              delta.scalar_type() == h.scalar_type() && on_cpu({&h, &delta, &w}),
              "h [T,N] contiguous, delta [T,N], w [N], one dtype, on CPU");
  const char* hb = static_cast<const char*>(h.data_ptr());
  const char* db = static_cast<const char*>(delta.data_ptr());
  TORCH_CHECK(h.numel() == 0 || hb + h.numel() * h.element_size() <= db ||
              db + ((delta.size(0) - 1) * delta.stride(0) + h.size(1)) * delta.element_size() <= hb,
              "delta must not overlap h");
  auto out = torch::empty_like(h);
  const int64_t N = h.size(1);
  const int64_t ds = delta.stride(0);
  DEEPINFER_FLOATING(h, at::parallel_for(0, h.size(0), row_grain(N), [&](int64_t b, int64_t e) {
    add_rows<S, A>(h.data_ptr<S>(), delta.data_ptr<S>(), ds, N, b, e);
    rms_rows<S, A>(h.data_ptr<S>(), N, out.data_ptr<S>(), N, w.data_ptr<S>(), N, A(eps), b, e);
  }));
  return out;
}

// gate_up [T, 2F] (gate then up, rows contiguous) → silu(gate) * up, [T, F].
torch::Tensor silu_mul(torch::Tensor gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.stride(1) == 1 && gate_up.size(1) % 2 == 0 && on_cpu({&gate_up}),
              "gate_up [T, 2F] with contiguous rows, on CPU");
  const int64_t F = gate_up.size(1) / 2, rs = gate_up.stride(0);
  auto out = torch::empty({gate_up.size(0), F}, gate_up.options());
  DEEPINFER_FLOATING(gate_up, at::parallel_for(0, gate_up.size(0), row_grain(2 * F), [&](int64_t b, int64_t e) {
    silu_mul_rows<S, A>(gate_up.data_ptr<S>(), rs, out.data_ptr<S>(), F, b, e);
  }));
  return out;
}

// x [T, heads, D] (a view: D contiguous; e.g. q and k side by side in the QKV output) rotated in place:
// x·cos + rotate_half(x)·sin with cos/sin [T, D] already indexed by position. Products and the sum are rounded
// separately (no fused multiply-add; in bfloat16 each rounded to bfloat16), as torch's reference computes them:
// the result is bit-identical.
template <typename S, typename A>
__attribute__((optimize("fp-contract=off")))
static void rope_rows(S* x, int64_t s0, int64_t s1, int64_t H, int64_t D, const S* cos, const S* sin, int64_t b,
                      int64_t e) {
  const int64_t half = D / 2;
  for (int64_t t = b; t < e; ++t) {
    const S* c = cos + t * D;
    const S* s = sin + t * D;
    for (int64_t h = 0; h < H; ++h) {
      S* r = x + t * s0 + h * s1;
      for (int64_t i = 0; i < half; ++i) {
        const A x1 = static_cast<A>(r[i]), x2 = static_cast<A>(r[i + half]);
        const A a = rnd<S>(x1 * static_cast<A>(c[i])), bb = rnd<S>(x2 * static_cast<A>(s[i]));
        const A cc = rnd<S>(x2 * static_cast<A>(c[i + half])), d = rnd<S>(x1 * static_cast<A>(s[i + half]));
        r[i] = static_cast<S>(a - bb);
        r[i + half] = static_cast<S>(cc + d);
      }
    }
  }
}

void rope_(torch::Tensor x, torch::Tensor cos, torch::Tensor sin) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.size(2) % 2 == 0 && cos.dim() == 2 && cos.sizes() == sin.sizes()
              && cos.size(0) == x.size(0) && cos.size(1) == x.size(2) && cos.is_contiguous() && sin.is_contiguous()
              && cos.scalar_type() == x.scalar_type() && sin.scalar_type() == x.scalar_type() && on_cpu({&x, &cos, &sin}),
              "x [T, heads, D] with contiguous D, cos/sin [T, D] contiguous, one dtype, on CPU");
  TORCH_CHECK(x.size(0) <= 1 || x.size(1) == 0 || x.stride(0) >= x.size(1) * x.stride(1), "rows of x must not overlap");
  TORCH_CHECK(x.size(1) <= 1 || x.stride(1) >= x.size(2), "heads of x must not overlap");
  const int64_t H = x.size(1), D = x.size(2);
  DEEPINFER_FLOATING(x, at::parallel_for(0, x.size(0), row_grain(H * D), [&](int64_t b, int64_t e) {
    rope_rows<S, A>(x.data_ptr<S>(), x.stride(0), x.stride(1), H, D, cos.data_ptr<S>(), sin.data_ptr<S>(), b, e);
  }));
}
