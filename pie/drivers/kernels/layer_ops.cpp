// A decoder layer's small float32 operations on the CPU, each one pass over its rows: RMS norm
// (over whole hidden states or per head), the residual add fused into the norm after it, and
// rotary embedding of q and k in place ("rotate_half" layout: channel i pairs with i + D/2).
// At batch 1 the torch versions spend their time dispatching and allocating a handful of ops
// per call, several times the arithmetic.

#include <ATen/MemoryOverlap.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>

#include "simd.h"

namespace {

constexpr int64_t kGrainFloats = 1 << 14;  // rows below this much work stay on one thread

// Isa is the instruction set's Simd (simd.h) and `sub`; the kernels below are written once over
// it, with a scalar loop for a row's last D % kWidth floats.

#if defined(__AVX512F__)
struct Isa : Simd {
  static Vec sub(Vec a, Vec b) { return _mm512_sub_ps(a, b); }
};
#elif defined(__AVX2__) && defined(__FMA__)
struct Isa : Simd {
  static Vec sub(Vec a, Vec b) { return _mm256_sub_ps(a, b); }
};
#else
struct Isa : Simd {
  static Vec sub(Vec a, Vec b) { return a - b; }
};
#endif

using Vec = Isa::Vec;
constexpr int64_t W = Isa::kWidth;

// The rows of a [T, D] or [T, heads, D] tensor whose last dimension is dense; the other two
// strides are free (q and k are views into the fused qkv projection's output).
struct Rows {
  float* data;
  int64_t count;
  int64_t heads;
  int64_t token_stride;
  int64_t head_stride;
  int64_t dim;
  float* row(int64_t i) const {
    return data + (i / heads) * token_stride + (i % heads) * head_stride;
  }
};

Rows rows_of(const at::Tensor& x, const char* what) {
  TORCH_CHECK(x.dim() == 2 || x.dim() == 3, what, ": expected [T, D] or [T, heads, D], got ",
              x.sizes());
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.device().is_cpu(), what,
              ": expected a float32 CPU tensor, got ", x.scalar_type(), " on ", x.device());
  TORCH_CHECK(x.stride(-1) == 1, what, ": the last dimension must be dense, strides ",
              x.strides());
  const bool per_head = x.dim() == 3;
  const int64_t heads = per_head ? x.size(1) : 1;
  return Rows{x.data_ptr<float>(), x.size(0) * heads, heads, x.stride(0),
              per_head ? x.stride(1) : 0, x.size(-1)};
}

const float* checked_weight(const at::Tensor& weight, int64_t dim) {
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == dim && weight.scalar_type() == at::kFloat &&
                  weight.is_contiguous() && weight.device().is_cpu(),
              "rms_norm: expected a contiguous float32 CPU weight of ", dim, " values, got ",
              weight.sizes(), " ", weight.scalar_type());
  return weight.data_ptr<float>();
}

int64_t grain(int64_t dim) { return std::max<int64_t>(1, kGrainFloats / std::max<int64_t>(1, dim)); }

// Four accumulator chains hide the add latency; the order of additions differs from torch's own
// reduction only in float32 rounding.
float sum_of_squares(const float* x, int64_t dim) {
  Vec acc[4] = {Isa::zero(), Isa::zero(), Isa::zero(), Isa::zero()};
  int64_t i = 0;
  for (; i + 4 * W <= dim; i += 4 * W)
    for (int a = 0; a < 4; ++a) {
      const Vec v = Isa::load(x + i + a * W);
      acc[a] = Isa::fma(v, v, acc[a]);
    }
  for (; i + W <= dim; i += W) {
    const Vec v = Isa::load(x + i);
    acc[0] = Isa::fma(v, v, acc[0]);
  }
  float total = Isa::sum(Isa::add(Isa::add(acc[0], acc[1]), Isa::add(acc[2], acc[3])));
  for (; i < dim; ++i) total += x[i] * x[i];
  return total;
}

// out = weight * (x * r), rounded in the order the torch version rounds.
void scale_row(const float* x, const float* weight, float r, int64_t dim, float* out) {
  const Vec rv = Isa::set1(r);
  int64_t i = 0;
  for (; i + W <= dim; i += W)
    Isa::store(out + i, Isa::mul(Isa::load(weight + i), Isa::mul(Isa::load(x + i), rv)));
  for (; i < dim; ++i) out[i] = weight[i] * (x[i] * r);
}

float inverse_rms(float sum_sq, int64_t dim, double eps) {
  return 1.0f / std::sqrt(sum_sq / static_cast<float>(dim) + static_cast<float>(eps));
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  const Rows in = rows_of(x, "rms_norm");
  const float* w = checked_weight(weight, in.dim);
  at::Tensor out = at::empty(x.sizes(), x.options());
  float* dst = out.data_ptr<float>();
  at::parallel_for(0, in.count, grain(in.dim), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const float* row = in.row(i);
      scale_row(row, w, inverse_rms(sum_of_squares(row, in.dim), in.dim, eps), in.dim,
                dst + i * in.dim);
    }
  });
  return out;
}

// residual += x, then x = rms_norm(residual): both in place, one pass over the sum.
void add_rms_norm(const at::Tensor& x, const at::Tensor& residual, const at::Tensor& weight,
                  double eps) {
  TORCH_CHECK(x.sizes() == residual.sizes(), "add_rms_norm: x ", x.sizes(), " and residual ",
              residual.sizes(), " differ in shape");
  const Rows xs = rows_of(x, "add_rms_norm x");
  const Rows rs = rows_of(residual, "add_rms_norm residual");
  at::assert_no_internal_overlap(x);
  at::assert_no_internal_overlap(residual);
  at::assert_no_overlap(x, residual);
  const float* w = checked_weight(weight, xs.dim);
  const int64_t dim = xs.dim;
  at::parallel_for(0, xs.count, grain(dim), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      float* h = xs.row(i);
      float* r = rs.row(i);
      Vec acc = Isa::zero();
      int64_t j = 0;
      for (; j + W <= dim; j += W) {
        const Vec s = Isa::add(Isa::load(h + j), Isa::load(r + j));
        Isa::store(r + j, s);
        acc = Isa::fma(s, s, acc);
      }
      float total = Isa::sum(acc);
      for (; j < dim; ++j) {
        r[j] += h[j];
        total += r[j] * r[j];
      }
      scale_row(r, w, inverse_rms(total, dim, eps), dim, h);
    }
  });
}

// One head's row: (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin), with x1, x2 its two halves.
void rotate_row(float* x, const float* cos, const float* sin, int64_t half) {
  float* x2 = x + half;
  int64_t i = 0;
  for (; i + W <= half; i += W) {
    const Vec a = Isa::load(x + i);
    const Vec b = Isa::load(x2 + i);
    const Vec c = Isa::load(cos + i);
    const Vec s = Isa::load(sin + i);
    Isa::store(x + i, Isa::sub(Isa::mul(a, c), Isa::mul(b, s)));
    Isa::store(x2 + i, Isa::add(Isa::mul(b, c), Isa::mul(a, s)));
  }
  for (; i < half; ++i) {
    const float a = x[i];
    const float b = x2[i];
    x[i] = a * cos[i] - b * sin[i];
    x2[i] = b * cos[i] + a * sin[i];
  }
}

void rotate_rows(const Rows& x, const float* cos, const float* sin, int64_t half) {
  at::parallel_for(0, x.count, grain(x.dim), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t t = i / x.heads;
      rotate_row(x.row(i), cos + t * half, sin + t * half, half);
    }
  });
}

void rotate(const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos,
            const at::Tensor& sin) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3, "rotate: expected q [T, Hq, D] and k [T, Hkv, D], got ",
              q.sizes(), " and ", k.sizes());
  const Rows qs = rows_of(q, "rotate q");
  const Rows ks = rows_of(k, "rotate k");
  const int64_t tokens = q.size(0);
  const int64_t half = cos.size(-1);
  TORCH_CHECK(k.size(0) == tokens && qs.dim == 2 * half && ks.dim == 2 * half,
              "rotate: q ", q.sizes(), " and k ", k.sizes(), " do not match cos/sin ",
              cos.sizes());
  for (const at::Tensor* table : {&cos, &sin})
    TORCH_CHECK(table->sizes() == at::IntArrayRef({tokens, half}) &&
                    table->scalar_type() == at::kFloat && table->is_contiguous() &&
                    table->device().is_cpu(),
                "rotate: expected contiguous float32 CPU cos and sin of shape [", tokens, ", ",
                half, "], got ", table->sizes(), " ", table->scalar_type());
  at::assert_no_internal_overlap(q);
  at::assert_no_internal_overlap(k);
  at::assert_no_overlap(q, k);
  rotate_rows(qs, cos.data_ptr<float>(), sin.data_ptr<float>(), half);
  rotate_rows(ks, cos.data_ptr<float>(), sin.data_ptr<float>(), half);
}

std::string layer_isa() { return Isa::kName; }

}  // namespace

// The namespace comes from the build (one per instruction-set variant), so that variants built
// side by side can be loaded into one process.
#define PIE_LIBRARY(ns, m) TORCH_LIBRARY(ns, m)
PIE_LIBRARY(PIE_KERNEL_NAMESPACE, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor", &rms_norm);
  m.def("add_rms_norm(Tensor(a!) x, Tensor(b!) residual, Tensor weight, float eps) -> ()",
        &add_rms_norm);
  m.def("rotate(Tensor(a!) q, Tensor(b!) k, Tensor cos, Tensor sin) -> ()", &rotate);
  m.def("isa() -> str", &layer_isa);
}
