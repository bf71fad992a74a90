// What pie's block-weight kernels share: W [n, k] in blocks of 32 weights along its input
// dimension in one of llama.cpp's formats, Q4_1 (w = d * q + m, q in 0..15; a block's low
// nibbles are weights 0..15 and its high nibbles 16..31) or Q8_0 (w = d * q, q an int8); the
// instruction set's block dequantization. Included by q4_linear.cpp and int8_dot.h.

#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/mm.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cstdint>

#include "simd.h"

namespace {

constexpr int64_t kBlock = 32;
constexpr int64_t kScaleChunk = 64;  // blocks whose scales are widened to float32 at a time

// A weight [n, k] in format F: `packed` holds F::kBytes bytes per block, `scales` F::kScales
// float16 values per block.
template <class F>
struct Weight {
  const uint8_t* packed;  // [n, k / 32 * F::kBytes]
  const c10::Half* scales;  // [n, k / 32, F::kScales]
  int64_t n;
  int64_t k;
  const uint8_t* row(int64_t i) const { return packed + i * (k / kBlock) * F::kBytes; }
  const c10::Half* row_scales(int64_t i) const { return scales + i * (k / kBlock) * F::kScales; }
};

// Isa is the instruction set's Simd (simd.h) and `widen` (float16 scales to float32) and
// `dequant` (one block into kParts Vecs in element order); the register kernel (PIE_Q4_FUSED)
// also uses Simd's arithmetic. The kernels below are written once over them.

#if defined(__AVX512F__)
#define PIE_Q4_FUSED 1
struct Isa : Simd {
  static void widen(const c10::Half* s, int64_t count, float* out) {
    int64_t i = 0;
    for (; i + 16 <= count; i += 16) {
      const __m256i halves = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + i));
      _mm512_storeu_ps(out + i, _mm512_cvtph_ps(halves));
    }
    for (; i < count; ++i) out[i] = static_cast<float>(s[i]);
  }
  // The 16 values d * q + m for q = 0..15 form a table that vpermps indexes with each lane's
  // low 4 bits, which is the low nibble as loaded: one permute per 16 weights, no conversions.
  static void dequant(const uint8_t* q, float d, float m, Vec* out) {
    const Vec levels = _mm512_set_ps(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    const Vec table = _mm512_fmadd_ps(levels, _mm512_set1_ps(d), _mm512_set1_ps(m));
    const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q)));
    out[0] = _mm512_permutexvar_ps(bytes, table);
    out[1] = _mm512_permutexvar_ps(_mm512_srli_epi32(bytes, 4), table);
  }
  static void dequant8(const int8_t* q, float d, Vec* out) {
    const Vec scale = _mm512_set1_ps(d);
    for (int p = 0; p < 2; ++p) {
      const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16 * p));
      out[p] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes)), scale);
    }
  }
};
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define PIE_Q4_FUSED 1
struct Isa : Simd {
  static void widen(const c10::Half* s, int64_t count, float* out) {
    int64_t i = 0;
    for (; i + 8 <= count; i += 8) {
      const __m128i halves = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i));
      _mm256_storeu_ps(out + i, _mm256_cvtph_ps(halves));
    }
    for (; i < count; ++i) out[i] = static_cast<float>(s[i]);
  }
  static void dequant(const uint8_t* q, float d, float m, Vec* out) {
    const Vec scale = _mm256_set1_ps(d);
    const Vec offset = _mm256_set1_ps(m);
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q));
    const __m128i mask = _mm_set1_epi8(15);
    const __m128i low = _mm_and_si128(bytes, mask);
    const __m128i high = _mm_and_si128(_mm_srli_epi16(bytes, 4), mask);
    const __m128i parts[4] = {low, _mm_srli_si128(low, 8), high, _mm_srli_si128(high, 8)};
    for (int p = 0; p < 4; ++p) {
      const Vec levels = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(parts[p]));
      out[p] = _mm256_fmadd_ps(levels, scale, offset);
    }
  }
  static void dequant8(const int8_t* q, float d, Vec* out) {
    const Vec scale = _mm256_set1_ps(d);
    for (int p = 0; p < 4; ++p) {
      const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + 8 * p));
      out[p] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes)), scale);
    }
  }
};
#else
#define PIE_Q4_FUSED 0
// Without SIMD the per-block loop lost to dequantizing into float tiles for torch's matmul at
// every batch size (0.35x float32 against 0.53x at one row, measured), so only that path runs.
// ScalarSimd, not Simd: a build with AVX2 and FMA but no F16C gets this one too.
struct Isa : ScalarSimd {
  static void widen(const c10::Half* s, int64_t count, float* out) {
    for (int64_t i = 0; i < count; ++i) out[i] = static_cast<float>(s[i]);
  }
  static void dequant(const uint8_t* q, float d, float m, Vec* out) {
    // d has 11 significant bits and q 4, so d * q is exact: rounding matches a fused d * q + m.
    for (int j = 0; j < 16; ++j) {
      out[j] = d * static_cast<float>(q[j] & 15) + m;
      out[j + 16] = d * static_cast<float>(q[j] >> 4) + m;
    }
  }
  static void dequant8(const int8_t* q, float d, Vec* out) {
    for (int j = 0; j < kBlock; ++j) out[j] = d * static_cast<float>(q[j]);
  }
};
#endif

constexpr int kParts = kBlock / Isa::kWidth;

struct Q4_1 {
  static constexpr int64_t kBytes = kBlock / 2;
  static constexpr int64_t kScales = 2;  // d, m
  static void dequant(const uint8_t* q, const float* s, Isa::Vec* out) {
    Isa::dequant(q, s[0], s[1], out);
  }
};

struct Q8_0 {
  static constexpr int64_t kBytes = kBlock;
  static constexpr int64_t kScales = 1;  // d
  static void dequant(const uint8_t* q, const float* s, Isa::Vec* out) {
    Isa::dequant8(reinterpret_cast<const int8_t*>(q), s[0], out);
  }
};

// Rows begin..end of W (or, with `ids`, rows ids[begin..end]) into `out` as float32.
template <class F>
void dequant_rows(const Weight<F>& w, int64_t begin, int64_t end, float* out,
                  const int64_t* ids = nullptr) {
  constexpr int64_t S = F::kScales;
  const int64_t blocks = w.k / kBlock;
  float scales[S * kScaleChunk];
  for (int64_t i0 = begin; i0 < end; ++i0) {
    const int64_t n = ids == nullptr ? i0 : ids[i0];
    float* dst = out + (i0 - begin) * w.k;
    for (int64_t b0 = 0; b0 < blocks; b0 += kScaleChunk) {
      const int64_t count = std::min(kScaleChunk, blocks - b0);
      Isa::widen(w.row_scales(n) + S * b0, S * count, scales);
      for (int64_t i = 0; i < count; ++i) {
        typename Isa::Vec block[kParts];
        const int64_t b = b0 + i;
        F::dequant(w.row(n) + b * F::kBytes, scales + S * i, block);
        for (int p = 0; p < kParts; ++p) Isa::store(dst + b * kBlock + p * Isa::kWidth, block[p]);
      }
    }
  }
}

}  // namespace
