// Decode rows of x times a block weight held in 16-row tiles, with x quantized to int8 blocks as
// llama.cpp's CPU path does: each block of 32 values of a row of x becomes int8 levels with one
// float scale dx = max|x| / 127, so a block's dot product with W's levels is an exact integer sum,
// scaled once per block by d_w * dx (Q4_1 adds m_w times the block's float sum of x).
//
// A tile stores block b of 16 consecutive rows of W together, as kBytes / 4 groups of 16 rows x 4
// bytes: row j's bytes 4g..4g+3 of the block sit in group g at lane j. One AVX-512 VNNI
// instruction then multiplies 4 levels of 16 rows with the same 4 levels of x (broadcast) and
// adds them into each row's lane: 64 multiply-adds, no horizontal sums, and every row's block
// sum ends in its own lane, ready for that block's scales (stored per tile as S x 16 float16).
// Q8_0 levels are stored offset by 128 (unsigned, as the instruction takes them) and the
// offset's share, 128 x the sum of x's levels, is taken off per block.

#pragma once

#include <cmath>
#include <cstring>
#include <vector>

#include "block_formats.h"

namespace {

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define PIE_INT8_DOT 1
#else
#define PIE_INT8_DOT 0
#endif

constexpr int64_t kTile = 16;
// How far ahead of the block it multiplies the kernel asks for W's bytes. A decode step streams
// the whole model from memory on one core, and the hardware prefetcher alone left it waiting:
// 4 KB ahead took a batch-1 step of the default model from 28.7 to 22.8 ms (medians of ten
// interleaved rounds; 8 KB: 23.7, 1 KB: 19.9 against 22.8 in another run).
constexpr int64_t kPrefetchBytes = 4096;

// Rows of x as int8 blocks.
struct XBlocks {
  int64_t rows = 0;
  int64_t blocks = 0;
  std::vector<int8_t> levels;  // [rows, blocks * 32]
  std::vector<float> dx;       // [rows, blocks]
  std::vector<float> sums;     // [rows, blocks]: the float sum of the block's x (Q4_1's m term)
  std::vector<int32_t> offset; // [rows, blocks]: 128 x the sum of the block's levels (Q8_0's)
};

XBlocks quantize_x(const float* x, int64_t rows, int64_t k) {
  XBlocks q;
  q.rows = rows;
  q.blocks = k / kBlock;
  q.levels.resize(rows * k);
  q.dx.resize(rows * q.blocks);
  q.sums.resize(rows * q.blocks);
  q.offset.resize(rows * q.blocks);
  for (int64_t rb = 0; rb < rows * q.blocks; ++rb) {
    const float* v = x + rb * kBlock;
    float amax = 0.0f, sum = 0.0f;
    for (int64_t i = 0; i < kBlock; ++i) {
      amax = std::max(amax, std::fabs(v[i]));
      sum += v[i];
    }
    const float d = amax / 127.0f;
    const float inverse = d > 0.0f ? 1.0f / d : 0.0f;
    int32_t level_sum = 0;
    for (int64_t i = 0; i < kBlock; ++i) {
      const auto level = static_cast<int8_t>(std::nearbyint(v[i] * inverse));
      q.levels[rb * kBlock + i] = level;
      level_sum += level;
    }
    q.dx[rb] = d;
    q.sums[rb] = sum;
    q.offset[rb] = 128 * level_sum;
  }
  return q;
}

// W [n, k] in tiles: `packed` [n / 16, blocks * 16 * kBytes], `scales` [n / 16, blocks, S, 16].
template <class F>
struct Tiled {
  const uint8_t* packed;
  const c10::Half* scales;
  int64_t n;
  int64_t k;
  int64_t blocks() const { return k / kBlock; }
  const uint8_t* block(int64_t tile, int64_t b) const {
    return packed + (tile * blocks() + b) * kTile * F::kBytes;
  }
  const c10::Half* block_scales(int64_t tile, int64_t b) const {
    return scales + (tile * blocks() + b) * F::kScales * kTile;
  }
};

// Q8_0 levels are stored offset by 128; the standard layout holds them signed.
template <class F>
constexpr uint8_t kStoredOffset = F::kScales == 1 ? 0x80 : 0;

// Rows n0..n1 of W in the standard layout (Weight<F>'s), into `packed` and `scales`.
template <class F>
void untile(const Tiled<F>& w, int64_t n0, int64_t n1, uint8_t* packed, c10::Half* scales) {
  constexpr int64_t S = F::kScales, groups = F::kBytes / 4;
  const int64_t blocks = w.blocks();
  for (int64_t n = n0; n < n1; ++n) {
    const int64_t t = n / kTile, j = n % kTile;
    for (int64_t b = 0; b < blocks; ++b) {
      const uint8_t* src = w.block(t, b) + j * 4;
      uint8_t* dst = packed + ((n - n0) * blocks + b) * F::kBytes;
      for (int64_t g = 0; g < groups; ++g)
        for (int64_t i = 0; i < 4; ++i) dst[g * 4 + i] = src[g * kTile * 4 + i] ^ kStoredOffset<F>;
      for (int64_t c = 0; c < S; ++c)
        scales[((n - n0) * blocks + b) * S + c] = w.block_scales(t, b)[c * kTile + j];
    }
  }
}

// Rows n0..n1 of W as float32 into `out`, through the standard layout.
template <class F>
void dequant_tiled(const Tiled<F>& w, int64_t n0, int64_t n1, float* out) {
  std::vector<uint8_t> packed((n1 - n0) * w.blocks() * F::kBytes);
  std::vector<c10::Half> scales((n1 - n0) * w.blocks() * F::kScales);
  untile(w, n0, n1, packed.data(), scales.data());
  dequant_rows(Weight<F>{packed.data(), scales.data(), n1 - n0, w.k}, 0, n1 - n0, out);
}

// Level i of a standard-layout block `q` as an integer (Q4_1: 0..15, Q8_0: -127..127).
template <class F>
int32_t weight_level(const uint8_t* q, int64_t i) {
  if constexpr (F::kScales == 2) return i < 16 ? q[i] & 15 : q[i - 16] >> 4;
  // Read as int8, not cast from uint8: GCC 12 vectorized the cast's loop (AVX-VNNI, no AVX-512)
  // as if the levels were unsigned.
  return reinterpret_cast<const int8_t*>(q)[i];
}

// The portable form over the standard layout: the same integer block sums and the same
// per-block scaling, in loops.
template <class F>
void int8_rows_plain(const XBlocks& x, const Weight<F>& w, int64_t begin, int64_t end, float* y) {
  for (int64_t n = begin; n < end; ++n) {
    const c10::Half* s = w.row_scales(n);
    for (int64_t r = 0; r < x.rows; ++r) {
      float total = 0.0f;
      for (int64_t b = 0; b < x.blocks; ++b) {
        const uint8_t* q = w.row(n) + b * F::kBytes;
        const int8_t* levels = x.levels.data() + (r * x.blocks + b) * kBlock;
        int32_t dot = 0;
        for (int64_t i = 0; i < kBlock; ++i) dot += weight_level<F>(q, i) * levels[i];
        const int64_t rb = r * x.blocks + b;
        total += static_cast<float>(dot) * (static_cast<float>(s[b * F::kScales]) * x.dx[rb]);
        if constexpr (F::kScales == 2) total += static_cast<float>(s[b * 2 + 1]) * x.sums[rb];
      }
      y[r * w.n + n] = total;
    }
  }
}

#if PIE_INT8_DOT

// The 16 rows' integer sums of a block, x's 32 levels against the 8 level vectors: two chains.
__m512i tile_dot(const __m512i* levels, const int8_t* x) {
  constexpr int groups = kBlock / 4;
  __m512i even = _mm512_setzero_si512(), odd = _mm512_setzero_si512();
  int32_t words[groups];
  std::memcpy(words, x, sizeof(words));
#pragma GCC unroll 8
  for (int g = 0; g < groups; g += 2) {
    even = _mm512_dpbusd_epi32(even, levels[g], _mm512_set1_epi32(words[g]));
    odd = _mm512_dpbusd_epi32(odd, levels[g + 1], _mm512_set1_epi32(words[g + 1]));
  }
  return _mm512_add_epi32(even, odd);
}

// Block b of a tile as 8 vectors of unsigned levels, group g's 4 levels of each row per lane.
// Q4_1's bytes hold levels i (low nibble) and i + 16 (high): groups 0..3 and 4..7.
template <class F>
void tile_levels(const uint8_t* block, __m512i* levels) {
  if constexpr (F::kScales == 2) {
    const __m512i low = _mm512_set1_epi8(15);
#pragma GCC unroll 4
    for (int g = 0; g < 4; ++g) {
      const __m512i bytes = _mm512_loadu_si512(block + 64 * g);
      levels[g] = _mm512_and_si512(bytes, low);
      levels[g + 4] = _mm512_and_si512(_mm512_srli_epi16(bytes, 4), low);
    }
  } else {
#pragma GCC unroll 8
    for (int g = 0; g < 8; ++g) levels[g] = _mm512_loadu_si512(block + 64 * g);
  }
}

// y[r0 + r, 16 t .. 16 t + 15] for rows r0 .. r0 + R - 1 of x and tile t. Only the first rows
// to read the tile prefetch ahead of it: for later ones the tile is in cache.
template <class F, int R>
void int8_tile(const XBlocks& x, int64_t r0, const Tiled<F>& w, int64_t t, float* y) {
  __m512 acc[R], extra[R];
  for (int r = 0; r < R; ++r) acc[r] = extra[r] = _mm512_setzero_ps();
  const int64_t blocks = w.blocks();
  for (int64_t b = 0; b < blocks; ++b) {
    __m512i levels[8];
    if (r0 == 0) {
      for (int64_t c = 0; c < kTile * F::kBytes; c += 64)
        _mm_prefetch(reinterpret_cast<const char*>(w.block(t, b)) + kPrefetchBytes + c,
                     _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(w.block_scales(t, b)) + kPrefetchBytes / 8,
                   _MM_HINT_T0);
    }
    tile_levels<F>(w.block(t, b), levels);
    const c10::Half* s = w.block_scales(t, b);
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(s)));
    const __m512 m = F::kScales == 2
        ? _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + kTile)))
        : d;
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const int64_t rb = (r0 + r) * blocks + b;
      __m512i dot = tile_dot(levels, x.levels.data() + rb * kBlock);
      if constexpr (F::kScales == 1) dot = _mm512_sub_epi32(dot, _mm512_set1_epi32(x.offset[rb]));
      const __m512 scale = _mm512_mul_ps(d, _mm512_set1_ps(x.dx[rb]));
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), scale, acc[r]);
      if constexpr (F::kScales == 2) extra[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(x.sums[rb]), extra[r]);
    }
  }
  for (int r = 0; r < R; ++r)
    _mm512_storeu_ps(y + (r0 + r) * w.n + t * kTile, _mm512_add_ps(acc[r], extra[r]));
}

// Every row of x against tile t, up to 8 rows a call, so the tile stays in cache while all
// of them read it.
template <class F>
void int8_tile_rows(const XBlocks& x, const Tiled<F>& w, int64_t t, float* y) {
  for (int64_t r0 = 0; r0 < x.rows; r0 += 8) {
    switch (std::min<int64_t>(8, x.rows - r0)) {
      case 1: int8_tile<F, 1>(x, r0, w, t, y); break;
      case 2: int8_tile<F, 2>(x, r0, w, t, y); break;
      case 3: int8_tile<F, 3>(x, r0, w, t, y); break;
      case 4: int8_tile<F, 4>(x, r0, w, t, y); break;
      case 5: int8_tile<F, 5>(x, r0, w, t, y); break;
      case 6: int8_tile<F, 6>(x, r0, w, t, y); break;
      case 7: int8_tile<F, 7>(x, r0, w, t, y); break;
      default: int8_tile<F, 8>(x, r0, w, t, y);
    }
  }
}

#endif  // PIE_INT8_DOT

// y [rows, N] for every row of x given as XBlocks. Each row's result depends on that row
// alone, computed in the same order whatever the rows beside it: a token gives the same
// output in a decode step, a prefill and any batch.
template <class F>
void int8_linear_rows(const XBlocks& x, const Tiled<F>& w, float* y) {
#if PIE_INT8_DOT
  at::parallel_for(0, w.n / kTile, 4, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) int8_tile_rows<F>(x, w, t, y);
  });
#else
  std::vector<uint8_t> packed(w.n * w.blocks() * F::kBytes);
  std::vector<c10::Half> scales(w.n * w.blocks() * F::kScales);
  untile(w, 0, w.n, packed.data(), scales.data());
  const Weight<F> plain{packed.data(), scales.data(), w.n, w.k};
  at::parallel_for(0, w.n, 32,
                   [&](int64_t begin, int64_t end) { int8_rows_plain<F>(x, plain, begin, end, y); });
#endif
}

}  // namespace
