// The data of the HTML report's pictures of a failing case.
#include "attnoracle/conformance/pictures.hpp"

#include <algorithm>
#include <cmath>
#include <tuple>

#include "attnoracle/conformance/tolerance.hpp"

namespace attnoracle::conformance {
namespace {

constexpr const char* kNames[3] = {"out", "weights", "lse"};

int tensor_index(const std::string& name) { return name == "out" ? 0 : name == "weights" ? 1 : name == "lse" ? 2 : -1; }

// The cell of index x of n along a side of m cells: floor(x m / n), within [0, m).
std::int64_t cell_of(std::int64_t x, std::int64_t n, std::int64_t m) { return x * m / n; }
// The first index whose cell is c: ceil(c n / m) (n at c = m).
std::int64_t first_of(std::int64_t c, std::int64_t n, std::int64_t m) { return (c * n + m - 1) / m; }

}  // namespace

PictureCollector::PictureCollector(const Case& c) : c_(c) {
  const bool mha = c.kind == Kind::Mha;
  const std::int64_t cols[3] = {mha ? c.Dout : c.Dv, c.Nk, 1};
  for (int t = 0; t < 3; ++t) {
    Tensor& x = t_[t];
    x.heads = t == 0 && mha ? 1 : c.Hq;
    x.cols = std::max<std::int64_t>(cols[t], 1);
    x.cell_rows = std::min(std::max<std::int64_t>(c.Nq, 1), Pictures::kMaxCells);
    x.cell_cols = std::min(x.cols, Pictures::kMaxCells);
    x.hist.tensor = kNames[t];
  }
}

void PictureCollector::record(const std::string& name, std::size_t k, double ratio) {
  const int t = tensor_index(name);
  if (t < 0 || c_.Nq <= 0) return;
  Tensor& x = t_[t];
  if (!x.seen) {
    x.seen = true;
    x.grids.resize(static_cast<std::size_t>(c_.B * x.heads));
    x.sums.resize(x.grids.size());
    x.row_worst.assign(static_cast<std::size_t>(c_.B * x.heads * c_.Nq), 0.0f);
  }
  const auto kk = static_cast<std::int64_t>(k);
  const std::int64_t j = kk % x.cols, r = kk / x.cols, i = r % c_.Nq, bh = r / c_.Nq;
  if (bh >= c_.B * x.heads) return;
  ++x.recorded;
  // NaN ratios (none are made by the comparison) count as infinite, like a NaN error.
  const float v = std::isnan(ratio) ? INFINITY : static_cast<float>(ratio);
  float& rw = x.row_worst[static_cast<std::size_t>(r)];
  rw = std::max(rw, v);
  if (t < 2) {
    auto& g = x.grids[static_cast<std::size_t>(bh)];
    auto& sum = x.sums[static_cast<std::size_t>(bh)];
    if (g.empty()) {
      g.assign(static_cast<std::size_t>(x.cell_rows * x.cell_cols), 0.0f);
      sum.assign(g.size(), 0.0);
    }
    const auto at = static_cast<std::size_t>(cell_of(i, c_.Nq, x.cell_rows) * x.cell_cols + cell_of(j, x.cols, x.cell_cols));
    g[at] = std::max(g[at], v);
    sum[at] += v;
  }
  Histogram& h = x.hist;
  if (v == 0) ++h.zero;
  else if (std::isinf(v)) ++h.infinite;
  else {
    const int e = std::ilogb(ratio);  // ratio in [2^e, 2^(e+1))
    if (e < Histogram::kLog2From) ++h.below;
    else if (e >= Histogram::kLog2From + Histogram::kBins) ++h.above;
    else ++h.bins[static_cast<std::size_t>(e - Histogram::kLog2From)];
  }
}

Pictures PictureCollector::finish(const std::vector<RowMagnitudes>& mags, const std::int64_t compared[3]) const {
  Pictures p;
  const bool mha = c_.kind == Kind::Mha;
  for (int t = 0; t < 3; ++t) {
    const Tensor& x = t_[t];
    if (compared[t] < 0) continue;
    Histogram hist = x.hist;
    hist.zero += std::max<std::int64_t>(0, compared[t] - x.recorded);  // the trivially equal elements
    p.histograms.push_back(std::move(hist));

    // maps: the (batch, head)s of largest worst ratio, in (batch, head) order
    if (t < 2) {
      std::vector<std::pair<double, std::size_t>> order;
      for (std::size_t bh = 0; bh < x.grids.size(); ++bh) {
        const auto& g = x.grids[bh];
        double w = 0;
        for (float v : g) w = std::max(w, static_cast<double>(v));
        order.emplace_back(w, bh);
      }
      if (order.empty() && compared[t] > 0)  // every element trivially equal
        for (std::size_t bh = 0; bh < static_cast<std::size_t>(c_.B * x.heads); ++bh) order.emplace_back(0.0, bh);
      std::stable_sort(order.begin(), order.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
      if (order.size() > Pictures::kMaxMaps) order.resize(Pictures::kMaxMaps);
      std::sort(order.begin(), order.end(), [](const auto& a, const auto& b) { return a.second < b.second; });
      for (const auto& [w, bh] : order) {
        ErrorMap m;
        m.tensor = kNames[t];
        m.b = static_cast<std::int64_t>(bh) / x.heads;
        m.h = t == 0 && mha ? -1 : static_cast<std::int64_t>(bh) % x.heads;
        m.kv = m.h < 0 ? -1 : c_.kv_head(m.h);
        m.rows = c_.Nq;
        m.cols = x.cols;
        m.cell_rows = x.cell_rows;
        m.cell_cols = x.cell_cols;
        m.worst = w;
        m.cells = bh < x.grids.size() && !x.grids[bh].empty() ? x.grids[bh]
                                                              : std::vector<float>(static_cast<std::size_t>(x.cell_rows * x.cell_cols), 0.0f);
        m.means.assign(m.cells.size(), 0.0f);
        if (bh < x.sums.size() && !x.sums[bh].empty())
          for (std::int64_t r = 0; r < x.cell_rows; ++r)
            for (std::int64_t q = 0; q < x.cell_cols; ++q) {
              // the elements of a cell: the rows and columns whose cell it is (cell_of inverted)
              const std::int64_t n = (first_of(r + 1, c_.Nq, x.cell_rows) - first_of(r, c_.Nq, x.cell_rows)) *
                                     (first_of(q + 1, x.cols, x.cell_cols) - first_of(q, x.cols, x.cell_cols));
              const auto at = static_cast<std::size_t>(r * x.cell_cols + q);
              m.means[at] = static_cast<float>(x.sums[bh][at] / static_cast<double>(n));
            }
        p.maps.push_back(std::move(m));
      }
    }

    // rows: every compared row (not padding) with its magnitudes
    RowSeries s;
    s.tensor = kNames[t];
    std::vector<RowPoint> failing, others;
    for (std::int64_t b = 0; b < c_.B; ++b)
      for (std::int64_t h = 0; h < x.heads; ++h)
        for (std::int64_t i = 0; i < c_.Nq; ++i) {
          if (!c_.query_valid(b, i)) continue;
          const std::int64_t r = (b * x.heads + h) * c_.Nq + i;
          // magnitudes per row of row_magnitudes: [B, Hq, Nq], or [B, Nq] for mha
          const std::size_t mrow = static_cast<std::size_t>(mha ? b * c_.Nq + i : r);
          RowPoint pt;
          pt.b = b;
          pt.h = t == 0 && mha ? -1 : h;
          pt.i = i;
          if (mrow < mags.size()) {
            pt.keys = mags[mrow].keys;
            pt.score_abs = mags[mrow].score_abs;
          }
          pt.ratio = x.row_worst.empty() ? 0.0 : static_cast<double>(x.row_worst[static_cast<std::size_t>(r)]);
          ++s.rows;
          (pt.ratio > 1 ? failing : others).push_back(pt);
        }
    if (failing.size() > Pictures::kMaxPoints) failing.resize(Pictures::kMaxPoints);
    const std::size_t room = Pictures::kMaxPoints - failing.size();
    // the others at a regular stride: ceil(n / room) keeps at most room of them
    const std::size_t stride = room == 0 ? 0 : (others.size() + room - 1) / room;
    s.points = std::move(failing);
    if (stride > 0)
      for (std::size_t k = 0; k < others.size(); k += stride) s.points.push_back(others[k]);
    std::sort(s.points.begin(), s.points.end(), [](const RowPoint& a, const RowPoint& b) {
      return std::tie(a.b, a.h, a.i) < std::tie(b.b, b.h, b.i);
    });
    p.rows.push_back(std::move(s));
  }
  return p;
}

}  // namespace attnoracle::conformance
