// y = x W^T on the CPU with W in Q4_1 or Q8_0 blocks (block_formats.h). With float32 x, a few
// rows (decode) are multiplied with each block dequantized in registers and many rows (prefill)
// go through float chunks of W and torch's matmul; with W in 16-row tiles, every row of x is
// multiplied as int8 blocks (int8_dot.h).

#include <torch/library.h>

#include <string>

#include "block_formats.h"
#include "int8_dot.h"

namespace {

constexpr int64_t kFusedRows = 8;   // the register kernel's widest batch of x rows
constexpr int64_t kChunkedFrom = 48;  // from here dequantizing + matmul beat ceil(T / 8) passes
constexpr int64_t kChunkFloats = 1 << 21;  // 8 MB of float32 scratch per chunk of W

#if PIE_Q4_FUSED
constexpr int kAccs = 2;  // two accumulator chains per output hide the FMA latency

// Output rows of W handled together so that each x load serves several of them; fewer when
// many x rows already fill the registers with accumulators.
template <int R>
constexpr int rows_at_once() {
  if (R <= 2) return Isa::kWidth == 16 ? 4 : 2;
  return R <= 4 ? 2 : 1;
}

// y[r, n0 + j] for R rows of x and NR rows of W, each block dequantized once for all R rows.
// The blocks' d and m are widened to float32 a chunk at a time, so that the inner loop reads
// them with plain broadcasts.
template <class F, int R, int NR>
void fused_rows(const float* x, const Weight<F>& w, int64_t n0, float* y) {
  typename Isa::Vec acc[NR][R][kAccs];
#pragma GCC unroll 32
  for (int j = 0; j < NR; ++j)
#pragma GCC unroll 32
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 32
      for (int a = 0; a < kAccs; ++a) acc[j][r][a] = Isa::zero();
  constexpr int64_t S = F::kScales;
  float scales[NR][S * kScaleChunk];
  const int64_t blocks = w.k / kBlock;
  for (int64_t b0 = 0; b0 < blocks; b0 += kScaleChunk) {
    const int64_t count = std::min(kScaleChunk, blocks - b0);
    for (int j = 0; j < NR; ++j) Isa::widen(w.row_scales(n0 + j) + S * b0, S * count, scales[j]);
    for (int64_t i = 0; i < count; ++i) {
      const int64_t b = b0 + i;
#pragma GCC unroll 32
      for (int j = 0; j < NR; ++j) {
        typename Isa::Vec block[kParts];
        F::dequant(w.row(n0 + j) + b * F::kBytes, scales[j] + S * i, block);
#pragma GCC unroll 32
        for (int r = 0; r < R; ++r) {
          const float* xs = x + r * w.k + b * kBlock;
#pragma GCC unroll 32
          for (int p = 0; p < kParts; ++p) {
            auto& sum = acc[j][r][p % kAccs];
            sum = Isa::fma(block[p], Isa::load(xs + p * Isa::kWidth), sum);
          }
        }
      }
    }
  }
  for (int j = 0; j < NR; ++j)
    for (int r = 0; r < R; ++r) {
      float total = 0.0f;
      for (int a = 0; a < kAccs; ++a) total += Isa::sum(acc[j][r][a]);
      y[r * w.n + n0 + j] = total;
    }
}

template <class F, int R>
void fused(const float* x, const Weight<F>& w, float* y) {
  constexpr int NR = rows_at_once<R>();
  at::parallel_for(0, w.n, 32, [&](int64_t begin, int64_t end) {
    int64_t n = begin;
    for (; n + NR <= end; n += NR) fused_rows<F, R, NR>(x, w, n, y);
    for (; n < end; ++n) fused_rows<F, R, 1>(x, w, n, y);
  });
}

template <class F>
void fused_any(const float* x, int64_t rows, const Weight<F>& w, float* y) {
  switch (rows) {
    case 1: return fused<F, 1>(x, w, y);
    case 2: return fused<F, 2>(x, w, y);
    case 3: return fused<F, 3>(x, w, y);
    case 4: return fused<F, 4>(x, w, y);
    case 5: return fused<F, 5>(x, w, y);
    case 6: return fused<F, 6>(x, w, y);
    case 7: return fused<F, 7>(x, w, y);
    default: return fused<F, 8>(x, w, y);
  }
}

#endif  // PIE_Q4_FUSED

// y a chunk of W's rows at a time: each chunk is dequantized into a float scratch of a few MB
// and multiplied in one matmul (small tiles made the matmul re-pack x for every tile and ran
// 1.6x slower than float32), so W never exists in float32 as a whole.
template <class F>
at::Tensor chunked(const at::Tensor& x, const Weight<F>& w) {
  at::Tensor y = at::empty({x.size(0), w.n}, x.options());
  const int64_t chunk = std::min(w.n, std::max<int64_t>(64, kChunkFloats / w.k));
  at::Tensor scratch = at::empty({chunk, w.k}, x.options());
  float* dst = scratch.data_ptr<float>();
  for (int64_t n0 = 0; n0 < w.n; n0 += chunk) {
    const int64_t rows = std::min(chunk, w.n - n0);
    at::parallel_for(n0, n0 + rows, 16, [&](int64_t begin, int64_t end) {
      dequant_rows(w, begin, end, dst + (begin - n0) * w.k);
    });
    at::Tensor out = y.narrow(1, n0, rows);
    at::mm_out(out, x, scratch.narrow(0, 0, rows).t());
  }
  return y;
}

template <class F>
Weight<F> checked_weight(const at::Tensor& packed, const at::Tensor& scales, const char* what) {
  TORCH_CHECK(packed.dim() == 2 && packed.is_contiguous() &&
                  (packed.scalar_type() == at::kByte || packed.scalar_type() == at::kChar),
              what, " packed weights: expected a contiguous uint8 or int8 [N, bytes] tensor");
  const int64_t n = packed.size(0);
  TORCH_CHECK(packed.size(1) % F::kBytes == 0, what, " packed weights: ", packed.size(1),
              " bytes per row is not a whole number of ", F::kBytes, "-byte blocks");
  const int64_t k = packed.size(1) / F::kBytes * kBlock;
  TORCH_CHECK(scales.scalar_type() == at::kHalf && scales.is_contiguous() &&
                  scales.sizes() == at::IntArrayRef({n, k / kBlock, F::kScales}),
              what, " scales: expected a contiguous float16 [N, K/32, ", F::kScales,
              "] tensor for N = ", n, ", K = ", k, ", got ", scales.sizes());
  TORCH_CHECK(packed.device().is_cpu() && scales.device().is_cpu(), what, " weights: CPU only");
  return Weight<F>{static_cast<const uint8_t*>(packed.data_ptr()), scales.data_ptr<c10::Half>(),
                   n, k};
}

template <class F>
at::Tensor linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                  const char* what) {
  const Weight<F> w = checked_weight<F>(packed, scales, what);
  TORCH_CHECK(x.dim() == 2 && x.size(1) == w.k && x.scalar_type() == at::kFloat && x.device().is_cpu(),
              what, " linear: expected float32 x of shape [T, ", w.k, "], got ", x.sizes(), " ",
              x.scalar_type());
  const at::Tensor rows = x.contiguous();
  const int64_t t = rows.size(0);
#if PIE_Q4_FUSED
  if (t < kChunkedFrom) {
    at::Tensor y = at::empty({t, w.n}, rows.options());
    for (int64_t r = 0; r < t; r += kFusedRows) {
      const int64_t count = std::min(kFusedRows, t - r);
      fused_any<F>(rows.data_ptr<float>() + r * w.k, count, w, y.data_ptr<float>() + r * w.n);
    }
    return y;
  }
#endif
  return chunked<F>(rows, w);
}

template <class F>
Tiled<F> checked_tiled(const at::Tensor& packed, const at::Tensor& scales, const char* what) {
  TORCH_CHECK(packed.dim() == 2 && packed.is_contiguous() && packed.scalar_type() == at::kByte &&
                  packed.size(1) % (kTile * F::kBytes) == 0,
              what, " tiled weights: expected a contiguous uint8 [N/16, K/32 * ",
              kTile * F::kBytes, "] tensor, got ", packed.sizes());
  const int64_t n = packed.size(0) * kTile;
  const int64_t blocks = packed.size(1) / (kTile * F::kBytes);
  TORCH_CHECK(scales.scalar_type() == at::kHalf && scales.is_contiguous() &&
                  scales.sizes() == at::IntArrayRef({n / kTile, blocks, F::kScales, kTile}),
              what, " tiled scales: expected a contiguous float16 [N/16, K/32, ", F::kScales,
              ", 16] tensor for N = ", n, ", K = ", blocks * kBlock, ", got ", scales.sizes());
  TORCH_CHECK(packed.device().is_cpu() && scales.device().is_cpu(), what, " weights: CPU only");
  return Tiled<F>{packed.data_ptr<uint8_t>(), scales.data_ptr<c10::Half>(), n, blocks * kBlock};
}

// y = x W^T with W in 16-row tiles (int8_dot.h) and every row of x in int8 blocks.
template <class F>
at::Tensor linear_tiled(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                        const char* what) {
  const Tiled<F> w = checked_tiled<F>(packed, scales, what);
  TORCH_CHECK(x.dim() == 2 && x.size(1) == w.k && x.scalar_type() == at::kFloat && x.device().is_cpu(),
              what, " linear: expected float32 x of shape [T, ", w.k, "], got ", x.sizes(), " ",
              x.scalar_type());
  const at::Tensor rows = x.contiguous();
  at::Tensor y = at::empty({rows.size(0), w.n}, rows.options());
  const XBlocks q = quantize_x(rows.data_ptr<float>(), rows.size(0), w.k);
  int8_linear_rows<F>(q, w, y.data_ptr<float>());
  return y;
}

template <class F>
at::Tensor dequantize_tiled(const at::Tensor& packed, const at::Tensor& scales, const char* what) {
  const Tiled<F> w = checked_tiled<F>(packed, scales, what);
  at::Tensor out = at::empty({w.n, w.k}, packed.options().dtype(at::kFloat));
  at::parallel_for(0, w.n, 16, [&](int64_t begin, int64_t end) {
    dequant_tiled<F>(w, begin, end, out.data_ptr<float>() + begin * w.k);
  });
  return out;
}

template <class F>
at::Tensor dequantize(const at::Tensor& packed, const at::Tensor& scales, const char* what) {
  const Weight<F> w = checked_weight<F>(packed, scales, what);
  at::Tensor out = at::empty({w.n, w.k}, packed.options().dtype(at::kFloat));
  at::parallel_for(0, w.n, 16, [&](int64_t begin, int64_t end) {
    dequant_rows<F>(w, begin, end, out.data_ptr<float>() + begin * w.k);
  });
  return out;
}

at::Tensor q4_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales) {
  return linear<Q4_1>(x, packed, scales, "q4");
}

at::Tensor q4_dequantize(const at::Tensor& packed, const at::Tensor& scales) {
  return dequantize<Q4_1>(packed, scales, "q4");
}

at::Tensor q8_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales) {
  return linear<Q8_0>(x, packed, scales, "q8");
}

at::Tensor q4_linear_tiled(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales) {
  return linear_tiled<Q4_1>(x, packed, scales, "q4");
}

at::Tensor q8_linear_tiled(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales) {
  return linear_tiled<Q8_0>(x, packed, scales, "q8");
}

at::Tensor q4_dequantize_tiled(const at::Tensor& packed, const at::Tensor& scales) {
  return dequantize_tiled<Q4_1>(packed, scales, "q4");
}

at::Tensor q8_dequantize_tiled(const at::Tensor& packed, const at::Tensor& scales) {
  return dequantize_tiled<Q8_0>(packed, scales, "q8");
}

at::Tensor q8_dequantize(const at::Tensor& packed, const at::Tensor& scales) {
  return dequantize<Q8_0>(packed, scales, "q8");
}

at::Tensor checked_ids(const at::Tensor& ids, int64_t n) {
  TORCH_CHECK(ids.dim() == 1 && ids.scalar_type() == at::kLong, "q8 rows: expected int64 ids [T]");
  at::Tensor index = ids.contiguous();
  const int64_t* rows = index.data_ptr<int64_t>();
  for (int64_t i = 0; i < index.size(0); ++i)
    TORCH_CHECK(rows[i] >= 0 && rows[i] < n, "q8 rows: id ", rows[i], " is out of range [0, ", n, ")");
  return index;
}

// Rows `ids` of W as float32 [len(ids), K]: an embedding lookup in a Q8_0 table.
at::Tensor q8_rows(const at::Tensor& packed, const at::Tensor& scales, const at::Tensor& ids) {
  const Weight<Q8_0> w = checked_weight<Q8_0>(packed, scales, "q8");
  const at::Tensor index = checked_ids(ids, w.n);
  at::Tensor out = at::empty({index.size(0), w.k}, packed.options().dtype(at::kFloat));
  dequant_rows<Q8_0>(w, 0, index.size(0), out.data_ptr<float>(), index.data_ptr<int64_t>());
  return out;
}

// The same lookup in a tiled Q8_0 table.
at::Tensor q8_rows_tiled(const at::Tensor& packed, const at::Tensor& scales, const at::Tensor& ids) {
  const Tiled<Q8_0> w = checked_tiled<Q8_0>(packed, scales, "q8");
  const at::Tensor index = checked_ids(ids, w.n);
  const int64_t* rows = index.data_ptr<int64_t>();
  at::Tensor out = at::empty({index.size(0), w.k}, packed.options().dtype(at::kFloat));
  for (int64_t i = 0; i < index.size(0); ++i)
    dequant_tiled<Q8_0>(w, rows[i], rows[i] + 1, out.data_ptr<float>() + i * w.k);
  return out;
}

std::string q4_isa() { return Isa::kName; }

bool q4_int8_dot() { return PIE_INT8_DOT; }

}  // namespace

// The namespace comes from the build (one per instruction-set variant), so that variants built
// side by side can be loaded into one process.
#define PIE_LIBRARY(ns, m) TORCH_LIBRARY(ns, m)
PIE_LIBRARY(PIE_KERNEL_NAMESPACE, m) {
  m.def("linear(Tensor x, Tensor packed, Tensor scales) -> Tensor", &q4_linear);
  m.def("dequantize(Tensor packed, Tensor scales) -> Tensor", &q4_dequantize);
  m.def("linear8(Tensor x, Tensor packed, Tensor scales) -> Tensor", &q8_linear);
  m.def("dequantize8(Tensor packed, Tensor scales) -> Tensor", &q8_dequantize);
  m.def("rows8(Tensor packed, Tensor scales, Tensor ids) -> Tensor", &q8_rows);
  m.def("linear_tiled(Tensor x, Tensor packed, Tensor scales) -> Tensor", &q4_linear_tiled);
  m.def("linear8_tiled(Tensor x, Tensor packed, Tensor scales) -> Tensor", &q8_linear_tiled);
  m.def("dequantize_tiled(Tensor packed, Tensor scales) -> Tensor", &q4_dequantize_tiled);
  m.def("dequantize8_tiled(Tensor packed, Tensor scales) -> Tensor", &q8_dequantize_tiled);
  m.def("rows8_tiled(Tensor packed, Tensor scales, Tensor ids) -> Tensor", &q8_rows_tiled);
  m.def("int8_dot() -> bool", &q4_int8_dot);
  m.def("isa() -> str", &q4_isa);
}
