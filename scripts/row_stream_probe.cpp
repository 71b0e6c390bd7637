// How fast one-row products can stream their weights on this CPU, next to a plain read of the
// same bytes: the question behind the autoregressive step's distance from its weight-streaming
// floor. A one-row product of the native kernel reduces each output element in one chain of
// dependent multiply-adds (its summation order is fixed so that a row's result does not depend on
// the rows beside it); this probe times that loop against loops that read the same matrix with
// more independent chains, a software prefetch, or other bfloat16 widenings, all on an LM-head-sized
// matrix (49152 x 576), the threads splitting its rows as the kernel does, interleaved rounds,
// medians. Standalone (no torch):
//
//   g++ -O3 -march=native -fopenmp -ffp-contract=off scripts/row_stream_probe.cpp -o /tmp/row_stream_probe
//   /tmp/row_stream_probe 2 21        # threads, rounds
//
// Prints GB/s of weight bytes per variant. Run it alone: two timed jobs on two cores slow each other.
#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

namespace {

constexpr int N = 49152, K = 576;
float *wf, *xf, *xp, *out;
uint16_t *wb, *xb;

float hsum(__m256 v) {
  __m128 a = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  a = _mm_add_ps(a, _mm_movehl_ps(a, a));
  return _mm_cvtss_f32(_mm_add_ss(a, _mm_movehdup_ps(a)));
}

__m256 widen(const uint16_t* p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
}

enum Variant {
  kF32Read,      // float32: a sum over the bytes in four accumulators (what a bandwidth benchmark does)
  kF32OneChain,  // float32: one row at a time, one accumulator (the kernel's order)
  kF32TwoChains, // float32: one row at a time, alternate vectors into two accumulators
  kF32Prefetch,  // float32: one chain, plus a prefetch 512 bytes ahead in the row's stream
  kBF16Read,     // bfloat16: a plain read of the bytes
  kBF16Widen,    // bfloat16: inputs and weights widened per vector, one chain (the kernel's loop)
  kBF16InputOnce,// bfloat16: inputs widened once, weights per vector, one chain
  kBF16Unpack,   // bfloat16: weights widened by interleaving with zeros (inputs permuted to match), one chain
  kBF16TwoChains,// bfloat16: inputs widened once, alternate vectors into two accumulators
  kVariants
};
const char* kNames[kVariants] = {"f32 read", "f32 one chain", "f32 two chains", "f32 prefetch", "bf16 read",
                                 "bf16 widen", "bf16 input once", "bf16 unpack", "bf16 two chains"};

void run(Variant v, int t, int nt) {
  const int share = (N + nt - 1) / nt, n0 = t * share, n1 = std::min(N, n0 + share);
  const __m256i zero = _mm256_setzero_si256();
  if (v == kF32Read) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (const float *p = wf + (size_t)n0 * K, *e = wf + (size_t)n1 * K; p < e; p += 32) {
      a0 = _mm256_add_ps(a0, _mm256_loadu_ps(p));
      a1 = _mm256_add_ps(a1, _mm256_loadu_ps(p + 8));
      a2 = _mm256_add_ps(a2, _mm256_loadu_ps(p + 16));
      a3 = _mm256_add_ps(a3, _mm256_loadu_ps(p + 24));
    }
    out[t] = hsum(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
    return;
  }
  if (v == kBF16Read) {
    __m256i a0 = zero, a1 = zero;
    for (const uint16_t *p = wb + (size_t)n0 * K, *e = wb + (size_t)n1 * K; p < e; p += 32) {
      a0 = _mm256_add_epi16(a0, _mm256_loadu_si256((const __m256i*)p));
      a1 = _mm256_add_epi16(a1, _mm256_loadu_si256((const __m256i*)(p + 16)));
    }
    out[t] = _mm256_extract_epi16(_mm256_add_epi16(a0, a1), 3);
    return;
  }
  for (int n = n0; n < n1; ++n) {
    const float* w = wf + (size_t)n * K;
    const uint16_t* u = wb + (size_t)n * K;
    __m256 a = _mm256_setzero_ps(), b = a;
    switch (v) {
      case kF32OneChain:
        for (int k = 0; k < K; k += 8) a = _mm256_fmadd_ps(_mm256_loadu_ps(xf + k), _mm256_loadu_ps(w + k), a);
        break;
      case kF32TwoChains:
        for (int k = 0; k < K; k += 16) {
          a = _mm256_fmadd_ps(_mm256_loadu_ps(xf + k), _mm256_loadu_ps(w + k), a);
          b = _mm256_fmadd_ps(_mm256_loadu_ps(xf + k + 8), _mm256_loadu_ps(w + k + 8), b);
        }
        break;
      case kF32Prefetch:
        for (int k = 0; k < K; k += 16) {
          _mm_prefetch(reinterpret_cast<const char*>(w + k) + 512, _MM_HINT_T0);
          a = _mm256_fmadd_ps(_mm256_loadu_ps(xf + k), _mm256_loadu_ps(w + k), a);
          a = _mm256_fmadd_ps(_mm256_loadu_ps(xf + k + 8), _mm256_loadu_ps(w + k + 8), a);
        }
        break;
      case kBF16Widen:
        for (int k = 0; k < K; k += 8) a = _mm256_fmadd_ps(widen(xb + k), widen(u + k), a);
        break;
      case kBF16InputOnce:
        for (int k = 0; k < K; k += 8) a = _mm256_fmadd_ps(_mm256_loadu_ps(xf + k), widen(u + k), a);
        break;
      case kBF16Unpack:
        for (int k = 0; k < K; k += 16) {
          const __m256i wv = _mm256_loadu_si256((const __m256i*)(u + k));
          a = _mm256_fmadd_ps(_mm256_loadu_ps(xp + k), _mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, wv)), a);
          a = _mm256_fmadd_ps(_mm256_loadu_ps(xp + k + 8), _mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, wv)), a);
        }
        break;
      case kBF16TwoChains:
        for (int k = 0; k < K; k += 16) {
          a = _mm256_fmadd_ps(_mm256_loadu_ps(xf + k), widen(u + k), a);
          b = _mm256_fmadd_ps(_mm256_loadu_ps(xf + k + 8), widen(u + k + 8), b);
        }
        break;
      default:
        break;
    }
    out[n] = hsum(_mm256_add_ps(a, b));
  }
}

double seconds(Variant v, int threads) {
  const double t0 = omp_get_wtime();
#pragma omp parallel num_threads(threads)
  run(v, omp_get_thread_num(), omp_get_num_threads());
  return omp_get_wtime() - t0;
}

}  // namespace

int main(int argc, char** argv) {
  const int threads = argc > 1 ? std::atoi(argv[1]) : 2, rounds = argc > 2 ? std::atoi(argv[2]) : 15;
  if (threads < 1 || rounds < 1) {
    std::fprintf(stderr, "usage: %s [threads >= 1] [rounds >= 1]\n", argv[0]);
    return 2;
  }
  wf = static_cast<float*>(std::aligned_alloc(64, (size_t)N * K * 4));
  wb = static_cast<uint16_t*>(std::aligned_alloc(64, (size_t)N * K * 2));
  xf = static_cast<float*>(std::aligned_alloc(64, K * 4));
  xp = static_cast<float*>(std::aligned_alloc(64, K * 4));
  xb = static_cast<uint16_t*>(std::aligned_alloc(64, K * 2));
  out = static_cast<float*>(std::aligned_alloc(64, N * 4));
#pragma omp parallel for num_threads(threads)
  for (long i = 0; i < (long)N * K; ++i) {
    wf[i] = 0.01f * (i % 7);
    wb[i] = static_cast<uint16_t>(0x3c00 + i % 7);
  }
  for (int k = 0; k < K; ++k) xf[k] = xp[k] = 1.0f, xb[k] = 0x3f80;
  std::vector<std::vector<double>> times(kVariants);
  for (int v = 0; v < kVariants; ++v) seconds(static_cast<Variant>(v), threads);  // warm-up
  for (int r = 0; r < rounds; ++r)
    for (int i = 0; i < kVariants; ++i) {
      const int v = (i + r) % kVariants;  // a different variant first in every round
      times[v].push_back(seconds(static_cast<Variant>(v), threads));
    }
  std::printf("%d thread(s), %d rounds, medians; weight bytes per second\n", threads, rounds);
  for (int v = 0; v < kVariants; ++v) {
    std::sort(times[v].begin(), times[v].end());
    const double bytes = (double)N * K * (v < kBF16Read ? 4 : 2);
    std::printf("  %-16s %6.2f GB/s\n", kNames[v], bytes / times[v][times[v].size() / 2] / 1e9);
  }
  return 0;
}
