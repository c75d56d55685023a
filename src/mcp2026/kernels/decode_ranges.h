// Decode attention cut by position: a sequence's context is divided at fixed multiples of kRangeTokens (whole
// blocks); each range's softmax and weighted sum of values is computed on its own (on any thread) and the ranges
// of a query head are merged in order through their maxima and sums of exponentials. The cuts depend on positions
// only, never on the batch or the thread count, so a sequence's output has the same bits in any batch; a context
// of one range is one softmax, as if uncut.
// Why: a batch-1 step has only nkv (sequence, KV head) pairs, fewer than the threads want. Split by query head,
// two threads read one KV head's blocks; split by range, every block is read once and threads get equal shares
// of a long context.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace {

constexpr int64_t kRangeTokens = 1024;

// One thread's unit of work: query heads j0 .. j0 + heads - 1 of KV head h of sequence b, over one range.
struct DecodeItem {
  int64_t b, h, j0, heads;
  int64_t first_block;  // the range's first block, an index into the sequence's table
  int64_t len;          // tokens in the range
  int64_t skip;         // positions of its first block before a sliding window's start
  int64_t slot;         // where its results go among the cut sequences' ranges; -1: straight to the output
};

struct DecodePlan {
  int64_t range_blocks = 1;         // blocks per range
  std::vector<DecodeItem> items;    // in (sequence, KV head, range, query head) order
  std::vector<int64_t> cuts;        // task k runs items cuts[k] .. cuts[k + 1] - 1
  std::vector<int64_t> first_slot;  // per sequence: its first range's slot; -1 when it is one range
  std::vector<int64_t> num_ranges;  // per sequence
  int64_t num_slots = 0;
  // Per slot and query head: the range's output normalized over it (hd), its (maximum, sum of exponentials),
  // and with mass its probability per block (range_blocks; zeroed by build).
  std::vector<float> partial, stats, range_mass;

  // lengths and starts (null: 0) as decode_attention_run takes them. Items of g query heads (a whole KV head)
  // unless there are fewer than two per thread and no attention mass is recorded (a mass row has one writer):
  // then of one query head each. Tasks: at most threads, fewer where a task would do under min_work
  // multiply-adds; items are dealt out in order by their share of the tokens times heads.
  void build(const int64_t* lengths, const int64_t* starts, int64_t B, int64_t nkv, int64_t g, int64_t hd,
             int64_t bs, bool with_mass, int64_t threads, int64_t min_work) {
    range_blocks = std::max<int64_t>(1, kRangeTokens / bs);
    first_slot.assign(B, -1);
    num_ranges.assign(B, 1);
    num_slots = 0;
    int64_t pairs = 0;
    for (int64_t b = 0; b < B; ++b) {
      const int64_t first = starts == nullptr ? 0 : starts[b] / bs, last = (lengths[b] - 1) / bs;
      num_ranges[b] = last / range_blocks - first / range_blocks + 1;
      if (num_ranges[b] > 1) {
        first_slot[b] = num_slots;
        num_slots += num_ranges[b];
      }
      pairs += nkv * num_ranges[b];
    }
    const int64_t unit = (!with_mass && pairs < 2 * threads) ? 1 : g;
    items.clear();
    int64_t work = 0;
    for (int64_t b = 0; b < B; ++b) {
      const int64_t first = starts == nullptr ? 0 : starts[b] / bs, end_block = (lengths[b] + bs - 1) / bs;
      for (int64_t h = 0; h < nkv; ++h)
        for (int64_t r = 0; r < num_ranges[b]; ++r) {
          const int64_t block = std::max(first, (first / range_blocks + r) * range_blocks);
          const int64_t stop = std::min(end_block, (first / range_blocks + r + 1) * range_blocks);
          const int64_t len = std::min(lengths[b], stop * bs) - block * bs;
          const int64_t skip = (starts != nullptr && block == first) ? starts[b] - first * bs : 0;
          const int64_t slot = first_slot[b] < 0 ? -1 : first_slot[b] + r;
          for (int64_t j0 = 0; j0 < g; j0 += unit) {
            items.push_back({b, h, j0, std::min(unit, g - j0), block, len, skip, slot});
            work += len * hd * items.back().heads;
          }
        }
    }
    partial.resize(num_slots * nkv * g * hd);
    stats.resize(num_slots * nkv * g * 2);
    range_mass.assign(with_mass ? num_slots * nkv * g * range_blocks : 0, 0.f);
    const int64_t tasks = std::max<int64_t>(1, std::min(threads, work / std::max<int64_t>(1, min_work)));
    cuts.assign(tasks + 1, static_cast<int64_t>(items.size()));
    cuts[0] = 0;
    int64_t done = 0, task = 0;
    for (int64_t i = 0; i < static_cast<int64_t>(items.size()); ++i) {
      const int64_t w = items[i].len * hd * items[i].heads;
      // the item goes to the task whose share holds its midpoint
      const int64_t owner = std::min(tasks - 1, (2 * done + w) * tasks / std::max<int64_t>(1, 2 * work));
      while (task < owner) cuts[++task] = i;
      done += w;
    }
  }
};

// A query head's output from its ranges' results, in range order: acc (row r at r * row_stride: hd floats
// normalized over range r), stats (range r's maximum score and sum of exponentials at r * stats_stride).
// weights (num_ranges floats) returns each range's share of the head's attention; merged (hd floats) is room.
template <typename T>
inline void merge_ranges(const float* acc, const float* stats, int64_t num_ranges, int64_t row_stride,
                         int64_t stats_stride, int64_t hd, float* weights, float* merged, T* out) {
  float mx = stats[0];
  for (int64_t r = 1; r < num_ranges; ++r) mx = std::max(mx, stats[r * stats_stride]);
  float total = 0.f;
  for (int64_t r = 0; r < num_ranges; ++r) {
    weights[r] = stats[r * stats_stride + 1] * std::exp(stats[r * stats_stride] - mx);
    total += weights[r];
  }
  std::fill(merged, merged + hd, 0.f);
  for (int64_t r = 0; r < num_ranges; ++r) {
    weights[r] /= total;
    const float w = weights[r], *row = acc + r * row_stride;
    for (int64_t d = 0; d < hd; ++d) merged[d] += w * row[d];
  }
  for (int64_t d = 0; d < hd; ++d) out[d] = static_cast<T>(merged[d]);
}

}  // namespace
