// Causal prefill attention on AVX-512 CPUs: a prefill chunk's queries over its context.
//
// q (T, nh, hd) float32, pre-scaled, rows of nh * hd contiguous; k, v (nkv, S, hd) float32 or bf16, contiguous.
// Query i sits at key position offset + i and sees keys 0 .. offset + i (slot order: everything cached precedes
// the chunk). Flash-style, in fp32 throughout: per (KV head, tile of query positions) the g grouped heads' rows
// share each pass over a key tile; scores for kRows rows x 16 keys stay in registers (K transposed once per
// head, so each of the hd steps is one load and kRows broadcast FMAs), an online softmax per row, and the
// value sums for 6 rows at a time in registers. torch's CPU flash kernel (SDPA) reaches ~100 GFLOP/s here at
// 1024 tokens; fp32 throughout keeps the fp32 model's arithmetic (only the summation order differs).

#include <torch/extension.h>
#include <ATen/Parallel.h>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "cpu_kernels.h"
#include "simd.h"

namespace {

#if defined(__AVX512F__)
#define MCP_PREFILL_AVX512 1

constexpr int64_t kKeyTile = 16;   // keys per score register
constexpr int64_t kKeyBlock = 64;  // keys per softmax update (4 tiles: one max, exp and sum pass per row)
constexpr int64_t kMaxRows = 12;  // score accumulators per key tile (query rows of one tile)
constexpr int64_t kPvRows = 6;    // rows whose value sums (hd / 16 registers each) stay in registers

// Value sums of rows r0 .. r0 + R - 1 over one key tile: acc[r] = acc[r] * rescale[r] + sum_j p[r][j] v[j].
template <int R, int H>  // H = hd / 16
inline void prefill_pv(float* acc, const float* p, const float* rescale, const float* v, int64_t nkeys,
                       int64_t hd) {
  __m512 a[R][H];
  for (int r = 0; r < R; ++r) {
    const __m512 sc = _mm512_set1_ps(rescale[r]);
    for (int h = 0; h < H; ++h) a[r][h] = _mm512_mul_ps(_mm512_loadu_ps(acc + r * hd + 16 * h), sc);
  }
  for (int64_t j = 0; j < nkeys; ++j) {
    __m512 vj[H];
    for (int h = 0; h < H; ++h) vj[h] = _mm512_loadu_ps(v + j * hd + 16 * h);
    for (int r = 0; r < R; ++r) {
      const __m512 pr = _mm512_set1_ps(p[r * kKeyBlock + j]);
      for (int h = 0; h < H; ++h) a[r][h] = _mm512_fmadd_ps(pr, vj[h], a[r][h]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int h = 0; h < H; ++h) _mm512_storeu_ps(acc + r * hd + 16 * h, a[r][h]);
}

template <int H>
void prefill_pv_rows(float* acc, const float* p, const float* rescale, const float* v, int64_t nkeys,
                     int64_t hd, int64_t rows) {
  int64_t r = 0;
  for (; r + kPvRows <= rows; r += kPvRows)
    prefill_pv<kPvRows, H>(acc + r * hd, p + r * kKeyBlock, rescale + r, v, nkeys, hd);
  for (; r < rows; ++r) prefill_pv<1, H>(acc + r * hd, p + r * kKeyBlock, rescale + r, v, nkeys, hd);
}

// Scores of R query rows against one key tile (16 keys): K^T rows (hd, kt_stride) give each dimension's 16
// keys in one load; R accumulators in registers (R is a template argument so they stay there).
template <int R>
inline void prefill_scores(const float* qrows, int64_t hd, const float* ktile, int64_t kt_stride, float* out) {
  __m512 s[R];
  for (int r = 0; r < R; ++r) s[r] = _mm512_setzero_ps();
  for (int64_t d = 0; d < hd; ++d) {
    const __m512 kd = _mm512_loadu_ps(ktile + d * kt_stride);
    for (int r = 0; r < R; ++r) s[r] = _mm512_fmadd_ps(_mm512_set1_ps(qrows[r * hd + d]), kd, s[r]);
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(out + r * kKeyBlock, s[r]);
}

inline void prefill_scores_rows(const float* qrows, int64_t hd, const float* ktile, int64_t kt_stride, float* out,
                                int64_t rows) {
  switch (rows) {
    case 12: prefill_scores<12>(qrows, hd, ktile, kt_stride, out); break;
    case 11: prefill_scores<11>(qrows, hd, ktile, kt_stride, out); break;
    case 10: prefill_scores<10>(qrows, hd, ktile, kt_stride, out); break;
    case 9: prefill_scores<9>(qrows, hd, ktile, kt_stride, out); break;
    case 8: prefill_scores<8>(qrows, hd, ktile, kt_stride, out); break;
    case 7: prefill_scores<7>(qrows, hd, ktile, kt_stride, out); break;
    case 6: prefill_scores<6>(qrows, hd, ktile, kt_stride, out); break;
    case 5: prefill_scores<5>(qrows, hd, ktile, kt_stride, out); break;
    case 4: prefill_scores<4>(qrows, hd, ktile, kt_stride, out); break;
    case 3: prefill_scores<3>(qrows, hd, ktile, kt_stride, out); break;
    case 2: prefill_scores<2>(qrows, hd, ktile, kt_stride, out); break;
    default: prefill_scores<1>(qrows, hd, ktile, kt_stride, out); break;
  }
}

// One (KV head, query tile): rows = positions x g heads, row r = (position r / g, head r % g).
template <int H>
void prefill_tile(const float* q, int64_t q_row_stride, const float* kt, int64_t kt_stride, const float* vf,
                  float* out, int64_t out_row_stride, int64_t i0, int64_t npos, int64_t g, int64_t offset) {
  constexpr int64_t hd = 16 * H;
  const int64_t rows = npos * g;
  alignas(64) float qrows[kMaxRows * hd];
  alignas(64) float p[kMaxRows * kKeyBlock];
  alignas(64) float acc[kMaxRows * hd];
  float m[kMaxRows], l[kMaxRows], rescale[kMaxRows];
  for (int64_t r = 0; r < rows; ++r) {
    std::memcpy(qrows + r * hd, q + (i0 + r / g) * q_row_stride + (r % g) * hd, hd * sizeof(float));
    m[r] = -std::numeric_limits<float>::infinity();
    l[r] = 0.f;
  }
  std::memset(acc, 0, rows * hd * sizeof(float));
  const int64_t kend = offset + i0 + npos;  // keys the tile's last position sees
  const float neg_inf = -std::numeric_limits<float>::infinity();
  for (int64_t j0 = 0; j0 < kend; j0 += kKeyBlock) {
    const int64_t nk = std::min(kKeyBlock, kend - j0);
    const int64_t ntiles = (nk + kKeyTile - 1) / kKeyTile;
    for (int64_t t = 0; t < ntiles; ++t)
      prefill_scores_rows(qrows, hd, kt + j0 + t * kKeyTile, kt_stride, p + t * kKeyTile, rows);
    for (int64_t r = 0; r < rows; ++r) {
      float* pr = p + r * kKeyBlock;
      const int64_t visible = std::min<int64_t>(nk, offset + i0 + r / g + 1 - j0);  // causal limit, >= 1
      __m512 mx = _mm512_set1_ps(neg_inf);
      for (int64_t t = 0; t < ntiles; ++t) {
        const int64_t left = visible - t * kKeyTile;
        const __mmask16 live = left >= 16 ? static_cast<__mmask16>(0xFFFF)
                                          : static_cast<__mmask16>((1u << std::max<int64_t>(left, 0)) - 1);
        mx = _mm512_mask_max_ps(mx, live, mx, _mm512_loadu_ps(pr + t * kKeyTile));
      }
      const float m_new = std::max(m[r], _mm512_reduce_max_ps(mx));
      const __m512 mv = _mm512_set1_ps(m_new);
      __m512 sum = _mm512_setzero_ps();
      for (int64_t t = 0; t < ntiles; ++t) {
        const int64_t left = visible - t * kKeyTile;
        const __mmask16 live = left >= 16 ? static_cast<__mmask16>(0xFFFF)
                                          : static_cast<__mmask16>((1u << std::max<int64_t>(left, 0)) - 1);
        const __m512 e = _mm512_maskz_mov_ps(live, exp_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(pr + t * kKeyTile), mv)));
        sum = _mm512_add_ps(sum, e);
        _mm512_storeu_ps(pr + t * kKeyTile, e);
      }
      rescale[r] = std::exp(m[r] - m_new);  // 0 on the first block (m = -inf)
      l[r] = l[r] * rescale[r] + _mm512_reduce_add_ps(sum);
      m[r] = m_new;
    }
    prefill_pv_rows<H>(acc, p, rescale, vf + j0 * hd, nk, hd, rows);
  }
  for (int64_t r = 0; r < rows; ++r) {
    float* o = out + (i0 + r / g) * out_row_stride + (r % g) * hd;
    const __m512 inv = _mm512_set1_ps(1.f / l[r]);
    for (int64_t h = 0; h < H; ++h)
      _mm512_storeu_ps(o + 16 * h, _mm512_mul_ps(_mm512_loadu_ps(acc + r * hd + 16 * h), inv));
  }
}

template <typename KV>
void prefill_attention_impl(const float* q, const KV* k, const KV* v, float* out, int64_t T, int64_t nh,
                            int64_t nkv, int64_t S, int64_t hd, int64_t offset) {
  const int64_t g = nh / nkv;
  const int64_t positions = std::max<int64_t>(1, kMaxRows / g);  // query positions per tile
  const int64_t num_tiles = (T + positions - 1) / positions;
  const int64_t s_pad = (S + kKeyTile - 1) / kKeyTile * kKeyTile;
  // Per KV head: K transposed to (hd, S_pad) and V as float (S, hd), built once, read by every query tile.
  std::vector<float> kt(nkv * hd * s_pad, 0.f), vf(nkv * S * hd);
  at::parallel_for(0, nkv * S, 64, [&](int64_t begin, int64_t end) {
    for (int64_t idx = begin; idx < end; ++idx) {
      const int64_t h = idx / S, j = idx % S;
      const KV* krow = k + idx * hd;
      const KV* vrow = v + idx * hd;
      float* ktp = kt.data() + h * hd * s_pad;
      for (int64_t d = 0; d < hd; ++d) ktp[d * s_pad + j] = static_cast<float>(krow[d]);
      for (int64_t d = 0; d < hd; ++d) vf[idx * hd + d] = static_cast<float>(vrow[d]);
    }
  });
  // Later tiles see more keys: tiles are taken in the order 0, last, 1, last - 1, ... so that parallel_for's
  // contiguous ranges hold about equal work (in order, the second thread got ~3/4 of it).
  at::parallel_for(0, nkv * num_tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t w = begin; w < end; ++w) {
      const int64_t h = w % nkv, k = w / nkv;
      const int64_t tile = k % 2 == 0 ? k / 2 : num_tiles - 1 - k / 2;
      const int64_t i0 = tile * positions, npos = std::min(positions, T - i0);
      const float* qh = q + h * g * hd;
      float* oh = out + h * g * hd;
      const float* kth = kt.data() + h * hd * s_pad;
      const float* vfh = vf.data() + h * S * hd;
      switch (hd / 16) {
        case 2: prefill_tile<2>(qh, nh * hd, kth, s_pad, vfh, oh, nh * hd, i0, npos, g, offset); break;
        case 4: prefill_tile<4>(qh, nh * hd, kth, s_pad, vfh, oh, nh * hd, i0, npos, g, offset); break;
        case 8: prefill_tile<8>(qh, nh * hd, kth, s_pad, vfh, oh, nh * hd, i0, npos, g, offset); break;
        default: prefill_tile<16>(qh, nh * hd, kth, s_pad, vfh, oh, nh * hd, i0, npos, g, offset); break;
      }
    }
  });
}
#endif

}  // namespace

bool prefill_attention_available() {
#ifdef MCP_PREFILL_AVX512
  return true;
#else
  return false;
#endif
}

torch::Tensor prefill_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                int64_t offset) {
#ifdef MCP_PREFILL_AVX512
  TORCH_CHECK(q.device().is_cpu() && q.scalar_type() == torch::kFloat && q.dim() == 3, "q must be float32 (T, nh, hd)");
  TORCH_CHECK(k.dim() == 3 && v.sizes() == k.sizes() && k.scalar_type() == v.scalar_type(),
              "k and v must be (nkv, S, hd) of one dtype");
  TORCH_CHECK(k.scalar_type() == torch::kFloat || k.scalar_type() == torch::kBFloat16, "k and v: float32 or bfloat16");
  const int64_t T = q.size(0), nh = q.size(1), hd = q.size(2), nkv = k.size(0), S = k.size(1);
  TORCH_CHECK(k.size(2) == hd && nh % nkv == 0, "head sizes do not match");
  TORCH_CHECK(hd % 16 == 0 && (hd == 32 || hd == 64 || hd == 128 || hd == 256), "hd must be 32, 64, 128 or 256");
  TORCH_CHECK(nh / nkv <= kMaxRows, "at most 12 query heads per KV head");
  TORCH_CHECK(offset >= 0 && offset + T <= S, "the chunk's keys must be in k: offset + T <= S");
  const auto qc = q.contiguous();
  const auto kc = k.contiguous(), vc = v.contiguous();
  auto out = torch::empty({T, nh, hd}, q.options());
  if (kc.scalar_type() == torch::kFloat)
    prefill_attention_impl<float>(qc.data_ptr<float>(), kc.data_ptr<float>(), vc.data_ptr<float>(),
                                  out.data_ptr<float>(), T, nh, nkv, S, hd, offset);
  else
    prefill_attention_impl<at::BFloat16>(qc.data_ptr<float>(), kc.data_ptr<at::BFloat16>(),
                                         vc.data_ptr<at::BFloat16>(), out.data_ptr<float>(), T, nh, nkv, S, hd,
                                         offset);
  return out;
#else
  TORCH_CHECK(false, "prefill_attention needs AVX-512 (this build has none)");
#endif
}
