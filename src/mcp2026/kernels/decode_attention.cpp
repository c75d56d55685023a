// Paged decode attention on the CPU: per (sequence, KV head), gather the live blocks, scores, softmax and the
// weighted sum of values in one call that reads the blocks where they lie (kv_blocks.h decodes each layout).
//
// q: (B, nh, hd), already scaled. k_cache, v_cache: (num_blocks, nkv, bs, hd) for one layer. tables: (B, nb)
// live block ids in position order; lengths: (B,) tokens to attend over those blocks (the last block may be
// partly filled). Grouped-query heads of one KV head share one pass over its keys and values. With mass
// (B, nkv, nb) given, each head's attention probabilities are added per block (H2O-style eviction scores).
// All arithmetic is float32; bf16 tensors are widened on load and rounded once on store.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

#include "cpu_kernels.h"
#include "decode_ranges.h"
#include "kv_blocks.h"
#include "simd.h"
#include "thread_team.h"

namespace {

template <typename T>
inline float load(const T* p, int64_t i) {
  return static_cast<float>(p[i]);
}

// What a softmax over one range of a sequence reports beside its probabilities: with mass, each head's
// probability per block is added at mass + j * mass_stride + block (stride 0: all heads into one row, the
// eviction scores of a KV head); with stats, each head's maximum score and sum of exponentials (stats[2j],
// stats[2j + 1]), which merge ranges computed apart.
struct SoftmaxTaps {
  float* mass = nullptr;
  int64_t mass_stride = 0;
  float* stats = nullptr;

  // Head j's len probabilities p, from scores whose maximum was mx and exponentials summed to sum.
  void report(int64_t j, const float* p, int64_t len, int64_t bs, float mx, float sum) const {
    if (stats != nullptr) {
      stats[2 * j] = mx;
      stats[2 * j + 1] = sum;
    }
    if (mass != nullptr) {
      float* row = mass + j * mass_stride;
      for (int64_t t = 0; t < len; ++t) row[t / bs] += p[t];
    }
  }
};

// A sliding window's first block may start before the window: its first skip positions get no attention
// (their scores -inf, which the softmax turns into 0).
inline void mask_front(float* scores, int64_t g, int64_t len, int64_t skip) {
  for (int64_t j = 0; j < g && skip > 0; ++j)
    std::fill(scores + j * len, scores + j * len + skip, -std::numeric_limits<float>::infinity());
}

#ifdef MCP_ATTN_AVX2
// scores[j * len + t] = q_j . k_t over one block's n rows of hd floats (kb); scores points at the block's first.
inline void score_rows_avx2(const float* qf, const float* kb, int64_t n, int64_t g, int64_t hd, int64_t len,
                            float* scores) {
  for (int64_t j = 0; j < g; ++j) {
    const float* qj = qf + j * hd;
    float* sj = scores + j * len;
    for (int64_t t = 0; t < n; ++t) {
      const float* kr = kb + t * hd;
      __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
      int64_t c = 0;
      for (; c + 16 <= hd; c += 16) {
        a0 = _mm256_fmadd_ps(_mm256_loadu_ps(qj + c), _mm256_loadu_ps(kr + c), a0);
        a1 = _mm256_fmadd_ps(_mm256_loadu_ps(qj + c + 8), _mm256_loadu_ps(kr + c + 8), a1);
      }
      if (c < hd) a0 = _mm256_fmadd_ps(_mm256_loadu_ps(qj + c), _mm256_loadu_ps(kr + c), a0);
      sj[t] = hsum(_mm256_add_ps(a0, a1));
    }
  }
}

// Each head's len scores -> probabilities, in place, reporting to taps (a mass row has one writer: one
// (sequence, KV head) per thread).
inline void softmax_heads_avx2(float* scores, int64_t g, int64_t len, int64_t bs, const SoftmaxTaps& taps) {
  for (int64_t j = 0; j < g; ++j) {
    float* sj = scores + j * len;
    __m256 mv = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
    int64_t t = 0;
    for (; t + 8 <= len; t += 8) mv = _mm256_max_ps(mv, _mm256_loadu_ps(sj + t));
    float mx = hmax(mv);
    for (; t < len; ++t) mx = std::max(mx, sj[t]);
    const __m256 mxv = _mm256_set1_ps(mx);
    __m256 sv = _mm256_setzero_ps();
    for (t = 0; t + 8 <= len; t += 8) {
      const __m256 e = exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(sj + t), mxv));
      _mm256_storeu_ps(sj + t, e);
      sv = _mm256_add_ps(sv, e);
    }
    float sum = hsum(sv);
    for (; t < len; ++t) {
      sj[t] = std::exp(sj[t] - mx);
      sum += sj[t];
    }
    const float inv = 1.f / sum;
    const __m256 invv = _mm256_set1_ps(inv);
    for (t = 0; t + 8 <= len; t += 8) _mm256_storeu_ps(sj + t, _mm256_mul_ps(_mm256_loadu_ps(sj + t), invv));
    for (; t < len; ++t) sj[t] *= inv;
    taps.report(j, sj, len, bs, mx, sum);
  }
}

// acc_j += sum_t p_jt v_t over one block's n rows of hd floats (vb), p_jt = probs[j * len + t]; 32 output
// values per pass (four independent FMA chains).
inline void accumulate_rows_avx2(const float* probs, int64_t len, const float* vb, int64_t n, int64_t g,
                                 int64_t hd, float* acc) {
  for (int64_t j = 0; j < g; ++j) {
    const float* pj = probs + j * len;
    float* aj = acc + j * hd;
    int64_t c = 0;
    for (; c + 32 <= hd; c += 32) {
      __m256 r0 = _mm256_loadu_ps(aj + c), r1 = _mm256_loadu_ps(aj + c + 8);
      __m256 r2 = _mm256_loadu_ps(aj + c + 16), r3 = _mm256_loadu_ps(aj + c + 24);
      for (int64_t t = 0; t < n; ++t) {
        const __m256 p = _mm256_set1_ps(pj[t]);
        const float* vr = vb + t * hd + c;
        r0 = _mm256_fmadd_ps(p, _mm256_loadu_ps(vr), r0);
        r1 = _mm256_fmadd_ps(p, _mm256_loadu_ps(vr + 8), r1);
        r2 = _mm256_fmadd_ps(p, _mm256_loadu_ps(vr + 16), r2);
        r3 = _mm256_fmadd_ps(p, _mm256_loadu_ps(vr + 24), r3);
      }
      _mm256_storeu_ps(aj + c, r0);
      _mm256_storeu_ps(aj + c + 8, r1);
      _mm256_storeu_ps(aj + c + 16, r2);
      _mm256_storeu_ps(aj + c + 24, r3);
    }
    for (; c < hd; c += 8) {
      __m256 r0 = _mm256_loadu_ps(aj + c);
      for (int64_t t = 0; t < n; ++t) r0 = _mm256_fmadd_ps(_mm256_set1_ps(pj[t]), _mm256_loadu_ps(vb + t * hd + c), r0);
      _mm256_storeu_ps(aj + c, r0);
    }
  }
}

// A range's attention once its scores are in: the window's mask, the softmax (reporting to taps) and the
// weighted sum of values, each block's rows widened or decoded into buf.
template <typename VS>
void softmax_then_row_values_avx2(float* scores, const VS& vs, const int64_t* table, int64_t len, int64_t g,
                                  int64_t hd, int64_t bs, float* acc, float* buf, const SoftmaxTaps& taps,
                                  int64_t skip) {
  mask_front(scores, g, len, skip);
  softmax_heads_avx2(scores, g, len, bs, taps);
  std::fill(acc, acc + g * hd, 0.f);
  for (int64_t t0 = 0; t0 < len; t0 += bs) {
    const int64_t n = std::min(bs, len - t0);
    accumulate_rows_avx2(scores + t0, len, vs.rows(table[t0 / bs], n, buf), n, g, hd, acc);
  }
}

// One (sequence, KV head): its g query heads over len tokens. hd % 8 == 0.
template <typename KS, typename VS>
void attend_avx2(const float* qf, const KS& ks, const VS& vs, const int64_t* table, int64_t len, int64_t g,
                 int64_t hd, int64_t bs, float* scores, float* acc, float* buf, const SoftmaxTaps& taps,
                 int64_t skip) {
  // A block is widened or decoded once and read by all g heads; keys and values are fetched ahead
  // (prefetch_key_pass).
  for (int64_t t0 = 0; t0 < len; t0 += bs) {
    const int64_t n = std::min(bs, len - t0);
    prefetch_key_pass(ks, vs, table, t0, len, bs);
    score_rows_avx2(qf, ks.rows(table[t0 / bs], n, buf), n, g, hd, len, scores + t0);
  }
  softmax_then_row_values_avx2(scores, vs, table, len, g, hd, bs, acc, buf, taps, skip);
}

#endif

}  // namespace

// int4 and int8 blocks read in place (they use the loops above).
#include "attention_int_codes.h"

namespace {

// Portable version of the AVX2 loops: one (sequence, KV head).
template <typename KS, typename VS>
void attend_scalar(const float* qf, const KS& ks, const VS& vs, const int64_t* table, int64_t len, int64_t g,
                   int64_t hd, int64_t bs, float* scores, float* acc, float* buf, const SoftmaxTaps& taps,
                   int64_t skip) {
  for (int64_t t0 = 0; t0 < len; t0 += bs) {
    const int64_t n = std::min(bs, len - t0);
    const float* kb = ks.rows(table[t0 / bs], n, buf);
    for (int64_t t = 0; t < n; ++t) {
      const float* kr = kb + t * hd;
      for (int64_t j = 0; j < g; ++j) {
        const float* qj = qf + j * hd;
        float s = 0.f;
        for (int64_t d = 0; d < hd; ++d) s += qj[d] * kr[d];
        scores[j * len + t0 + t] = s;
      }
    }
  }
  mask_front(scores, g, len, skip);
  for (int64_t j = 0; j < g; ++j) {
    float* sj = scores + j * len;
    float mx = -std::numeric_limits<float>::infinity();
    for (int64_t t = 0; t < len; ++t) mx = std::max(mx, sj[t]);
    float sum = 0.f;
    for (int64_t t = 0; t < len; ++t) {
      sj[t] = std::exp(sj[t] - mx);
      sum += sj[t];
    }
    const float inv = 1.f / sum;
    for (int64_t t = 0; t < len; ++t) sj[t] *= inv;
    taps.report(j, sj, len, bs, mx, sum);
  }
  std::fill(acc, acc + g * hd, 0.f);
  for (int64_t t0 = 0; t0 < len; t0 += bs) {
    const int64_t n = std::min(bs, len - t0);
    const float* vb = vs.rows(table[t0 / bs], n, buf);
    for (int64_t t = 0; t < n; ++t) {
      const float* vr = vb + t * hd;
      for (int64_t j = 0; j < g; ++j) {
        const float p = scores[j * len + t0 + t];
        float* aj = acc + j * hd;
        for (int64_t d = 0; d < hd; ++d) aj[d] += p * vr[d];
      }
    }
  }
}

}  // namespace

// The AVX-512 BF16 path for bf16 blocks (it uses mask_front and softmax_heads_avx2 above).
#include "attention_bf16.h"

namespace {

// Whether the AVX-512 BF16 path takes these queries and sources: bf16 queries over bf16 blocks (a float query
// would be rounded to bf16 there).
template <typename T, typename KS, typename VS>
constexpr bool bf16_blocks() {
  return std::is_same_v<T, at::BFloat16> && std::is_same_v<KS, RawSource<at::BFloat16>> &&
         std::is_same_v<VS, RawSource<at::BFloat16>>;
}

// One (sequence, KV head)'s query heads first_head .. first_head + g - 1 (of the sequence's nh) over len tokens
// from table: acc (g * hd) gets their outputs. A query head's result does not depend on which other heads of its
// KV head are computed beside it.
template <typename T, typename KS, typename VS>
void attend_range(const T* q, const KS& ks, const VS& vs, const int64_t* table, int64_t len, int64_t first_head,
                  int64_t g, int64_t hd, int64_t bs, float* scores, float* qf, float* acc, float* buf,
                  const SoftmaxTaps& taps, int64_t skip) {
  for (int64_t j = 0; j < g; ++j)
    for (int64_t d = 0; d < hd; ++d) qf[j * hd + d] = load(q, (first_head + j) * hd + d);
  bool done = false;
#ifdef MCP_ATTN_BF16
  if constexpr (bf16_blocks<T, KS, VS>()) {
    if (bf16_attention_fits(g, hd)) {
      attend_bf16(qf, ks, vs, table, len, g, hd, bs, scores, acc, taps, skip);
      done = true;
    }
  }
#endif
#ifdef MCP_ATTN_AVX2
  if (!done && hd % 8 == 0) {
    attend_avx2(qf, ks, vs, table, len, g, hd, bs, scores, acc, buf, taps, skip);
    done = true;
  }
#endif
  if (!done) attend_scalar(qf, ks, vs, table, len, g, hd, bs, scores, acc, buf, taps, skip);
}

// Every (sequence, KV head) of a decode batch, cut into ranges by position (decode_ranges.h); sources(h) gives
// that KV head's (key, value) sources. starts (a sliding window's first position per sequence, or null: 0): the
// blocks before the one holding it are not read, and its positions before it get no attention.
template <typename T, typename Sources>
void decode_attention_run(const T* q, const int64_t* tables, const int64_t* lengths, T* out, float* mass,
                          int64_t B, int64_t nh, int64_t nkv, int64_t hd, int64_t bs, int64_t nb, const Sources& sources,
                          const int64_t* starts = nullptr) {
  const int64_t g = nh / nkv;
  const int64_t threads = team::current != nullptr ? team::current->size : at::get_num_threads();
  // Small problems run inline: handing out work costs more than it saves. Inside a decode stack's thread team a
  // hand-off is a spinning handshake, not an OpenMP fork and join, so far smaller problems are worth splitting.
  const int64_t min_work = team::current != nullptr ? (1 << 12) : (1 << 16);
  // Reused across calls; a reference, so that the helper threads read this thread's plan, not their own.
  static thread_local DecodePlan plan_scratch;
  DecodePlan& plan = plan_scratch;
  plan.build(lengths, starts, B, nkv, g, hd, bs, mass != nullptr, threads, min_work);
  const int64_t rb = plan.range_blocks;
  float *partial = plan.partial.data(), *stats = plan.stats.data(), *range_mass = plan.range_mass.data();
  const int64_t max_range = rb * bs;
  team::parallel_for(0, static_cast<int64_t>(plan.cuts.size()) - 1, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(g * max_range), qf(g * hd), acc(g * hd), buf(bs * hd);
    for (int64_t i = plan.cuts[begin], stop = plan.cuts[end], next; i < stop; i = next) {
      const DecodeItem& it = plan.items[i];
      // A task's consecutive items of one (sequence, KV head, range) run as one call: one pass over the blocks.
      int64_t heads = it.heads;
      for (next = i + 1; next < stop && plan.items[next].b == it.b && plan.items[next].h == it.h &&
                         plan.items[next].first_block == it.first_block;
           ++next)
        heads += plan.items[next].heads;
      const int64_t head = it.h * g + it.j0;  // the first query head, within the sequence
      SoftmaxTaps taps;
      if (it.slot >= 0) taps.stats = stats + (it.slot * nh + head) * 2;
      if (mass != nullptr && it.slot < 0) taps.mass = mass + (it.b * nkv + it.h) * nb;
      if (mass != nullptr && it.slot >= 0) {
        taps.mass = range_mass + (it.slot * nh + head) * rb;
        taps.mass_stride = rb;
      }
      if (next < stop) {  // the next call's first keys, fetched while this one runs (blocks lie anywhere)
        const DecodeItem& following = plan.items[next];
        sources(following.h).first.prefetch(tables[following.b * nb + following.first_block],
                                            std::min(bs, following.len), true);
      }
      const auto src = sources(it.h);
      attend_range(q + it.b * nh * hd, src.first, src.second, tables + it.b * nb + it.first_block, it.len, head,
                   heads, hd, bs, scores.data(), qf.data(), acc.data(), buf.data(), taps, it.skip);
      const int64_t n = heads * hd;
      if (it.slot < 0)
        for (int64_t k = 0; k < n; ++k) out[(it.b * nh + head) * hd + k] = static_cast<T>(acc[k]);
      else
        std::copy(acc.begin(), acc.begin() + n, partial + (it.slot * nh + head) * hd);
    }
  });
  if (plan.num_slots == 0) return;
  // Merge per (cut sequence, KV head): its g query heads' outputs and, with mass, its mass row.
  std::vector<int64_t> pairs;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < nkv && plan.first_slot[b] >= 0; ++h) pairs.push_back(b * nkv + h);
  const int64_t cut = static_cast<int64_t>(pairs.size()) / nkv;
  const int64_t grain = std::max<int64_t>(1, min_work * cut / (plan.num_slots * g * hd));
  team::parallel_for(0, static_cast<int64_t>(pairs.size()), grain, [&](int64_t begin, int64_t end) {
    std::vector<float> weights(g * plan.num_slots), merged(hd);
    for (int64_t i = begin; i < end; ++i) {
      const int64_t b = pairs[i] / nkv, h = pairs[i] % nkv, slot = plan.first_slot[b], n = plan.num_ranges[b];
      for (int64_t j = 0; j < g; ++j) {
        const int64_t head = h * g + j;
        merge_ranges(partial + (slot * nh + head) * hd, stats + (slot * nh + head) * 2, n, nh * hd,
                     nh * 2, hd, weights.data() + j * n, merged.data(), out + (b * nh + head) * hd);
      }
      if (mass == nullptr) continue;
      float* row = mass + pairs[i] * nb;
      for (int64_t r = 0; r < n; ++r)
        for (int64_t j = 0; j < g; ++j) {
          const float w = weights[j * n + r], *m = range_mass + ((slot + r) * nh + h * g + j) * rb;
          for (int64_t k = 0; k < rb && r * rb + k < nb; ++k) row[r * rb + k] += w * m[k];
        }
    }
  });
}

// Checks shared by both bindings. num_ids: the ids a table may name.
void check_decode_batch(const torch::Tensor& tc, const torch::Tensor& lc, int64_t B, int64_t bs, int64_t num_ids) {
  TORCH_CHECK(tc.scalar_type() == torch::kLong && lc.scalar_type() == torch::kLong, "tables and lengths must be int64");
  TORCH_CHECK(tc.dim() == 2 && tc.size(0) == B && lc.size(0) == B, "tables/lengths need one row per sequence");
  const int64_t nb = tc.size(1);
  const int64_t* lp = lc.data_ptr<int64_t>();
  const int64_t* tp = tc.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(lp[b] >= 1 && lp[b] <= nb * bs, "length out of range for the block table");
    for (int64_t i = 0; i < (lp[b] + bs - 1) / bs; ++i)
      TORCH_CHECK(tp[b * nb + i] >= 0 && tp[b * nb + i] < num_ids, "block id out of range");
  }
}

float* check_mass(const c10::optional<torch::Tensor>& mass, int64_t B, int64_t nkv, int64_t nb) {
  if (!mass.has_value()) return nullptr;
  TORCH_CHECK(mass->scalar_type() == torch::kFloat && mass->is_contiguous() && mass->dim() == 3 &&
                  mass->size(0) == B && mass->size(1) == nkv && mass->size(2) == nb,
              "mass must be a contiguous float32 (B, nkv, nb) tensor");
  return mass->data_ptr<float>();
}

// starts (B,) int64, each 0 <= start < its length, or none; a window ranks no blocks for eviction.
const int64_t* check_starts(const c10::optional<torch::Tensor>& starts, const torch::Tensor& lc, int64_t B,
                            bool with_mass) {
  if (!starts.has_value()) return nullptr;
  TORCH_CHECK(!with_mass, "a sliding window's starts and attention mass (eviction scores) do not combine");
  TORCH_CHECK(starts->scalar_type() == torch::kLong && starts->is_contiguous() && starts->dim() == 1 &&
                  starts->size(0) == B,
              "starts must be a contiguous int64 (B,) tensor");
  const int64_t* sp = starts->data_ptr<int64_t>();
  const int64_t* lp = lc.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) TORCH_CHECK(sp[b] >= 0 && sp[b] < lp[b], "a window start must lie before its length");
  return sp;
}

}  // namespace

torch::Tensor paged_decode_attention(const torch::Tensor& q, const torch::Tensor& k_cache,
                                     const torch::Tensor& v_cache, const torch::Tensor& tables,
                                     const torch::Tensor& lengths, const c10::optional<torch::Tensor>& mass,
                                     const c10::optional<torch::Tensor>& starts) {
  return paged_decode_attention_into(q, k_cache, v_cache, tables, lengths, mass, nullptr, starts);
}

torch::Tensor paged_decode_attention_into(const torch::Tensor& q, const torch::Tensor& k_cache,
                                          const torch::Tensor& v_cache, const torch::Tensor& tables,
                                          const torch::Tensor& lengths, const c10::optional<torch::Tensor>& mass,
                                          torch::Tensor* slot, const c10::optional<torch::Tensor>& starts) {
  check_cpu_float(q, "q");
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.dim() == 4, "q must be (B, nh, hd), caches 4-D");
  // The caches may be narrower than q (bf16 / fp16 K/V with fp32 activations: half the bytes to read, the
  // decode step's dominant traffic at long contexts) or wider (fp32 K/V with bf16 activations); values are
  // read as float either way.
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type(), "k_cache and v_cache must share a dtype");
  TORCH_CHECK(k_cache.scalar_type() == torch::kFloat || k_cache.scalar_type() == torch::kBFloat16 ||
                  k_cache.scalar_type() == torch::kHalf,
              "the caches must be float32, bfloat16 or float16");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.sizes() == v_cache.sizes(),
              "k_cache and v_cache must be contiguous and of one shape");
  const auto qc = q.contiguous();
  const auto tc = tables.contiguous();
  const auto lc = lengths.contiguous();
  const int64_t B = qc.size(0), nh = qc.size(1), hd = qc.size(2);
  const int64_t nkv = k_cache.size(1), bs = k_cache.size(2), nb = tc.size(1);
  TORCH_CHECK(k_cache.size(3) == hd && nh % nkv == 0, "head sizes do not match");
  check_decode_batch(tc, lc, B, bs, k_cache.size(0));
  float* mp = check_mass(mass, B, nkv, nb);
  const int64_t* sp = check_starts(starts, lc, B, mp != nullptr);
  auto out = slot_or_empty(slot, qc.sizes(), qc.options());
  AT_DISPATCH_FLOATING_TYPES_AND(at::ScalarType::BFloat16, qc.scalar_type(), "paged_decode_attention", [&] {
    using T = scalar_t;
    AT_DISPATCH_FLOATING_TYPES_AND2(at::ScalarType::BFloat16, at::ScalarType::Half, k_cache.scalar_type(),
                                    "paged_decode_attention_kv", [&] {
      using KV = scalar_t;
      const KV* kp = k_cache.data_ptr<KV>();
      const KV* vp = v_cache.data_ptr<KV>();
      const int64_t block_stride = nkv * bs * hd;
      auto sources = [&](int64_t h) {
        return std::make_pair(RawSource<KV>{kp, h * bs * hd, block_stride, hd},
                              RawSource<KV>{vp, h * bs * hd, block_stride, hd});
      };
      decode_attention_run<T>(qc.data_ptr<T>(), tc.data_ptr<int64_t>(), lc.data_ptr<int64_t>(), out.data_ptr<T>(),
                              mp, B, nh, nkv, hd, bs, nb, sources, sp);
    });
  });
  return out;
}

// Decode attention straight from a quantized pool: kind 1 = int8 per (token, head) K and V (planes q, scale,
// zero), kind 2 = int4 KIVI (keys q, per-channel scale and zero codes, meta; values q, per-(token, group)
// codes, meta), kind 3 = fp8 e4m3 per (token, head) (planes q, scale). int4's staged blocks (ids >= num_blocks)
// come from stage_k / stage_v, bf16 (entries, nkv, bs, hd).
// Decoding a block costs about what widening a bf16 one does, and reads 2-4x fewer bytes.
torch::Tensor paged_decode_attention_quantized(const torch::Tensor& q, int64_t kind, const std::vector<torch::Tensor>& kp,
                                               const std::vector<torch::Tensor>& vp, const torch::Tensor& stage_k,
                                               const torch::Tensor& stage_v, const torch::Tensor& tables,
                                               const torch::Tensor& lengths, const c10::optional<torch::Tensor>& mass) {
  check_cpu_float(q, "q");
  TORCH_CHECK(q.dim() == 3, "q must be (B, nh, hd)");
  TORCH_CHECK(kind >= 1 && kind <= 3, "kind must be 1 (int8), 2 (int4) or 3 (fp8)");
  const size_t num_planes = kind == 1 ? 3 : kind == 2 ? 4 : 2;
  TORCH_CHECK(kp.size() == num_planes && vp.size() == num_planes, "kind ", kind, " takes ", num_planes,
              " planes for K and for V");
  for (const auto* planes : {&kp, &vp})
    for (const auto& p : *planes) TORCH_CHECK(p.device().is_cpu() && p.is_contiguous(), "planes must be contiguous CPU tensors");
  const auto qc = q.contiguous();
  const auto tc = tables.contiguous();
  const auto lc = lengths.contiguous();
  const int64_t B = qc.size(0), nh = qc.size(1), hd = qc.size(2);
  TORCH_CHECK(kp[0].dim() == 4 && kp[0].sizes() == vp[0].sizes(), "K and V data planes must be (num_blocks, nkv, bs, *)");
  const int64_t num_blocks = kp[0].size(0), nkv = kp[0].size(1), bs = kp[0].size(2), nb = tc.size(1);
  TORCH_CHECK(nh % nkv == 0, "query heads must be a multiple of KV heads");
  const auto data_type = kind == 3 ? at::ScalarType::Float8_e4m3fn : torch::kByte;
  TORCH_CHECK(kp[0].scalar_type() == data_type && vp[0].scalar_type() == data_type,
              "data planes must be uint8 (int8, int4) or float8_e4m3fn (fp8)");
  TORCH_CHECK(kp[0].size(3) == (kind == 2 ? hd / 2 : hd) && (kind != 2 || hd % 2 == 0), "head sizes do not match");
  int64_t num_stage = 0;
  if (stage_k.numel() > 0) {
    TORCH_CHECK(stage_k.scalar_type() == torch::kBFloat16 && stage_v.scalar_type() == torch::kBFloat16 &&
                    stage_k.is_contiguous() && stage_v.is_contiguous() && stage_k.sizes() == stage_v.sizes() &&
                    stage_k.dim() == 4 && stage_k.size(1) == nkv && stage_k.size(2) == bs && stage_k.size(3) == hd,
                "stage_k / stage_v must be contiguous bf16 (entries, nkv, bs, hd)");
    num_stage = stage_k.size(0);
  }
  check_decode_batch(tc, lc, B, bs, num_blocks + num_stage);
  float* mp = check_mass(mass, B, nkv, nb);
  const at::BFloat16* skp = num_stage ? stage_k.data_ptr<at::BFloat16>() : nullptr;
  const at::BFloat16* svp = num_stage ? stage_v.data_ptr<at::BFloat16>() : nullptr;
  auto staged = [&](const at::BFloat16* base, int64_t h) {
    return StagedRows{RawSource<at::BFloat16>{base, h * bs * hd, nkv * bs * hd, hd}, num_blocks};
  };
  auto out = torch::empty_like(qc);
  AT_DISPATCH_FLOATING_TYPES_AND(at::ScalarType::BFloat16, qc.scalar_type(), "paged_decode_attention_quantized", [&] {
    using T = scalar_t;
    TORCH_CHECK(kind == 2 || num_stage == 0, "only int4 is a staged codec");
    if (kind == 1) {
      for (const auto* planes : {&kp, &vp})
        TORCH_CHECK((*planes)[1].scalar_type() == torch::kHalf && (*planes)[2].scalar_type() == torch::kHalf &&
                        (*planes)[1].numel() == num_blocks * nkv * bs && (*planes)[2].numel() == num_blocks * nkv * bs,
                    "int8 scale and zero planes must be fp16 (num_blocks, nkv, bs)");
      auto sources = [&](int64_t h) {
        return std::make_pair(
            Int8Source{kp[0].data_ptr<uint8_t>(), kp[1].data_ptr<at::Half>(), kp[2].data_ptr<at::Half>(), nkv, h, bs,
                       hd},
            Int8Source{vp[0].data_ptr<uint8_t>(), vp[1].data_ptr<at::Half>(), vp[2].data_ptr<at::Half>(), nkv, h, bs,
                       hd});
      };
      decode_attention_run<T>(qc.data_ptr<T>(), tc.data_ptr<int64_t>(), lc.data_ptr<int64_t>(), out.data_ptr<T>(),
                              mp, B, nh, nkv, hd, bs, nb, sources);
    } else if (kind == 3) {
      for (const auto* planes : {&kp, &vp})
        TORCH_CHECK((*planes)[1].scalar_type() == torch::kHalf && (*planes)[1].numel() == num_blocks * nkv * bs,
                    "fp8 scale planes must be fp16 (num_blocks, nkv, bs)");
      auto sources = [&](int64_t h) {
        return std::make_pair(
            Fp8Source{static_cast<const uint8_t*>(kp[0].data_ptr()), kp[1].data_ptr<at::Half>(), nkv, h, bs, hd},
            Fp8Source{static_cast<const uint8_t*>(vp[0].data_ptr()), vp[1].data_ptr<at::Half>(), nkv, h, bs, hd});
      };
      decode_attention_run<T>(qc.data_ptr<T>(), tc.data_ptr<int64_t>(), lc.data_ptr<int64_t>(), out.data_ptr<T>(),
                              mp, B, nh, nkv, hd, bs, nb, sources);
    } else {
      const int64_t ng = vp[1].numel() / std::max<int64_t>(1, num_blocks * nkv * bs);
      TORCH_CHECK(kp[1].numel() == num_blocks * nkv * hd && kp[2].numel() == kp[1].numel(),
                  "int4 key codes must be (num_blocks, nkv, hd)");
      TORCH_CHECK(ng >= 1 && ng <= 64 && hd % ng == 0 && vp[1].numel() == num_blocks * nkv * bs * ng &&
                      vp[2].numel() == vp[1].numel(),
                  "int4 value codes must be (num_blocks, nkv, bs, groups), at most 64 groups");
      for (const auto* planes : {&kp, &vp})
        TORCH_CHECK((*planes)[1].scalar_type() == torch::kByte && (*planes)[2].scalar_type() == torch::kByte &&
                        (*planes)[3].scalar_type() == torch::kHalf && (*planes)[3].numel() == num_blocks * nkv * 3,
                    "int4 codes must be uint8 and meta fp16 (num_blocks, nkv, 3)");
      auto sources = [&](int64_t h) {
        return std::make_pair(
            Int4Source{kp[0].data_ptr<uint8_t>(), kp[1].data_ptr<uint8_t>(), kp[2].data_ptr<uint8_t>(),
                       kp[3].data_ptr<at::Half>(), nkv, h, bs, hd, 0, staged(skp, h), {}},
            Int4Source{vp[0].data_ptr<uint8_t>(), vp[1].data_ptr<uint8_t>(), vp[2].data_ptr<uint8_t>(),
                       vp[3].data_ptr<at::Half>(), nkv, h, bs, hd, ng, staged(svp, h), {}});
      };
      decode_attention_run<T>(qc.data_ptr<T>(), tc.data_ptr<int64_t>(), lc.data_ptr<int64_t>(), out.data_ptr<T>(),
                              mp, B, nh, nkv, hd, bs, nb, sources);
    }
  });
  return out;
}
