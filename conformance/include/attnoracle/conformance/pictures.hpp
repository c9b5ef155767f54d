// What the HTML report draws for a failing case, gathered while comparing: the error / limit
// ratios of out and weights downsampled by max, per row the worst ratio beside the row's allowed
// keys and score magnitude, and a histogram of the ratios.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "attnoracle/reference/case_file.hpp"

namespace attnoracle::conformance {

struct RowMagnitudes;

// One (batch, head) of out (query row x output column) or weights (query x key).
struct ErrorMap {
  std::string tensor;                          // "out" or "weights"
  std::int64_t b = 0, h = -1, kv = -1;         // h and its kv head; -1 for the out of kind mha
  std::int64_t rows = 0, cols = 0;             // the tensor's extent: Nq x (Dv, Dout or Nk)
  std::int64_t cell_rows = 0, cell_cols = 0;   // at most kMaxCells each
  std::vector<float> cells;                    // row-major: the largest ratio in each cell (inf: a NaN or infinite error)
  std::vector<float> means;                    // row-major: the mean ratio over each cell's elements
  double worst = 0;
};

// One query row of a tensor: its worst ratio, its allowed keys and its magnitude max |S_j|
// (the magnitudes the limits are computed from; for mha the heads' largest).
struct RowPoint {
  std::int64_t b = 0, h = -1, i = 0;
  std::int64_t keys = 0;
  double score_abs = 0, ratio = 0;
};
struct RowSeries {
  std::string tensor;
  std::int64_t rows = 0;          // rows compared, before sampling
  std::vector<RowPoint> points;   // at most kMaxPoints
};

// Ratios of the compared elements of a tensor: bins[k] counts ratios in [2^(kLog2From + k),
// 2^(kLog2From + k + 1)); zero, below and above the bins, infinite (NaN or infinite error).
struct Histogram {
  static constexpr int kLog2From = -32, kBins = 64;
  std::string tensor;
  std::vector<std::int64_t> bins = std::vector<std::int64_t>(kBins, 0);
  std::int64_t zero = 0, below = 0, above = 0, infinite = 0;
};

struct Pictures {
  static constexpr std::int64_t kMaxCells = 128;   // per side of a map
  static constexpr std::size_t kMaxMaps = 16;      // per tensor: the (batch, head)s of largest ratio
  static constexpr std::size_t kMaxPoints = 4096;  // per tensor: failing rows first, others sampled
  std::vector<ErrorMap> maps;
  std::vector<RowSeries> rows;
  std::vector<Histogram> histograms;
  bool empty() const { return maps.empty() && rows.empty() && histograms.empty(); }
};

// Fed every element the comparison looks at beyond the trivially equal ones (those have ratio
// 0 and are counted by `compared` in finish).
class PictureCollector {
 public:
  explicit PictureCollector(const Case& c);
  // Element k (flat) of tensor name ("out", "weights", "lse").
  void record(const std::string& name, std::size_t k, double ratio);
  // compared[t]: elements compared of out, weights, lse (-1: not compared).
  Pictures finish(const std::vector<RowMagnitudes>& mags, const std::int64_t compared[3]) const;

 private:
  struct Tensor {
    std::int64_t heads = 1, cols = 1, cell_rows = 1, cell_cols = 1;
    std::vector<std::vector<float>> grids;  // per b * heads + h: empty until an element is recorded
    std::vector<std::vector<double>> sums;  // per b * heads + h, beside grids: each cell's sum of ratios
    std::vector<float> row_worst;           // per (b * heads + h) * Nq + i
    Histogram hist;
    std::int64_t recorded = 0;
    bool seen = false;
  };
  const Case& c_;
  Tensor t_[3];
};

}  // namespace attnoracle::conformance
