// Native CPU kernels for the few rows of a decode or verify step (float32).
//
// harness::streaming_linear(x, weight, bias): x @ weight.T + bias, each weight row streamed from
// memory once for all input rows.
//
// A forward of M <= 64 rows is memory-bound: the weights are read once whatever M is, so a kernel
// that reads each weight row once and multiplies it into every input row costs about what the read
// costs until the arithmetic catches up (around 8-16 rows on two AVX-512 cores). The work is split
// over output features (blocks of NB weight rows, one thread per range of blocks, torch's own
// OpenMP pool); within a block, register tiles of up to MB input rows by NB weight rows hold one
// vector accumulator per output element, and the next block is prefetched into L2 while the first
// tile of the current one runs. Several products that share their input (q, k and v; gate and up)
// run as one split of the union of their blocks.
//
// Row invariance: every output element y[m, n] is reduced in the same order (one accumulator over
// k in steps of the vector width, a fixed horizontal sum, the scalar tail, then the bias), whatever
// M, the tile it fell in, or the number of threads. So a row's result does not depend on which
// other rows share the forward: a verify forward gives every row exactly the value a one-row step
// over the same input gives. More than 64 rows (a prefill) go to at::linear, and so does any other
// dtype or device.
//
// harness::llama_layer(...): one Llama decoder layer (RMSNorm, q/k/v projections, rotary
// embedding, the append of k and v into preallocated cache buffers, grouped-query attention under
// a boolean mask or the causal rule, the output projection and residual, RMSNorm, the SiLU-gated
// MLP and residual) as one call, with the same products and its own attention and element-wise
// loops, so a step pays one dispatch per layer instead of dozens. The element-wise steps follow
// transformers' LlamaDecoderLayer operation by operation (the file is built with
// -ffp-contract=off, so no multiply-add is fused where torch rounds twice); the attention is an
// exact softmax over the allowed keys (max subtracted), whose float32 rounding differs from
// PyTorch's SDPA kernels by summation order only.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
struct Vec {
  using T = __m512;
  static constexpr int width = 16;
  static T zero() { return _mm512_setzero_ps(); }
  static T load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, T v) { _mm512_storeu_ps(p, v); }
  static T set1(float a) { return _mm512_set1_ps(a); }
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
  static void store(float* p, T v) { _mm256_storeu_ps(p, v); }
  static T set1(float a) { return _mm256_set1_ps(a); }
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
  static void store(float* p, T v) { __builtin_memcpy(p, &v, sizeof(T)); }
  static T set1(float a) { return T{} + a; }
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

// ------------------------------------------------------------------------------------- products

// y [M, N] = x [M, K] @ w [N, K].T (+ bias [N])
struct Product {
  const float* w;
  const float* bias;  // or null
  float* y;
  int64_t N;
};

struct Input {
  const float* x;  // [M, K]
  int64_t M, K, kv;  // kv: K rounded down to the vector width
};

// Rows [m, m + TM) of x against weight rows [n, n + TN); `ahead`, when set, is prefetched (the
// next block's weights, TN * K floats) a vector's worth per weight row and step.
template <int TM, int TN>
inline void tile(const Input& in, const Product& p, int64_t m, int64_t n, const float* ahead) {
  const float* x = in.x + m * in.K;
  const float* w = p.w + n * in.K;
  typename Vec::T acc[TM][TN];
  for (int i = 0; i < TM; ++i)
    for (int j = 0; j < TN; ++j) acc[i][j] = Vec::zero();
  for (int64_t k = 0; k < in.kv; k += W) {
    if (ahead != nullptr) {
      const float* a = ahead + k * TN;
      for (int b = 0; b < TN * W; b += 16) HARNESS_PREFETCH(a + b);
    }
    typename Vec::T wv[TN];
    for (int j = 0; j < TN; ++j) wv[j] = Vec::load(w + j * in.K + k);
    for (int i = 0; i < TM; ++i) {
      const typename Vec::T xv = Vec::load(x + i * in.K + k);
      for (int j = 0; j < TN; ++j) acc[i][j] = Vec::fma(xv, wv[j], acc[i][j]);
    }
  }
  for (int i = 0; i < TM; ++i)
    for (int j = 0; j < TN; ++j) {
      float s = Vec::sum(acc[i][j]);
      for (int64_t k = in.kv; k < in.K; ++k) s += x[i * in.K + k] * w[j * in.K + k];
      if (p.bias != nullptr) s += p.bias[n + j];
      p.y[(m + i) * p.N + n + j] = s;
    }
}

// Every input row against weight rows [n, n + TN).
template <int TN>
void block(const Input& in, const Product& p, int64_t n, const float* ahead) {
  int64_t m = 0;
  for (; m + MB <= in.M; m += MB, ahead = nullptr) tile<MB, TN>(in, p, m, n, ahead);
  switch (in.M - m) {
    case 3: tile<3, TN>(in, p, m, n, ahead); break;
    case 2: tile<2, TN>(in, p, m, n, ahead); break;
    case 1: tile<1, TN>(in, p, m, n, ahead); break;
    default: break;
  }
}

// Every product of `ps` (all sharing the input) in one parallel split of their blocks.
void run_products(const Input& in, const Product* ps, int count) {
  int64_t first[8];  // first block id of each product (count <= 7)
  int64_t total = 0;
  for (int i = 0; i < count; ++i) {
    first[i] = total;
    total += (ps[i].N + NB - 1) / NB;
  }
  at::parallel_for(0, total, 8, [&](int64_t b0, int64_t b1) {
    int i = 0;
    for (int64_t b = b0; b < b1; ++b) {
      while (i + 1 < count && b >= first[i + 1]) ++i;
      const Product& p = ps[i];
      const int64_t n = (b - first[i]) * NB;
      if (n + NB <= p.N) {
        const bool next_full = b + 1 < b1 && n + 2 * NB <= p.N;  // the next block is this product's, whole
        block<NB>(in, p, n, next_full ? p.w + (n + NB) * in.K : nullptr);
      } else {
        for (int64_t j = n; j < p.N; ++j) block<1>(in, p, j, nullptr);
      }
    }
  });
}

Input input_of(const float* x, int64_t M, int64_t K) { return Input{x, M, K, K - K % W}; }

bool streamable(const at::Tensor& t) { return t.scalar_type() == at::kFloat && t.device().is_cpu(); }

at::Tensor streaming_linear(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(weight.dim() == 2, "streaming_linear: weight must be [N, K]; got ", weight.sizes());
  TORCH_CHECK(x.size(-1) == weight.size(1), "streaming_linear: x has ", x.size(-1), " features, weight ",
              weight.size(1));
  const int64_t rows = x.numel() / std::max<int64_t>(x.size(-1), 1);
  const bool fits = streamable(x) && streamable(weight) && (!bias.has_value() || streamable(*bias));
  if (!fits || rows > kMaxRows || rows == 0) return at::linear(x, weight, bias);
  const at::Tensor xc = x.reshape({rows, x.size(-1)}).contiguous();
  const at::Tensor wc = weight.contiguous();
  const at::Tensor bc = bias.has_value() ? bias->contiguous() : at::Tensor();
  std::vector<int64_t> out_shape(x.sizes().begin(), x.sizes().end());
  out_shape.back() = weight.size(0);
  at::Tensor y = at::empty({rows, weight.size(0)}, x.options());
  const Product p{wc.data_ptr<float>(), bc.defined() ? bc.data_ptr<float>() : nullptr, y.data_ptr<float>(),
                  wc.size(0)};
  run_products(input_of(xc.data_ptr<float>(), rows, xc.size(1)), &p, 1);
  return y.view(out_shape);
}

// ---------------------------------------------------------------------------------- the layer

// out [M, d] = RMSNorm(h) * weight, as LlamaRMSNorm: h * rsqrt(mean(h^2) + eps), then weight * it
void rms_norm(const float* h, const float* weight, float* out, int64_t M, int64_t d, float eps) {
  for (int64_t m = 0; m < M; ++m) {
    const float* hm = h + m * d;
    float ss = 0.f;
    for (int64_t i = 0; i < d; ++i) ss += hm[i] * hm[i];
    const float r = 1.f / std::sqrt(ss / static_cast<float>(d) + eps);
    for (int64_t i = 0; i < d; ++i) out[m * d + i] = weight[i] * (hm[i] * r);
  }
}

// x [M, H * dh] in place: x * cos + rotate_half(x) * sin per head, cos / sin [M, dh]
void rotary(float* x, const float* cos, const float* sin, int64_t M, int64_t H, int64_t dh) {
  const int64_t half = dh / 2;
  for (int64_t m = 0; m < M; ++m)
    for (int64_t h = 0; h < H; ++h) {
      float* v = x + (m * H + h) * dh;
      const float* c = cos + m * dh;
      const float* s = sin + m * dh;
      for (int64_t i = 0; i < half; ++i) {
        const float a = v[i], b = v[i + half];
        v[i] = a * c[i] + (-b) * s[i];
        v[i + half] = b * c[i + half] + a * s[i + half];
      }
    }
}

float dot(const float* a, const float* b, int64_t n) {
  typename Vec::T acc = Vec::zero();
  int64_t i = 0;
  for (; i + W <= n; i += W) acc = Vec::fma(Vec::load(a + i), Vec::load(b + i), acc);
  float s = Vec::sum(acc);
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

// out += p * v (n floats)
void axpy(float* out, float p, const float* v, int64_t n) {
  const typename Vec::T pv = Vec::set1(p);
  int64_t i = 0;
  for (; i + W <= n; i += W) Vec::store(out + i, Vec::fma(pv, Vec::load(v + i), Vec::load(out + i)));
  for (; i < n; ++i) out[i] += p * v[i];
}

struct Attention {
  const float* q;      // [B, R, Hq, dh]
  const float* keys;   // [B, Hkv, cap, dh]
  const float* values;
  const bool* mask;    // [B, R, L] (True = attend) or null: row r sees slots [0, start + r]
  float* out;          // [B, R, Hq, dh]
  int64_t B, R, Hq, Hkv, dh, cap, start, L;  // L = start + R keys
  float scaling;
};

void attend(const Attention& a) {
  const int64_t rep = a.Hq / a.Hkv;
  at::parallel_for(0, a.B * a.Hq * a.R, 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> scores(a.L);
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t r = t % a.R, h = (t / a.R) % a.Hq, b = t / (a.R * a.Hq);
      const float* q = a.q + ((b * a.R + r) * a.Hq + h) * a.dh;
      const int64_t base = (b * a.Hkv + h / rep) * a.cap * a.dh;
      const bool* allowed = a.mask != nullptr ? a.mask + (b * a.R + r) * a.L : nullptr;
      const int64_t seen = allowed != nullptr ? a.L : a.start + r + 1;
      float top = -INFINITY;
      for (int64_t j = 0; j < seen; ++j) {
        if (allowed != nullptr && !allowed[j]) continue;
        scores[j] = dot(q, a.keys + base + j * a.dh, a.dh) * a.scaling;
        top = std::max(top, scores[j]);
      }
      float* out = a.out + ((b * a.R + r) * a.Hq + h) * a.dh;
      std::fill(out, out + a.dh, 0.f);
      float total = 0.f;
      for (int64_t j = 0; j < seen; ++j) {
        if (allowed != nullptr && !allowed[j]) continue;
        const float p = std::exp(scores[j] - top);
        total += p;
        axpy(out, p, a.values + base + j * a.dh, a.dh);
      }
      const float inv = 1.f / total;
      for (int64_t i = 0; i < a.dh; ++i) out[i] *= inv;
    }
  });
}

const float* ptr_or_null(const c10::List<std::optional<at::Tensor>>& list, int64_t i) {
  const std::optional<at::Tensor> t = list.get(i);
  return t.has_value() ? t->data_ptr<float>() : nullptr;
}

// hidden [B, R, d]; cos, sin [B, R, dh]; mask bool [B, R, start + R] or none (causal);
// key_buffer, value_buffer [B, Hkv, cap, dh] receive this forward's rows at [start, start + R);
// weights: input norm [d], q [Hq dh, d], k [Hkv dh, d], v [Hkv dh, d], o [d, Hq dh], post norm [d],
// gate [I, d], up [I, d], down [d, I]; biases: q, k, v, o, gate, up, down (each or none).
at::Tensor llama_layer(const at::Tensor& hidden, const at::Tensor& cos, const at::Tensor& sin,
                       const std::optional<at::Tensor>& mask, at::Tensor key_buffer, at::Tensor value_buffer,
                       int64_t start, at::TensorList weights, const c10::List<std::optional<at::Tensor>>& biases,
                       double input_eps, double post_eps, double scaling) {
  TORCH_CHECK(weights.size() == 9 && biases.size() == 7, "llama_layer: 9 weights and 7 biases expected");
  TORCH_CHECK(hidden.dim() == 3 && hidden.is_contiguous() && streamable(hidden), "llama_layer: hidden [B, R, d]");
  for (const at::Tensor& t : {cos, sin, key_buffer, value_buffer})
    TORCH_CHECK(t.is_contiguous() && streamable(t), "llama_layer: contiguous float32 CPU tensors expected");
  for (const at::Tensor& w : weights)
    TORCH_CHECK(w.is_contiguous() && streamable(w), "llama_layer: contiguous float32 CPU weights expected");
  const int64_t B = hidden.size(0), R = hidden.size(1), d = hidden.size(2), M = B * R;
  const int64_t Hkv = key_buffer.size(1), cap = key_buffer.size(2), dh = key_buffer.size(3);
  const int64_t Hq = weights[1].size(0) / dh, I = weights[6].size(0), L = start + R;
  TORCH_CHECK(M <= kMaxRows && L <= cap && Hq % Hkv == 0 && dh % 2 == 0, "llama_layer: shapes out of range");
  const int64_t shapes[9][2] = {{d, 1}, {Hq * dh, d}, {Hkv * dh, d}, {Hkv * dh, d}, {d, Hq * dh},
                                {d, 1}, {I, d},       {I, d},        {d, I}};
  for (int i = 0; i < 9; ++i)
    TORCH_CHECK(weights[i].numel() == shapes[i][0] * shapes[i][1] && weights[i].size(0) == shapes[i][0],
                "llama_layer: weight ", i, " has shape ", weights[i].sizes());
  const int64_t bias_sizes[7] = {Hq * dh, Hkv * dh, Hkv * dh, d, I, I, d};
  for (int i = 0; i < 7; ++i) {
    const std::optional<at::Tensor> b = biases.get(i);
    TORCH_CHECK(!b.has_value() || (b->is_contiguous() && streamable(*b) && b->numel() == bias_sizes[i]),
                "llama_layer: bias ", i, " must be a contiguous float32 CPU vector of ", bias_sizes[i]);
  }
  TORCH_CHECK(cos.numel() == M * dh && sin.numel() == M * dh && value_buffer.sizes() == key_buffer.sizes(),
              "llama_layer: cos / sin [B, R, dh] and equal key / value buffers expected");
  TORCH_CHECK(!mask.has_value() || (mask->scalar_type() == at::kBool && mask->is_contiguous() &&
                                    mask->numel() == M * L), "llama_layer: mask must be bool [B, R, start + R]");
  const auto opts = hidden.options();
  const float* h = hidden.data_ptr<float>();
  at::Tensor x = at::empty({M, d}, opts), q = at::empty({M, Hq * dh}, opts);
  at::Tensor k = at::empty({M, Hkv * dh}, opts), v = at::empty({M, Hkv * dh}, opts);
  at::Tensor ctx = at::empty({M, Hq * dh}, opts), attn = at::empty({M, d}, opts);
  at::Tensor out = at::empty({B, R, d}, opts);
  float* xp = x.data_ptr<float>();

  rms_norm(h, weights[0].data_ptr<float>(), xp, M, d, static_cast<float>(input_eps));
  const Product qkv[3] = {{weights[1].data_ptr<float>(), ptr_or_null(biases, 0), q.data_ptr<float>(), Hq * dh},
                          {weights[2].data_ptr<float>(), ptr_or_null(biases, 1), k.data_ptr<float>(), Hkv * dh},
                          {weights[3].data_ptr<float>(), ptr_or_null(biases, 2), v.data_ptr<float>(), Hkv * dh}};
  run_products(input_of(xp, M, d), qkv, 3);
  rotary(q.data_ptr<float>(), cos.data_ptr<float>(), sin.data_ptr<float>(), M, Hq, dh);
  rotary(k.data_ptr<float>(), cos.data_ptr<float>(), sin.data_ptr<float>(), M, Hkv, dh);

  float* kb = key_buffer.data_ptr<float>();
  float* vb = value_buffer.data_ptr<float>();
  for (int64_t b = 0; b < B; ++b)
    for (int64_t r = 0; r < R; ++r)
      for (int64_t g = 0; g < Hkv; ++g) {
        const int64_t src = ((b * R + r) * Hkv + g) * dh, dst = ((b * Hkv + g) * cap + start + r) * dh;
        std::copy(k.data_ptr<float>() + src, k.data_ptr<float>() + src + dh, kb + dst);
        std::copy(v.data_ptr<float>() + src, v.data_ptr<float>() + src + dh, vb + dst);
      }

  attend(Attention{q.data_ptr<float>(), kb, vb, mask.has_value() ? mask->data_ptr<bool>() : nullptr,
                   ctx.data_ptr<float>(), B, R, Hq, Hkv, dh, cap, start, L, static_cast<float>(scaling)});
  const Product o{weights[4].data_ptr<float>(), ptr_or_null(biases, 3), attn.data_ptr<float>(), d};
  run_products(input_of(ctx.data_ptr<float>(), M, Hq * dh), &o, 1);
  float* mid = attn.data_ptr<float>();  // the residual stream after attention, in place
  for (int64_t i = 0; i < M * d; ++i) mid[i] = h[i] + mid[i];

  rms_norm(mid, weights[5].data_ptr<float>(), xp, M, d, static_cast<float>(post_eps));
  at::Tensor gate = at::empty({M, I}, opts), up = at::empty({M, I}, opts);
  const Product gate_up[2] = {{weights[6].data_ptr<float>(), ptr_or_null(biases, 4), gate.data_ptr<float>(), I},
                              {weights[7].data_ptr<float>(), ptr_or_null(biases, 5), up.data_ptr<float>(), I}};
  run_products(input_of(xp, M, d), gate_up, 2);
  float* g = gate.data_ptr<float>();
  const float* u = up.data_ptr<float>();
  for (int64_t i = 0; i < M * I; ++i) g[i] = (g[i] / (1.f + std::exp(-g[i]))) * u[i];  // silu(gate) * up
  float* o_ptr = out.data_ptr<float>();
  const Product down{weights[8].data_ptr<float>(), ptr_or_null(biases, 6), o_ptr, d};
  run_products(input_of(g, M, I), &down, 1);
  for (int64_t i = 0; i < M * d; ++i) o_ptr[i] = mid[i] + o_ptr[i];
  return out;
}

}  // namespace

// The ops' namespace is a build flag (tests load builds for other instruction sets beside the real one).
#ifndef HARNESS_NAMESPACE
#define HARNESS_NAMESPACE harness
#endif
#define HARNESS_LIBRARY(ns, m) TORCH_LIBRARY(ns, m)
#define HARNESS_LIBRARY_IMPL(ns, key, m) TORCH_LIBRARY_IMPL(ns, key, m)

HARNESS_LIBRARY(HARNESS_NAMESPACE, m) {
  m.def("streaming_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
  m.def(
      "llama_layer(Tensor hidden, Tensor cos, Tensor sin, Tensor? mask, Tensor(a!) key_buffer, "
      "Tensor(b!) value_buffer, int start, Tensor[] weights, Tensor?[] biases, float input_eps, float post_eps, "
      "float scaling) -> Tensor");
}

HARNESS_LIBRARY_IMPL(HARNESS_NAMESPACE, CPU, m) {
  m.impl("streaming_linear", &streaming_linear);
  m.impl("llama_layer", &llama_layer);
}
