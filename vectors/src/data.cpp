// Data generators, each aimed at one weakness of attention implementations (vectors/SUITES.md).
#include "data.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <initializer_list>
#include <iterator>
#include <stdexcept>
#include <string_view>
#include <utility>

#include "numbers.hpp"

namespace attnoracle::vectors {
namespace {

constexpr double kLn2 = 0.6931471805599453;  // the double nearest ln 2

std::size_t sz(std::int64_t n) { return static_cast<std::size_t>(n); }

// A row-major matrix view into one tensor.
struct Mat {
  double* p;
  std::int64_t rows, cols;
  double& at(std::int64_t r, std::int64_t c) const { return p[sz(r * cols + c)]; }
};

// Shapes and views of the problem's tensors. For sdpa a group is (b, head); for mha it is b,
// and "key rows" are rows of x_kv (the values are projected from them too).
struct Layout {
  const ProblemSpec& p;
  InputData& d;
  bool mha() const { return p.kind == Kind::Mha; }
  std::int64_t qgroups() const { return mha() ? p.B : p.B * p.Hq; }
  std::int64_t kgroups() const { return mha() ? p.B : p.B * p.Hkv; }
  std::int64_t width() const { return mha() ? p.D : p.Dk; }  // length of query and key rows
  Mat qrows(std::int64_t g) const {
    return {(mha() ? d.x_q.data() : d.q.data()) + sz(g * p.Nq * width()), p.Nq, width()};
  }
  Mat krows(std::int64_t g) const {
    return {(mha() ? d.x_kv.data() : d.k.data()) + sz(g * p.Nk * width()), p.Nk, width()};
  }
  Mat vrows(std::int64_t g) const { return {d.v.data() + sz(g * p.Nk * p.Dv), p.Nk, p.Dv}; }
  Mat w(std::vector<double>& t, std::int64_t r, std::int64_t cols) const {
    return {t.data() + sz(r * p.D * cols), p.D, cols};
  }
};

// 2^-ceil(log2(n)/2): about 1/sqrt(n), a power of two, so that projections over n terms stay
// of order 1 whatever the data.
double fan_in_scale(std::int64_t n) {
  int e = 0;
  while ((std::int64_t{1} << e) < n) ++e;
  return std::ldexp(1.0, -(e + 1) / 2);
}

class Gen {
 public:
  Gen(const ProblemSpec& p, Rng& rng, InputData& d) : p_(p), rng_(rng), L_{p, d}, d_(d) {
    const auto n = [](std::initializer_list<std::int64_t> dims) {
      std::int64_t s = 1;
      for (auto x : dims) s *= x;
      return sz(s);
    };
    if (L_.mha()) {
      d.x_q.assign(n({p.B, p.Nq, p.D}), 0);
      d.x_kv.assign(n({p.B, p.Nk, p.D}), 0);
      d.w_q.assign(n({p.Hq, p.D, p.Dk}), 0);
      d.w_k.assign(n({p.Hq, p.D, p.Dk}), 0);
      d.w_v.assign(n({p.Hq, p.D, p.Dv}), 0);
      d.w_o.assign(n({p.Hq * p.Dv, p.Dout}), 0);
    } else {
      d.q.assign(n({p.B, p.Hq, p.Nq, p.Dk}), 0);
      d.k.assign(n({p.B, p.Hkv, p.Nk, p.Dk}), 0);
      d.v.assign(n({p.B, p.Hkv, p.Nk, p.Dv}), 0);
    }
  }

  double rn(double x) const { return round_into(x, p_.dtype); }
  double normal(double sigma = 1) { return rn(sigma * rng_.normal()); }

  void fill(std::vector<double>& t, const std::function<double()>& f) {
    for (auto& x : t) x = f();
  }
  void fill(const Mat& m, const std::function<double()>& f) {
    for (std::int64_t r = 0; r < m.rows; ++r)
      for (std::int64_t c = 0; c < m.cols; ++c) m.at(r, c) = f();
  }
  // Projections of kind mha drawn with a fan-in scale, so that Q, K, V and out stay of order 1.
  void normal_weights() {
    const double s = fan_in_scale(p_.D), so = fan_in_scale(p_.Hq * p_.Dv);
    fill(d_.w_q, [&] { return normal(s); });
    fill(d_.w_k, [&] { return normal(s); });
    fill(d_.w_v, [&] { return normal(s); });
    fill(d_.w_o, [&] { return normal(so); });
  }
  void all(const std::function<double()>& f) {
    for (auto* t : {&d_.q, &d_.k, &d_.v, &d_.x_q, &d_.x_kv}) fill(*t, f);
    if (L_.mha()) normal_weights();
  }

  void run(std::string_view g) {
    if (g == "uniform") {
      const double lo = param(p_, "lo"), hi = param(p_, "hi");
      all([&] { return rn(rng_.uniform(lo, hi)); });
    } else if (g == "normal") {
      const double sigma = param(p_, "sigma");
      all([&] { return normal(sigma); });
    } else {
      static constexpr std::pair<std::string_view, void (Gen::*)()> kGenerators[] = {
          {"large_scores", &Gen::large_scores}, {"ties", &Gen::ties},
          {"near_ties", &Gen::near_ties},       {"dominant", &Gen::dominant},
          {"cancel", &Gen::cancel},             {"wide_range", &Gen::wide_range},
          {"subnormal", &Gen::subnormal},       {"score_jump", &Gen::score_jump}};
      const auto it = std::find_if(std::begin(kGenerators), std::end(kGenerators),
                                   [&](const auto& e) { return e.first == g; });
      if (it == std::end(kGenerators))
        throw std::invalid_argument("unknown generator " + std::string(g));
      (this->*(it->second))();
    }
    if (L_.mha() && p_.self_attention) d_.x_q = d_.x_kv;
  }

 private:
  // Scores by design: the first coordinate of query row i is a(i), that of key row j is b(j),
  // and the other coordinates are normal with sigma_q and sigma_k, so that
  // score(i,j) = scale * (a(i) b(j) + small). For mha the projections W_q[r], W_k[r] carry the
  // first input coordinate through unchanged (1 at [0][0], zeros elsewhere in row and column 0)
  // and W_v[r] ignores it, so the designed coordinate reaches the scores and not the values.
  void designed(const std::function<double(std::int64_t g, std::int64_t i)>& a,
                const std::function<double(std::int64_t g, std::int64_t j)>& b, double sigma_q,
                double sigma_k) {
    for (std::int64_t g = 0; g < L_.qgroups(); ++g) {
      const Mat m = L_.qrows(g);
      for (std::int64_t i = 0; i < m.rows; ++i) {
        m.at(i, 0) = rn(a(g, i));
        for (std::int64_t c = 1; c < m.cols; ++c) m.at(i, c) = normal(sigma_q);
      }
    }
    for (std::int64_t g = 0; g < L_.kgroups(); ++g) {
      const Mat m = L_.krows(g);
      for (std::int64_t j = 0; j < m.rows; ++j) {
        m.at(j, 0) = rn(b(g, j));
        for (std::int64_t c = 1; c < m.cols; ++c) m.at(j, c) = normal(sigma_k);
      }
      if (!L_.mha()) fill(L_.vrows(g), [&] { return normal(); });
    }
    if (!L_.mha()) return;
    normal_weights();
    for (std::int64_t r = 0; r < p_.Hq; ++r) {
      for (auto* w : {&d_.w_q, &d_.w_k}) {
        const Mat m = L_.w(*w, r, p_.Dk);
        for (std::int64_t c = 0; c < m.cols; ++c) m.at(0, c) = 0;
        for (std::int64_t e = 0; e < m.rows; ++e) m.at(e, 0) = 0;
        m.at(0, 0) = 1;
      }
      const Mat wv = L_.w(d_.w_v, r, p_.Dv);
      if (p_.D > 1)
        for (std::int64_t c = 0; c < wv.cols; ++c) wv.at(0, c) = 0;
    }
  }

  // Scores near +offset or -offset (the sign drawn per query row) with spread about `spread`:
  // exp without max subtraction overflows (or underflows every term to 0), yet the weights are
  // ordinary.
  void large_scores() {
    const double offset = param(p_, "offset"), spread = param(p_, "spread");
    const double scale = scale_value(p_.scale, static_cast<long>(p_.Dk));
    const double c = rn(sqrt_rn(offset / scale));
    std::vector<double> sign(sz(L_.qgroups() * p_.Nq));
    for (auto& s : sign) s = rng_.sign();
    designed([&](std::int64_t g, std::int64_t i) { return sign[sz(g * p_.Nq + i)] * c; },
             [&](std::int64_t, std::int64_t) { return c; }, 1.0, spread);
  }

  // Scores that jump by about `jump` at key `at`: the first coordinate of every query is c and
  // of keys j >= at c (of the others 0), with c^2 scale = jump. A blocked online softmax whose
  // maximum comes from the keys before `at` meets exp(jump) > 448 after them: FP8 P saturates.
  void score_jump() {
    const double jump = param(p_, "jump");
    const auto at = static_cast<std::int64_t>(param(p_, "at"));
    const double scale = scale_value(p_.scale, static_cast<long>(p_.Dk));
    const double c = rn(sqrt_rn(jump / scale));
    designed([&](std::int64_t, std::int64_t) { return c; },
             [&](std::int64_t, std::int64_t j) { return j >= at ? c : 0.0; }, 1.0, 1.0);
  }

  // One key per group scores far above the others: gaps put the other weights across the
  // output format's smallest normals, its subnormals and below (rounding to 0).
  void dominant() {
    const Limits out = limits(p_.output_dtype.value_or(p_.dtype));
    const double l_normal = -out.min_normal_exp * kLn2, l_sub = -out.min_sub_exp * kLn2;
    const double scale = scale_value(p_.scale, static_cast<long>(p_.Dk));
    const double top = l_sub / 2;
    std::vector<double> target(sz(L_.kgroups() * p_.Nk));
    for (std::int64_t g = 0; g < L_.kgroups(); ++g) {
      const std::int64_t star = static_cast<std::int64_t>(rng_.below(sz(p_.Nk)));
      for (std::int64_t j = 0; j < p_.Nk; ++j)
        target[sz(g * p_.Nk + j)] = j == star ? top : top - rng_.uniform(l_normal - 4, l_sub + 2);
    }
    designed([](std::int64_t, std::int64_t) { return 1.0; },
             [&](std::int64_t g, std::int64_t j) { return target[sz(g * p_.Nk + j)] / scale; },
             0.25, 0.25);
  }

  // Exact duplicate key rows drawn from a small pool: equal scores, equal weights.
  void ties() {
    std::int64_t distinct = static_cast<std::int64_t>(param(p_, "distinct"));
    if (distinct <= 0) distinct = std::max<std::int64_t>(1, p_.Nk / 4);
    all([&] { return normal(); });
    for (std::int64_t g = 0; g < L_.kgroups(); ++g) {
      const Mat m = L_.krows(g);
      std::vector<double> pool(sz(distinct * m.cols));
      for (auto& x : pool) x = normal();
      for (std::int64_t j = 0; j < m.rows; ++j) {
        const auto from = static_cast<std::int64_t>(rng_.below(sz(distinct)));
        for (std::int64_t c = 0; c < m.cols; ++c) m.at(j, c) = pool[sz(from * m.cols + c)];
      }
    }
  }

  double nudged(double x, std::int64_t ulps) const {
    if (x == 0) x = rn(0.5);
    for (std::int64_t u = 0; u < ulps; ++u) x = away_ulp(x, p_.dtype);
    return x;
  }

  // Key rows equal to a base row but for one coordinate moved by a few units in the last place.
  void near_ties() {
    const auto ulps = static_cast<std::int64_t>(param(p_, "ulps"));
    all([&] { return normal(); });
    for (std::int64_t g = 0; g < L_.kgroups(); ++g) {
      const Mat m = L_.krows(g);
      for (std::int64_t j = 1; j < m.rows; ++j) {
        for (std::int64_t c = 0; c < m.cols; ++c) m.at(j, c) = m.at(0, c);
        const auto c = static_cast<std::int64_t>(rng_.below(sz(m.cols)));
        m.at(j, c) = nudged(m.at(j, c), ulps);
      }
    }
  }

  // Pairs of keys with nearly equal (or equal) scores and opposite values: the output is a
  // small difference of large terms, far below out.bound.
  void cancel() {
    all([&] { return normal(); });
    if (!L_.mha()) {
      for (std::int64_t g = 0; g < L_.kgroups(); ++g) {
        const Mat k = L_.krows(g), v = L_.vrows(g);
        for (std::int64_t j = 0; j + 1 < p_.Nk; j += 2) {
          const bool equal = rng_.chance(0.25);
          const auto c0 = static_cast<std::int64_t>(rng_.below(sz(k.cols)));
          for (std::int64_t c = 0; c < k.cols; ++c)
            k.at(j + 1, c) = equal || c != c0 ? k.at(j, c) : nudged(k.at(j, c), 1);
          for (std::int64_t c = 0; c < v.cols; ++c) v.at(j + 1, c) = -v.at(j, c);
        }
        if (p_.Nk % 2)
          for (std::int64_t c = 0; c < v.cols; ++c) v.at(p_.Nk - 1, c) = normal(0x1p-20);
      }
      return;
    }
    // mha: value columns in equal pairs, and W_o rows of a pair nearly opposite.
    for (std::int64_t r = 0; r < p_.Hq; ++r) {
      const Mat wv = L_.w(d_.w_v, r, p_.Dv);
      for (std::int64_t c = 0; c + 1 < p_.Dv; c += 2)
        for (std::int64_t e = 0; e < p_.D; ++e) wv.at(e, c + 1) = wv.at(e, c);
      const Mat wo{d_.w_o.data() + sz(r * p_.Dv * p_.Dout), p_.Dv, p_.Dout};
      for (std::int64_t c = 0; c + 1 < p_.Dv; c += 2)
        for (std::int64_t e = 0; e < p_.Dout; ++e) wo.at(c + 1, e) = -nudged(wo.at(c, e), 1);
      if (p_.Dv % 2)
        for (std::int64_t e = 0; e < p_.Dout; ++e) wo.at(p_.Dv - 1, e) = normal(0x1p-20);
    }
  }

  // sign * (1 + u) * 2^e, e uniform in [lo, hi]
  double spread_value(int lo, int hi) {
    // one draw per statement: the order of evaluation of operands is unspecified
    const int e = lo + static_cast<int>(rng_.below(static_cast<std::uint64_t>(hi - lo + 1)));
    const double s = rng_.sign();
    return rn(s * std::ldexp(1.0 + rng_.uniform(), e));
  }

  // Exponents spread over the range shared by the input and output formats: values from the
  // smallest normal to a quarter of the largest, queries and keys from the square root of the
  // smallest normal to 4 (so that scores stay finite in the input format).
  void wide_range() {
    const Limits in = limits(p_.dtype), out = limits(p_.output_dtype.value_or(p_.dtype));
    const int lo = std::max(in.min_normal_exp, out.min_normal_exp);
    const int hi = std::min(in.max_exp, out.max_exp);
    if (!L_.mha()) {
      for (auto* t : {&d_.q, &d_.k}) fill(*t, [&] { return spread_value(lo / 2, 2); });
      // E4M3 values reach its top binade, saturating at 448
      fill(d_.v, [&] { return spread_value(lo, p_.dtype == DType::F8_E4M3 ? hi - 1 : hi - 2); });
      return;
    }
    for (auto* t : {&d_.x_q, &d_.x_kv}) fill(*t, [&] { return spread_value(lo / 4, hi / 8); });
    normal_weights();
  }

  // sign * n * 2^min_sub_exp with 1 <= n < 2^(p-1): a subnormal of the input format.
  double subnormal_value() {
    const Limits l = limits(p_.dtype);
    const auto n = 1 + rng_.below((std::uint64_t{1} << (l.precision - 1)) - 1);
    return rn(rng_.sign() * std::ldexp(static_cast<double>(n), l.min_sub_exp));
  }

  // Values all subnormal, queries and keys half subnormal (mha: x_kv all, x_q half).
  void subnormal() {
    auto half = [&] { return rng_.chance(0.5) ? subnormal_value() : normal(); };
    if (!L_.mha()) {
      fill(d_.q, half);
      fill(d_.k, half);
      fill(d_.v, [&] { return subnormal_value(); });
      return;
    }
    fill(d_.x_q, half);
    fill(d_.x_kv, [&] { return subnormal_value(); });
    normal_weights();
  }

  const ProblemSpec& p_;
  Rng& rng_;
  Layout L_;
  InputData& d_;
};

}  // namespace

const std::vector<GeneratorInfo>& generators() {
  static const std::vector<GeneratorInfo> g = {
      {"uniform", {{"lo", -1.0}, {"hi", 1.0}}, "uniform [lo, hi)"},
      {"normal", {{"sigma", 1.0}}, "normal (Irwin-Hall) with standard deviation sigma"},
      {"large_scores",
       {{"offset", 1000.0}, {"spread", 1.0}},
       "scaled scores near +-offset: exp without max subtraction overflows or underflows"},
      {"ties", {{"distinct", 0.0}}, "exact duplicate keys from a pool of `distinct` rows"},
      {"near_ties", {{"ulps", 1.0}}, "keys equal but for one coordinate moved by a few ulps"},
      {"dominant", {}, "one key far above the others: weights near 1 beside subnormal weights"},
      {"cancel", {}, "key pairs with opposite values: outputs cancel to near zero"},
      {"wide_range", {}, "exponents spread over the format's range"},
      {"subnormal", {}, "inputs in the format's subnormal range"},
      {"score_jump",
       {{"jump", 8.0}, {"at", 64.0}},
       "scores that rise by `jump` from key `at` on: FP8 P saturates against a stale row maximum"},
  };
  return g;
}

const GeneratorInfo* find_generator(std::string_view name) {
  for (const auto& g : generators())
    if (g.name == name) return &g;
  return nullptr;
}

double param(const ProblemSpec& p, std::string_view name) {
  if (auto it = p.params.find(std::string(name)); it != p.params.end()) return it->second;
  const GeneratorInfo* g = find_generator(p.generator);
  if (g)
    for (const auto& [n, v] : g->params)
      if (n == name) return v;
  throw std::logic_error("no parameter " + std::string(name));
}

InputData generate_data(const ProblemSpec& p, Rng& rng) {
  InputData d;
  Gen gen(p, rng, d);
  gen.run(p.generator);
  return d;
}

}  // namespace attnoracle::vectors
