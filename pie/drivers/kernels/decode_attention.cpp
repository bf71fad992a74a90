// Decode attention (one new token per request) read straight from a float32 paged KV cache: each
// request's pages are visited in order where they lie, under an online softmax (a running max
// and sum per query head), so the context is never gathered into a copy. The query heads that
// share a KV head (GQA) are attended one after another on the same page, which is then in L1.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Optional.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "simd.h"

namespace {

constexpr float kNothing = -std::numeric_limits<float>::infinity();

// Isa is the instruction set's Simd (simd.h) and the few further operations the loops below
// use; the scalar one is a Vec of one float, so the same loops serve every build.
#if defined(__AVX512F__)
struct Isa : Simd {
  static Vec round(Vec x) {
    return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  }
  static Vec pow2(Vec n) {  // 2^n for whole n in [-126, 0]
    const __m512i biased = _mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127));
    return _mm512_castsi512_ps(_mm512_slli_epi32(biased, 23));
  }
  static Vec zero_below(Vec y, Vec x, Vec floor) {
    return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, floor, _CMP_GE_OQ), y);
  }
  static Vec max(Vec a, Vec b) { return _mm512_max_ps(a, b); }
  static float top(Vec v) { return _mm512_reduce_max_ps(v); }
  static float first(Vec v) { return _mm512_cvtss_f32(v); }
  // Lane i of the result is the sum of v[i]'s lanes, for 16 vectors: pairs are folded into
  // each other level by level (within 128-bit lanes, then across them), 45 instructions for
  // what 16 separate reductions would take about 130 for.
  static Vec sums(const Vec* v) {
    Vec x[8], y[4], z[2];
    for (int i = 0; i < 8; ++i)
      x[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                           _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; ++i)
      y[i] = _mm512_add_ps(_mm512_shuffle_ps(x[2 * i], x[2 * i + 1], 0x44),
                           _mm512_shuffle_ps(x[2 * i], x[2 * i + 1], 0xEE));
    for (int i = 0; i < 2; ++i)
      z[i] = _mm512_add_ps(_mm512_shuffle_f32x4(y[2 * i], y[2 * i + 1], 0x44),
                           _mm512_shuffle_f32x4(y[2 * i], y[2 * i + 1], 0xEE));
    return _mm512_add_ps(_mm512_shuffle_f32x4(z[0], z[1], 0x88),
                         _mm512_shuffle_f32x4(z[0], z[1], 0xDD));
  }
};
#elif defined(__AVX2__) && defined(__FMA__)
struct Isa : Simd {
  static Vec round(Vec x) {
    return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  }
  static Vec pow2(Vec n) {  // 2^n for whole n in [-126, 0]
    const __m256i biased = _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127));
    return _mm256_castsi256_ps(_mm256_slli_epi32(biased, 23));
  }
  static Vec zero_below(Vec y, Vec x, Vec floor) {
    return _mm256_and_ps(y, _mm256_cmp_ps(x, floor, _CMP_GE_OQ));
  }
  static Vec max(Vec a, Vec b) { return _mm256_max_ps(a, b); }
  static float first(Vec v) { return _mm256_cvtss_f32(v); }
  static float top(Vec v) {
    __m128 half = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    half = _mm_max_ps(half, _mm_movehl_ps(half, half));
    return _mm_cvtss_f32(_mm_max_ss(half, _mm_movehdup_ps(half)));
  }
  // Lane i of the result is the sum of v[i]'s lanes, for 8 vectors (as in the AVX-512 one).
  static Vec sums(const Vec* v) {
    Vec x[4], y[2];
    for (int i = 0; i < 4; ++i)
      x[i] = _mm256_add_ps(_mm256_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                           _mm256_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 2; ++i)
      y[i] = _mm256_add_ps(_mm256_shuffle_ps(x[2 * i], x[2 * i + 1], 0x44),
                           _mm256_shuffle_ps(x[2 * i], x[2 * i + 1], 0xEE));
    return _mm256_add_ps(_mm256_permute2f128_ps(y[0], y[1], 0x20),
                         _mm256_permute2f128_ps(y[0], y[1], 0x31));
  }
};
#else
struct Isa : Simd {
  static Vec sums(const Vec* v) { return v[0]; }
  static Vec max(Vec a, Vec b) { return std::max(a, b); }
  static float top(Vec v) { return v; }
  static float first(Vec v) { return v; }
};
#endif

constexpr int64_t kW = Isa::kWidth;

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
// exp(x) for x <= 0 (-inf included, which gives 0): x = n ln2 + r with whole n and
// |r| <= ln2 / 2, e^r by its Taylor series to r^7 (the next term is under 1e-8 of it), times 2^n
// built in the exponent bits. Below -87.3 (where 2^n leaves the normal floats) it is 0.
typename Isa::Vec exp_nonpositive(typename Isa::Vec x) {
  const typename Isa::Vec floor = Isa::set1(-87.3f);
  const typename Isa::Vec clamped = Isa::max(x, floor);
  const typename Isa::Vec n = Isa::round(Isa::mul(clamped, Isa::set1(1.44269504f)));
  // ln2 in two parts, so that n * ln2_hi is exact and r keeps its low bits.
  typename Isa::Vec r = Isa::fma(n, Isa::set1(-0.693145752f), clamped);
  r = Isa::fma(n, Isa::set1(-1.42860682e-6f), r);
  typename Isa::Vec y = Isa::set1(1.0f / 5040);
  for (const float c : {1.0f / 720, 1.0f / 120, 1.0f / 24, 1.0f / 6, 0.5f, 1.0f, 1.0f})
    y = Isa::fma(y, r, Isa::set1(c));
  return Isa::zero_below(Isa::mul(y, Isa::pow2(n)), x, floor);
}
#else
float exp_nonpositive(float x) { return std::exp(x); }
#endif

// The loops below take V, the head size in whole vectors when it is one the build specialises
// for (their trip counts then known, they unroll and keep rows in registers), or 0 for any
// head size, looped at run time.
template <int V>
int64_t whole_vectors(int64_t d) {
  return V > 0 ? V : d / kW;
}

// The products of a and b summed lane by lane over the whole vectors of a row: what is left is
// one horizontal sum, done for a block of slots at once by Isa::sums.
template <int V>
typename Isa::Vec dot_lanes(const float* a, const float* b, int64_t d) {
  const int64_t n = whole_vectors<V>(d);
  typename Isa::Vec acc0 = Isa::zero();
  typename Isa::Vec acc1 = Isa::zero();
  int64_t i = 0;
#pragma GCC unroll 8
  for (; i + 2 <= n; i += 2) {
    acc0 = Isa::fma(Isa::load(a + i * kW), Isa::load(b + i * kW), acc0);
    acc1 = Isa::fma(Isa::load(a + (i + 1) * kW), Isa::load(b + (i + 1) * kW), acc1);
  }
  if (i < n) acc0 = Isa::fma(Isa::load(a + i * kW), Isa::load(b + i * kW), acc0);
  return Isa::add(acc0, acc1);
}

float dot_tail(const float* a, const float* b, int64_t d) {
  float total = 0.0f;
  for (int64_t i = d / kW * kW; i < d; ++i) total += a[i] * b[i];
  return total;
}

// acc[0, N * kW) = acc * keep + the sum of w[o] * V row o over the visible slots o in [lo, hi),
// with the N vectors of acc held in registers across the slots.
template <int N>
void accumulate_chunk(float* acc, float keep, const float* w, const uint8_t* shown,
                      const float* v, int64_t lo, int64_t hi, int64_t row) {
  typename Isa::Vec a[N];
  const typename Isa::Vec k = Isa::set1(keep);
  for (int n = 0; n < N; ++n) a[n] = Isa::mul(k, Isa::load(acc + n * kW));
  for (int64_t o = lo; o < hi; ++o) {
    // A hidden slot's weight is 0, but its V row may hold anything (a NaN would survive 0 * x).
    if (!shown[o]) continue;
    const typename Isa::Vec x = Isa::set1(w[o]);
    for (int n = 0; n < N; ++n) a[n] = Isa::fma(x, Isa::load(v + o * row + n * kW), a[n]);
  }
  for (int n = 0; n < N; ++n) Isa::store(acc + n * kW, a[n]);
}

template <int V>
void accumulate(float* acc, float keep, const float* w, const uint8_t* shown, const float* v,
                int64_t lo, int64_t hi, int64_t row, int64_t d) {
  if constexpr (V > 0 && V <= 8) {
    return accumulate_chunk<V>(acc, keep, w, shown, v, lo, hi, row);
  }
  int64_t i = 0;
  for (; i + 8 * kW <= d; i += 8 * kW)
    accumulate_chunk<8>(acc + i, keep, w, shown, v + i, lo, hi, row);
  for (; i + 4 * kW <= d; i += 4 * kW)
    accumulate_chunk<4>(acc + i, keep, w, shown, v + i, lo, hi, row);
  for (; i + kW <= d; i += kW) accumulate_chunk<1>(acc + i, keep, w, shown, v + i, lo, hi, row);
  for (; i < d; ++i) {
    float a = acc[i] * keep;
    for (int64_t o = lo; o < hi; ++o)
      if (shown[o]) a += w[o] * v[o * row + i];
    acc[i] = a;
  }
}

struct Decode {
  const float* q;  // [B, Hq, D]
  const float* pages;  // [num_pages, 2, page_size, Hkv, D]
  const int64_t* table;  // [B, table_width]
  const int64_t* lens;  // [B]
  const bool* visible;  // [B, visible_width] or null
  float* out;  // [B, Hq, D]
  int64_t heads, kv_heads, dim, page_size, table_width, visible_width;
  float scale, softcap;
  int64_t window;

  int64_t group() const { return heads / kv_heads; }
  int64_t row() const { return kv_heads * dim; }  // floats from one slot to the next
  const float* page_keys(int64_t b, int64_t i) const {  // the K block of request b's page i
    return pages + table[b * table_width + i] * 2 * page_size * row();
  }
  int64_t first_slot(int64_t b) const {
    return window > 0 ? std::max<int64_t>(0, lens[b] - window) : 0;
  }
  bool shown(int64_t b, int64_t slot) const {
    return visible == nullptr || visible[b * visible_width + slot];
  }
};

// What one task (a request's kv heads [h0, h1)) keeps while it walks the request's pages: for
// each of their query heads the running max and sum of exp(score - max) and the weighted sum
// of V rows, and one page's scores [heads, stride] (stride: the page size rounded up to whole
// vectors) with which of its slots are visible (`hidden`: 0 where visible, else -inf).
struct State {
  int64_t h0, h1, stride;
  std::vector<float> scores, max, sum, acc, hidden;
  std::vector<uint8_t> shown;
  State(const Decode& p, int64_t kv_per_task)
      : h0(0), h1(0), stride((p.page_size + kW - 1) / kW * kW),
        scores(kv_per_task * p.group() * stride), max(kv_per_task * p.group()),
        sum(kv_per_task * p.group()), acc(kv_per_task * p.group() * p.dim), hidden(stride),
        shown(stride) {}
  void reset(int64_t first, int64_t last) {
    h0 = first;
    h1 = last;
    std::fill(max.begin(), max.end(), kNothing);
    std::fill(sum.begin(), sum.end(), 0.0f);
    std::fill(acc.begin(), acc.end(), 0.0f);
  }
};

// Marks which slots of page i of request b are visible ([lo, hi) as offsets in the page);
// false when none is.
bool page_shown(const Decode& p, int64_t b, int64_t base, int64_t lo, int64_t hi, State& s) {
  bool any = false;
  for (int64_t o = 0; o < s.stride; ++o) {
    s.shown[o] = o >= lo && o < hi && p.shown(b, base + o);
    s.hidden[o] = s.shown[o] ? 0.0f : kNothing;
    any = any || s.shown[o];
  }
  return any;
}

// One query head's scores for the page's slots, kW slots at a time (only visible slots' K rows
// are read, so a block that runs past the page reads nothing past it); -inf where hidden.
template <int V>
void head_scores(const Decode& p, const float* q, const float* keys, float* row, State& s) {
  typename Isa::Vec lanes[kW];
  const bool plain = p.dim % kW == 0 && p.softcap == 0.0f;
  const typename Isa::Vec scale = Isa::set1(plain ? p.scale : 1.0f);
  for (int64_t o0 = 0; o0 < s.stride; o0 += kW) {
    for (int64_t j = 0; j < kW; ++j)
      lanes[j] = s.shown[o0 + j] ? dot_lanes<V>(q, keys + (o0 + j) * p.row(), p.dim)
                                 : Isa::zero();
    Isa::store(row + o0, Isa::fma(Isa::sums(lanes), scale, Isa::load(s.hidden.data() + o0)));
  }
  if (plain) return;
  for (int64_t o = 0; o < s.stride; ++o) {
    if (!s.shown[o]) continue;
    float score = (row[o] + dot_tail(q, keys + o * p.row(), p.dim)) * p.scale;
    if (p.softcap > 0.0f) score = p.softcap * std::tanh(score / p.softcap);
    row[o] = score;
  }
}

// Folds one page into the running softmax of query head h: what was summed so far is rescaled
// to the new max, then each visible slot's V row is added with weight exp(score - max).
template <int V>
void head_values(const Decode& p, int64_t h, const float* values, int64_t lo, int64_t hi,
                 State& s) {
  float* w = s.scores.data() + h * s.stride;
  typename Isa::Vec tops = Isa::set1(s.max[h]);
  for (int64_t o = 0; o < s.stride; o += kW) tops = Isa::max(tops, Isa::load(w + o));
  const float top = Isa::top(tops);
  // 0 while nothing was seen (max is -inf); computed in vector registers, as a call into libm
  // from AVX code costs a state transition each way.
  const float keep = Isa::first(exp_nonpositive(Isa::set1(s.max[h] - top)));
  const typename Isa::Vec shift = Isa::set1(-top);
  typename Isa::Vec total = Isa::zero();
  for (int64_t o = 0; o < s.stride; o += kW) {
    const typename Isa::Vec e = exp_nonpositive(Isa::add(Isa::load(w + o), shift));
    Isa::store(w + o, e);
    total = Isa::add(total, e);
  }
  float* acc = s.acc.data() + h * p.dim;
  accumulate<V>(acc, keep, w, s.shown.data(), values, lo, hi, p.row(), p.dim);
  s.max[h] = top;
  s.sum[h] = s.sum[h] * keep + Isa::sum(total);
}

// The task's kv heads read one page after another, so that each page's K and V blocks are
// read front to back once.
template <int V>
void attend(const Decode& p, int64_t b, State& s) {
  const int64_t g = p.group();
  const int64_t len = p.lens[b];
  const int64_t first = p.first_slot(b);
  const float* q = p.q + (b * p.heads + s.h0 * g) * p.dim;
  for (int64_t i = first / p.page_size; i * p.page_size < len; ++i) {
    const int64_t base = i * p.page_size;
    const int64_t lo = std::max(first, base) - base;
    const int64_t hi = std::min(len, base + p.page_size) - base;
    if (!page_shown(p, b, base, lo, hi, s)) continue;
    const float* keys = p.page_keys(b, i);
    const float* values = keys + p.page_size * p.row();
    for (int64_t kv = s.h0; kv < s.h1; ++kv)
      for (int64_t h = (kv - s.h0) * g; h < (kv - s.h0 + 1) * g; ++h) {
        head_scores<V>(p, q + h * p.dim, keys + kv * p.dim, s.scores.data() + h * s.stride, s);
        head_values<V>(p, h, values + kv * p.dim, lo, hi, s);
      }
  }
  float* out = p.out + (b * p.heads + s.h0 * g) * p.dim;
  for (int64_t h = 0; h < (s.h1 - s.h0) * g; ++h) {
    // A head that saw no slot has sum 0 and an all-zero acc: its output stays zero.
    const float inv = s.sum[h] > 0.0f ? 1.0f / s.sum[h] : 0.0f;
    for (int64_t i = 0; i < p.dim; ++i) out[h * p.dim + i] = s.acc[h * p.dim + i] * inv;
  }
}

void check_inputs(const at::Tensor& q, const at::Tensor& pages, const at::Tensor& table,
                  const at::Tensor& lens, const c10::optional<at::Tensor>& visible) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat && q.device().is_cpu(),
              "decode attention: q must be a float32 CPU tensor [B, Hq, D], got ", q.sizes(), " ",
              q.scalar_type());
  TORCH_CHECK(pages.dim() == 5 && pages.scalar_type() == at::kFloat && pages.device().is_cpu() &&
                  pages.is_contiguous() && pages.size(1) == 2 && pages.size(2) > 0 &&
                  pages.size(3) > 0 && pages.size(4) == q.size(2),
              "decode attention: layer_pages must be a contiguous float32 CPU tensor "
              "[num_pages, 2, page_size, Hkv, D=",
              q.size(2), "], got ", pages.sizes(), " ", pages.scalar_type());
  TORCH_CHECK(q.size(1) % pages.size(3) == 0, "decode attention: ", q.size(1),
              " query heads do not share ", pages.size(3), " kv heads evenly");
  const int64_t batch = q.size(0);
  TORCH_CHECK(table.dim() == 2 && table.size(0) == batch && table.scalar_type() == at::kLong &&
                  table.device().is_cpu(),
              "decode attention: page_table must be an int64 CPU tensor [B=", batch, ", P], got ",
              table.sizes(), " ", table.scalar_type());
  TORCH_CHECK(lens.dim() == 1 && lens.size(0) == batch && lens.scalar_type() == at::kLong &&
                  lens.device().is_cpu(),
              "decode attention: kv_lens must be an int64 CPU tensor [B=", batch, "], got ",
              lens.sizes(), " ", lens.scalar_type());
  if (visible.has_value()) {
    const at::Tensor& v = *visible;
    TORCH_CHECK(v.dim() == 2 && v.size(0) == batch && v.scalar_type() == at::kBool &&
                    v.device().is_cpu(),
                "decode attention: visible must be a bool CPU tensor [B=", batch, ", L], got ",
                v.sizes(), " ", v.scalar_type());
  }
}

// Every slot the kernel will read must lie in the pool: each length within its row of the page
// table (and of `visible`), each page it covers a page of the pool.
void check_slots(const at::Tensor& table, const at::Tensor& lens, int64_t num_pages,
                 int64_t page_size, int64_t visible_width) {
  const int64_t* t = table.data_ptr<int64_t>();
  const int64_t* l = lens.data_ptr<int64_t>();
  const int64_t width = table.size(1);
  for (int64_t b = 0; b < lens.size(0); ++b) {
    TORCH_CHECK(l[b] >= 0 && l[b] <= width * page_size, "decode attention: kv_lens[", b, "] = ",
                l[b], " does not fit ", width, " pages of ", page_size, " slots");
    TORCH_CHECK(visible_width < 0 || l[b] <= visible_width, "decode attention: kv_lens[", b,
                "] = ", l[b], " is longer than visible's ", visible_width, " slots");
    for (int64_t i = 0; i * page_size < l[b]; ++i) {
      const int64_t page = t[b * width + i];
      TORCH_CHECK(page >= 0 && page < num_pages, "decode attention: page_table[", b, ", ", i,
                  "] = ", page, " is not a page of the ", num_pages, "-page pool");
    }
  }
}

at::Tensor decode(const at::Tensor& q_in, const at::Tensor& layer_pages,
                  const at::Tensor& page_table, const at::Tensor& kv_lens, double scale,
                  double softcap, int64_t window, const c10::optional<at::Tensor>& visible_in) {
  check_inputs(q_in, layer_pages, page_table, kv_lens, visible_in);
  TORCH_CHECK(softcap >= 0.0 && window >= 0,
              "decode attention: softcap and window must be >= 0 (0: none), got ", softcap, ", ",
              window);
  const at::Tensor q = q_in.contiguous();
  const at::Tensor table = page_table.contiguous();
  const at::Tensor lens = kv_lens.contiguous();
  at::Tensor visible;
  if (visible_in.has_value()) visible = visible_in->contiguous();
  const int64_t page_size = layer_pages.size(2);
  check_slots(table, lens, layer_pages.size(0), page_size,
              visible.defined() ? visible.size(1) : -1);
  at::Tensor out = at::empty(q.sizes(), q.options());
  const Decode p{q.data_ptr<float>(),
                 layer_pages.data_ptr<float>(),
                 table.data_ptr<int64_t>(),
                 lens.data_ptr<int64_t>(),
                 visible.defined() ? visible.data_ptr<bool>() : nullptr,
                 out.data_ptr<float>(),
                 q.size(1),
                 layer_pages.size(3),
                 q.size(2),
                 page_size,
                 table.size(1),
                 visible.defined() ? visible.size(1) : 0,
                 static_cast<float>(scale),
                 static_cast<float>(softcap),
                 window};
  // A task is a request's kv heads, all of them unless there are fewer requests than threads.
  const int64_t batch = q.size(0);
  const int64_t threads = at::get_num_threads();
  const int64_t splits = std::clamp<int64_t>(threads / std::max<int64_t>(1, batch), 1, p.kv_heads);
  const int64_t kv_per_task = (p.kv_heads + splits - 1) / splits;
  // Specialised for the head sizes of most models (64 and 128) on this build's vector width.
  void (*const run)(const Decode&, int64_t, State&) =
      p.dim == 4 * kW ? attend<4> : p.dim == 8 * kW ? attend<8> : attend<0>;
  at::parallel_for(0, batch * splits, 1, [&](int64_t begin, int64_t end) {
    State state(p, kv_per_task);
    for (int64_t t = begin; t < end; ++t) {
      const int64_t h0 = t % splits * kv_per_task;
      if (h0 >= p.kv_heads) continue;
      state.reset(h0, std::min(p.kv_heads, h0 + kv_per_task));
      run(p, t / splits, state);
    }
  });
  return out;
}

std::string decode_isa() { return Isa::kName; }

}  // namespace

// The namespace comes from the build (one per instruction-set variant), so that variants built
// side by side can be loaded into one process.
#define PIE_LIBRARY(ns, m) TORCH_LIBRARY(ns, m)
PIE_LIBRARY(PIE_KERNEL_NAMESPACE, m) {
  m.def(
      "decode(Tensor q, Tensor layer_pages, Tensor page_table, Tensor kv_lens, float scale, "
      "float softcap, int window, Tensor? visible) -> Tensor",
      &decode);
  m.def("isa() -> str", &decode_isa);
}
