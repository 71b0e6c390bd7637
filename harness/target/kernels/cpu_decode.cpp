// Native CPU kernels for the rows of a decode, verify or prefill step (float32 and bfloat16), and
// prompt lookup's match search.
//
// harness::streaming_linear(x, weight, bias): x @ weight.T + bias, each weight row streamed from
// memory once for every 64 input rows.
//
// A forward of a few rows is memory-bound: the weights are read once whatever M is, so a kernel
// that reads each weight row once and multiplies it into every input row costs about what the read
// costs until the arithmetic catches up (around 8-16 rows on two AVX-512 cores). The work is split
// over output features (blocks of NB weight rows, one thread per range of blocks, torch's own
// OpenMP pool); within a block, register tiles of up to MB input rows by NB weight rows hold one
// vector accumulator per output element, and the next block is prefetched into L2 while the first
// tile of the current one runs (float32 without AVX-512: while all its tiles run; a one-row float32
// product instead reads its rows in sequence where float32 products use 256-bit vectors, below, with
// a software prefetch ahead in that stream where AVX-512 is not built; a one-row bfloat16 product
// reads them in sequence where AVX-512 is built, in tiles of two rows where it is not). Several
// products that share their input (q, k and v; gate and up) run as one split of the union of their
// blocks. bfloat16 products accumulate in float32 and round once. More than 64 rows (a prefill) are
// computed 64 at a time, one pass over the weights each.
//
// Row invariance: every output element y[m, n] is reduced in the same order (one accumulator over
// k in steps of the vector width, a fixed horizontal sum, the scalar tail, then the bias, then the
// rounding to the output dtype), whatever M, the tile or pass it fell in, or the number of threads.
// So a row's result does not depend on which other rows share the forward: a verify forward gives
// every row exactly the value a one-row step over the same input gives, and a prefill of a whole
// prompt the values a prefill of all but its last token and a step over that token give. Any other
// dtype (or a mix of dtypes) or device goes to at::linear.
//
// A float32 weight may also come packed in panels of 16 output features ([N / 16, K, 16], each
// panel's rows transposed; model.linear_kernel=streaming_panels packs them once): its products
// reduce every element in the other order, one chain of multiply-adds over k from zero, then the
// bias, again whatever M, the tile or the thread (see "float32 weights in panels" below). A
// bfloat16 weight may come packed in pairs ([N / 16, K / 2, 16, 2], the same option), multiplied
// with AMX tiles where the CPU has them (see "bfloat16 weights in pairs" below). A layer's seven
// products come all packed or none.
//
// harness::llama_layer(...): one Llama decoder layer (RMSNorm, q/k/v projections, rotary
// embedding, the append of k and v into preallocated cache buffers, grouped-query attention under
// a boolean mask or the causal rule, the output projection and residual, RMSNorm, the SiLU-gated
// MLP and residual) as one call, with the same products and its own attention and element-wise
// loops, so a step pays one dispatch per layer instead of dozens; float32 or bfloat16 (every tensor
// in one dtype). The element-wise steps follow transformers' LlamaDecoderLayer operation by
// operation, rounding to bfloat16 where its bfloat16 operators round (the file is built with
// -ffp-contract=off, so no multiply-add is fused where torch rounds twice); the attention is an
// exact softmax over the allowed keys (max subtracted), whose float32 rounding differs from
// PyTorch's SDPA kernels by summation order and its own vectorised exp. The query heads that share a
// key / value head run together: every row and head of the forward reads each key once (and each
// value once per block of rows and heads), the scores split over runs of keys and the value sums
// over slices of the head's width, so a decode step's few heads spread evenly over the threads
// (forwards whose scores would not fit its scratch, such as a long prefill, run over blocks of up
// to four rows of one head instead); either way each row is reduced in the order it would be alone.
// Where the CPU has AMX, bfloat16 attention over heads of a multiple of 32 runs on its tiles instead,
// in every forward alike, each row's keys summed in its path's order (see "bfloat16 attention on
// tiles, in path order" below).
//
// harness::llama_stack(...): a whole stack of such layers as one call: the same per-layer steps, layer after layer, in one parallel region of torch's OpenMP pool
// with one set of scratch buffers, so a decode step pays one dispatch and one thread-team start for
// the whole decoder rather than one per layer; bit for bit what the layers compute one call each.
//
// harness::lookup_matches(...): prompt lookup's match search over the request and the history of
// earlier outputs (integer work; see its section at the end).
//
// harness::move_slots(buffers, src, dst): a commit's accepted rows moved in every layer's preallocated
// key and value buffers in one call (plain copies, every source read before any write).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <omp.h>
#include <sys/syscall.h>
#include <torch/library.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <type_traits>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
// the horizontal sum of eight floats, in a fixed order
inline float sum256(__m256 h) {
  __m128 q = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
  q = _mm_add_ps(q, _mm_movehl_ps(q, q));
  return _mm_cvtss_f32(_mm_add_ss(q, _mm_movehdup_ps(q)));
}

// out[c] = sum256(v[c]) for c < 8, bit for bit: the same additions, eight vectors at a time (the
// halves of v[c] and v[c + 4] folded in one add, then pairs of lanes, then the pair).
inline void sum8_256(const __m256* v, float* out) {
  auto fold = [](__m256 a, __m256 b) {  // [a_lo + a_hi | b_lo + b_hi] (halves 0, 1: a's; 2, 3: b's)
    return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 2 << 4 | 0), _mm256_permute2f128_ps(a, b, 3 << 4 | 1));
  };
  auto pairs = [](__m256 a, __m256 b) {  // per 128-bit lane [a0 + a2, a1 + a3, b0 + b2, b1 + b3]
    return _mm256_add_ps(_mm256_shuffle_ps(a, b, _MM_SHUFFLE(1, 0, 1, 0)), _mm256_shuffle_ps(a, b, _MM_SHUFFLE(3, 2, 3, 2)));
  };
  const __m256 low = pairs(fold(v[0], v[4]), fold(v[1], v[5]));  // [v0 v1 | v4 v5], two partial sums each
  const __m256 high = pairs(fold(v[2], v[6]), fold(v[3], v[7]));
  _mm256_storeu_ps(out, _mm256_add_ps(_mm256_shuffle_ps(low, high, _MM_SHUFFLE(2, 0, 2, 0)),
                                      _mm256_shuffle_ps(low, high, _MM_SHUFFLE(3, 1, 3, 1))));
}
#endif

#if defined(__AVX512F__)
struct Vec {
  using T = __m512;
  static constexpr int width = 16;
  static T zero() { return _mm512_setzero_ps(); }
  static T load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, T v) { _mm512_storeu_ps(p, v); }
  static T set1(float a) { return _mm512_set1_ps(a); }
  static T fma(T a, T b, T c) { return _mm512_fmadd_ps(a, b, c); }
  static T widen(const uint16_t* p) {  // 16 bfloat16 -> float32 (exact: the high half of each float)
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
  }
  static float sum(T v) { return sum256(_mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1))); }
  static void sum8(const T* v, float* out) {  // out[c] = sum(v[c]), c < 8, bit for bit: each folded as sum()
    __m256 h[8];                              // folds it, then the eight sums of 8 together
    for (int c = 0; c < 8; ++c) h[c] = _mm256_add_ps(_mm512_castps512_ps256(v[c]), _mm512_extractf32x8_ps(v[c], 1));
    sum8_256(h, out);
  }
};
#define HARNESS_PREFETCH(p) _mm_prefetch(reinterpret_cast<const char*>(p), _MM_HINT_T1)
#elif defined(__AVX2__) && defined(__FMA__)
struct Vec {
  using T = __m256;
  static constexpr int width = 8;
  static T zero() { return _mm256_setzero_ps(); }
  static T load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, T v) { _mm256_storeu_ps(p, v); }
  static T set1(float a) { return _mm256_set1_ps(a); }
  static T fma(T a, T b, T c) { return _mm256_fmadd_ps(a, b, c); }
  static T widen(const uint16_t* p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
  }
  static float sum(T h) { return sum256(h); }
  static void sum8(const T* v, float* out) { sum8_256(v, out); }
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
  static T widen(const uint16_t* p) {
    uint32_t bits[width];
    for (int i = 0; i < width; ++i) bits[i] = static_cast<uint32_t>(p[i]) << 16;
    T v;
    __builtin_memcpy(&v, bits, sizeof(T));
    return v;
  }
  static float sum(T v) {
    float s[width];
    __builtin_memcpy(s, &v, sizeof(T));
    for (int w = width / 2; w >= 1; w /= 2)
      for (int i = 0; i < w; ++i) s[i] += s[i + w];
    return s[0];
  }
  static void sum8(const T* v, float* out) {
    for (int c = 0; c < 8; ++c) out[c] = sum(v[c]);
  }
};
#define HARNESS_PREFETCH(p) __builtin_prefetch((p), 0, 2)
#endif

namespace {

constexpr int64_t kChunkRows = 64;  // rows per pass over the weights
#if defined(__AVX512F__)
constexpr int kRowPrefetchBytes = 0;
#else
constexpr int kRowPrefetchBytes = 512;  // how far ahead a one-row product prefetches its own stream
#endif

// Where a layer's time goes, in a build for measurements only (-DHARNESS_PHASE_TIMES, never the one
// the harness loads): each thread adds the wall time of every step of a layer (up to the barrier that
// ends it) and of each part of the attention on tiles, per block, to its own counters (outside a
// team every thread counts as thread 0); layer_phase_times() returns them and starts them again.
constexpr int kLayerSteps = 10, kAttentionParts = 5, kMaxTimedThreads = 64;
#if defined(HARNESS_PHASE_TIMES)
struct PhaseTimes {
  double step[kLayerSteps] = {}, part[kAttentionParts] = {};
  int64_t layers = 0, blocks = 0;
  char pad[64];  // threads' counters on their own cache lines
};
PhaseTimes phase_times[kMaxTimedThreads];
inline double seconds_now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}
// Adds the time since `*last` to counter `into` of this thread and moves `*last` on.
inline void tick(double* into, double* last) {
  const double now = seconds_now();
  *into += now - *last;
  *last = now;
}
#define HARNESS_TIMER(name) double name = seconds_now()
#define HARNESS_TICK(tid, field, i, last)                                          \
  do {                                                                             \
    if ((tid) < kMaxTimedThreads) tick(&phase_times[(tid)].field[(i)], &(last)); \
  } while (0)
#define HARNESS_COUNT(tid, field)                                \
  do {                                                           \
    if ((tid) < kMaxTimedThreads) ++phase_times[(tid)].field; \
  } while (0)
#else
#define HARNESS_TIMER(name)
#define HARNESS_TICK(tid, field, i, last)
#define HARNESS_COUNT(tid, field)
#endif

// A block of weight rows is read from memory by its first tile of input rows and from L1 by the
// rest; a prefetch of the next block keeps the memory busy meanwhile. Where this is set, float32
// blocks split that prefetch evenly over all their tiles, so the next block streams in during every
// tile instead of only the first one's (the memory otherwise idles while the later tiles compute).
// On Zen 3 (AVX2) SmolLM2's float32 forwards of 6-16 rows took 0.80-0.95 of the time, 4 rows or
// fewer (one tile) unchanged; bfloat16 ones, whose tiles compute longer per byte, gained nothing
// (0.96-1.09 at 4-16 rows), so they keep the first tile's prefetch. Not measured with AVX-512.
#if defined(__AVX512F__)
constexpr bool kSpreadF32Prefetch = false;
#else
constexpr bool kSpreadF32Prefetch = true;
#endif
#define HARNESS_PREFETCH_NEAR(p) __builtin_prefetch((p), 0, 3)
constexpr int W = Vec::width;

// How work is split over threads. Outside a team (size 0) each split is a parallel region of
// torch's pool (at::parallel_for). In a team, every thread of one OpenMP region runs the same
// sequence of steps: a split gives this thread its share and then waits for the others at a
// barrier. A fused layer runs as one team, so each of its steps costs a barrier instead of a
// parallel region.
struct Team {
  int tid = 0, size = 0;

  template <class F>
  void split(int64_t n, int64_t grain, const F& fn) const {
    if (size == 0) {
      at::parallel_for(0, n, grain, fn);
      return;
    }
    const int64_t share = (n + size - 1) / size;
    const int64_t b0 = std::min(n, tid * share), b1 = std::min(n, b0 + share);
    if (b0 < b1) fn(b0, b1);
#pragma omp barrier
  }
};

// ------------------------------------------------------------------------------------- products

// How one dtype's products are computed: the weight (`Wt`), input (`X`) and output (`Y`) element
// types, the elements a vector step covers, the step itself, and whether a one-row product reads
// its weight rows one after another (a single stream for the hardware prefetcher) rather than 16 at
// a time. On Zen 4 the single stream is 5-10% faster for SmolLM2's bfloat16 products and for
// float32 ones in 256-bit vectors, and 6-9% slower for float32 ones in 512-bit vectors; on Zen 3
// (AVX2, no AVX-512) a one-row float32 product streams about 14% faster in sequence (SmolLM2's
// layers and head, interleaved A/B). Either way each output element is reduced in the same order.
// Without AVX-512, a row read on its own also prefetches its stream ahead (kRowPrefetchBytes), once
// per cache line: each element is one chain of dependent multiply-adds (the fixed order), which fills
// the out-of-order window and with it limits the loads in flight; the prefetch runs ahead of the
// chain. On Zen 3 SmolLM2's one-row step (layers and head) took 8-10% less time in fp32 and 8% in
// bf16, the same bits, multi-row forwards unchanged (12 interleaved rounds each); float32 is no
// faster 1-2 KB ahead. On Zen 4 (AVX-512 built, float32 in 256-bit vectors) the same prefetch made
// the one-row step slower, 1.04x in fp32 and 1.12x in bf16 (12 interleaved rounds), so it stays off
// wherever AVX-512 is built. Without AVX-512 a one-row bfloat16 product is faster still in 1 x 2 tiles, two
// weight rows at a time with the next pair prefetched, each row its own chain in the same order: its
// loop (every vector widened before the multiply-add) has several times float32's instructions per
// byte, so one chain's window reaches fewer bytes ahead. On Zen 3 SmolLM2's bf16 one-row step took
// 0.94 of the time in sequence with a 2 KB prefetch, and 1 x 2 tiles 0.90 of that (12 interleaved
// rounds each, same bits); two float32 rows at a time stream slower than one.
//
// F32: float32 everywhere, one fused multiply-add per vector of weights and inputs. Where AVX-512 is
// built, its vectors are 512 bits unless HARNESS_F32_WIDTH is 256: AMD Zen 4 executes 512-bit
// instructions as two 256-bit halves, and there SmolLM2's one-row products stream 5-12% faster with
// 256-bit loads, one weight row after another (measured by interleaved A/B; no slower from 2 to 16
// rows). The build picks the width per CPU (harness/target/native.py); the width sets the order
// each element is reduced in, for every M alike, so rows stay invariant either way.
#ifndef HARNESS_F32_WIDTH
#define HARNESS_F32_WIDTH 512
#endif
#if defined(__AVX512F__) && HARNESS_F32_WIDTH == 256
struct F32 {
  using Wt = float;
  using X = float;
  using Y = float;
  using Acc = __m256;
  using WV = __m256;
  using XV = __m256;
  static constexpr int step = 8;
  static constexpr bool one_row_in_sequence = true;
  static constexpr int one_row_cols = 16;
  static Acc zero() { return _mm256_setzero_ps(); }
  static WV wload(const Wt* p) { return _mm256_loadu_ps(p); }
  static XV xload(const X* p) { return _mm256_loadu_ps(p); }
  static Acc madd(Acc acc, XV x, WV w) { return _mm256_fmadd_ps(x, w, acc); }
  static Y out(float s) { return s; }
  static float sum(Acc h) { return sum256(h); }
};
#else
struct F32 {
  using Wt = float;
  using X = float;
  using Y = float;
  using Acc = Vec::T;
  using WV = Vec::T;
  using XV = Vec::T;
  static constexpr int step = W;
#if defined(__AVX512F__)
  static constexpr bool one_row_in_sequence = false;  // 512-bit vectors: 16 rows at a time stream faster
#else
  static constexpr bool one_row_in_sequence = true;  // 256-bit vectors (AVX2 and others): one stream
#endif
  static constexpr int one_row_cols = 16;
  static Acc zero() { return Vec::zero(); }
  static WV wload(const Wt* p) { return Vec::load(p); }
  static XV xload(const X* p) { return Vec::load(p); }
  static Acc madd(Acc acc, XV x, WV w) { return Vec::fma(x, w, acc); }
  static Y out(float s) { return s; }
  static float sum(Acc v) { return Vec::sum(v); }
};
#endif

// bfloat16 weights, inputs and outputs, accumulated in float32 and rounded to bfloat16 once, at the
// end (round to nearest even, as torch converts). With AVX512-BF16 each step is one VDPBF16PS (32
// products into 16 float32 sums, pairs added in the instruction's fixed order); without it each
// vector of inputs and weights is widened to float32 in registers (exact) before a float32
// multiply-add.
using bf16 = c10::BFloat16;
#if defined(__AVX512BF16__)
struct BF16 {
  using Wt = bf16;
  using X = bf16;
  using Y = bf16;
  using Acc = __m512;
  using WV = __m512bh;
  using XV = __m512bh;
  static constexpr int step = 32;
  static constexpr bool one_row_in_sequence = true;
  static constexpr int one_row_cols = 16;
  static Acc zero() { return _mm512_setzero_ps(); }
  static WV wload(const Wt* p) { return (__m512bh)_mm512_loadu_si512(p); }
  static XV xload(const X* p) { return (__m512bh)_mm512_loadu_si512(p); }
  static Acc madd(Acc acc, XV x, WV w) { return _mm512_dpbf16_ps(acc, x, w); }
  static Y out(float s) { return bf16(s); }
  static float sum(Acc v) { return Vec::sum(v); }
};
#else
struct BF16 {
  using Wt = bf16;
  using X = bf16;
  using Y = bf16;
  using Acc = Vec::T;
  using WV = Vec::T;
  using XV = Vec::T;
  static constexpr int step = W;
#if defined(__AVX512F__)
  static constexpr bool one_row_in_sequence = true;
  static constexpr int one_row_cols = 16;
#else
  static constexpr bool one_row_in_sequence = false;  // AVX2 and others: 1 x 2 tiles (see above)
  static constexpr int one_row_cols = 2;
#endif
  static Acc zero() { return Vec::zero(); }
  static WV wload(const Wt* p) { return Vec::widen(reinterpret_cast<const uint16_t*>(p)); }
  static XV xload(const X* p) { return Vec::widen(reinterpret_cast<const uint16_t*>(p)); }
  static Acc madd(Acc acc, XV x, WV w) { return Vec::fma(x, w, acc); }
  static Y out(float s) { return bf16(s); }
  static float sum(Acc v) { return Vec::sum(v); }
};
#endif

// y [M, N] = x [M, K] @ w [N, K].T (+ bias [N])
template <class P>
struct Product {
  const typename P::Wt* w;
  const typename P::Wt* bias;  // or null
  typename P::Y* y;
  int64_t N;
  bool panels = false;  // w is float32 in panels [N / 16, K, 16] or bfloat16 in pairs (below), not [N, K]
};

template <class P>
struct Input {
  const typename P::X* x;  // [M, K]
  int64_t M, K, kv;  // kv: K rounded down to the step
};

// One element of either dtype read as float32 (exact) or written from it, for the products' scalar
// tails and the layer's element-wise steps, which compute in float32: `rnd` rounds a float32
// result to T's precision where transformers' layer, running in T, rounds one (after each
// operator); in float32 it is the identity, so the float32 layer computes what it always has.
inline float rnd(float v, float) { return v; }
inline float rnd(float v, bf16) { return static_cast<float>(bf16(v)); }
inline float load1(const float* p) { return *p; }
inline float load1(const bf16* p) { return static_cast<float>(*p); }
inline void store1(float* p, float v) { *p = v; }
inline void store1(bf16* p, float v) { *p = bf16(v); }
inline Vec::T loadv(const float* p) { return Vec::load(p); }
inline Vec::T loadv(const bf16* p) { return Vec::widen(reinterpret_cast<const uint16_t*>(p)); }

// Whether P's blocks spread the next block's prefetch over their tiles (float32 only).
template <class P>
constexpr bool spreads_prefetch = kSpreadF32Prefetch && std::is_same_v<typename P::Wt, float>;

// Rows [m, m + TM) of x against weight rows [n, n + TN). `ahead`, when set, is the next block's
// weights (TN * K elements), prefetched in chunks of a step's worth per weight row: the block's
// `shares` tiles split its chunks evenly, this tile (`share` of them) taking every shares-th step of
// the steps all of them run, so the next block streams in while every tile of this one computes.
template <class P, int TM, int TN>
inline void tile(const Input<P>& in, const Product<P>& p, int64_t m, int64_t n, const typename P::Wt* ahead,
                 int64_t share = 0, int64_t shares = 1) {
  const typename P::X* x = in.x + m * in.K;
  const typename P::Wt* w = p.w + n * in.K;
  typename P::Acc acc[TM][TN];
  for (int i = 0; i < TM; ++i)
    for (int j = 0; j < TN; ++j) acc[i][j] = P::zero();
  constexpr int ahead_bytes = TN * P::step * static_cast<int>(sizeof(typename P::Wt));
  int64_t k0 = 0;
  if constexpr (TM == 1 && TN == 1 && P::one_row_in_sequence && kRowPrefetchBytes > 0) {
    // a row read on its own: a prefetch a few lines ahead in its stream, one per line, the same chain
    constexpr int64_t per_line = std::max<int64_t>(1, 64 / (P::step * sizeof(typename P::Wt)));
    for (; k0 + per_line * P::step <= in.kv; k0 += per_line * P::step) {
      HARNESS_PREFETCH_NEAR(reinterpret_cast<const char*>(w + k0) + kRowPrefetchBytes);
      for (int64_t u = 0; u < per_line; ++u)
        acc[0][0] = P::madd(acc[0][0], P::xload(x + k0 + u * P::step), P::wload(w + k0 + u * P::step));
    }
  }
  const char* chunk = nullptr;  // spread: the next chunk of `ahead` this tile prefetches
  int64_t wait = 0;             // and the steps until it
  if (spreads_prefetch<P> && ahead != nullptr) {
    const int64_t first = share * (in.kv / P::step);  // this tile's first step, counted over the block
    const int64_t c = (first + shares - 1) / shares;  // the first chunk it takes
    chunk = reinterpret_cast<const char*>(ahead) + c * ahead_bytes;
    wait = c * shares - first;
  }
  for (int64_t k = k0; k < in.kv; k += P::step) {
    if constexpr (spreads_prefetch<P>) {
      if (chunk != nullptr) {
        if (wait == 0) {
          for (int b = 0; b < ahead_bytes; b += 64) HARNESS_PREFETCH(chunk + b);
          chunk += ahead_bytes;
          wait = shares;
        }
        --wait;
      }
    } else if (ahead != nullptr) {
      const char* a = reinterpret_cast<const char*>(ahead + k * TN);
      for (int b = 0; b < ahead_bytes; b += 64) HARNESS_PREFETCH(a + b);
    }
    typename P::WV wv[TN];
    for (int j = 0; j < TN; ++j) wv[j] = P::wload(w + j * in.K + k);
    for (int i = 0; i < TM; ++i) {
      const typename P::XV xv = P::xload(x + i * in.K + k);
      for (int j = 0; j < TN; ++j) acc[i][j] = P::madd(acc[i][j], xv, wv[j]);
    }
  }
  for (int i = 0; i < TM; ++i)
    for (int j = 0; j < TN; ++j) {
      float s = P::sum(acc[i][j]);
      for (int64_t k = in.kv; k < in.K; ++k) s += load1(x + i * in.K + k) * load1(w + j * in.K + k);
      if (p.bias != nullptr) s += load1(p.bias + n + j);
      p.y[(m + i) * p.N + n + j] = P::out(s);
    }
}

// Every input row against weight rows [n, n + TN).
// The last in.M - m < MB rows in one tile of that many rows.
template <class P, int TN, int TM>
inline void tail_tile(const Input<P>& in, const Product<P>& p, int64_t m, int64_t n, const typename P::Wt* ahead,
                      int64_t share, int64_t shares) {
  if constexpr (TM >= 1) {
    if (in.M - m == TM)
      tile<P, TM, TN>(in, p, m, n, ahead, share, shares);
    else
      tail_tile<P, TN, TM - 1>(in, p, m, n, ahead, share, shares);
  }
}

template <class P, int TN, int MB>
void block(const Input<P>& in, const Product<P>& p, int64_t n, const typename P::Wt* ahead) {
  if constexpr (MB == 1 && P::one_row_in_sequence) {  // one weight row after another: a single stream
    for (int j = 0; j < TN; ++j) tile<P, 1, 1>(in, p, 0, n + j, nullptr);
    return;
  }
  // the block's tiles share the prefetch of the next block, or the first tile issues all of it
  const int64_t shares = spreads_prefetch<P> ? (in.M + MB - 1) / MB : 1;
  int64_t m = 0, share = 0;
  for (; m + MB <= in.M; m += MB, ++share) {
    tile<P, MB, TN>(in, p, m, n, ahead, share, shares);
    if (!spreads_prefetch<P>) ahead = nullptr;
  }
  tail_tile<P, TN, MB - 1>(in, p, m, n, ahead, share, shares);
}

// Every product of `ps` (all sharing the input) in one parallel split of their blocks.
template <class P, int NB, int MB>
void run_blocks(const Input<P>& in, const Product<P>* ps, int count, const Team& team) {
  int64_t first[8];  // first block id of each product (count <= 7)
  int64_t total = 0;
  for (int i = 0; i < count; ++i) {
    first[i] = total;
    total += (ps[i].N + NB - 1) / NB;
  }
  team.split(total, 8, [&](int64_t b0, int64_t b1) {
    int i = 0;
    for (int64_t b = b0; b < b1; ++b) {
      while (i + 1 < count && b >= first[i + 1]) ++i;
      const Product<P>& p = ps[i];
      const int64_t n = (b - first[i]) * NB;
      if (n + NB <= p.N) {
        const bool next_full = b + 1 < b1 && n + 2 * NB <= p.N;  // the next block is this product's, whole
        block<P, NB, MB>(in, p, n, next_full ? p.w + (n + NB) * in.K : nullptr);
      } else {
        for (int64_t j = n; j < p.N; ++j) block<P, 1, MB>(in, p, j, nullptr);
      }
    }
  });
}

// ------------------------------------------------------------------ float32 weights in panels
//
// The other summation order, for float32 weights packed once in panels of 16 output features:
// panel p holds rows 16p .. 16p + 15 of W transposed, [K, 16], so one cache line holds one k of the
// panel's 16 features. A tile of R input rows by C vectors of output features (C / 2 consecutive
// panels) keeps one vector accumulator per 8 outputs and, for each k in turn, multiplies a broadcast
// input element into the panel's vectors: y[m, n] = (((0 + x[m,0] w[n,0]) + x[m,1] w[n,1]) + ...) + bias[n],
// one multiply-add after another over k, whatever M, the tile or the thread, so rows are invariant
// as in the dot order above (the two orders round differently; a model computes in one of them).
// The tile needs no horizontal sums and no input vectors: each step is C loads of weights, R
// broadcasts and R * C multiply-adds on registers. On Zen 3 (AVX2, 2 threads) SmolLM2's verify
// forwards took 0.83-0.89 of the dot order's time at one row, 0.93-0.99 at four and 0.78-0.80 at
// 16-32 (interleaved), with the weights packed once (a copy next to the original). Where 512-bit
// float32 vectors are built, a panel is one vector and a tile holds up to 24 accumulators (below).
#if defined(__AVX2__) && defined(__FMA__)
struct V8 {
  using T = __m256;
  static T zero() { return _mm256_setzero_ps(); }
  static T load(const float* p) { return _mm256_loadu_ps(p); }
  static T broadcast(const float* p) { return _mm256_broadcast_ss(p); }
  static T fma(T a, T b, T c) { return _mm256_fmadd_ps(a, b, c); }
  static T add(T a, T b) { return _mm256_add_ps(a, b); }
  static void store(float* p, T v) { _mm256_storeu_ps(p, v); }
};
#else
struct V8 {
  typedef float T __attribute__((vector_size(32)));
  static T zero() { return T{}; }
  static T load(const float* p) {
    T v;
    __builtin_memcpy(&v, p, sizeof(T));
    return v;
  }
  static T broadcast(const float* p) { return T{} + *p; }
  static T fma(T a, T b, T c) { return a * b + c; }
  static T add(T a, T b) { return a + b; }
  static void store(float* p, T v) { __builtin_memcpy(p, &v, sizeof(T)); }
};
#endif
constexpr int kPanel = 16;  // output features per panel

// Rows [0, R) of x [R, K] against the C / 2 consecutive panels from `panel` on: y [R, C * 8] (row
// stride ldy), the bias (or null) added after the last step. `pf`, when set, is `pf_lines` cache
// lines to prefetch into L2, spread evenly over the K steps: a share of the next group of panels,
// streaming in while this tile computes. The accumulators are named variables: GCC keeps an array of them in
// registers but also stores it to the stack on every step.
template <int R, int C>
inline void panel_tile(const float* x, const float* panel, int64_t K, const float* bias, float* y, int64_t ldy,
                       const char* pf, int64_t pf_lines) {
  static_assert(R >= 1 && R <= 6 && C >= 2 && C <= 8 && C % 2 == 0 && R * C <= 12, "tile out of range");
  const int64_t ps = K * kPanel;  // floats per panel
  const V8::T z = V8::zero();
  V8::T a00 = z, a01 = z, a02 = z, a03 = z, a04 = z, a05 = z, a06 = z, a07 = z;
  V8::T a10 = z, a11 = z, a12 = z, a13 = z, a14 = z, a15 = z;
  V8::T a20 = z, a21 = z, a22 = z, a23 = z;
  V8::T a30 = z, a31 = z, a40 = z, a41 = z, a50 = z, a51 = z;
  int64_t credit = 0;
  for (int64_t k = 0; k < K; ++k) {
    if (pf != nullptr)  // pf_lines / K lines a step
      for (credit += pf_lines; credit >= K; credit -= K, pf += 64) HARNESS_PREFETCH(pf);
    const float* wk = panel + k * kPanel;
    const V8::T w0 = V8::load(wk), w1 = V8::load(wk + 8);
    V8::T w2 = z, w3 = z, w4 = z, w5 = z, w6 = z, w7 = z;
    if constexpr (C > 2) w2 = V8::load(wk + ps), w3 = V8::load(wk + ps + 8);
    if constexpr (C > 4) w4 = V8::load(wk + 2 * ps), w5 = V8::load(wk + 2 * ps + 8);
    if constexpr (C > 6) w6 = V8::load(wk + 3 * ps), w7 = V8::load(wk + 3 * ps + 8);
#define HARNESS_PANEL_FMA(r, c) \
  if constexpr (C > c) a##r##c = V8::fma(b, w##c, a##r##c);
    {
      const V8::T b = V8::broadcast(x + k);
      HARNESS_PANEL_FMA(0, 0) HARNESS_PANEL_FMA(0, 1) HARNESS_PANEL_FMA(0, 2) HARNESS_PANEL_FMA(0, 3)
      HARNESS_PANEL_FMA(0, 4) HARNESS_PANEL_FMA(0, 5) HARNESS_PANEL_FMA(0, 6) HARNESS_PANEL_FMA(0, 7)
    }
    if constexpr (R > 1) {
      const V8::T b = V8::broadcast(x + K + k);
      HARNESS_PANEL_FMA(1, 0) HARNESS_PANEL_FMA(1, 1) HARNESS_PANEL_FMA(1, 2) HARNESS_PANEL_FMA(1, 3)
      HARNESS_PANEL_FMA(1, 4) HARNESS_PANEL_FMA(1, 5)
    }
    if constexpr (R > 2) {
      const V8::T b = V8::broadcast(x + 2 * K + k);
      HARNESS_PANEL_FMA(2, 0) HARNESS_PANEL_FMA(2, 1) HARNESS_PANEL_FMA(2, 2) HARNESS_PANEL_FMA(2, 3)
    }
    if constexpr (R > 3) {
      const V8::T b = V8::broadcast(x + 3 * K + k);
      HARNESS_PANEL_FMA(3, 0) HARNESS_PANEL_FMA(3, 1)
    }
    if constexpr (R > 4) {
      const V8::T b = V8::broadcast(x + 4 * K + k);
      HARNESS_PANEL_FMA(4, 0) HARNESS_PANEL_FMA(4, 1)
    }
    if constexpr (R > 5) {
      const V8::T b = V8::broadcast(x + 5 * K + k);
      HARNESS_PANEL_FMA(5, 0) HARNESS_PANEL_FMA(5, 1)
    }
#undef HARNESS_PANEL_FMA
  }
  // the panels are consecutive: output vector c is features 8c .. 8c + 7 of the tile
#define HARNESS_PANEL_STORE(r, c)                                                                   \
  if constexpr (R > r && C > c)                                                                     \
    V8::store(y + r * ldy + 8 * c, bias != nullptr ? V8::add(a##r##c, V8::load(bias + 8 * c)) : a##r##c);
  HARNESS_PANEL_STORE(0, 0) HARNESS_PANEL_STORE(0, 1) HARNESS_PANEL_STORE(0, 2) HARNESS_PANEL_STORE(0, 3)
  HARNESS_PANEL_STORE(0, 4) HARNESS_PANEL_STORE(0, 5) HARNESS_PANEL_STORE(0, 6) HARNESS_PANEL_STORE(0, 7)
  HARNESS_PANEL_STORE(1, 0) HARNESS_PANEL_STORE(1, 1) HARNESS_PANEL_STORE(1, 2) HARNESS_PANEL_STORE(1, 3)
  HARNESS_PANEL_STORE(1, 4) HARNESS_PANEL_STORE(1, 5)
  HARNESS_PANEL_STORE(2, 0) HARNESS_PANEL_STORE(2, 1) HARNESS_PANEL_STORE(2, 2) HARNESS_PANEL_STORE(2, 3)
  HARNESS_PANEL_STORE(3, 0) HARNESS_PANEL_STORE(3, 1) HARNESS_PANEL_STORE(4, 0) HARNESS_PANEL_STORE(4, 1)
  HARNESS_PANEL_STORE(5, 0) HARNESS_PANEL_STORE(5, 1)
#undef HARNESS_PANEL_STORE
}

#if defined(__AVX512F__) && HARNESS_F32_WIDTH == 512
// Where 512-bit float32 vectors are built, a panel's 16 features are one vector: a tile of R input
// rows by C consecutive panels keeps R * C accumulators (up to 24 of the 32 registers) and, per k,
// loads C vectors of weights and multiplies R broadcast input elements into them. Each element is the
// same chain of multiply-adds over k as in the 256-bit tile above, so the bits do not depend on the
// vector width either.
template <int R, int C>
inline void panel_tile16(const float* x, const float* panel, int64_t K, const float* bias, float* y, int64_t ldy,
                         const char* pf, int64_t pf_lines) {
  static_assert(R >= 1 && R <= 8 && C >= 1 && C <= 4 && R * C <= 24, "tile out of range");
  const int64_t ps = K * kPanel;  // floats per panel
  const __m512 z = _mm512_setzero_ps();
  __m512 a00 = z, a01 = z, a02 = z, a03 = z, a10 = z, a11 = z, a12 = z, a13 = z;
  __m512 a20 = z, a21 = z, a22 = z, a23 = z, a30 = z, a31 = z, a32 = z, a33 = z;
  __m512 a40 = z, a41 = z, a42 = z, a43 = z, a50 = z, a51 = z, a52 = z, a53 = z;
  __m512 a60 = z, a61 = z, a62 = z, a63 = z, a70 = z, a71 = z, a72 = z, a73 = z;
  int64_t credit = 0;
  for (int64_t k = 0; k < K; ++k) {
    if (pf != nullptr)  // pf_lines / K lines a step
      for (credit += pf_lines; credit >= K; credit -= K, pf += 64) HARNESS_PREFETCH(pf);
    const float* wk = panel + k * kPanel;
    const __m512 w0 = _mm512_loadu_ps(wk);
    __m512 w1 = z, w2 = z, w3 = z;
    if constexpr (C > 1) w1 = _mm512_loadu_ps(wk + ps);
    if constexpr (C > 2) w2 = _mm512_loadu_ps(wk + 2 * ps);
    if constexpr (C > 3) w3 = _mm512_loadu_ps(wk + 3 * ps);
#define HARNESS_PANEL16_ROW(r)                                                    \
  if constexpr (R > r) {                                                          \
    const __m512 b = _mm512_set1_ps(x[r * K + k]);                                \
    a##r##0 = _mm512_fmadd_ps(b, w0, a##r##0);                                    \
    if constexpr (C > 1) a##r##1 = _mm512_fmadd_ps(b, w1, a##r##1);               \
    if constexpr (C > 2) a##r##2 = _mm512_fmadd_ps(b, w2, a##r##2);               \
    if constexpr (C > 3) a##r##3 = _mm512_fmadd_ps(b, w3, a##r##3);               \
  }
    HARNESS_PANEL16_ROW(0) HARNESS_PANEL16_ROW(1) HARNESS_PANEL16_ROW(2) HARNESS_PANEL16_ROW(3)
    HARNESS_PANEL16_ROW(4) HARNESS_PANEL16_ROW(5) HARNESS_PANEL16_ROW(6) HARNESS_PANEL16_ROW(7)
#undef HARNESS_PANEL16_ROW
  }
#define HARNESS_PANEL16_STORE(r, c)                                                                      \
  if constexpr (R > r && C > c)                                                                          \
    _mm512_storeu_ps(y + r * ldy + kPanel * c,                                                           \
                     bias != nullptr ? _mm512_add_ps(a##r##c, _mm512_loadu_ps(bias + kPanel * c)) : a##r##c);
#define HARNESS_PANEL16_STORE_ROW(r) \
  HARNESS_PANEL16_STORE(r, 0) HARNESS_PANEL16_STORE(r, 1) HARNESS_PANEL16_STORE(r, 2) HARNESS_PANEL16_STORE(r, 3)
  HARNESS_PANEL16_STORE_ROW(0) HARNESS_PANEL16_STORE_ROW(1) HARNESS_PANEL16_STORE_ROW(2) HARNESS_PANEL16_STORE_ROW(3)
  HARNESS_PANEL16_STORE_ROW(4) HARNESS_PANEL16_STORE_ROW(5) HARNESS_PANEL16_STORE_ROW(6) HARNESS_PANEL16_STORE_ROW(7)
#undef HARNESS_PANEL16_STORE_ROW
#undef HARNESS_PANEL16_STORE
}
#endif

// A tile of R input rows by G consecutive panels, in the build's float32 vectors.
#if defined(__AVX512F__) && HARNESS_F32_WIDTH == 512
constexpr bool kPanelVectors512 = true;
#else
constexpr bool kPanelVectors512 = false;
#endif
template <int R, int G>
inline void panels_tile(const float* x, const float* panel, int64_t K, const float* bias, float* y, int64_t ldy,
                        const char* pf, int64_t pf_lines) {
#if defined(__AVX512F__) && HARNESS_F32_WIDTH == 512
  panel_tile16<R, G>(x, panel, K, bias, y, ldy, pf, pf_lines);
#else
  panel_tile<R, 2 * G>(x, panel, K, bias, y, ldy, pf, pf_lines);
#endif
}

// The rows of the next tile when `left` rows remain for `tiles_left` tiles: as even as they go
// (16 rows in tiles of up to 6: 6, 5, 5), so each tile keeps 8 to 12 chains in flight.
inline int64_t panel_rows(int64_t left, int64_t tiles_left) { return (left + tiles_left - 1) / tiles_left; }

template <int R, int G>
inline void panel_rows_tile(int64_t rows, const float* x, const float* panel, int64_t K, const float* bias, float* y,
                            int64_t ldy, const char* pf, int64_t pf_lines) {
  if constexpr (R >= 1) {
    if (rows == R)
      panels_tile<R, G>(x, panel, K, bias, y, ldy, pf, pf_lines);
    else
      panel_rows_tile<R - 1, G>(rows, x, panel, K, bias, y, ldy, pf, pf_lines);
  }
}

// Rows [0, M) in tiles of up to RT rows against the G consecutive panels from `panel` on, each tile
// prefetching its share of `pf` (the next G panels' lines, or null).
template <int RT, int G>
inline void panel_row_tiles(const Input<F32>& in, const float* panel, const float* bias, float* y, int64_t ldy,
                            const char* pf) {
  const int64_t K = in.K, tiles = (in.M + RT - 1) / RT, lines = G * K;
  for (int64_t m = 0, t = 0; m < in.M; ++t) {
    const int64_t rows = panel_rows(in.M - m, tiles - t);
    const int64_t l0 = t * lines / tiles, l1 = (t + 1) * lines / tiles;  // this tile's share of the lines
    panel_rows_tile<RT, G>(rows, in.x + m * K, panel, K, bias, y + m * ldy, ldy,
                           pf == nullptr ? nullptr : pf + l0 * 64, l1 - l0);
    m += rows;
  }
}

// Rows [0, M) against `panels` panels from panel index j of product p (G of them, or fewer at the
// product's end). A few rows (M >= 1 here): the whole group in one tile of M rows, reading its
// panels as streams (on Zen 3 a prefetch of the next group made SmolLM2's one- to three-row steps
// 10-20% slower). More (M = 0 here): the group in tiles of up to RT rows, each tile prefetching its
// share of the next group (`ahead`, or null) into L2, since the later tiles read this one from the
// caches while the memory would otherwise idle (on Zen 3, without that prefetch SmolLM2's 4- to
// 16-row forwards took 3-10% longer).
template <int M, int G, int RT>
inline void panel_group(const Input<F32>& in, const Product<F32>& p, int64_t j, int64_t panels, const float* ahead) {
  const int64_t K = in.K, ps = K * kPanel;
  const float* bias = p.bias != nullptr ? p.bias + j * kPanel : nullptr;
  if constexpr (M >= 1) {
    if (panels == G) {
      panels_tile<M, G>(in.x, p.w + j * ps, K, bias, p.y + j * kPanel, p.N, nullptr, 0);
    } else {
      for (int64_t g = 0; g < panels; ++g)
        panels_tile<M, 1>(in.x, p.w + (j + g) * ps, K, bias == nullptr ? nullptr : bias + g * kPanel,
                          p.y + (j + g) * kPanel, p.N, nullptr, 0);
    }
  } else if (panels == G) {
    panel_row_tiles<RT, G>(in, p.w + j * ps, bias, p.y + j * kPanel, p.N, reinterpret_cast<const char*>(ahead));
  } else {
    for (int64_t g = 0; g < panels; ++g)
      panel_row_tiles<kPanelVectors512 ? 8 : 6, 1>(in, p.w + (j + g) * ps,
                                                   bias == nullptr ? nullptr : bias + g * kPanel,
                                                   p.y + (j + g) * kPanel, p.N, nullptr);
  }
}

// The products of `ps` cut into groups of G panels, numbered one product after another: `first[i]` is
// product i's first group; returns how many there are.
template <class P>
int64_t panel_groups(const Product<P>* ps, int count, int64_t G, int64_t* first) {
  int64_t total = 0;
  for (int i = 0; i < count; ++i) {
    first[i] = total;
    total += (ps[i].N / kPanel + G - 1) / G;
  }
  return total;
}

// Every product of `ps` (all in panels, all sharing the input) in one split of their groups of G
// panels (M = 0: four or more rows in tiles of rows; see run_panels for G).
template <int M, int G, int RT = (G == 1 ? 6 : 3)>
void run_panel_groups(const Input<F32>& in, const Product<F32>* ps, int count, const Team& team) {
  int64_t first[8];  // first group id of each product (count <= 7)
  const int64_t total = panel_groups(ps, count, G, first);
  team.split(total, 1, [&](int64_t b0, int64_t b1) {
    int i = 0;
    for (int64_t b = b0; b < b1; ++b) {
      while (i + 1 < count && b >= first[i + 1]) ++i;
      const Product<F32>& p = ps[i];
      const int64_t panels = p.N / kPanel, j = (b - first[i]) * G, here = std::min<int64_t>(G, panels - j);
      const bool next_full = b + 1 < b1 && j + 2 * G <= panels;  // the next group is this product's, whole
      panel_group<M, G, RT>(in, p, j, here, M == 0 && next_full ? p.w + (j + G) * in.K * kPanel : nullptr);
    }
  });
}

// The tile shapes by rows. In 256-bit vectors, as measured on Zen 3 (SmolLM2's layers and head,
// interleaved): one to three rows in groups of two panels (1 x 4 streams as fast as four panels at a
// time and splits more evenly over the threads); 7-8 rows in tiles of up to 3 rows by two panels
// (0.84-0.89 of the dot kernel's time, against 0.93-0.94 in 4-row tiles of one panel); otherwise tiles
// of up to 6 rows of one panel (two panels at a time were no faster at 4-6 rows and slower at 10-16).
// In 512-bit vectors, as measured on an Intel Xeon with AMX (SmolLM2's verify forward, interleaved
// with the dot order): one row in groups of two panels; two or more in tiles of up to 8 rows by three
// panels (24 accumulators), each prefetching its share of the next group. Two and three rows as one
// tile of the group read as streams, as in 256-bit vectors, took 1.07-1.10 of the dot order's time;
// in tiles of rows they take what it takes. Groups of four panels in tiles of up to 6 rows, or of two
// in tiles of 8, were 2-5% slower at 16 rows than three in tiles of 8.
void run_panels(const Input<F32>& in, const Product<F32>* ps, int count, const Team& team) {
  if constexpr (kPanelVectors512) {
    if (in.M == 1)
      run_panel_groups<1, 2>(in, ps, count, team);
    else
      run_panel_groups<0, 3, 8>(in, ps, count, team);
    return;
  }
  if (in.M == 1)
    run_panel_groups<1, 2>(in, ps, count, team);
  else if (in.M == 2)
    run_panel_groups<2, 2>(in, ps, count, team);
  else if (in.M == 3)
    run_panel_groups<3, 2>(in, ps, count, team);
  else if (in.M == 7 || in.M == 8)
    run_panel_groups<0, 2>(in, ps, count, team);
  else
    run_panel_groups<0, 1>(in, ps, count, team);
}

// ----------------------------------------------------------------- bfloat16 weights in pairs
//
// A bfloat16 weight may also come packed in panels of 16 output features with k in pairs:
// [N / 16, K / 2, 16, 2], panel p's element [k / 2, n, k % 2] being W[16p + n, k], K a multiple of
// 32 (model.linear_kernel=streaming_panels packs them once). Each 32 k of a panel are then 16 rows
// of 64 bytes in the layout AMX's TDPBF16PS reads for its second operand, and where the build has
// AMX (and the OS grants the tile state) a product multiplies tiles of up to 16 input rows into
// them: each output element accumulates in one float32 element of a tile over k from zero, in the
// tile unit's own order (pairs of products; its denormals flushed), then the bias, then one
// rounding to bfloat16. A row of a tile is computed from that input row alone, and the split over
// threads is over panels, so rows are invariant whatever M, the tile or the thread (a test checks
// it bit for bit); the order differs from the dot order's, so the two round differently.
//
// The tile unit does the multiplications: a few rows cost what the read of the weights costs, and
// so do a few dozen (the dot order's vector multiply-adds run out at around 8 rows). Up to 16 rows
// run as one tile of rows against 4 panels at a time (4 accumulator tiles), 17-32 as two tiles of
// rows against 2 panels, more in passes of 32 rows over the same 2 panels (read again from the
// caches). Each thread loads its tile configuration for its share and releases the tiles after it.
//
// Without AMX the same layout is computed by a portable loop: one float32 chain of multiply-adds
// per output element over k in order (each pair's first element, then its second), far slower; it
// keeps the layout usable (and testable) on any CPU, and rounds differently from the tile unit.
constexpr int kPairK = 32;  // k per tile step: 16 pairs

// Whether a weight is bfloat16 in pairs ([N / 16, K / 2, 16, 2]).
bool in_pairs(const at::Tensor& w) {
  return w.dim() == 4 && w.size(2) == kPanel && w.size(3) == 2 && w.scalar_type() == at::kBFloat16;
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
// 16 float32 rounded to bfloat16 as the scalar `bf16(s)` rounds them (to nearest even, NaN to the
// quiet NaN torch writes)
inline __m256i round16(__m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(32767))), 16);
  r = _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), r, _mm512_set1_epi32(32704));
  return _mm512_cvtepi32_epi16(r);
}
#endif

// y[n0 .. n0 + 15] of one row = round(acc + bias), as the scalar `bf16(s)` rounds, 16 at a time where
// AVX-512 is built.
inline void finish16(const float* acc, const bf16* bias, bf16* y) {
#if defined(__AVX512F__) && defined(__AVX512BW__)
  __m512 v = _mm512_loadu_ps(acc);
  if (bias != nullptr) v = _mm512_add_ps(v, Vec::widen(reinterpret_cast<const uint16_t*>(bias)));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(y), round16(v));
#else
  for (int c = 0; c < kPanel; ++c) y[c] = bf16(bias != nullptr ? acc[c] + static_cast<float>(bias[c]) : acc[c]);
#endif
}

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
// Whether this process may use the tile registers (Linux grants their state on request, once).
bool amx_permitted() {
  static const bool ok = [] {
#if defined(__linux__)
    constexpr long kRequestPermission = 4131, kTileData = 18;  // ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA
    return syscall(SYS_arch_prctl, kRequestPermission, kTileData) == 0;
#else
    return true;
#endif
  }();
  return ok;
}

struct TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// The compiler does not see the tile instruction read the configuration's memory: without the
// barrier GCC may drop the stores that fill it where the function that fills it is not inlined (the
// instruction then faults on a configuration of zero columns).
inline void load_tile_config(const TileConfig& cfg) {
  asm volatile("" : : "r"(&cfg) : "memory");
  _tile_loadconfig(&cfg);
}

// The configuration for input tiles of r0 and r1 rows (r1 = 0: one tile of rows, 4 panels at a
// time: accumulators 0-3, input 4, weights 5-7; else two, 2 panels: accumulators 0-3 as (tile of
// rows, panel) (0, 0), (0, 1), (1, 0), (1, 1), inputs 4 and 5, weights 6 and 7).
void configure_tiles(int r0, int r1) {
  TileConfig cfg;
  auto set = [&](int t, int rows) {
    cfg.rows[t] = static_cast<uint8_t>(rows);
    cfg.colsb[t] = 64;
  };
  if (r1 == 0) {
    for (int t = 0; t < 5; ++t) set(t, r0);
    for (int t = 5; t < 8; ++t) set(t, 16);
  } else {
    set(0, r0), set(1, r0), set(2, r1), set(3, r1), set(4, r0), set(5, r1), set(6, 16), set(7, 16);
  }
  load_tile_config(cfg);
}

// The weights two tile steps (2 KB) ahead in each of the G panels a tile step reads, prefetched into
// L1: the tile loads alone leave the memory idle between steps (on the Xeon with AMX, SmolLM2's
// bfloat16 products took 0.80-0.85 of the time with it at 1-32 rows; 1 KB and 3 KB ahead were no
// better, 4-8 KB worse; prefetching the next group of panels into L2 as well made them slower). A
// prefetch past the weights' end is harmless (it does not fault).
constexpr int kPairPrefetchBytes = 2048;
template <int G>
inline void pair_prefetch(const bf16* wk, int64_t ps) {
  for (int g = 0; g < G; ++g) {
    const char* p = reinterpret_cast<const char*>(wk + g * ps) + kPairPrefetchBytes;
    for (int line = 0; line < 1024; line += 64) _mm_prefetch(p + line, _MM_HINT_T0);
  }
}

// rows [0, R) (R <= 16, the configuration's) of x [., K] against G <= 4 consecutive panels from
// `w` (ps elements each): accumulators to `acc` [G][16 x 16]. One or two panels read their weights
// into tiles 6 and 7, so they run under either configuration.
template <int G>
inline void pairs_one_tile(const bf16* x, int64_t K, const bf16* w, int64_t ps, float* acc) {
  _tile_zero(0);
  if constexpr (G > 1) _tile_zero(1);
  if constexpr (G > 2) _tile_zero(2);
  if constexpr (G > 3) _tile_zero(3);
  const int64_t lda = K * 2;
  for (int64_t k = 0; k < K; k += kPairK) {
    const bf16* wk = w + k * kPanel;  // 32 k of a panel: 16 pairs of 16 features
    pair_prefetch<G>(wk, ps);
    _tile_loadd(4, x + k, lda);
    if constexpr (G <= 2) {
      _tile_loadd(6, wk, 64);
      _tile_dpbf16ps(0, 4, 6);
      if constexpr (G > 1) {
        _tile_loadd(7, wk + ps, 64);
        _tile_dpbf16ps(1, 4, 7);
      }
    } else {
      _tile_loadd(5, wk, 64);
      _tile_dpbf16ps(0, 4, 5);
      _tile_loadd(6, wk + ps, 64);
      _tile_dpbf16ps(1, 4, 6);
      _tile_loadd(7, wk + 2 * ps, 64);
      _tile_dpbf16ps(2, 4, 7);
      if constexpr (G > 3) {
        _tile_loadd(5, wk + 3 * ps, 64);
        _tile_dpbf16ps(3, 4, 5);
      }
    }
  }
  _tile_stored(0, acc, 64);
  if constexpr (G > 1) _tile_stored(1, acc + 256, 64);
  if constexpr (G > 2) _tile_stored(2, acc + 512, 64);
  if constexpr (G > 3) _tile_stored(3, acc + 768, 64);
}

// rows [0, 16 + R1) of x in two tiles of rows against G <= 2 panels: acc [2][G][16 x 16].
template <int G>
inline void pairs_two_tiles(const bf16* x, int64_t K, const bf16* w, int64_t ps, float* acc) {
  _tile_zero(0);
  _tile_zero(2);
  if constexpr (G > 1) {
    _tile_zero(1);
    _tile_zero(3);
  }
  const int64_t lda = K * 2;
  const bf16* x1 = x + 16 * K;
  for (int64_t k = 0; k < K; k += kPairK) {
    const bf16* wk = w + k * kPanel;
    pair_prefetch<G>(wk, ps);
    _tile_loadd(4, x + k, lda);
    _tile_loadd(5, x1 + k, lda);
    _tile_loadd(6, wk, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(2, 5, 6);
    if constexpr (G > 1) {
      _tile_loadd(7, wk + ps, 64);
      _tile_dpbf16ps(1, 4, 7);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
  _tile_stored(0, acc, 64);
  _tile_stored(2, acc + 2 * 256, 64);
  if constexpr (G > 1) {
    _tile_stored(1, acc + 256, 64);
    _tile_stored(3, acc + 3 * 256, 64);
  }
}
#else
bool amx_permitted() { return false; }  // no tiles in this build
#endif

// Rows [0, R) (R <= 16) of x against panel `w`: the portable order (see above), acc [16 x 16].
inline void pairs_portable(const bf16* x, int64_t R, int64_t K, const bf16* w, float* acc) {
  for (int64_t r = 0; r < R; ++r) {
    float a[kPanel] = {};
    const bf16* xr = x + r * K;
    for (int64_t k = 0; k < K; k += 2) {
      const float x0 = static_cast<float>(xr[k]), x1 = static_cast<float>(xr[k + 1]);
      const bf16* wk = w + k * kPanel;
      for (int c = 0; c < kPanel; ++c) {
        a[c] = std::fma(x0, static_cast<float>(wk[2 * c]), a[c]);
        a[c] = std::fma(x1, static_cast<float>(wk[2 * c + 1]), a[c]);
      }
    }
    std::memcpy(acc + r * kPanel, a, sizeof a);
  }
}

// Rows [0, in.M) of the input against panels [j, j + here) of p (here <= G: 4 for up to 16 rows,
// else 2), written to p.y.
// `shape`: the input tiles' rows the thread's tile configuration holds now (loaded again on a change).
template <int G>
void pair_group(const Input<BF16>& in, const Product<BF16>& p, int64_t j, int64_t here, int (&shape)[2]) {
  const int64_t K = in.K, ps = K * kPanel;  // elements per panel
  const bf16* w = p.w + j * ps;
  alignas(64) float acc[4 * 256];
  auto finish = [&](const float* tile, int64_t m, int64_t rows, int64_t g) {
    const bf16* bias = p.bias == nullptr ? nullptr : p.bias + (j + g) * kPanel;
    for (int64_t r = 0; r < rows; ++r) finish16(tile + r * kPanel, bias, p.y + (m + r) * p.N + (j + g) * kPanel);
  };
  if (!amx_permitted()) {
    for (int64_t g = 0; g < here; ++g)
      for (int64_t m = 0; m < in.M; m += 16) {
        const int64_t rows = std::min<int64_t>(16, in.M - m);
        pairs_portable(in.x + m * K, rows, K, w + g * ps, acc);
        finish(acc, m, rows, g);
      }
    return;
  }
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
  if constexpr (G == 4) {
    switch (here) {
      case 4: pairs_one_tile<4>(in.x, K, w, ps, acc); break;
      case 3: pairs_one_tile<3>(in.x, K, w, ps, acc); break;
      case 2: pairs_one_tile<2>(in.x, K, w, ps, acc); break;
      default: pairs_one_tile<1>(in.x, K, w, ps, acc);
    }
    for (int64_t g = 0; g < here; ++g) finish(acc + g * 256, 0, in.M, g);
  } else {
    // Passes of up to 32 rows. Past 32 rows every pass has full tiles: the last one reads the 16 or
    // 32 rows that end at the input's last row, and the rows the pass before it computed come out
    // again, the same, and are written once. So one tile configuration serves the whole call
    // (loading one twice for every group of panels cost about 1 ms of a 33-row SmolLM2 forward).
    for (int64_t m = 0; m < in.M; m += 32) {
      const int64_t start = in.M > 32 ? std::min(m, in.M - (in.M - m > 16 ? 32 : 16)) : m;
      const int r0 = static_cast<int>(std::min<int64_t>(16, in.M - start));
      const int r1 = static_cast<int>(std::min<int64_t>(16, in.M - start - r0));
      // one tile of rows runs under a configuration of two whose first has its rows
      if (shape[0] != r0 || (r1 != 0 && shape[1] != r1)) {
        configure_tiles(r0, r1);
        shape[0] = r0, shape[1] = r1;
      }
      auto finish_tile = [&](const float* tile, int64_t first, int64_t rows, int64_t g) {
        const int64_t done = std::clamp<int64_t>(m - first, 0, rows);  // rows written already
        if (done < rows) finish(tile + done * kPanel, first + done, rows - done, g);
      };
      if (r1 == 0) {
        if (here == 2) pairs_one_tile<2>(in.x + start * K, K, w, ps, acc);
        else pairs_one_tile<1>(in.x + start * K, K, w, ps, acc);
        for (int64_t g = 0; g < here; ++g) finish_tile(acc + g * 256, start, r0, g);
      } else {
        if (here == 2) pairs_two_tiles<2>(in.x + start * K, K, w, ps, acc);
        else pairs_two_tiles<1>(in.x + start * K, K, w, ps, acc);
        for (int64_t g = 0; g < here; ++g) {
          finish_tile(acc + g * 256, start, r0, g);
          finish_tile(acc + (2 + g) * 256, start + 16, r1, g);
        }
      }
    }
  }
#endif
}

// Every product of `ps` (all in pairs, all sharing the input; M <= 64) in one split of their panels,
// each thread's share run in groups of up to G panels (a product's last group of a share may be
// smaller). Splitting panels rather than whole groups keeps the threads' shares within a panel of
// each other: SmolLM2's o and down products (36 panels) split as 5 groups of four against 4 kept one
// thread waiting for the other for a fifth of the product, in every step of up to 16 rows.
template <int G>
void run_pair_groups(const Input<BF16>& in, const Product<BF16>* ps, int count, const Team& team) {
  int64_t first[8];  // first panel of each product, numbered one product after another (count <= 7)
  int64_t total = 0;
  for (int i = 0; i < count; ++i) {
    first[i] = total;
    total += ps[i].N / kPanel;
  }
  team.split(total, 1, [&](int64_t b0, int64_t b1) {
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
    const bool tiles = amx_permitted();
    if (tiles && G == 4) configure_tiles(static_cast<int>(in.M), 0);
#endif
    int shape[2] = {G == 4 ? static_cast<int>(in.M) : -1, 0};
    int i = 0;
    for (int64_t b = b0; b < b1;) {
      while (i + 1 < count && b >= first[i + 1]) ++i;
      const int64_t end = std::min(b1, i + 1 < count ? first[i + 1] : total);  // this product's panels here
      const int64_t here = std::min<int64_t>(G, end - b);
      pair_group<G>(in, ps[i], b - first[i], here, shape);
      b += here;
    }
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
    if (tiles) _tile_release();
#endif
  });
}

void run_pairs(const Input<BF16>& in, const Product<BF16>* ps, int count, const Team& team) {
  if (in.M <= 16)
    run_pair_groups<4>(in, ps, count, team);
  else
    run_pair_groups<2>(in, ps, count, team);
}

// The register tile for M rows: 1 x 16 for one row (or 16 tiles of 1 x 1 in sequence, per the
// dtype's policy), 2 x 8 for two, 6 x 4 from three on, the last rows (M mod 6) in one smaller tile (a
// block of the split is one tile's weight rows). Those are AVX-512's shapes (32 vector registers);
// with 16 (AVX2 and others) 2 x 4 and 4 x 3, whose accumulators, weight vectors and input vector
// fit the registers: on Zen 3 SmolLM2's products at 16 rows took 7-9% less time (bf16: 4-8% at
// 2-16 rows), at 2-8 float32 rows within +-3%. Fewer input rows need more weight rows per tile to
// keep enough independent accumulators and loads in flight (measured on Zen 4: a one-row bfloat16
// product streams about a quarter faster in 1 x 16 tiles than in 1 x 4); more rows per tile reuse
// each weight vector more often (SmolLM2's layers at 8-32 rows: 6 x 4 tiles 3-18% faster than 4 x 4
// in float32, up to 9% in bfloat16, by interleaved A/B). The shape changes which elements a tile
// holds, never the order an element is reduced in.
#if defined(__AVX512F__)
constexpr int kTwoRowTile = 8, kTileRows = 6, kTileCols = 4;
#else
constexpr int kTwoRowTile = 4, kTileRows = 4, kTileCols = 3;
#endif

template <class P>
void run_products(const Input<P>& in, const Product<P>* ps, int count, const Team& team = Team{}) {
  for (int64_t m0 = 0; m0 < in.M; m0 += kChunkRows) {  // one pass over the weights per 64 rows
    const Input<P> part{in.x + m0 * in.K, std::min(kChunkRows, in.M - m0), in.K, in.kv};
    Product<P> rows[8];
    for (int i = 0; i < count; ++i)
      rows[i] = Product<P>{ps[i].w, ps[i].bias, ps[i].y + m0 * ps[i].N, ps[i].N, ps[i].panels};
    if (ps[0].panels) {  // the callers' checks: every product of a call in panels, or none
      if constexpr (std::is_same_v<P, F32>)
        run_panels(part, rows, count, team);
      else
        run_pairs(part, rows, count, team);
      continue;
    }
    if (part.M == 1)
      run_blocks<P, P::one_row_cols, 1>(part, rows, count, team);
    else if (part.M == 2)
      run_blocks<P, kTwoRowTile, 2>(part, rows, count, team);
    else
      run_blocks<P, kTileCols, kTileRows>(part, rows, count, team);
  }
}

template <class P>
Input<P> input_of(const typename P::X* x, int64_t M, int64_t K) {
  return Input<P>{x, M, K, K - K % P::step};
}

bool is_cpu(const at::Tensor& t, at::ScalarType dtype) { return t.scalar_type() == dtype && t.device().is_cpu(); }

// Whether a weight is packed: float32 in panels ([N / 16, K, 16]) or bfloat16 in pairs ([N / 16, K / 2,
// 16, 2]) rather than [N, K]; its N and K either way.
bool in_panels(const at::Tensor& w) {
  return (w.dim() == 3 && w.size(2) == kPanel && w.scalar_type() == at::kFloat) || in_pairs(w);
}
int64_t rows_of(const at::Tensor& w) { return in_panels(w) ? w.size(0) * kPanel : w.size(0); }
int64_t cols_of(const at::Tensor& w) { return in_pairs(w) ? w.size(1) * 2 : w.size(1); }

// The dtype both products of a streaming_linear call run in (float32 or bfloat16), or Undefined.
at::ScalarType streaming_dtype(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  for (at::ScalarType dtype : {at::kFloat, at::kBFloat16})
    if (is_cpu(x, dtype) && is_cpu(weight, dtype) && (!bias.has_value() || is_cpu(*bias, dtype))) return dtype;
  return at::ScalarType::Undefined;
}

template <class P>
void linear_rows(const at::Tensor& xc, const at::Tensor& wc, const at::Tensor& bc, at::Tensor& y) {
  using T = typename P::Wt;
  const Product<P> p{wc.data_ptr<T>(), bc.defined() ? bc.data_ptr<T>() : nullptr, y.data_ptr<T>(), rows_of(wc),
                     in_panels(wc)};
  run_products<P>(input_of<P>(xc.data_ptr<T>(), xc.size(0), xc.size(1)), &p, 1);
}

at::Tensor streaming_linear(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(weight.dim() == 2 || in_panels(weight),
              "streaming_linear: weight must be [N, K], float32 in panels [N / 16, K, 16] or bfloat16 in pairs "
              "[N / 16, K / 2, 16, 2]; got ",
              weight.sizes());
  const int64_t K = cols_of(weight);
  TORCH_CHECK(x.size(-1) == K, "streaming_linear: x has ", x.size(-1), " features, weight ", K);
  const int64_t rows = x.numel() / std::max<int64_t>(x.size(-1), 1), N = rows_of(weight);
  const at::ScalarType dtype = streaming_dtype(x, weight, bias);
  if (weight.dim() > 2) {
    const bool pairs = in_pairs(weight);
    TORCH_CHECK(dtype == weight.scalar_type() && (!bias.has_value() || bias->numel() == N),
                "streaming_linear: a weight in ", pairs ? "pairs takes a bfloat16" : "panels takes a float32",
                " CPU input and bias of ", N, " features");
    TORCH_CHECK(!pairs || K % kPairK == 0, "streaming_linear: a weight in pairs needs K a multiple of ", kPairK,
                "; got ", K);
    if (rows == 0 || x.size(-1) == 0) {  // no rows, or an empty sum: the bias alone, as at::linear gives
      std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
      shape.back() = N;
      at::Tensor y = at::zeros(shape, x.options());
      return bias.has_value() ? y.add_(*bias) : y;
    }
  }
  TORCH_CHECK(!bias.has_value() || bias->numel() == N, "streaming_linear: a bias of ", N, " features expected, got ",
              bias.has_value() ? bias->numel() : 0);
  if (dtype == at::ScalarType::Undefined || rows == 0) return at::linear(x, weight, bias);
  const at::Tensor xc = x.reshape({rows, x.size(-1)}).contiguous();
  const at::Tensor wc = weight.contiguous();
  const at::Tensor bc = bias.has_value() ? bias->contiguous() : at::Tensor();
  std::vector<int64_t> out_shape(x.sizes().begin(), x.sizes().end());
  out_shape.back() = N;
  at::Tensor y = at::empty({rows, N}, x.options());
  if (dtype == at::kFloat)
    linear_rows<F32>(xc, wc, bc, y);
  else
    linear_rows<BF16>(xc, wc, bc, y);
  return y.view(out_shape);
}

// ---------------------------------------------------------------------------------- the layer

// The sum of squares of h[0, d) in float32: four vector accumulators over blocks of four vectors
// (multiply-adds), added in a fixed order, then the scalar tail. The order depends on d alone, so a
// row's sum on its row alone. (One chain of scalar additions, 576 a row twice a layer, took about 3%
// of the samples of a 32-row bfloat16 verify of SmolLM2 on the Xeon with AMX under perf; this, 1%.)
template <class T>
float sum_of_squares(const T* h, int64_t d) {
  typename Vec::T acc[4] = {Vec::zero(), Vec::zero(), Vec::zero(), Vec::zero()};
  int64_t i = 0;
  for (; i + 4 * W <= d; i += 4 * W)
    for (int c = 0; c < 4; ++c) {
      const typename Vec::T x = loadv(h + i + c * W);
      acc[c] = Vec::fma(x, x, acc[c]);
    }
  for (; i + W <= d; i += W) {
    const typename Vec::T x = loadv(h + i);
    acc[0] = Vec::fma(x, x, acc[0]);
  }
  float ss = Vec::sum((acc[0] + acc[1]) + (acc[2] + acc[3]));
  for (; i < d; ++i) ss += load1(h + i) * load1(h + i);
  return ss;
}

// out [M, d] = RMSNorm(h) * weight, as LlamaRMSNorm: h * rsqrt(mean(h^2) + eps) in float32 (the
// mean's sum in sum_of_squares' order), rounded to T, then weight * it
template <class T>
void rms_norm(const T* h, const T* weight, T* out, int64_t M, int64_t d, float eps) {
  for (int64_t m = 0; m < M; ++m) {
    const T* hm = h + m * d;
    const float r = 1.f / std::sqrt(sum_of_squares(hm, d) / static_cast<float>(d) + eps);
    for (int64_t i = 0; i < d; ++i) store1(out + m * d + i, load1(weight + i) * rnd(load1(hm + i) * r, T{}));
  }
}

// x [M, H * dh] in place: x * cos + rotate_half(x) * sin per head, cos / sin [M, dh]
template <class T>
void rotary(T* x, const T* cos, const T* sin, int64_t M, int64_t H, int64_t dh) {
  const int64_t half = dh / 2;
  for (int64_t m = 0; m < M; ++m)
    for (int64_t h = 0; h < H; ++h) {
      T* v = x + (m * H + h) * dh;
      const T* c = cos + m * dh;
      const T* s = sin + m * dh;
      for (int64_t i = 0; i < half; ++i) {
        const float a = load1(v + i), b = load1(v + i + half);
        store1(v + i, rnd(a * load1(c + i), T{}) + rnd((-b) * load1(s + i), T{}));
        store1(v + i + half, rnd(b * load1(c + i + half), T{}) + rnd(a * load1(s + i + half), T{}));
      }
    }
}

template <class T>
float dot(const T* a, const T* b, int64_t n) {
  typename Vec::T acc = Vec::zero();
  int64_t i = 0;
  for (; i + W <= n; i += W) acc = Vec::fma(loadv(a + i), loadv(b + i), acc);
  float s = Vec::sum(acc);
  for (; i < n; ++i) s += load1(a + i) * load1(b + i);
  return s;
}

// out += p * v (n floats)
template <class T>
void axpy(float* out, float p, const T* v, int64_t n) {
  const typename Vec::T pv = Vec::set1(p);
  int64_t i = 0;
  for (; i + W <= n; i += W) Vec::store(out + i, Vec::fma(pv, loadv(v + i), Vec::load(out + i)));
  for (; i < n; ++i) out[i] += p * load1(v + i);
}

// exp over float32 vectors, the same code for every element of every call (an element's result does
// not depend on where it sits in an array), so the layer's softmax and SiLU stay row-invariant.
// Cody-Waite reduction x = n ln2 + r with n rounded to nearest, the Cephes minimax polynomial for
// e^r on [-ln2/2, ln2/2] (within 2 ulp of the exact value), then the exponent bits of 2^n; below
// -87.3 (a result under the smallest normal float) it is 0, above 88.38 infinity. Written with
// GCC/Clang vector extensions, so each instruction set's vector type runs it.
inline Vec::T exp_vec(Vec::T x) {
  typedef int32_t I __attribute__((vector_size(sizeof(Vec::T))));
  const Vec::T zero = Vec::zero();
  const I under = x < zero - 87.33654f, over = x > zero + 88.3762626647949f;
  Vec::T xc = x;
  xc = under ? zero - 87.33654f : xc;
  xc = over ? zero + 88.3762626647949f : xc;
  const Vec::T big = zero + 12582912.f;  // 1.5 * 2^23: adding it rounds to an integer
  const Vec::T n = (xc * 1.44269504088896341f + big) - big;
  const Vec::T r = (xc - n * 0.693359375f) - n * -2.12194440e-4f;
  Vec::T p = zero + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const Vec::T y = (p * (r * r) + r) + 1.f;
  const I bits = (__builtin_convertvector(n, I) + 127) << 23;
  Vec::T scale;
  __builtin_memcpy(&scale, &bits, sizeof(scale));
  Vec::T e = y * scale;
  e = under ? zero : e;
  return over ? zero + INFINITY : e;
}

// v[i] = exp(v[i]) for i < n; a partial last vector is computed in a padded copy
inline void exp_inplace(float* v, int64_t n) {
  int64_t i = 0;
  for (; i + W <= n; i += W) Vec::store(v + i, exp_vec(Vec::load(v + i)));
  if (i < n) {
    float tail[W] = {};
    std::copy(v + i, v + n, tail);
    Vec::store(tail, exp_vec(Vec::load(tail)));
    std::copy(tail, tail + (n - i), v + i);
  }
}

template <class T>
struct Attention {
  const T* q;      // [B, R, Hq, dh]
  const T* keys;   // [B, Hkv, cap, dh]
  const T* values;
  const bool* mask;  // [B, R, L] (True = attend) or null: row r sees slots [0, start + r]
  T* out;            // [B, R, Hq, dh]
  int64_t B, R, Hq, Hkv, dh, cap, start, L;  // L = start + R keys
  float scaling;
};

// Scores, softmax and the weighted sum of values in float32 for one (batch, head) and rows
// [r0, r0 + RB) of the forward; the output rounded to T once. Every (row, key) score is reduced as
// dot() reduces it (one accumulator over the head's NV vectors, the horizontal sum, the scaling) and
// every row's weighted sum runs over its keys in order, so a row's output is the same bits whichever
// rows share its block, its forward or its thread. The rows of a block share each key and value
// vector load, and their value sums stay in registers (the head's width is NV vectors).
template <class T, int NV, int RB>
void attend_rows(const Attention<T>& a, int64_t b, int64_t h, int64_t r0, float* scores) {
  const int64_t rep = a.Hq / a.Hkv, L = a.L, dh = a.dh;
  const int64_t base = (b * a.Hkv + h / rep) * a.cap * dh;
  const T* keys = a.keys + base;
  const T* values = a.values + base;
  const bool* allowed[RB];
  int64_t seen[RB];
  float top[RB];
  Vec::T qv[RB][NV];
  int64_t keys_seen = 0;
  for (int i = 0; i < RB; ++i) {
    const int64_t r = r0 + i;
    allowed[i] = a.mask != nullptr ? a.mask + (b * a.R + r) * L : nullptr;
    seen[i] = a.mask != nullptr ? L : a.start + r + 1;
    keys_seen = std::max(keys_seen, seen[i]);
    top[i] = -INFINITY;
    const T* q = a.q + ((b * a.R + r) * a.Hq + h) * dh;
    for (int v = 0; v < NV; ++v) qv[i][v] = loadv(q + v * W);
  }
  auto sees = [&](int i, int64_t j) { return j < seen[i] && (allowed[i] == nullptr || allowed[i][j]); };
  for (int64_t j = 0; j < keys_seen; ++j) {
    const T* k = keys + j * dh;
    __builtin_prefetch(k + 8 * dh, 0, 3);
    Vec::T kv[NV];
    for (int v = 0; v < NV; ++v) kv[v] = loadv(k + v * W);
    for (int i = 0; i < RB; ++i) {
      if (!sees(i, j)) continue;
      Vec::T acc = Vec::zero();
      for (int v = 0; v < NV; ++v) acc = Vec::fma(qv[i][v], kv[v], acc);
      const float score = Vec::sum(acc) * a.scaling;
      scores[i * L + j] = score;
      top[i] = std::max(top[i], score);
    }
  }
  for (int i = 0; i < RB; ++i) {
    float* row = scores + i * L;
    for (int64_t j = 0; j < seen[i]; ++j) row[j] = sees(i, j) ? row[j] - top[i] : -INFINITY;
    exp_inplace(row, seen[i]);
  }
  Vec::T acc[RB][NV];
  float total[RB];
  for (int i = 0; i < RB; ++i) {
    total[i] = 0.f;
    for (int v = 0; v < NV; ++v) acc[i][v] = Vec::zero();
  }
  for (int64_t j = 0; j < keys_seen; ++j) {
    const T* val = values + j * dh;
    __builtin_prefetch(val + 8 * dh, 0, 3);
    Vec::T vv[NV];
    for (int v = 0; v < NV; ++v) vv[v] = loadv(val + v * W);
    for (int i = 0; i < RB; ++i) {
      if (!sees(i, j)) continue;
      const float p = scores[i * L + j];
      total[i] += p;
      const Vec::T pv = Vec::set1(p);
      for (int v = 0; v < NV; ++v) acc[i][v] = Vec::fma(pv, vv[v], acc[i][v]);
    }
  }
  for (int i = 0; i < RB; ++i) {
    float sum[NV * W];
    for (int v = 0; v < NV; ++v) Vec::store(sum + v * W, acc[i][v]);
    const float inv = total[i] > 0.f ? 1.f / total[i] : 0.f;  // a row that sees no key: 0, as SDPA
    T* out = a.out + ((b * a.R + r0 + i) * a.Hq + h) * dh;
    for (int64_t e = 0; e < dh; ++e) store1(out + e, sum[e] * inv);
  }
}

// Every (batch, head) in blocks of RB rows (the last rows in a smaller block), split over the team.
template <class T, int NV, int RB>
void attend_blocked(const Attention<T>& a, const Team& team) {
  const int64_t blocks = (a.R + RB - 1) / RB;
  team.split(a.B * a.Hq * blocks, 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> scores(RB * a.L);
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t rb = t % blocks, h = (t / blocks) % a.Hq, b = t / (blocks * a.Hq);
      const int64_t r0 = rb * RB, n = std::min<int64_t>(RB, a.R - r0);
      if (n == RB) attend_rows<T, NV, RB>(a, b, h, r0, scores.data());
      else if (n == 3) attend_rows<T, NV, 3>(a, b, h, r0, scores.data());
      else if (n == 2) attend_rows<T, NV, 2>(a, b, h, r0, scores.data());
      else attend_rows<T, NV, 1>(a, b, h, r0, scores.data());
    }
  });
}

// The same attention for the heads of one key / value head together, in three steps with a barrier
// after each, for forwards whose scores fit `scratch` ([B, R, Hq, L] scores, then [B, R, Hq] sums):
// (1) every score, split over (batch, key head, run of keys): each key vector is read once for every
// query head of its group and every row; (2) per (batch, row, head) the maximum, the exponentials
// and their sum, in key order; (3) the weighted sums of values, split over (batch, key head, slice
// of the head's width holding 128 bytes of float32 sums, block of query (row, head) pairs sized so
// that the block's sums fill twelve vector registers): each value slice is read once per block (a
// one-row step of three query heads per key head is one block). On Zen 3 blocks of three pairs
// rather than two took 0.8-0.9 of the value sums' time at 2,048-8,192 keys, for 1 to 16 rows. A
// decode step's few heads are so spread evenly over the threads, and each key and value
// is read from memory once per step rather than once per query head. Every score, maximum, sum and
// output element is computed by the operations attend_rows uses, in its order, so both give the
// same bits (the split only changes which thread computes what).
constexpr int64_t kKeysPerItem = 64;
#ifndef HARNESS_GROUPED_ATTENTION_BYTES  // the scratch attend_grouped may use (0: never grouped)
#define HARNESS_GROUPED_ATTENTION_BYTES (int64_t{64} << 20)
#endif
constexpr int64_t kGroupedScratchBytes = HARNESS_GROUPED_ATTENTION_BYTES;

inline int64_t grouped_scratch_floats(int64_t B, int64_t R, int64_t Hq, int64_t L) { return B * R * Hq * L; }

template <class T, int NV>
void attend_grouped(const Attention<T>& a, float* scratch, const Team& team) {
  const int64_t rep = a.Hq / a.Hkv, L = a.L, dh = a.dh, R = a.R, pairs = R * rep;
  const int64_t keys_max = a.mask != nullptr ? L : a.start + R;
  auto seen_of = [&](int64_t r) { return a.mask != nullptr ? L : a.start + r + 1; };
  auto allowed_of = [&](int64_t b, int64_t r) { return a.mask != nullptr ? a.mask + (b * R + r) * L : nullptr; };
  auto row_of = [&](int64_t b, int64_t r, int64_t h) { return (b * R + r) * a.Hq + h; };  // (b, r, h) -> row
  const int64_t runs = (keys_max + kKeysPerItem - 1) / kKeysPerItem;
  team.split(a.B * a.Hkv * runs, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t run = t % runs, g = (t / runs) % a.Hkv, b = t / (runs * a.Hkv);
      const T* keys = a.keys + (b * a.Hkv + g) * a.cap * dh;
      const int64_t j0 = run * kKeysPerItem, j1 = std::min(keys_max, j0 + kKeysPerItem);
      // bfloat16 keys are widened to float32 (exactly) once per run, not once per pair: the pairs
      // then read the same values without a conversion each (on the Xeon with AMX, SmolLM2's 32-row
      // verify over 256 keys spent about 0.7 of the scores' time, timed against the products of the
      // same forward)
      const float* run_keys = nullptr;
      if constexpr (!std::is_same_v<T, float>) {
        thread_local std::vector<float> widened;
        widened.resize(static_cast<size_t>((j1 - j0) * dh));
        for (int64_t i = 0; i < (j1 - j0) * dh; i += W) Vec::store(widened.data() + i, loadv(keys + j0 * dh + i));
        run_keys = widened.data();  // key j at (j - j0) * dh
      }
      for (int64_t pr = 0; pr < pairs; ++pr) {
        const int64_t r = pr / rep, h = g * rep + pr % rep;
        const int64_t seen = std::min(j1, seen_of(r));
        const bool* allowed = allowed_of(b, r);
        const T* q = a.q + row_of(b, r, h) * dh;
        Vec::T qv[NV];
        for (int v = 0; v < NV; ++v) qv[v] = loadv(q + v * W);
        float* row = scratch + row_of(b, r, h) * L;
        // Eight keys at a time, `key_at(j)` the first float of key j. Float32 keys: the first pair
        // streams the run's keys from memory one at a time, the others find them in the cache and take
        // eight at a time; bfloat16 keys, widened above, eight at a time for every pair. Either way
        // each score is reduced as dot() reduces it.
        int64_t j = j0;
        auto eight_at_a_time = [&](auto key_at) {
          for (; j + 8 <= seen; j += 8) {
            Vec::T acc[8];
            for (int c = 0; c < 8; ++c) acc[c] = Vec::zero();
            for (int v = 0; v < NV; ++v)
              for (int c = 0; c < 8; ++c) acc[c] = Vec::fma(qv[v], loadv(key_at(j + c) + v * W), acc[c]);
            float sums[8];
            Vec::sum8(acc, sums);
            for (int c = 0; c < 8; ++c)
              row[j + c] = allowed != nullptr && !allowed[j + c] ? -INFINITY : sums[c] * a.scaling;
          }
        };
        if (run_keys != nullptr)
          eight_at_a_time([&](int64_t jj) { return run_keys + (jj - j0) * dh; });
        else if (pr > 0)
          eight_at_a_time([&](int64_t jj) { return keys + jj * dh; });
        for (; j < seen; ++j) {
          if (allowed != nullptr && !allowed[j]) {
            row[j] = -INFINITY;
            continue;
          }
          const T* k = keys + j * dh;
          Vec::T acc = Vec::zero();
          for (int v = 0; v < NV; ++v) acc = Vec::fma(qv[v], loadv(k + v * W), acc);
          row[j] = Vec::sum(acc) * a.scaling;
        }
      }
    }
  });
  team.split(a.B * R * a.Hq, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t seen = seen_of((t / a.Hq) % R);
      float* row = scratch + t * L;  // an unseen key's score is -inf, so it never is the maximum
      Vec::T tops = Vec::set1(-INFINITY);
      int64_t j = 0;
      for (; j + W <= seen; j += W) {
        const Vec::T x = Vec::load(row + j);
        tops = tops < x ? x : tops;
      }
      float lanes[W], top = -INFINITY;
      Vec::store(lanes, tops);
      for (int i = 0; i < W; ++i) top = std::max(top, lanes[i]);
      for (; j < seen; ++j) top = std::max(top, row[j]);
      for (j = 0; j < seen; ++j) row[j] -= top;
      exp_inplace(row, seen);
    }
  });
  constexpr int CV = NV >= 128 / (W * 4) ? 128 / (W * 4) : NV;  // vectors per slice: 128 bytes of floats
  constexpr int PB = std::max(1, 12 / CV);                       // (row, head) pairs per block
  constexpr int slices = NV / CV;
  const int64_t blocks = (pairs + PB - 1) / PB;
  team.split(a.B * a.Hkv * slices * blocks, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t blk = t % blocks, sl = (t / blocks) % slices, g = (t / (blocks * slices)) % a.Hkv;
      const int64_t b = t / (blocks * slices * a.Hkv);
      const T* values = a.values + (b * a.Hkv + g) * a.cap * dh + sl * CV * W;
      const int64_t p0 = blk * PB, n = std::min<int64_t>(PB, pairs - p0);
      const float* rows[PB];
      const bool* allowed[PB];
      int64_t seen[PB], out_row[PB];
      int64_t keys_seen = 0, all_see = keys_max;  // every pair of the block sees keys [0, all_see)
      for (int i = 0; i < n; ++i) {
        const int64_t r = (p0 + i) / rep, h = g * rep + (p0 + i) % rep;
        out_row[i] = row_of(b, r, h);
        rows[i] = scratch + out_row[i] * L;
        allowed[i] = allowed_of(b, r);
        seen[i] = seen_of(r);
        keys_seen = std::max(keys_seen, seen[i]);
        all_see = std::min(all_see, seen[i]);
        if (allowed[i] != nullptr) {
          const void* hole = std::memchr(allowed[i], 0, static_cast<size_t>(all_see));
          if (hole != nullptr) all_see = static_cast<const bool*>(hole) - allowed[i];
        }
      }
      Vec::T acc[PB][CV];
      float total[PB];
      for (int i = 0; i < PB; ++i) {
        total[i] = 0.f;
        for (int c = 0; c < CV; ++c) acc[i][c] = Vec::zero();
      }
      int64_t j = 0;
      if (n == PB) {
        for (; j < all_see; ++j) {
          const T* val = values + j * dh;
          Vec::T vv[CV];
          for (int c = 0; c < CV; ++c) vv[c] = loadv(val + c * W);
          for (int i = 0; i < PB; ++i) {
            const float p = rows[i][j];
            total[i] += p;
            const Vec::T pv = Vec::set1(p);
            for (int c = 0; c < CV; ++c) acc[i][c] = Vec::fma(pv, vv[c], acc[i][c]);
          }
        }
      }
      for (; j < keys_seen; ++j) {
        const T* val = values + j * dh;
        Vec::T vv[CV];
        for (int c = 0; c < CV; ++c) vv[c] = loadv(val + c * W);
        for (int i = 0; i < n; ++i) {
          if (j >= seen[i] || (allowed[i] != nullptr && !allowed[i][j])) continue;
          const float p = rows[i][j];
          total[i] += p;
          const Vec::T pv = Vec::set1(p);
          for (int c = 0; c < CV; ++c) acc[i][c] = Vec::fma(pv, vv[c], acc[i][c]);
        }
      }
      for (int i = 0; i < n; ++i) {
        float sum[CV * W];
        for (int c = 0; c < CV; ++c) Vec::store(sum + c * W, acc[i][c]);
        const float inv = total[i] > 0.f ? 1.f / total[i] : 0.f;  // a row that sees no key: 0, as SDPA
        T* out = a.out + out_row[i] * dh + sl * CV * W;
        for (int e = 0; e < CV * W; ++e) store1(out + e, sum[e] * inv);
      }
    }
  });
}

// --------------------------------------------------------- bfloat16 attention on tiles, in path order
//
// Where the products multiply bfloat16 with AMX tiles, bfloat16 attention over heads of a multiple
// of 32 dimensions (at most 256) runs on them too, in every forward alike: a one-row step, a verify,
// a prefill. A row must get the bits its path decoded one token at a time gets, and under a tree
// mask its ancestors sit in other slots than in that sequential decode. So every sum over keys runs
// over the row's own key sequence: the keys it may attend to, in slot order, numbered 0 .. n - 1 (in
// the sequential decode, slots 0 .. n - 1 themselves, with the same contents).
//
// - Scores: blocks of 16 keys, read as they sit in the cache, times up to 16 query rows of one key /
//   value head (its (row, head) pairs), one accumulator tile each, summed over the head's width by
//   the tile unit, then turned to rows of keys and scaled. A score depends on its query and key
//   alone, so scores are computed by slot for all the block's rows at once.
// - Softmax in float32 over the row's keys: the maximum of the scaled scores and their exponentials
//   by slot (exp16); the sum of the exponentials over the row's tile keys (below) in 16 lanes by
//   sequence index and a fixed horizontal sum, then key by key over the rest, in order.
// - Weighted sums of values: the row's first tile_keys(n) keys (the largest multiple of 32 at most
//   n - 32) on tiles, probabilities rounded to bfloat16 times the values, 16 keys a step from a zero
//   accumulator in the tile unit's own order (which depends on which keys share a step: hence a
//   split that depends on n alone); then the remaining 32 to 63 keys one after another in float32
//   multiply-adds; then the division by the sum and one rounding. The values are read as they sit
//   too (see value_steps). A row's tile keys are its first slots unless its mask has a hole before
//   they end, which never happens to a row with at most 32 keys past its first hole (any row of a
//   tree of up to 32 rows over any prefix, right-padded batches included): the block's rows then
//   share their tile steps over the cache's values. A row with such a hole gathers its own keys'
//   values in order for its tile steps (the same steps, so the same bits).
//
// Nothing is copied or packed per forward but each block's queries and probabilities, so a one-row
// step reads each key and value once, as attention in vectors does. Each element of a tile depends
// on its own row alone, so a row's output is the same bits alone, beside other rows, in any forward.
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512F__) && defined(__AVX512BW__) && \
    !defined(HARNESS_NO_TILE_ATTENTION)  // (a build for comparisons may leave attention in vectors)
#define HARNESS_TILE_ATTENTION 1
#endif
constexpr int64_t kTileKeys = 32;  // a row's tile keys come in multiples of this
constexpr int64_t kTailKeys = 32;  // the keys (at least) every row sums in float32 after its tile steps

// How many of a row's n keys its value sums take on tiles.
inline int64_t tile_keys(int64_t n) { return n <= kTailKeys ? 0 : (n - kTailKeys) / kTileKeys * kTileKeys; }

// One row's keys: n in all; `first`: its keys 0 .. first - 1 are slots 0 .. first - 1 (at most its
// tile keys); keys first .. n - 1 at positions[offset ...].
struct RowKeys {
  int64_t n, tiles, first, offset;
};

// What the plan keeps for attention on tiles: each (batch, row)'s keys (null: attention in vectors).
struct TileAttention {
  const RowKeys* rows = nullptr;
  const int32_t* positions = nullptr;
};

bool attention_on_tiles(int64_t dh) {
#if defined(HARNESS_TILE_ATTENTION)
  return dh % 32 == 0 && dh <= 256 && amx_permitted();
#else
  (void)dh;
  return false;
#endif
}

// Each (batch, row)'s keys under the mask (null: causal, row r sees slots 0 .. start + r); returns the
// positions, `rows` filled.
std::vector<int32_t> row_keys(const bool* mask, int64_t B, int64_t R, int64_t start, std::vector<RowKeys>& rows) {
  const int64_t L = start + R;
  rows.resize(static_cast<size_t>(B * R));
  std::vector<int32_t> positions;
  for (int64_t br = 0; br < B * R; ++br) {
    RowKeys& k = rows[static_cast<size_t>(br)];
    const bool* allowed = mask != nullptr ? mask + br * L : nullptr;
    const int64_t slots = allowed != nullptr ? L : start + br % R + 1;
    int64_t run = 0, n = 0;
    if (allowed == nullptr) {
      run = n = slots;
    } else {
      while (run < slots && allowed[run]) ++run;
      n = run;
      for (int64_t j = run; j < slots; ++j) n += allowed[j] ? 1 : 0;
    }
    k.n = n;
    k.tiles = tile_keys(n);
    k.first = std::min(run, k.tiles);
    k.offset = static_cast<int64_t>(positions.size());
    for (int64_t j = k.first; j < slots; ++j)
      if (allowed == nullptr || allowed[j]) positions.push_back(static_cast<int32_t>(j));
  }
  return positions;
}

#if defined(HARNESS_TILE_ATTENTION)
// exp of 16 float32 for the softmax on tiles: exp_vec's reduction and polynomial in fused
// multiply-adds, then a scale by 2^n (within an ulp of exp from -87.3 to 88.3, checked against
// double precision; the softmax of a 32-row verify took about half the time it took with exp_vec).
// Below -87.3 it is 0, above 88.38 infinity. Every element alike, wherever it sits.
inline __m512 exp16(__m512 x) {
  const __mmask16 under = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.33654f), _CMP_LT_OQ);
  const __mmask16 over = _mm512_cmp_ps_mask(x, _mm512_set1_ps(88.3762626647949f), _CMP_GT_OQ);
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.33654f)), _mm512_set1_ps(88.3762626647949f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  const __m512 y = _mm512_add_ps(_mm512_fmadd_ps(p, _mm512_mul_ps(r, r), r), _mm512_set1_ps(1.f));
  const __m512 e = _mm512_maskz_scalef_ps(static_cast<__mmask16>(~under), y, n);
  return _mm512_mask_mov_ps(e, over, _mm512_set1_ps(INFINITY));
}

// r[0..15] (16 rows of 16 32-bit words) transposed in place
inline void transpose16(__m512i* r) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  // r[4q + c], 128-bit lane l: column 4l + c of rows 4q .. 4q + 3
  for (int q = 0; q < 16; q += 8)
    for (int c = 0; c < 4; ++c) {
      t[q + c] = _mm512_shuffle_i32x4(r[q + c], r[q + 4 + c], _MM_SHUFFLE(2, 0, 2, 0));  // columns c, 8 + c
      t[q + 4 + c] = _mm512_shuffle_i32x4(r[q + c], r[q + 4 + c], _MM_SHUFFLE(3, 1, 3, 1));  // columns 4 + c, 12 + c
    }
  for (int c = 0; c < 8; ++c) {
    r[c] = _mm512_shuffle_i32x4(t[c], t[8 + c], _MM_SHUFFLE(2, 0, 2, 0));
    r[8 + c] = _mm512_shuffle_i32x4(t[c], t[8 + c], _MM_SHUFFLE(3, 1, 3, 1));
  }
}

// The tile configurations: for the scores, accumulators 0-3 of 16 keys by `nq` query rows, keys in
// 4 and 5 (16 rows of 32 dimensions), the queries in 6 and 7 (16 pairs of dimensions by nq); for
// the value sums, accumulators 0-3 and probabilities 4 and 5 of nq rows, values in 6 and 7 (16 keys).
void configure_attention_tiles(int nq, bool scores) {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = static_cast<uint8_t>(scores || t >= 6 ? 16 : nq);
    cfg.colsb[t] = static_cast<uint16_t>(scores && (t < 4 || t >= 6) ? nq * 4 : 64);
  }
  load_tile_config(cfg);
}

// The scores of G blocks of 16 keys (at `keys`, as they sit in the cache, dh apart) against the
// block's queries packed in pairs of dimensions (`qb`: [dh / 32][16 pairs][16 query rows] words):
// accumulator c, [16 keys][16], stored to ct + 256 c.
template <int G>
inline void score_tiles(const bf16* keys, int64_t dh, const uint32_t* qb, float* ct) {
  _tile_zero(0);
  if constexpr (G > 1) _tile_zero(1);
  if constexpr (G > 2) _tile_zero(2);
  if constexpr (G > 3) _tile_zero(3);
  const int64_t ld = dh * 2;
  for (int64_t s = 0; s < dh / 32; ++s) {
    const bf16* k = keys + s * 32;
    _tile_loadd(6, qb + s * 256, 64);
    _tile_loadd(4, k, ld);
    _tile_dpbf16ps(0, 4, 6);
    if constexpr (G > 1) {
      _tile_loadd(5, k + 16 * dh, ld);
      _tile_dpbf16ps(1, 5, 6);
    }
    if constexpr (G > 2) {
      _tile_loadd(4, k + 32 * dh, ld);
      _tile_dpbf16ps(2, 4, 6);
    }
    if constexpr (G > 3) {
      _tile_loadd(5, k + 48 * dh, ld);
      _tile_dpbf16ps(3, 5, 6);
    }
  }
  _tile_stored(0, ct, 64);
  if constexpr (G > 1) _tile_stored(1, ct + 256, 64);
  if constexpr (G > 2) _tile_stored(2, ct + 512, 64);
  if constexpr (G > 3) _tile_stored(3, ct + 768, 64);
}

inline void score_tiles_of(int64_t g, const bf16* keys, int64_t dh, const uint32_t* qb, float* ct) {
  switch (g) {
    case 4: return score_tiles<4>(keys, dh, qb, ct);
    case 3: return score_tiles<3>(keys, dh, qb, ct);
    case 2: return score_tiles<2>(keys, dh, qb, ct);
    default: return score_tiles<1>(keys, dh, qb, ct);
  }
}

// Value sums over key steps [s0, s1) of 16 keys for S slices of 32 dimensions from d0 (S = 1 or
// 2). The values are read as they sit in the cache (16 keys by 32 dimensions, neighbouring
// dimensions a pair), so the probabilities come twice: `pe`'s words hold each in their low half
// (the pair's other half zero), `po`'s in their high half; accumulator 2q then sums slice q's even
// dimensions, 2q + 1 its odd ones, each over the keys alone. `w` (ldw bytes a row) holds a row's
// accumulators in that order, [even | odd] per slice; from zero at s0 == 0, else continued from w.
template <int S>
inline void value_steps(const uint32_t* pe, const uint32_t* po, int64_t lda, const bf16* vals, int64_t dh,
                        int64_t s0, int64_t s1, float* w, int64_t ldw) {
  if (s0 == 0) {
    _tile_zero(0);
    _tile_zero(1);
    if constexpr (S > 1) {
      _tile_zero(2);
      _tile_zero(3);
    }
  } else {
    _tile_loadd(0, w, ldw);
    _tile_loadd(1, w + 16, ldw);
    if constexpr (S > 1) {
      _tile_loadd(2, w + 32, ldw);
      _tile_loadd(3, w + 48, ldw);
    }
  }
  for (int64_t s = s0; s < s1; ++s) {
    const bf16* v = vals + s * 16 * dh;
    _tile_loadd(4, pe + s * 16, lda);
    _tile_loadd(5, po + s * 16, lda);
    _tile_loadd(6, v, dh * 2);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 5, 6);
    if constexpr (S > 1) {
      _tile_loadd(7, v + 32, dh * 2);
      _tile_dpbf16ps(2, 4, 7);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
  _tile_stored(0, w, ldw);
  _tile_stored(1, w + 16, ldw);
  if constexpr (S > 1) {
    _tile_stored(2, w + 32, ldw);
    _tile_stored(3, w + 48, ldw);
  }
}

// The value sums on tiles of `nq` rows (the configuration's) of probabilities `pe` / `po` (lda
// bytes a row) against values `vals` (dh apart): row i over its first steps[i] steps of 16 keys,
// into sums[i] (dh floats, in order; a row of no steps gets zeros). Rows of fewer steps are copied
// out when the others go on (a tile row is its own row's alone, so stopping it early or not is the
// same bits).
inline void value_tiles(int64_t nq, const int64_t* steps, const uint32_t* pe, const uint32_t* po, int64_t lda,
                        const bf16* vals, int64_t dh, float* work, float* sums) {
  int64_t done = 0;
  for (;;) {
    int64_t next = INT64_MAX;  // the fewest steps of a row beyond `done`
    for (int64_t i = 0; i < nq; ++i)
      if (steps[i] > done) next = std::min(next, steps[i]);
    if (next == INT64_MAX) break;
    for (int64_t d0 = 0; d0 < dh; d0 += 64) {
      if (dh - d0 >= 64)
        value_steps<2>(pe, po, lda, vals + d0, dh, done, next, work + d0, dh * 4);
      else
        value_steps<1>(pe, po, lda, vals + d0, dh, done, next, work + d0, dh * 4);
    }
    for (int64_t i = 0; i < nq; ++i)
      if (steps[i] == next)
        for (int64_t d = 0; d < dh; d += 32)  // [even | odd] per slice back to the dimensions' order
          for (int64_t n = 0; n < 16; ++n) {
            sums[i * dh + d + 2 * n] = work[i * dh + d + n];
            sums[i * dh + d + 2 * n + 1] = work[i * dh + d + 16 + n];
          }
    done = next;
  }
  for (int64_t i = 0; i < nq; ++i)
    if (steps[i] == 0) std::fill(sums + i * dh, sums + (i + 1) * dh, 0.f);
}

// The float32 part of NH heads of one row over NV vectors of dimensions from d0: keys `from` .. n - 1
// of its sequence (slot of key c: positions[c - first]), sums[h] += p * value, total[h] += p (with
// `add_totals`).
template <int NH, int NV>
inline void value_tail(const RowKeys& k, int64_t from, const int32_t* positions, const float* const* rows,
                       const bf16* values, int64_t dh, int64_t d0, float* const* sums, float* total, bool add_totals) {
  __m512 acc[NH][NV];
  for (int h = 0; h < NH; ++h)
    for (int v = 0; v < NV; ++v) acc[h][v] = _mm512_loadu_ps(sums[h] + d0 + 16 * v);
  float t[NH];
  for (int h = 0; h < NH; ++h) t[h] = total[h];
  for (int64_t c = from; c < k.n; ++c) {
    const int64_t slot = positions[k.offset + c - k.first];
    const bf16* val = values + slot * dh + d0;
    __m512 vv[NV];
    for (int v = 0; v < NV; ++v) vv[v] = Vec::widen(reinterpret_cast<const uint16_t*>(val + 16 * v));
    for (int h = 0; h < NH; ++h) {
      const float p = rows[h][slot];
      t[h] += p;
      const __m512 pv = _mm512_set1_ps(p);
      for (int v = 0; v < NV; ++v) acc[h][v] = _mm512_fmadd_ps(pv, vv[v], acc[h][v]);
    }
  }
  for (int h = 0; h < NH; ++h) {
    for (int v = 0; v < NV; ++v) _mm512_storeu_ps(sums[h] + d0 + 16 * v, acc[h][v]);
    if (add_totals) total[h] = t[h];
  }
}

template <int NV>
inline void value_tail_of(int nh, const RowKeys& k, int64_t from, const int32_t* positions, const float* const* rows,
                          const bf16* values, int64_t dh, int64_t d0, float* const* sums, float* total, bool add) {
  switch (nh) {
    case 4: return value_tail<4, NV>(k, from, positions, rows, values, dh, d0, sums, total, add);
    case 3: return value_tail<3, NV>(k, from, positions, rows, values, dh, d0, sums, total, add);
    case 2: return value_tail<2, NV>(k, from, positions, rows, values, dh, d0, sums, total, add);
    default: return value_tail<1, NV>(k, from, positions, rows, values, dh, d0, sums, total, add);
  }
}

void attend_tiles(const Attention<bf16>& a, const TileAttention& ta, const Team& team) {
  const int64_t rep = a.Hq / a.Hkv, dh = a.dh, R = a.R, L = a.L, pairs = R * rep;
  const int64_t blocks = (pairs + 15) / 16, Lp = (L + 31) / 32 * 32;
  team.split(a.B * a.Hkv * blocks, 1, [&](int64_t t0, int64_t t1) {
    thread_local std::vector<float> scores, work, sums, ct;
    thread_local std::vector<uint32_t> pe, po, qb;
    thread_local std::vector<bf16> own, edge;
    scores.resize(static_cast<size_t>(16 * Lp));
    pe.resize(static_cast<size_t>(16 * Lp));
    po.resize(static_cast<size_t>(16 * Lp));
    work.resize(static_cast<size_t>(16 * dh));
    sums.resize(static_cast<size_t>(16 * dh));
    ct.resize(4 * 256);
    qb.resize(static_cast<size_t>(dh / 2 * 16));
    edge.resize(static_cast<size_t>(16 * dh));
    int configured = 0;  // n: the value sums' configuration for n rows, -n the scores'
    auto configure = [&](int rows, bool for_scores) {
      const int code = for_scores ? -rows : rows;
      if (configured != code) configure_attention_tiles(rows, for_scores);
      configured = code;
    };
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t blk = t % blocks, g = (t / blocks) % a.Hkv, b = t / (blocks * a.Hkv);
      const bf16* keys = a.keys + (b * a.Hkv + g) * a.cap * dh;
      const bf16* values = a.values + (b * a.Hkv + g) * a.cap * dh;
      const int64_t p0 = blk * 16, nq = std::min<int64_t>(16, pairs - p0);
      int64_t out_row[16], slots[16], steps[16];
      const bool* allowed[16];
      const RowKeys* keys_of[16];
      int64_t block_slots = 0;
      for (int64_t i = 0; i < nq; ++i) {
        const int64_t r = (p0 + i) / rep, h = g * rep + (p0 + i) % rep;
        out_row[i] = (b * R + r) * a.Hq + h;
        slots[i] = a.mask != nullptr ? L : a.start + r + 1;
        allowed[i] = a.mask != nullptr ? a.mask + (b * R + r) * L : nullptr;
        keys_of[i] = ta.rows + b * R + r;
        block_slots = std::max(block_slots, slots[i]);
        const uint32_t* q = reinterpret_cast<const uint32_t*>(a.q + out_row[i] * dh);
        for (int64_t w = 0; w < dh / 2; ++w) qb[w * 16 + i] = q[w];  // pairs of dimensions by query row
      }
      // scores: 4 blocks of 16 keys at a time, read where they sit (a last block past the cache's
      // capacity from a copy), summed over the head's width in steps of 32; each block's
      // accumulator [16 keys][16 rows] turned to rows of 16 keys
      HARNESS_TIMER(last);
      configure(static_cast<int>(nq), true);
      const int64_t key_blocks = (block_slots + 15) / 16;
      for (int64_t kb = 0; kb < key_blocks;) {
        int64_t G = std::min<int64_t>(4, key_blocks - kb);
        const bf16* at = keys + kb * 16 * dh;
        if ((kb + G) * 16 > a.cap) {
          G = 1;
          const int64_t live = std::min<int64_t>(16, L - kb * 16);
          std::fill(edge.begin(), edge.end(), bf16(0.f));
          std::copy(at, at + live * dh, edge.begin());
          at = edge.data();
        }
        score_tiles_of(G, at, dh, qb.data(), ct.data());
        for (int64_t c = 0; c < G; ++c) {
          __m512i rows[16];
          for (int j = 0; j < 16; ++j) rows[j] = _mm512_loadu_si512(ct.data() + c * 256 + j * 16);
          transpose16(rows);
          for (int64_t i = 0; i < nq; ++i) _mm512_storeu_si512(scores.data() + i * Lp + (kb + c) * 16, rows[i]);
        }
        kb += G;
      }
      HARNESS_TICK(team.tid, part, 0, last);
      // softmax by slot: the maximum of the scaled scores the row sees, then their exponentials
      // (zero where it does not see the key); the sum over its tile keys in 16 lanes, and their
      // probabilities in bfloat16, twice (in the low and in the high half of a word)
      float total[16];
      const __m512 scale = _mm512_set1_ps(a.scaling), minus_inf = _mm512_set1_ps(-INFINITY);
      auto tile_probabilities = [&](int64_t i, int64_t c, __m512 p) {
        const __m512i words = _mm512_cvtepu16_epi32(round16(p));
        _mm512_storeu_si512(pe.data() + i * Lp + c, words);
        _mm512_storeu_si512(po.data() + i * Lp + c, _mm512_slli_epi32(words, 16));
      };
      for (int64_t i = 0; i < nq; ++i) {
        float* row = scores.data() + i * Lp;
        const int64_t n = slots[i];
        const bool* seen = allowed[i];
        auto sees = [&](int64_t j) {  // the slots j .. j + 15 the row sees
          if (j + 16 > n) {
            __mmask16 m = __mmask16((1u << (n - j)) - 1u);
            for (int e = 0; seen != nullptr && j + e < n; ++e)
              if (!seen[j + e]) m &= __mmask16(~(1u << e));
            return m;
          }
          if (seen == nullptr) return __mmask16(65535);
          const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(seen + j));
          return __mmask16(~_mm_movemask_epi8(_mm_cmpeq_epi8(bytes, _mm_setzero_si128())));
        };
        __m512 tops = minus_inf;
        for (int64_t j = 0; j < n; j += 16)
          tops = _mm512_mask_max_ps(tops, sees(j), tops, _mm512_mul_ps(_mm512_loadu_ps(row + j), scale));
        const __m512 top = _mm512_set1_ps(_mm512_reduce_max_ps(tops));
        const RowKeys& k = *keys_of[i];
        const bool in_place = k.first == k.tiles;  // else a hole before its tile keys end: its own steps below
        steps[i] = in_place ? k.tiles / 16 : 0;
        __m512 lanes = _mm512_setzero_ps();
        for (int64_t j = 0; j < n; j += 16) {
          const __m512 x = _mm512_sub_ps(_mm512_mul_ps(_mm512_loadu_ps(row + j), scale), top);
          const __m512 p = _mm512_maskz_mov_ps(sees(j), exp16(x));
          _mm512_storeu_ps(row + j, p);
          if (in_place && j < k.tiles) {  // k.tiles is a multiple of 32
            lanes = _mm512_add_ps(lanes, p);
            tile_probabilities(i, j, p);
          }
        }
        for (int64_t c = 0; !in_place && c < k.tiles; c += 16) {  // the row's keys in order
          alignas(64) float in_order[16];
          for (int e = 0; e < 16; ++e)
            in_order[e] = c + e < k.first ? row[c + e] : row[ta.positions[k.offset + c + e - k.first]];
          const __m512 p = _mm512_load_ps(in_order);
          lanes = _mm512_add_ps(lanes, p);
          tile_probabilities(i, c, p);
        }
        total[i] = Vec::sum(lanes);
      }
      HARNESS_TICK(team.tid, part, 1, last);
      // value sums on tiles: the rows that share their first slots together, each other row alone
      // (with its heads in this block) over its own keys' values gathered in order
      configure(static_cast<int>(nq), false);
      value_tiles(nq, steps, pe.data(), po.data(), Lp * 4, values, dh, work.data(), sums.data());
      HARNESS_TICK(team.tid, part, 2, last);
      for (int64_t i = 0; i < nq;) {
        int64_t e = i + 1;  // rows [i, e): the heads of one row in this block
        while (e < nq && keys_of[e] == keys_of[i]) ++e;
        const RowKeys& k = *keys_of[i];
        if (k.first < k.tiles) {
          own.resize(static_cast<size_t>(k.tiles * dh));
          for (int64_t c = 0; c < k.tiles; ++c) {
            const int64_t slot = c < k.first ? c : ta.positions[k.offset + c - k.first];
            std::copy(values + slot * dh, values + (slot + 1) * dh, own.begin() + c * dh);
          }
          int64_t own_steps[16];
          for (int64_t h = i; h < e; ++h) own_steps[h - i] = k.tiles / 16;
          configure(static_cast<int>(e - i), false);
          value_tiles(e - i, own_steps, pe.data() + i * Lp, po.data() + i * Lp, Lp * 4, own.data(), dh, work.data(),
                      sums.data() + i * dh);
        }
        // the rest of the keys in float32, in order, up to 4 heads and 64 dimensions at a time
        for (int64_t h0 = i; h0 < e; h0 += 4) {
          const int nh = static_cast<int>(std::min<int64_t>(4, e - h0));
          const float* rows[4];
          float* acc[4];
          for (int h = 0; h < nh; ++h) {
            rows[h] = scores.data() + (h0 + h) * Lp;
            acc[h] = sums.data() + (h0 + h) * dh;
          }
          for (int64_t d0 = 0; d0 < dh; d0 += 64) {
            if (dh - d0 >= 64)
              value_tail_of<4>(nh, k, k.tiles, ta.positions, rows, values, dh, d0, acc, total + h0, d0 == 0);
            else
              value_tail_of<2>(nh, k, k.tiles, ta.positions, rows, values, dh, d0, acc, total + h0, d0 == 0);
          }
        }
        i = e;
      }
      HARNESS_TICK(team.tid, part, 3, last);
      for (int64_t i = 0; i < nq; ++i) {
        const float inv = total[i] > 0.f ? 1.f / total[i] : 0.f;  // a row that sees no key: 0, as SDPA
        bf16* out = a.out + out_row[i] * dh;
        const float* sum = sums.data() + i * dh;
        for (int64_t e = 0; e < dh; ++e) store1(out + e, sum[e] * inv);
      }
      HARNESS_TICK(team.tid, part, 4, last);
      HARNESS_COUNT(team.tid, blocks);
    }
    if (configured != 0) _tile_release();
  });
}
#endif

// Scores, softmax and the weighted sum of values; the output rounded to T once. Where the plan set
// `tiles` (bfloat16 on AMX, attention_on_tiles), on the tiles (attend_tiles); otherwise in float32
// vectors: with `scratch` (a forward whose scores fit it) heads of 1, 2, 4, 8 or 16 vectors run
// grouped (attend_grouped), else heads of 1, 2, 4 or 8 vectors run blocked (attend_rows), any other
// width this loop, which reduces every score and sum in the same order.
template <class T>
void attend(const Attention<T>& a, float* scratch, const TileAttention& tiles, const Team& team) {
#if defined(HARNESS_TILE_ATTENTION)
  if constexpr (std::is_same_v<T, bf16>)
    if (tiles.rows != nullptr) return attend_tiles(a, tiles, team);
#endif
  if (scratch != nullptr) {
    if (a.dh == W) return attend_grouped<T, 1>(a, scratch, team);
    if (a.dh == 2 * W) return attend_grouped<T, 2>(a, scratch, team);
    if (a.dh == 4 * W) return attend_grouped<T, 4>(a, scratch, team);
    if (a.dh == 8 * W) return attend_grouped<T, 8>(a, scratch, team);
    if (a.dh == 16 * W) return attend_grouped<T, 16>(a, scratch, team);
  }
  if (a.dh == W) return attend_blocked<T, 1, 4>(a, team);
  if (a.dh == 2 * W) return attend_blocked<T, 2, 4>(a, team);
  if (a.dh == 4 * W) return attend_blocked<T, 4, 4>(a, team);
  if (a.dh == 8 * W) return attend_blocked<T, 8, 2>(a, team);
  const int64_t rep = a.Hq / a.Hkv;
  team.split(a.B * a.Hq * a.R, 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> scores(a.L), acc(a.dh);
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t r = t % a.R, h = (t / a.R) % a.Hq, b = t / (a.R * a.Hq);
      const T* q = a.q + ((b * a.R + r) * a.Hq + h) * a.dh;
      const int64_t base = (b * a.Hkv + h / rep) * a.cap * a.dh;
      const bool* allowed = a.mask != nullptr ? a.mask + (b * a.R + r) * a.L : nullptr;
      const int64_t seen = allowed != nullptr ? a.L : a.start + r + 1;
      float top = -INFINITY;
      for (int64_t j = 0; j < seen; ++j) {
        if (allowed != nullptr && !allowed[j]) continue;
        scores[j] = dot(q, a.keys + base + j * a.dh, a.dh) * a.scaling;
        top = std::max(top, scores[j]);
      }
      for (int64_t j = 0; j < seen; ++j) scores[j] = allowed == nullptr || allowed[j] ? scores[j] - top : -INFINITY;
      exp_inplace(scores.data(), seen);
      std::fill(acc.begin(), acc.end(), 0.f);
      float total = 0.f;
      for (int64_t j = 0; j < seen; ++j) {
        if (allowed != nullptr && !allowed[j]) continue;
        total += scores[j];
        axpy(acc.data(), scores[j], a.values + base + j * a.dh, a.dh);
      }
      const float inv = total > 0.f ? 1.f / total : 0.f;  // a row that sees no key: 0, as SDPA
      T* out = a.out + ((b * a.R + r) * a.Hq + h) * a.dh;
      for (int64_t i = 0; i < a.dh; ++i) store1(out + i, acc[i] * inv);
    }
  });
}

// One decoder layer's parameters and cache buffers, as raw pointers in the layer's dtype.
template <class T>
struct LayerParams {
  const T* w[9];     // input norm, q, k, v, o, post norm, gate, up, down
  bool panels;       // the seven products' weights in panels (float32), or none of them
  const T* bias[7];  // q, k, v, o, gate, up, down (each or null)
  T* keys;           // [B, Hkv, cap, dh]
  T* values;
  float input_eps, post_eps;
};

// The shapes of a forward over M = B * R rows and the scratch its layers share (every layer of a
// stack has the same shapes, so one set of buffers serves them all in turn).
template <class T>
struct LayerPlan {
  int64_t B, R, d, Hq, Hkv, dh, cap, I, start;
  const T* cos;  // [B, R, dh]
  const T* sin;
  const bool* mask;  // [B, R, start + R] or null (causal)
  float scaling;
  T *x, *q, *k, *v, *ctx, *mid, *gate, *up;  // [M, d], [M, Hq dh], [M, Hkv dh] x 2, [M, Hq dh], [M, d], [M, I] x 2
  float* attention;  // attend_grouped's scratch, or null where its scores would not fit or tiles run
  TileAttention tiles;  // bfloat16 attention on tiles (each row's keys), or none
};

// Scratch tensors for a plan; they stay alive as long as the returned vector.
template <class T>
std::vector<at::Tensor> allocate_scratch(LayerPlan<T>& s, const at::TensorOptions& opts) {
  const int64_t M = s.B * s.R;
  std::vector<at::Tensor> keep = {at::empty({M, s.d}, opts),         at::empty({M, s.Hq * s.dh}, opts),
                                  at::empty({M, s.Hkv * s.dh}, opts), at::empty({M, s.Hkv * s.dh}, opts),
                                  at::empty({M, s.Hq * s.dh}, opts), at::empty({M, s.d}, opts),
                                  at::empty({M, s.I}, opts),         at::empty({M, s.I}, opts)};
  T** slots[8] = {&s.x, &s.q, &s.k, &s.v, &s.ctx, &s.mid, &s.gate, &s.up};
  for (int i = 0; i < 8; ++i) *slots[i] = keep[i].data_ptr<T>();
  const int64_t floats = grouped_scratch_floats(s.B, s.R, s.Hq, s.start + s.R);
  s.attention = nullptr;
  s.tiles = TileAttention{};
  if (std::is_same_v<T, bf16> && attention_on_tiles(s.dh)) {
    std::vector<RowKeys> rows;
    const std::vector<int32_t> positions = row_keys(s.mask, s.B, s.R, s.start, rows);
    TileAttention& ta = s.tiles;
    static_assert(sizeof(RowKeys) == 4 * sizeof(int64_t), "RowKeys is four int64");
    keep.push_back(at::empty({static_cast<int64_t>(rows.size()) * 4}, opts.dtype(at::kLong)));
    std::memcpy(keep.back().data_ptr(), rows.data(), rows.size() * sizeof(RowKeys));
    ta.rows = reinterpret_cast<const RowKeys*>(keep.back().data_ptr());
    keep.push_back(at::empty({std::max<int64_t>(1, static_cast<int64_t>(positions.size()))}, opts.dtype(at::kInt)));
    std::copy(positions.begin(), positions.end(), keep.back().data_ptr<int32_t>());
    ta.positions = keep.back().data_ptr<int32_t>();
  } else if (floats > 0 && floats * static_cast<int64_t>(sizeof(float)) <= kGroupedScratchBytes) {
    keep.push_back(at::empty({floats}, opts.dtype(at::kFloat)));
    s.attention = keep.back().data_ptr<float>();
  }
  return keep;
}

// One layer: out [M, d] from h [M, d] (never the same memory), this thread's share of every step,
// a barrier after each (Team::split), so a team runs layer after layer without leaving its region.
template <class P>
void layer_steps(const LayerPlan<typename P::Wt>& s, const LayerParams<typename P::Wt>& lp, const typename P::Wt* h,
                 typename P::Wt* out, const Team& team) {
  using T = typename P::Wt;
  HARNESS_TIMER(last);
  HARNESS_COUNT(team.tid, layers);
  const int64_t M = s.B * s.R, d = s.d, dh = s.dh, hq = s.Hq * dh, hk = s.Hkv * dh, I = s.I, R = s.R;
  T *xp = s.x, *qp = s.q, *kp = s.k, *vp = s.v, *cp = s.ctx, *mid = s.mid, *g = s.gate;
  const T* u = s.up;
  const bool pn = lp.panels;
  const Product<P> qkv[3] = {
      {lp.w[1], lp.bias[0], qp, hq, pn}, {lp.w[2], lp.bias[1], kp, hk, pn}, {lp.w[3], lp.bias[2], vp, hk, pn}};
  const Product<P> o{lp.w[4], lp.bias[3], mid, d, pn};
  const Product<P> gate_up[2] = {{lp.w[6], lp.bias[4], g, I, pn}, {lp.w[7], lp.bias[5], s.up, I, pn}};
  const Product<P> down{lp.w[8], lp.bias[6], out, d, pn};
  team.split(M, 1, [&](int64_t m0, int64_t m1) { rms_norm(h + m0 * d, lp.w[0], xp + m0 * d, m1 - m0, d, lp.input_eps); });
  HARNESS_TICK(team.tid, step, 0, last);
  run_products<P>(input_of<P>(xp, M, d), qkv, 3, team);
  HARNESS_TICK(team.tid, step, 1, last);
  team.split(M, 1, [&](int64_t m0, int64_t m1) {
    rotary(qp + m0 * hq, s.cos + m0 * dh, s.sin + m0 * dh, m1 - m0, s.Hq, dh);
    rotary(kp + m0 * hk, s.cos + m0 * dh, s.sin + m0 * dh, m1 - m0, s.Hkv, dh);
    for (int64_t m = m0; m < m1; ++m)
      for (int64_t gi = 0; gi < s.Hkv; ++gi) {
        const int64_t b = m / R, r = m % R, src = m * hk + gi * dh, dst = ((b * s.Hkv + gi) * s.cap + s.start + r) * dh;
        std::copy(kp + src, kp + src + dh, lp.keys + dst);
        std::copy(vp + src, vp + src + dh, lp.values + dst);
      }
  });
  HARNESS_TICK(team.tid, step, 2, last);
  attend(Attention<T>{qp, lp.keys, lp.values, s.mask, cp, s.B, R, s.Hq, s.Hkv, dh, s.cap, s.start, s.start + R, s.scaling},
         s.attention, s.tiles, team);
  HARNESS_TICK(team.tid, step, 3, last);
  run_products<P>(input_of<P>(cp, M, hq), &o, 1, team);
  HARNESS_TICK(team.tid, step, 4, last);
  team.split(M, 1, [&](int64_t m0, int64_t m1) {
    for (int64_t i = m0 * d; i < m1 * d; ++i) store1(mid + i, load1(h + i) + load1(mid + i));
    rms_norm(mid + m0 * d, lp.w[5], xp + m0 * d, m1 - m0, d, lp.post_eps);
  });
  HARNESS_TICK(team.tid, step, 5, last);
  run_products<P>(input_of<P>(xp, M, d), gate_up, 2, team);
  HARNESS_TICK(team.tid, step, 6, last);
  team.split(M, 1, [&](int64_t m0, int64_t m1) {  // silu(gate) * up, a chunk of elements at a time
    float e[1024];
    for (int64_t c = m0 * I; c < m1 * I; c += 1024) {
      const int64_t n = std::min<int64_t>(1024, m1 * I - c);
      for (int64_t i = 0; i < n; ++i) e[i] = -load1(g + c + i);
      exp_inplace(e, n);
      for (int64_t i = 0; i < n; ++i) {
        const float gi = load1(g + c + i);
        store1(g + c + i, rnd(gi / (1.f + e[i]), T{}) * load1(u + c + i));
      }
    }
  });
  HARNESS_TICK(team.tid, step, 7, last);
  run_products<P>(input_of<P>(g, M, I), &down, 1, team);
  HARNESS_TICK(team.tid, step, 8, last);
  team.split(M, 1, [&](int64_t m0, int64_t m1) {
    for (int64_t i = m0 * d; i < m1 * d; ++i) store1(out + i, load1(mid + i) + load1(out + i));
  });
  HARNESS_TICK(team.tid, step, 9, last);
}

// fn(team) on every thread of torch's intra-op pool in one parallel region (or inline on one thread)
template <class F>
void on_team(const F& fn) {
  const int threads = at::get_num_threads();
  if (threads <= 1 || at::in_parallel_region()) {
    fn(Team{});
  } else {
#pragma omp parallel num_threads(threads)
    fn(Team{omp_get_thread_num(), omp_get_num_threads()});
  }
}

// The argument checks of one layer (weights / biases: the layer's 9 and 7); returns its params.
template <class T>
LayerParams<T> layer_params(const std::vector<at::Tensor>& weights, const std::vector<std::optional<at::Tensor>>& biases,
                            at::Tensor& key_buffer, at::Tensor& value_buffer, at::ScalarType dtype, int64_t B,
                            int64_t d, int64_t L, double input_eps, double post_eps, const char* op) {
  auto ok = [&](const at::Tensor& t) { return t.is_contiguous() && is_cpu(t, dtype); };
  TORCH_CHECK(weights.size() == 9 && biases.size() == 7, op, ": 9 weights and 7 biases per layer expected");
  TORCH_CHECK(ok(key_buffer) && ok(value_buffer) && key_buffer.dim() == 4 && value_buffer.sizes() == key_buffer.sizes(),
              op, ": equal contiguous key / value buffers [B, Hkv, cap, dh] in the hidden states' dtype expected");
  for (const at::Tensor& w : weights)
    TORCH_CHECK(ok(w), op, ": contiguous CPU weights in the hidden states' dtype expected");
  const int64_t Hkv = key_buffer.size(1), cap = key_buffer.size(2), dh = key_buffer.size(3);
  TORCH_CHECK(dh > 0 && dh % 2 == 0 && Hkv > 0 && rows_of(weights[1]) % dh == 0, op, ": shapes out of range");
  const int64_t Hq = rows_of(weights[1]) / dh, I = rows_of(weights[6]);
  TORCH_CHECK(L <= cap && key_buffer.size(0) == B && Hq % Hkv == 0, op, ": shapes out of range");
  const int64_t shapes[9][2] = {{d, 1}, {Hq * dh, d}, {Hkv * dh, d}, {Hkv * dh, d}, {d, Hq * dh},
                                {d, 1}, {I, d},       {I, d},        {d, I}};
  const bool panels = in_panels(weights[1]);
  for (int i = 0; i < 9; ++i) {
    const bool product = i != 0 && i != 5;
    TORCH_CHECK(weights[i].numel() == shapes[i][0] * shapes[i][1] && rows_of(weights[i]) == shapes[i][0] &&
                    (product ? in_panels(weights[i]) == panels : weights[i].dim() == 1),
                op, ": weight ", i, " has shape ", weights[i].sizes(),
                " (the products' weights all [N, K], or all float32 in panels [N / 16, K, 16], or all bfloat16 in pairs"
                " [N / 16, K / 2, 16, 2])");
  }
  TORCH_CHECK(!panels || dtype != at::kBFloat16 || (d % kPairK == 0 && I % kPairK == 0 && Hq * dh % kPairK == 0), op,
              ": weights in pairs need every product's K (", d, ", ", Hq * dh, ", ", I, ") a multiple of ", kPairK);
  const int64_t bias_sizes[7] = {Hq * dh, Hkv * dh, Hkv * dh, d, I, I, d};
  LayerParams<T> lp;
  for (int i = 0; i < 9; ++i) lp.w[i] = weights[i].data_ptr<T>();
  lp.panels = panels;
  for (int i = 0; i < 7; ++i) {
    const std::optional<at::Tensor>& b = biases[i];
    TORCH_CHECK(!b.has_value() || (ok(*b) && b->numel() == bias_sizes[i]), op, ": bias ", i,
                " must be a contiguous CPU vector of ", bias_sizes[i], " in the hidden states' dtype");
    lp.bias[i] = b.has_value() ? b->data_ptr<T>() : nullptr;
  }
  lp.keys = key_buffer.data_ptr<T>();
  lp.values = value_buffer.data_ptr<T>();
  lp.input_eps = static_cast<float>(input_eps);
  lp.post_eps = static_cast<float>(post_eps);
  return lp;
}

// The plan of a forward whose first layer has these weights and buffers, after the checks every
// layer shares (hidden, cos, sin, mask).
template <class T>
LayerPlan<T> plan_of(const at::Tensor& hidden, const at::Tensor& cos, const at::Tensor& sin,
                     const std::optional<at::Tensor>& mask, const at::Tensor& key_buffer, const at::Tensor& q_weight,
                     const at::Tensor& gate_weight, int64_t start, double scaling, const char* op) {
  const at::ScalarType dtype = hidden.scalar_type();
  auto ok = [&](const at::Tensor& t) { return t.is_contiguous() && is_cpu(t, dtype); };
  TORCH_CHECK(hidden.dim() == 3 && ok(hidden), op, ": hidden [B, R, d] on the CPU");
  TORCH_CHECK(ok(cos) && ok(sin), op, ": contiguous cos / sin in the hidden states' dtype expected");
  LayerPlan<T> s{};
  s.B = hidden.size(0);
  s.R = hidden.size(1);
  s.d = hidden.size(2);
  s.Hkv = key_buffer.size(1);
  s.cap = key_buffer.size(2);
  s.dh = key_buffer.size(3);
  TORCH_CHECK(key_buffer.dim() == 4 && s.dh > 0, op, ": key / value buffers [B, Hkv, cap, dh] with dh > 0 expected");
  s.Hq = rows_of(q_weight) / s.dh;
  s.I = rows_of(gate_weight);
  s.start = start;
  const int64_t M = s.B * s.R, L = start + s.R;
  TORCH_CHECK(M > 0 && start >= 0, op, ": shapes out of range");
  TORCH_CHECK(cos.numel() == M * s.dh && sin.numel() == M * s.dh, op, ": cos / sin [B, R, dh] expected");
  TORCH_CHECK(!mask.has_value() || (mask->scalar_type() == at::kBool && mask->is_contiguous() && mask->numel() == M * L),
              op, ": mask must be bool [B, R, start + R]");
  s.cos = cos.data_ptr<T>();
  s.sin = sin.data_ptr<T>();
  s.mask = mask.has_value() ? mask->data_ptr<bool>() : nullptr;
  s.scaling = static_cast<float>(scaling);
  return s;
}

std::vector<std::optional<at::Tensor>> optional_list(const c10::List<std::optional<at::Tensor>>& list, int64_t from,
                                                     int64_t n) {
  std::vector<std::optional<at::Tensor>> out;
  for (int64_t i = from; i < from + n; ++i) out.push_back(list.get(i));
  return out;
}

template <class P>
at::Tensor layer_forward(const at::Tensor& hidden, const at::Tensor& cos, const at::Tensor& sin,
                         const std::optional<at::Tensor>& mask, at::Tensor& key_buffer, at::Tensor& value_buffer,
                         int64_t start, at::TensorList weights, const c10::List<std::optional<at::Tensor>>& biases,
                         double input_eps, double post_eps, double scaling) {
  using T = typename P::Wt;
  const char* op = "llama_layer";
  TORCH_CHECK(weights.size() == 9 && biases.size() == 7, op, ": 9 weights and 7 biases expected");
  LayerPlan<T> s = plan_of<T>(hidden, cos, sin, mask, key_buffer, weights[1], weights[6], start, scaling, op);
  const LayerParams<T> lp = layer_params<T>(weights.vec(), optional_list(biases, 0, 7), key_buffer, value_buffer,
                                            hidden.scalar_type(), s.B, s.d, start + s.R, input_eps, post_eps, op);
  const std::vector<at::Tensor> scratch = allocate_scratch(s, hidden.options());
  at::Tensor out = at::empty({s.B, s.R, s.d}, hidden.options());
  const T* h = hidden.data_ptr<T>();
  T* o = out.data_ptr<T>();
  on_team([&](const Team& team) { layer_steps<P>(s, lp, h, o, team); });
  return out;
}

// Layers 0..n-1 in turn in one parallel region (the output of each the input of the next, in two
// buffers used alternately).
template <class P>
at::Tensor stack_forward(const at::Tensor& hidden, const at::Tensor& cos, const at::Tensor& sin,
                         const std::optional<at::Tensor>& mask, at::TensorList key_buffers, at::TensorList value_buffers,
                         int64_t start, at::TensorList weights, const c10::List<std::optional<at::Tensor>>& biases,
                         at::ArrayRef<double> input_eps, at::ArrayRef<double> post_eps, double scaling) {
  using T = typename P::Wt;
  const char* op = "llama_stack";
  const int64_t n = static_cast<int64_t>(key_buffers.size());
  TORCH_CHECK(n > 0 && value_buffers.size() == static_cast<size_t>(n) && weights.size() == static_cast<size_t>(9 * n) &&
                  biases.size() == static_cast<size_t>(7 * n) && input_eps.size() == static_cast<size_t>(n) &&
                  post_eps.size() == static_cast<size_t>(n),
              op, ": per layer one key and one value buffer, 9 weights, 7 biases and two epsilons expected");
  LayerPlan<T> s = plan_of<T>(hidden, cos, sin, mask, key_buffers[0], weights[1], weights[6], start, scaling, op);
  std::vector<LayerParams<T>> layers;
  for (int64_t l = 0; l < n; ++l) {
    at::Tensor kb = key_buffers[l], vb = value_buffers[l];
    TORCH_CHECK(kb.sizes() == key_buffers[0].sizes() && weights[9 * l + 1].sizes() == weights[1].sizes() &&
                    weights[9 * l + 6].sizes() == weights[6].sizes(),
                op, ": every layer must have the first layer's shapes (layer ", l, " differs)");
    std::vector<at::Tensor> w(weights.begin() + 9 * l, weights.begin() + 9 * l + 9);
    layers.push_back(layer_params<T>(w, optional_list(biases, 7 * l, 7), kb, vb, hidden.scalar_type(), s.B, s.d,
                                     start + s.R, input_eps[l], post_eps[l], op));
  }
  const std::vector<at::Tensor> scratch = allocate_scratch(s, hidden.options());
  at::Tensor ping = at::empty({s.B, s.R, s.d}, hidden.options()), pong = at::empty({s.B, s.R, s.d}, hidden.options());
  T* bufs[2] = {ping.data_ptr<T>(), pong.data_ptr<T>()};
  const T* h0 = hidden.data_ptr<T>();
  on_team([&](const Team& team) {
    const T* in = h0;
    for (int64_t l = 0; l < n; ++l) {
      layer_steps<P>(s, layers[l], in, bufs[l % 2], team);
      in = bufs[l % 2];
    }
  });
  return n % 2 ? ping : pong;
}

// exp of a float32 tensor with the layer's own vectorised exp (for its tests)
at::Tensor vector_exp(const at::Tensor& x) {
  TORCH_CHECK(is_cpu(x, at::kFloat), "vector_exp: a float32 CPU tensor expected");
  at::Tensor y = x.contiguous().clone();
  exp_inplace(y.data_ptr<float>(), y.numel());
  return y;
}

// hidden [B, R, d]; cos, sin [B, R, dh]; mask bool [B, R, start + R] or none (causal);
// key_buffer, value_buffer [B, Hkv, cap, dh] receive this forward's rows at [start, start + R);
// weights: input norm [d], q [Hq dh, d], k [Hkv dh, d], v [Hkv dh, d], o [d, Hq dh], post norm [d],
// gate [I, d], up [I, d], down [d, I] (the seven products' weights all [N, K], or all float32 in panels
// [N / 16, K, 16]); biases: q, k, v, o, gate, up, down (each or none). Every tensor but the mask in one
// dtype, float32 or bfloat16.
at::Tensor llama_layer(const at::Tensor& hidden, const at::Tensor& cos, const at::Tensor& sin,
                       const std::optional<at::Tensor>& mask, at::Tensor key_buffer, at::Tensor value_buffer,
                       int64_t start, at::TensorList weights, const c10::List<std::optional<at::Tensor>>& biases,
                       double input_eps, double post_eps, double scaling) {
  const at::ScalarType dtype = hidden.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "llama_layer: float32 or bfloat16, not ", dtype);
  if (dtype == at::kFloat)
    return layer_forward<F32>(hidden, cos, sin, mask, key_buffer, value_buffer, start, weights, biases, input_eps,
                              post_eps, scaling);
  return layer_forward<BF16>(hidden, cos, sin, mask, key_buffer, value_buffer, start, weights, biases, input_eps,
                             post_eps, scaling);
}

// A stack of n such layers as one call (what n llama_layer calls in turn compute, bit for bit):
// key_buffers, value_buffers one per layer; weights 9 per layer and biases 7 per layer, layer after
// layer, in llama_layer's order; input_eps, post_eps one per layer.
at::Tensor llama_stack(const at::Tensor& hidden, const at::Tensor& cos, const at::Tensor& sin,
                       const std::optional<at::Tensor>& mask, at::TensorList key_buffers, at::TensorList value_buffers,
                       int64_t start, at::TensorList weights, const c10::List<std::optional<at::Tensor>>& biases,
                       at::ArrayRef<double> input_eps, at::ArrayRef<double> post_eps, double scaling) {
  const at::ScalarType dtype = hidden.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "llama_stack: float32 or bfloat16, not ", dtype);
  if (dtype == at::kFloat)
    return stack_forward<F32>(hidden, cos, sin, mask, key_buffers, value_buffers, start, weights, biases, input_eps,
                              post_eps, scaling);
  return stack_forward<BF16>(hidden, cos, sin, mask, key_buffers, value_buffers, start, weights, biases, input_eps,
                             post_eps, scaling);
}


// ---------------------------------------------------------------------------------------------
// harness::lookup_matches(...): prompt lookup's match search (harness/proposers/prompt_lookup.py,
// find_continuations_python), the same matches in the same order. For n from the longest n-gram down:
// every earlier occurrence of the request's suffix n-gram in the request (a scan) and in the
// history of earlier outputs (binary search in its sorted unigram and bigram codes), each
// continuation start taken by the longest n that reaches it, its context the n-gram plus the run
// of equal tokens before it (at most max_context in all, never from before the request's second
// token, never across a separator); ranked by context, then the most recent (the request after
// the history); the first max_matches non-empty continuations of up to max_depth tokens (a
// history continuation cut at its separator). Integer work only, so the Python search and this
// one agree exactly.
namespace lookup {

constexpr int64_t kSeparator = -1;

struct Found {
  int64_t rank;     // position that orders recency: history positions before every request position
  int64_t context;  // the matched context length
  int64_t start;    // the continuation's first position (in the request or in the history)
  bool in_history;
};

int64_t context_length(const int64_t* seq, int64_t hit, int64_t n, const int64_t* tokens, int64_t total,
                       int64_t max_context) {
  const int64_t reach = std::min<int64_t>(max_context, total - 1) - n;
  int64_t run = 0;
  while (run < reach && hit - 1 - run >= 0 && seq[hit - 1 - run] == tokens[total - n - 1 - run]) ++run;
  return n + run;
}

// Ascending history positions p with history[p:p+n] == gram and a token after them, the last max_hits.
std::vector<int64_t> history_hits(const int64_t* hist, int64_t size, const at::Tensor& uni, const at::Tensor& uni_order,
                                  const at::Tensor& bi, const at::Tensor& bi_order, int64_t base, const int64_t* gram,
                                  int64_t n, int64_t max_hits) {
  std::vector<int64_t> out;
  const int64_t g0 = gram[0] + 1, g1 = n > 1 ? gram[1] + 1 : 0;
  if (g0 < 0 || g1 < 0 || g0 >= base || g1 >= base) return out;  // a token the history never holds
  const at::Tensor& codes = n == 1 ? uni : bi;
  const int64_t* sorted = codes.data_ptr<int64_t>();
  const int64_t* order = (n == 1 ? uni_order : bi_order).data_ptr<int64_t>();
  const int64_t len = codes.numel(), code = n == 1 ? g0 : g0 * base + g1;
  const int64_t lo = std::lower_bound(sorted, sorted + len, code) - sorted;
  const int64_t hi = std::upper_bound(sorted, sorted + len, code) - sorted;
  // order[lo:hi] is ascending (a stable sort kept equal codes in position order): walk it from the
  // most recent end until max_hits are found, then put them back in ascending order
  for (int64_t i = hi - 1; i >= lo && static_cast<int64_t>(out.size()) < max_hits; --i) {
    const int64_t p = order[i];
    if (p < 0 || p + n >= size) continue;
    bool same = true;
    for (int64_t j = 2; j < n && same; ++j) same = hist[p + j] == gram[j];
    if (same) out.push_back(p);
  }
  std::reverse(out.begin(), out.end());
  return out;
}

}  // namespace lookup

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> lookup_matches(
    const at::Tensor& tokens_t, const at::Tensor& history_t, const at::Tensor& uni_t, const at::Tensor& uni_order_t,
    const at::Tensor& bi_t, const at::Tensor& bi_order_t, int64_t base, const std::optional<at::Tensor>& skip_t,
    int64_t max_ngram, int64_t min_ngram, int64_t max_depth, int64_t max_matches, int64_t max_hits,
    int64_t max_context) {
  for (const at::Tensor* t : {&tokens_t, &history_t, &uni_t, &uni_order_t, &bi_t, &bi_order_t})
    TORCH_CHECK(t->scalar_type() == at::kLong && t->dim() == 1 && t->is_contiguous() && t->device().is_cpu(),
                "lookup_matches: token and index arrays are contiguous 1-D int64 CPU tensors");
  TORCH_CHECK(min_ngram >= 1 && max_depth >= 1 && max_matches >= 1 && max_hits >= 1,
              "lookup_matches: min_ngram, max_depth, max_matches and max_hits must be >= 1");
  const int64_t total = tokens_t.numel(), offset = history_t.numel();
  TORCH_CHECK(uni_t.numel() == offset && uni_order_t.numel() == offset &&
                  bi_t.numel() == std::max<int64_t>(offset - 1, 0) && bi_order_t.numel() == bi_t.numel(),
              "lookup_matches: the index arrays do not index a history of ", offset, " tokens");
  const int64_t* tokens = tokens_t.data_ptr<int64_t>();
  const int64_t* hist = history_t.data_ptr<int64_t>();
  const bool* skip = nullptr;
  if (skip_t.has_value() && skip_t->defined()) {
    TORCH_CHECK(skip_t->scalar_type() == at::kBool && skip_t->dim() == 1 && skip_t->numel() == offset &&
                    skip_t->is_contiguous() && skip_t->device().is_cpu(),
                "lookup_matches: skip is a contiguous 1-D bool CPU mask over the history");
    skip = skip_t->data_ptr<bool>();
  }
  std::vector<char> seen(total + 1, 0), seen_history(offset + 1, 0);
  std::vector<lookup::Found> found;
  std::vector<int64_t> hits;
  const int64_t top = std::min<int64_t>(max_ngram, offset ? total : total - 1);
  for (int64_t n = top; n >= min_ngram; --n) {
    const int64_t* suffix = tokens + total - n;
    hits.clear();
    if (n < total) {
      for (int64_t i = 0; i + n < total; ++i) {
        bool same = true;
        for (int64_t j = 0; j < n && same; ++j) same = tokens[i + j] == suffix[j];
        if (same && !seen[i + n]) hits.push_back(i);
      }
      for (int64_t i : hits) {
        seen[i + n] = 1;
        found.push_back({i + n + offset, lookup::context_length(tokens, i, n, tokens, total, max_context), i + n, false});
      }
    }
    if (offset) {
      for (int64_t p : lookup::history_hits(hist, offset, uni_t, uni_order_t, bi_t, bi_order_t, base, suffix, n,
                                            max_hits)) {
        if ((skip && skip[p]) || seen_history[p + n]) continue;
        seen_history[p + n] = 1;
        found.push_back({p + n, lookup::context_length(hist, p, n, tokens, total, max_context), p + n, true});
      }
    }
  }
  const auto better = [](const lookup::Found& a, const lookup::Found& b) {
    return a.context != b.context ? a.context > b.context : a.rank > b.rank;  // (context, rank) are unique
  };
  // only the best few are read: order a prefix, and the rest only if empty continuations exhaust it
  const size_t head = std::min(found.size(), static_cast<size_t>(max_matches) + 16);
  std::partial_sort(found.begin(), found.begin() + head, found.end(), better);
  const int64_t rows = std::min<int64_t>(max_matches, static_cast<int64_t>(found.size()));
  at::Tensor context = at::empty({rows}, at::kLong), in_history = at::empty({rows}, at::kBool);
  at::Tensor conts = at::empty({rows, max_depth}, at::kLong), lengths = at::empty({rows}, at::kLong);
  int64_t m = 0;
  for (size_t k = 0; k < found.size() && m < rows; ++k) {
    if (k == head) std::sort(found.begin() + head, found.end(), better);
    const lookup::Found& f = found[k];
    const int64_t* src = f.in_history ? hist : tokens;
    const int64_t end = std::min(f.start + max_depth, f.in_history ? offset : total);
    int64_t len = 0;
    int64_t* row = conts.data_ptr<int64_t>() + m * max_depth;
    while (f.start + len < end && !(f.in_history && src[f.start + len] == lookup::kSeparator)) {
      row[len] = src[f.start + len];
      ++len;
    }
    if (len == 0) continue;
    context.data_ptr<int64_t>()[m] = f.context;
    in_history.data_ptr<bool>()[m] = f.in_history;
    lengths.data_ptr<int64_t>()[m] = len;
    ++m;
  }
  return {context.narrow(0, 0, m), in_history.narrow(0, 0, m), conts.narrow(0, 0, m), lengths.narrow(0, 0, m)};
}

// Slot src[b, j] of every buffer [B, H, cap, d] copied to slot dst[b, j], every source read before any
// write: a commit's accepted rows moved to follow the request's cached ones, in every layer's keys and
// values in one call.
void move_slots(const std::vector<at::Tensor>& buffers, const at::Tensor& src, const at::Tensor& dst) {
  TORCH_CHECK(src.dim() == 2 && dst.sizes() == src.sizes() && src.scalar_type() == at::kLong &&
                  dst.scalar_type() == at::kLong && src.device().is_cpu() && dst.device().is_cpu(),
              "move_slots: src and dst must be int64 [B, K] on the CPU, of one shape");
  const at::Tensor from = src.contiguous(), to = dst.contiguous();
  const int64_t B = from.size(0), K = from.size(1);
  const int64_t *sp = from.data_ptr<int64_t>(), *tp = to.data_ptr<int64_t>();
  int64_t lowest = 0, highest = -1;  // the slots named, over src and dst
  for (int64_t i = 0; i < B * K; ++i) {
    lowest = std::min({lowest, sp[i], tp[i]});
    highest = std::max({highest, sp[i], tp[i]});
  }
  for (const at::Tensor& buf : buffers)  // every buffer checked before any is written
    TORCH_CHECK(buf.dim() == 4 && buf.size(0) == B && buf.is_contiguous() && buf.device().is_cpu() &&
                    lowest >= 0 && highest < buf.size(2),
                "move_slots: every buffer must be a contiguous CPU tensor [B, H, cap, d] with B = ", B,
                " and slots ", lowest, " .. ", highest, " inside cap");
  std::vector<char> rows;
  for (const at::Tensor& buf : buffers) {
    const int64_t H = buf.size(1), cap = buf.size(2), row = buf.size(3) * static_cast<int64_t>(buf.element_size());
    char* base = static_cast<char*>(buf.data_ptr());
    rows.resize(static_cast<size_t>(H * K * row));
    for (int64_t b = 0; b < B; ++b) {
      for (int64_t h = 0; h < H; ++h)
        for (int64_t j = 0; j < K; ++j)
          std::memcpy(rows.data() + (h * K + j) * row, base + ((b * H + h) * cap + sp[b * K + j]) * row,
                      static_cast<size_t>(row));
      for (int64_t h = 0; h < H; ++h)
        for (int64_t j = 0; j < K; ++j)
          std::memcpy(base + ((b * H + h) * cap + tp[b * K + j]) * row, rows.data() + (h * K + j) * row,
                      static_cast<size_t>(row));
    }
  }
}

#if defined(HARNESS_PHASE_TIMES)
// Each thread's counters since the last call ([threads, 2 + steps + parts]: layers, attention blocks
// on tiles, then seconds), which start again from zero.
at::Tensor layer_phase_times() {
  const int64_t width = 2 + kLayerSteps + kAttentionParts;
  at::Tensor out = at::zeros({kMaxTimedThreads, width}, at::TensorOptions().dtype(at::kDouble));
  double* o = out.data_ptr<double>();
  for (int t = 0; t < kMaxTimedThreads; ++t) {
    PhaseTimes& p = phase_times[t];
    o[t * width] = static_cast<double>(p.layers);
    o[t * width + 1] = static_cast<double>(p.blocks);
    for (int i = 0; i < kLayerSteps; ++i) o[t * width + 2 + i] = p.step[i];
    for (int i = 0; i < kAttentionParts; ++i) o[t * width + 2 + kLayerSteps + i] = p.part[i];
    p = PhaseTimes{};
  }
  return out;
}
#endif

}  // namespace

// The ops' namespace is a build flag (tests load builds for other instruction sets beside the real one).
#ifndef HARNESS_NAMESPACE
#define HARNESS_NAMESPACE harness
#endif
#define HARNESS_LIBRARY(ns, m) TORCH_LIBRARY(ns, m)
#define HARNESS_LIBRARY_IMPL(ns, key, m) TORCH_LIBRARY_IMPL(ns, key, m)

HARNESS_LIBRARY(HARNESS_NAMESPACE, m) {
  m.def("streaming_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
  m.def("vector_exp(Tensor x) -> Tensor");
  m.def("pairs_on_amx() -> bool", [] { return amx_permitted(); });
  m.def("move_slots(Tensor(a!)[] buffers, Tensor src, Tensor dst) -> ()");
#if defined(HARNESS_PHASE_TIMES)
  m.def("layer_phase_times() -> Tensor", &layer_phase_times);
#endif
  m.def(
      "llama_layer(Tensor hidden, Tensor cos, Tensor sin, Tensor? mask, Tensor(a!) key_buffer, "
      "Tensor(b!) value_buffer, int start, Tensor[] weights, Tensor?[] biases, float input_eps, float post_eps, "
      "float scaling) -> Tensor");
  m.def(
      "llama_stack(Tensor hidden, Tensor cos, Tensor sin, Tensor? mask, Tensor(a!)[] key_buffers, "
      "Tensor(b!)[] value_buffers, int start, Tensor[] weights, Tensor?[] biases, float[] input_eps, "
      "float[] post_eps, float scaling) -> Tensor");
  m.def(
      "lookup_matches(Tensor tokens, Tensor history, Tensor uni, Tensor uni_order, Tensor bi, Tensor bi_order, "
      "int base, Tensor? skip, int max_ngram, int min_ngram, int max_depth, int max_matches, int max_hits, "
      "int max_context) -> (Tensor, Tensor, Tensor, Tensor)");
}

HARNESS_LIBRARY_IMPL(HARNESS_NAMESPACE, CPU, m) {
  m.impl("streaming_linear", &streaming_linear);
  m.impl("vector_exp", &vector_exp);
  m.impl("llama_layer", &llama_layer);
  m.impl("llama_stack", &llama_stack);
  m.impl("lookup_matches", &lookup_matches);
  m.impl("move_slots", &move_slots);
}
