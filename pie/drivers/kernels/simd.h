// The float vector operations pie's CPU kernels share, one struct per instruction set: Vec
// (kWidth floats), kName, and zero, set1, load, store, add, mul, fma and sum (of a Vec's lanes).
// A kernel's own `struct Isa : Simd` adds the operations only it uses. Everything here is in an
// anonymous namespace: each build variant of a kernel is a separate library loaded into the same
// process, and these functions compile to different instructions in each.

#pragma once

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

namespace {

// One float per Vec: the fallback that every build compiles, and what Simd is without AVX2 and
// FMA. The loops written over Vec serve it unchanged.
struct ScalarSimd {
  using Vec = float;
  static constexpr int kWidth = 1;
  static constexpr const char* kName = "portable";
  static Vec zero() { return 0.0f; }
  static Vec set1(float v) { return v; }
  static Vec load(const float* p) { return *p; }
  static void store(float* p, Vec v) { *p = v; }
  static Vec add(Vec a, Vec b) { return a + b; }
  static Vec mul(Vec a, Vec b) { return a * b; }
  static Vec fma(Vec a, Vec b, Vec c) { return a * b + c; }
  static float sum(Vec v) { return v; }
};

#if defined(__AVX512F__)
struct Simd {
  using Vec = __m512;
  static constexpr int kWidth = 16;
  static constexpr const char* kName = "avx512";
  static Vec zero() { return _mm512_setzero_ps(); }
  static Vec set1(float v) { return _mm512_set1_ps(v); }
  static Vec load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, Vec v) { _mm512_storeu_ps(p, v); }
  static Vec add(Vec a, Vec b) { return _mm512_add_ps(a, b); }
  static Vec mul(Vec a, Vec b) { return _mm512_mul_ps(a, b); }
  static Vec fma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
  static float sum(Vec v) { return _mm512_reduce_add_ps(v); }
};
#elif defined(__AVX2__) && defined(__FMA__)
struct Simd {
  using Vec = __m256;
  static constexpr int kWidth = 8;
  static constexpr const char* kName = "avx2";
  static Vec zero() { return _mm256_setzero_ps(); }
  static Vec set1(float v) { return _mm256_set1_ps(v); }
  static Vec load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, Vec v) { _mm256_storeu_ps(p, v); }
  static Vec add(Vec a, Vec b) { return _mm256_add_ps(a, b); }
  static Vec mul(Vec a, Vec b) { return _mm256_mul_ps(a, b); }
  static Vec fma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
  static float sum(Vec v) {
    __m128 half = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    half = _mm_add_ps(half, _mm_movehl_ps(half, half));
    return _mm_cvtss_f32(_mm_add_ss(half, _mm_movehdup_ps(half)));
  }
};
#else
using Simd = ScalarSimd;
#endif

}  // namespace
