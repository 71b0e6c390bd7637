// harness::streaming_linear(x, weight, bias): x @ weight.T + bias for the few rows of a decode or
// verify step, computed so that each weight row is streamed from memory once for all input rows.
//
// A forward of M <= 64 rows is memory-bound: the weights are read once whatever M is, so a kernel
// that reads each weight row once and multiplies it into every input row costs about what the read
// costs until the arithmetic catches up (around 16 rows on two AVX-512 cores). The work is split
// over output features (blocks of NB weight rows, one thread per range of blocks, torch's own
// OpenMP pool); within a block, register tiles of up to MB input rows by NB weight rows hold one
// vector accumulator per output element, and the next block is prefetched into L2 while the first
// tile of the current one runs.
//
// Row invariance: every output element y[m, n] is reduced in the same order (one accumulator over
// k in steps of the vector width, a fixed horizontal sum, the scalar tail, then the bias), whatever
// M, the tile it fell in, or the number of threads. So a row's result does not depend on which
// other rows share the forward: a verify forward gives every row exactly the value a one-row step
// over the same input gives.
//
// More than 64 rows (a prefill) go to at::linear, and so does any other dtype or device.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>

#if defined(__AVX512F__)
#include <immintrin.h>
struct Vec {
  using T = __m512;
  static constexpr int width = 16;
  static T zero() { return _mm512_setzero_ps(); }
  static T load(const float* p) { return _mm512_loadu_ps(p); }
  static T fma(T a, T b, T c) { return _mm512_fmadd_ps(a, b, c); }
  static float sum(T v) {
    __m256 h = _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1));
    __m128 q = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
    q = _mm_add_ps(q, _mm_movehl_ps(q, q));
    return _mm_cvtss_f32(_mm_add_ss(q, _mm_movehdup_ps(q)));
  }
};
#define HARNESS_PREFETCH(p) _mm_prefetch(reinterpret_cast<const char*>(p), _MM_HINT_T1)
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
struct Vec {
  using T = __m256;
  static constexpr int width = 8;
  static T zero() { return _mm256_setzero_ps(); }
  static T load(const float* p) { return _mm256_loadu_ps(p); }
  static T fma(T a, T b, T c) { return _mm256_fmadd_ps(a, b, c); }
  static float sum(T h) {
    __m128 q = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
    q = _mm_add_ps(q, _mm_movehl_ps(q, q));
    return _mm_cvtss_f32(_mm_add_ss(q, _mm_movehdup_ps(q)));
  }
};
#define HARNESS_PREFETCH(p) _mm_prefetch(reinterpret_cast<const char*>(p), _MM_HINT_T1)
#else
// Any other CPU: GCC/Clang vector extensions, lowered to the target's own vector instructions.
struct Vec {
  typedef float T __attribute__((vector_size(32)));
  static constexpr int width = 8;
  static T zero() { return T{}; }
  static T load(const float* p) {
    T v;
    __builtin_memcpy(&v, p, sizeof(T));
    return v;
  }
  static T fma(T a, T b, T c) { return a * b + c; }
  static float sum(T v) {
    float s[width];
    __builtin_memcpy(s, &v, sizeof(T));
    for (int w = width / 2; w >= 1; w /= 2)
      for (int i = 0; i < w; ++i) s[i] += s[i + w];
    return s[0];
  }
};
#define HARNESS_PREFETCH(p) __builtin_prefetch((p), 0, 2)
#endif

namespace {

constexpr int64_t kMaxRows = 64;  // more rows than this: at::linear
constexpr int NB = 4;             // weight rows per block (and per register tile)
constexpr int MB = 4;             // input rows per register tile
constexpr int W = Vec::width;

struct Problem {
  const float* x;     // [M, K]
  const float* w;     // [N, K]
  const float* bias;  // [N] or null
  float* y;           // [M, N]
  int64_t M, N, K, kv;  // kv: K rounded down to the vector width
};

// Rows [m, m + TM) of x against weight rows [n, n + TN); `ahead`, when set, is prefetched (the
// next block's weights, TN * K floats) a vector's worth per weight row and step.
template <int TM, int TN>
inline void tile(const Problem& p, int64_t m, int64_t n, const float* ahead) {
  const float* x = p.x + m * p.K;
  const float* w = p.w + n * p.K;
  typename Vec::T acc[TM][TN];
  for (int i = 0; i < TM; ++i)
    for (int j = 0; j < TN; ++j) acc[i][j] = Vec::zero();
  for (int64_t k = 0; k < p.kv; k += W) {
    if (ahead != nullptr) {
      const float* a = ahead + k * TN;
      for (int b = 0; b < TN * W; b += 16) HARNESS_PREFETCH(a + b);
    }
    typename Vec::T wv[TN];
    for (int j = 0; j < TN; ++j) wv[j] = Vec::load(w + j * p.K + k);
    for (int i = 0; i < TM; ++i) {
      const typename Vec::T xv = Vec::load(x + i * p.K + k);
      for (int j = 0; j < TN; ++j) acc[i][j] = Vec::fma(xv, wv[j], acc[i][j]);
    }
  }
  for (int i = 0; i < TM; ++i)
    for (int j = 0; j < TN; ++j) {
      float s = Vec::sum(acc[i][j]);
      for (int64_t k = p.kv; k < p.K; ++k) s += x[i * p.K + k] * w[j * p.K + k];
      if (p.bias != nullptr) s += p.bias[n + j];
      p.y[(m + i) * p.N + n + j] = s;
    }
}

// Every input row against weight rows [n, n + TN).
template <int TN>
void block(const Problem& p, int64_t n, const float* ahead) {
  int64_t m = 0;
  for (; m + MB <= p.M; m += MB, ahead = nullptr) tile<MB, TN>(p, m, n, ahead);
  switch (p.M - m) {
    case 3: tile<3, TN>(p, m, n, ahead); break;
    case 2: tile<2, TN>(p, m, n, ahead); break;
    case 1: tile<1, TN>(p, m, n, ahead); break;
    default: break;
  }
}

at::Tensor streaming_linear(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(weight.dim() == 2, "streaming_linear: weight must be [N, K]; got ", weight.sizes());
  TORCH_CHECK(x.size(-1) == weight.size(1), "streaming_linear: x has ", x.size(-1), " features, weight ",
              weight.size(1));
  const int64_t rows = x.numel() / std::max<int64_t>(x.size(-1), 1);
  const bool fits = x.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat && x.device().is_cpu() &&
                    weight.device().is_cpu() && (!bias.has_value() || bias->scalar_type() == at::kFloat);
  if (!fits || rows > kMaxRows || rows == 0) return at::linear(x, weight, bias);
  const at::Tensor xc = x.reshape({rows, x.size(-1)}).contiguous();
  const at::Tensor wc = weight.contiguous();
  const at::Tensor bc = bias.has_value() ? bias->contiguous() : at::Tensor();
  std::vector<int64_t> out_shape(x.sizes().begin(), x.sizes().end());
  out_shape.back() = weight.size(0);
  at::Tensor y = at::empty({rows, weight.size(0)}, x.options());
  const int64_t K = xc.size(1);
  const Problem p{xc.data_ptr<float>(), wc.data_ptr<float>(), bc.defined() ? bc.data_ptr<float>() : nullptr,
                  y.data_ptr<float>(), rows, wc.size(0), K, K - K % W};
  const int64_t full = p.N / NB;  // whole blocks; the last N % NB rows are done one by one
  at::parallel_for(0, full + (p.N % NB != 0), 8, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t n = b * NB;
      if (b < full) {
        const float* ahead = (b + 1 < std::min(b1, full)) ? p.w + (n + NB) * K : nullptr;
        block<NB>(p, n, ahead);
      } else {
        for (int64_t j = n; j < p.N; ++j) block<1>(p, j, nullptr);
      }
    }
  });
  return y.view(out_shape);
}

}  // namespace

// The op's namespace is a build flag (tests load builds for other instruction sets beside the real one).
#ifndef HARNESS_NAMESPACE
#define HARNESS_NAMESPACE harness
#endif
#define HARNESS_LIBRARY(ns, m) TORCH_LIBRARY(ns, m)
#define HARNESS_LIBRARY_IMPL(ns, key, m) TORCH_LIBRARY_IMPL(ns, key, m)

HARNESS_LIBRARY(HARNESS_NAMESPACE, m) {
  m.def("streaming_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
}

HARNESS_LIBRARY_IMPL(HARNESS_NAMESPACE, CPU, m) {
  m.impl("streaming_linear", &streaming_linear);
}
