// How many float32 multiply-adds one core can do in the register tiles of a multi-row product, with
// every operand in L1: the ceiling of a verify forward's extra rows once the weights have arrived.
// Four loops, each timed on one core over SmolLM2's width (K = 576), best of several runs:
//
// - peak: ten independent chains of multiply-adds on registers (no loads), the core's FMA rate;
// - dot 4x3, as compiled: the native kernel's tile shape without AVX-512 (4 input rows by 3 weight
//   rows, one vector accumulator per output element, reduced over k), written as the kernel writes
//   it (arrays of vectors), so GCC chooses the loads;
// - dot 4x3, weights in registers: the same tile with each step's weight and input vectors kept in
//   registers by empty asm (7 loads per 12 multiply-adds instead of the 16 GCC emits), the same
//   values and the same order;
// - outer 6x16: the other summation order (6 input rows by 16 outputs, a broadcast input element
//   times a packed panel of weights, no horizontal sums), which needs a repacked copy of the weights.
//
// Standalone (no torch):
//
//   g++ -O3 -march=native -ffp-contract=off scripts/tile_ceiling_probe.cpp -o /tmp/tile_ceiling_probe
//   /tmp/tile_ceiling_probe
//
// Prints GFLOP/s per loop (2 per multiply-add). Run it alone: two timed jobs on two cores slow each
// other. Needs AVX2 and FMA.
#include <immintrin.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>

namespace {

constexpr long K = 576;

#define FMA(a, x, w) a = _mm256_fmadd_ps(x, w, a)

__attribute__((noipa)) float peak(long iterations) {
  __m256 a[10];
  for (int i = 0; i < 10; ++i) a[i] = _mm256_set1_ps(1.0f + 1e-3f * i);
  const __m256 b = _mm256_set1_ps(0.999999f), c = _mm256_set1_ps(1e-7f);
  for (long it = 0; it < iterations; ++it)
    for (int i = 0; i < 10; ++i) a[i] = _mm256_fmadd_ps(a[i], b, c);
  float s = 0;
  for (int i = 0; i < 10; ++i) s += _mm256_cvtss_f32(a[i]);
  return s;
}

__attribute__((noipa)) void dot_as_compiled(const float* x, const float* w, float* y) {
  __m256 acc[4][3];
  for (auto& row : acc)
    for (auto& v : row) v = _mm256_setzero_ps();
  for (long k = 0; k < K; k += 8) {
    __m256 wv[3];
    for (int j = 0; j < 3; ++j) wv[j] = _mm256_loadu_ps(w + j * K + k);
    for (int i = 0; i < 4; ++i) {
      const __m256 xv = _mm256_loadu_ps(x + i * K + k);
      for (int j = 0; j < 3; ++j) acc[i][j] = _mm256_fmadd_ps(xv, wv[j], acc[i][j]);
    }
  }
  for (int i = 0; i < 4; ++i)
    for (int j = 0; j < 3; ++j) _mm256_storeu_ps(y + 8 * (3 * i + j), acc[i][j]);
}

__attribute__((noipa)) void dot_in_registers(const float* x, const float* w, float* y) {
  const __m256 z = _mm256_setzero_ps();
  __m256 a00 = z, a01 = z, a02 = z, a10 = z, a11 = z, a12 = z, a20 = z, a21 = z, a22 = z, a30 = z, a31 = z, a32 = z;
  for (long k = 0; k < K; k += 8) {
    __m256 w0 = _mm256_loadu_ps(w + k), w1 = _mm256_loadu_ps(w + K + k), w2 = _mm256_loadu_ps(w + 2 * K + k);
    __asm__("" : "+x"(w0), "+x"(w1), "+x"(w2));
    __m256 xv = _mm256_loadu_ps(x + k);
    __asm__("" : "+x"(xv));
    FMA(a00, xv, w0), FMA(a01, xv, w1), FMA(a02, xv, w2);
    xv = _mm256_loadu_ps(x + K + k);
    __asm__("" : "+x"(xv));
    FMA(a10, xv, w0), FMA(a11, xv, w1), FMA(a12, xv, w2);
    xv = _mm256_loadu_ps(x + 2 * K + k);
    __asm__("" : "+x"(xv));
    FMA(a20, xv, w0), FMA(a21, xv, w1), FMA(a22, xv, w2);
    xv = _mm256_loadu_ps(x + 3 * K + k);
    __asm__("" : "+x"(xv));
    FMA(a30, xv, w0), FMA(a31, xv, w1), FMA(a32, xv, w2);
  }
  const __m256 out[12] = {a00, a01, a02, a10, a11, a12, a20, a21, a22, a30, a31, a32};
  for (int i = 0; i < 12; ++i) _mm256_storeu_ps(y + 8 * i, out[i]);
}

__attribute__((noipa)) void outer(const float* x, const float* panel, float* y) {
  const __m256 z = _mm256_setzero_ps();
  __m256 a00 = z, a01 = z, a10 = z, a11 = z, a20 = z, a21 = z, a30 = z, a31 = z, a40 = z, a41 = z, a50 = z, a51 = z;
  for (long k = 0; k < K; ++k) {
    const __m256 w0 = _mm256_loadu_ps(panel + 16 * k), w1 = _mm256_loadu_ps(panel + 16 * k + 8);
    __m256 b = _mm256_broadcast_ss(x + k);
    FMA(a00, b, w0), FMA(a01, b, w1);
    b = _mm256_broadcast_ss(x + K + k);
    FMA(a10, b, w0), FMA(a11, b, w1);
    b = _mm256_broadcast_ss(x + 2 * K + k);
    FMA(a20, b, w0), FMA(a21, b, w1);
    b = _mm256_broadcast_ss(x + 3 * K + k);
    FMA(a30, b, w0), FMA(a31, b, w1);
    b = _mm256_broadcast_ss(x + 4 * K + k);
    FMA(a40, b, w0), FMA(a41, b, w1);
    b = _mm256_broadcast_ss(x + 5 * K + k);
    FMA(a50, b, w0), FMA(a51, b, w1);
  }
  const __m256 out[12] = {a00, a01, a10, a11, a20, a21, a30, a31, a40, a41, a50, a51};
  for (int i = 0; i < 12; ++i) _mm256_storeu_ps(y + 8 * i, out[i]);
}

template <class F>
double best_seconds(const F& fn, int runs = 7) {
  double best = 1e30;
  for (int r = 0; r < runs; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    fn();
    best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  return best;
}

}  // namespace

int main() {
  float* x = static_cast<float*>(std::aligned_alloc(64, 8 * K * sizeof(float)));
  float* w = static_cast<float*>(std::aligned_alloc(64, 16 * K * sizeof(float)));
  float y[128];
  for (long i = 0; i < 8 * K; ++i) x[i] = 1e-3f * static_cast<float>(i % 11);
  for (long i = 0; i < 16 * K; ++i) w[i] = 2e-3f * static_cast<float>(i % 5);
  const long reps = 200000, iterations = 20000000;
  const double gflop_tile = 2.0 * 12 * 8 * K / 8 * reps / 1e9;  // 12 vector accumulators, K / 8 steps
  const double gflop_outer = 2.0 * 12 * 8 * K * reps / 1e9;     // 12 vector accumulators, K steps
  std::printf("peak (10 chains, no loads):      %6.1f GFLOP/s\n",
              2.0 * 8 * 10 * iterations / 1e9 / best_seconds([&] { peak(iterations); }));
  std::printf("dot 4x3, as compiled:            %6.1f GFLOP/s\n",
              gflop_tile / best_seconds([&] { for (long i = 0; i < reps; ++i) dot_as_compiled(x, w, y); }));
  std::printf("dot 4x3, weights in registers:   %6.1f GFLOP/s\n",
              gflop_tile / best_seconds([&] { for (long i = 0; i < reps; ++i) dot_in_registers(x, w, y); }));
  std::printf("outer 6x16, packed weight panel: %6.1f GFLOP/s\n",
              gflop_outer / 8 / best_seconds([&] { for (long i = 0; i < reps / 8; ++i) outer(x, w, y); }));
  std::free(x);
  std::free(w);
  return 0;
}
