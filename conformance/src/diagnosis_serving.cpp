// What the failing rows of a serving kernel's case have in common: a page of the block table, a
// split of the keys, a merge's empty split. Each detector takes a set of rows (those reading a
// kind of page, those with an empty split, ...) and speaks only when every failing row is in it,
// at least half of its rows fail, and rows outside it were compared (and pass).
#include "diagnosis_serving.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <functional>
#include <map>
#include <optional>
#include <set>
#include <string>

namespace attnoracle::conformance {
namespace {

std::string list(const std::vector<std::string>& v, std::size_t cap = 4, const char* sep = ", ") {
  std::string s;
  for (std::size_t k = 0; k < v.size() && k < cap; ++k) s += (k ? sep : "") + v[k];
  if (v.size() > cap) s += ", ... (" + std::to_string(v.size()) + " in all)";
  return s;
}
std::string fmt_g(double x) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.6g", x);
  return buf;
}
std::string plural(std::int64_t n, const char* one, const char* many) {
  return std::to_string(n) + " " + (n == 1 ? one : many);
}

// How a set of rows (b, h, i) meets the failing rows.
struct Fit {
  std::int64_t with = 0, fail_with = 0, without = 0;
  bool all = true;  // every failing row is in the set
  // every failing row in the set, rows outside it compared, and `share` of its rows failing
  bool holds(double share = 0.5) const {
    return all && fail_with > 0 && without > 0 && static_cast<double>(fail_with) >= share * static_cast<double>(with);
  }
  // "(3 of the 4 rows reading one fail; the 20 other rows pass)"
  std::string counts(const char* what) const {
    return "(" + std::to_string(fail_with) + " of the " + (what ? plural(with, "row", "rows") + " " + what : plural(with, "such row", "such rows")) + " " +
           (fail_with == 1 ? "fails" : "fail") + "; the " + plural(without, "other row passes", "other rows pass") + ")";
  }
};

// The set `has(b, h, i)` against the compared rows of [B, H, Nq].
Fit fit(std::int64_t B, std::int64_t H, std::int64_t Nq, const RowFlags& r,
        const std::function<bool(std::int64_t, std::int64_t, std::int64_t)>& has) {
  Fit f;
  std::size_t k = 0;
  for (std::int64_t b = 0; b < B; ++b)
    for (std::int64_t h = 0; h < H; ++h)
      for (std::int64_t i = 0; i < Nq; ++i, ++k) {
        if (!r.compared[k]) continue;
        const bool in = has(b, h, i), fails = r.failing[k] != 0;
        f.with += in;
        f.without += !in;
        f.fail_with += in && fails;
        f.all = f.all && (in || !fails);
      }
  return f;
}


// ---- paged KV caches

struct Paged {
  const Case& c;
  const PagedKv& p;
  const RowFlags& r;
  std::int64_t P;
  explicit Paged(const Case& cc, const RowFlags& rr) : c(cc), p(*cc.paged), r(rr), P(cc.paged->page_size) {}

  std::int64_t page(std::int64_t b, std::int64_t m) const {
    return p.block_table[static_cast<std::size_t>(b * p.table_width + m)];
  }
  // The entries of its block table that batch b uses, 0..used(b) - 1.
  std::int64_t used(std::int64_t b) const { return (c.key_length(b) + P - 1) / P; }
  // The entries row (b, i) reads: those of its keys key_range(b, i) (empty: first > last).
  std::pair<std::int64_t, std::int64_t> entries(std::int64_t b, std::int64_t i) const {
    const auto kr = c.key_range(b, i);
    if (kr.first > kr.last) return {0, -1};
    return {kr.first / P, kr.last / P};
  }
  std::string entry(std::int64_t b, std::int64_t m) const {
    return "batch " + std::to_string(b) + " entry " + std::to_string(m) + " -> page " + std::to_string(page(b, m));
  }
  // The batches with a failing row.
  std::vector<std::int64_t> failing_batches() const {
    std::vector<std::int64_t> v;
    const auto per = static_cast<std::size_t>(c.Hq * c.Nq);
    for (std::int64_t b = 0; b < c.B; ++b)
      for (std::size_t k = 0; k < per; ++k)
        if (r.failing[static_cast<std::size_t>(b) * per + k]) {
          v.push_back(b);
          break;
        }
    return v;
  }
  Fit fit_rows(const std::function<bool(std::int64_t, std::int64_t)>& has) const {
    return fit(c.B, c.Hq, c.Nq, r, [&](std::int64_t b, std::int64_t, std::int64_t i) { return has(b, i); });
  }

  struct Candidate {
    std::string name;
    Fit f;
    std::string text;
  };

  // The candidates that hold, most specific (fewest rows) first.
  std::vector<Candidate> candidates() const {
    std::vector<Candidate> out;
    const auto fb = failing_batches();
    auto add = [&](std::string name, const Fit& f, const std::function<std::string()>& text) {
      if (f.holds()) out.push_back({std::move(name), f, text()});
    };
    // the partly filled last page, and the last page
    const Fit partial = fit_rows([&](std::int64_t b, std::int64_t i) {
      const std::int64_t lk = c.key_length(b);
      return lk % P != 0 && entries(b, i).second == used(b) - 1;
    });
    add("paged_partial_last_page", partial, [&] {
      std::vector<std::string> v;
      for (auto b : fb)
        v.push_back(entry(b, used(b) - 1) + " (" + std::to_string(c.key_length(b) % P) + " of " + std::to_string(P) +
                    " slots used)");
      return "failures only in rows that read the partly filled last page of their block table: " + list(v) + " " +
             partial.counts("reading such a page") +
             ": check the page a row's last key reads and the slot count there (seqlens_k mod " + std::to_string(P) + ")";
    });
    // the same, of rows of more than one page (a kernel that takes the entry before it)
    const Fit partial_later = fit_rows([&](std::int64_t b, std::int64_t i) {
      const std::int64_t lk = c.key_length(b);
      return lk % P != 0 && used(b) > 1 && entries(b, i).second == used(b) - 1;
    });
    add("paged_partial_last_page", partial_later, [&] {
      std::vector<std::string> v;
      for (auto b : fb)
        v.push_back(entry(b, used(b) - 1) + " (" + std::to_string(c.key_length(b) % P) + " of " + std::to_string(P) +
                    " slots used)");
      return "failures only in rows that read the partly filled last page of a block table of several pages: " + list(v) +
             " " + partial_later.counts("reading such a page") +
             ": check the page a row's last key reads and the slot count there (seqlens_k mod " + std::to_string(P) + ")";
    });
    const Fit last = fit_rows([&](std::int64_t b, std::int64_t i) { return entries(b, i).second == used(b) - 1; });
    add("paged_last_page", last, [&] {
      std::vector<std::string> v;
      for (auto b : fb) v.push_back(entry(b, used(b) - 1));
      return "failures only in rows that read the last page of their block table: " + list(v) + " " +
             last.counts("reading it") + ": check the page of a row's last key (entry (seqlens_k - 1) / " +
             std::to_string(P) + ")";
    });
    // entries that differ from batch 0's: a row read through batch 0's table
    if (c.B > 1) {
      auto differs = [&](std::int64_t b, std::int64_t m) { return b != 0 && (m >= used(0) || page(b, m) != page(0, m)); };
      const Fit t0 = fit_rows([&](std::int64_t b, std::int64_t i) {
        const auto [m0, m1] = entries(b, i);
        for (std::int64_t m = m0; m <= m1; ++m)
          if (differs(b, m)) return true;
        return false;
      });
      add("paged_table_row0", t0, [&] {
        std::vector<std::string> v;
        for (auto b : fb)
          for (std::int64_t m = 0; m < used(b); ++m)
            if (differs(b, m)) {
              v.push_back(entry(b, m) + (m < used(0) ? " where batch 0's is page " + std::to_string(page(0, m))
                                                      : " past batch 0's " + plural(used(0), "entry", "entries")));
              break;
            }
        return "failures only in rows that read block-table entries other than batch 0's: " + list(v) + " " +
               t0.counts("reading such entries") + ": check that each batch row reads its own row of block_table";
      });
    }
    // pages used by more than one batch row (or twice by one), and single physical pages
    std::map<std::int64_t, std::vector<std::pair<std::int64_t, std::int64_t>>> users;  // page -> (b, entry)
    for (std::int64_t b = 0; b < c.B; ++b)
      for (std::int64_t m = 0; m < used(b); ++m) users[page(b, m)].emplace_back(b, m);
    auto where = [&](std::int64_t x) {
      std::vector<std::string> v;
      for (const auto& [b, m] : users[x])
        v.push_back("batch " + std::to_string(b) + " entry " + std::to_string(m) +
                    (m == used(b) - 1 ? (c.key_length(b) % P ? ", its last, " + std::to_string(c.key_length(b) % P) + " of " +
                                                                   std::to_string(P) + " slots used"
                                                             : ", its last")
                                      : ""));
      return "page " + std::to_string(x) + " (" + list(v, 3, "; ") + ")";
    };
    auto reads = [&](std::int64_t b, std::int64_t i, const std::function<bool(std::int64_t)>& pick) {
      const auto [m0, m1] = entries(b, i);
      for (std::int64_t m = m0; m <= m1; ++m)
        if (pick(page(b, m))) return true;
      return false;
    };
    const Fit shared = fit_rows([&](std::int64_t b, std::int64_t i) { return reads(b, i, [&](std::int64_t x) { return users[x].size() > 1; }); });
    add("paged_shared_page", shared, [&] {
      std::vector<std::string> v;
      for (const auto& [x, u] : users)
        if (u.size() > 1 && std::any_of(u.begin(), u.end(), [&](const auto& e) { return std::find(fb.begin(), fb.end(), e.first) != fb.end(); }))
          v.push_back(where(x));
      return "failures only in rows that read a page shared between block-table entries: " + list(v, 3) + " " +
             shared.counts("reading one") + ": check that a shared page is read, not written or freed, by each row";
    });
    // a physical page all failing rows read: only when it says more than the batch (two batch
    // rows read it, or rows of its batch that do not read it pass)
    std::set<std::int64_t> common;
    bool first = true;
    std::size_t k = 0;
    for (std::int64_t b = 0; b < c.B; ++b)
      for (std::int64_t h = 0; h < c.Hq; ++h)
        for (std::int64_t i = 0; i < c.Nq; ++i, ++k) {
          if (!r.compared[k] || !r.failing[k] || (!first && common.empty())) continue;
          std::set<std::int64_t> mine;
          const auto [m0, m1] = entries(b, i);
          for (std::int64_t m = m0; m <= m1; ++m) mine.insert(page(b, m));
          if (first) common = std::move(mine);
          else std::erase_if(common, [&](std::int64_t x) { return !mine.count(x); });
          first = false;
        }
    for (const std::int64_t x : common) {
      const Fit f = fit_rows([&](std::int64_t b, std::int64_t i) { return reads(b, i, [&](std::int64_t y) { return y == x; }); });
      std::set<std::int64_t> batches;
      for (const auto& e : users[x]) batches.insert(e.first);
      if (batches.size() < 2) {
        const std::int64_t b = *batches.begin();
        const Fit whole = fit_rows([&](std::int64_t bb, std::int64_t) { return bb == b; });
        if (whole.with == f.with) continue;  // the whole batch: one_batch says it
      }
      // read at one entry m by every row that reaches m: the rows' lengths say as much
      std::set<std::int64_t> at;
      for (const auto& e : users[x]) at.insert(e.second);
      if (at.size() == 1) {
        const std::int64_t m = *at.begin();
        const Fit reach = fit_rows([&](std::int64_t b, std::int64_t i) {
          const auto [m0, m1] = entries(b, i);
          return m0 <= m && m <= m1;
        });
        if (reach.with == f.with) continue;
      }
      add("paged_page", f, [&] {
        return "failures only in rows that read " + where(x) + " " + f.counts("reading it") +
               ": check what the kernel reads from, or wrote to, that page";
      });
    }
    // a page boundary: keys on both sides of one
    const Fit cross = fit_rows([&](std::int64_t b, std::int64_t i) {
      const auto [m0, m1] = entries(b, i);
      return m1 > m0;
    });
    // only when a failing row crosses exactly one boundary (else longer rows fail, not crossing ones)
    bool one = false;
    k = 0;
    for (std::int64_t b = 0; b < c.B; ++b)
      for (std::int64_t h = 0; h < c.Hq; ++h)
        for (std::int64_t i = 0; i < c.Nq; ++i, ++k)
          if (r.compared[k] && r.failing[k]) {
            const auto [m0, m1] = entries(b, i);
            one = one || m1 == m0 + 1;
          }
    if (one) add("paged_page_boundary", cross, [&] {
      std::vector<std::string> v;
      for (auto b : fb)
        if (used(b) > 1) v.push_back("batch " + std::to_string(b) + ": entry 0 -> page " + std::to_string(page(b, 0)) +
                                     ", entry 1 -> page " + std::to_string(page(b, 1)));
      return "failures only in rows whose keys cross a page boundary (page size " + std::to_string(P) + "; " + list(v, 2) +
             ") " + cross.counts("crossing one") + ": check the page and slot of the keys next to a boundary (key j: entry j / " +
             std::to_string(P) + ", slot j mod " + std::to_string(P) + ")";
    });
    std::stable_sort(out.begin(), out.end(), [](const Candidate& a, const Candidate& b) { return a.f.with < b.f.with; });
    return out;
  }

  // Failing weights (at allowed keys) all at slot 0 of a page past the row's first, or all at
  // the page's last slot.
  void slots(const Diagnosis& d, std::int64_t elements, std::vector<Finding>& out) const {
    if (P < 2) return;  // every key is at slot 0
    std::int64_t n = 0, at0 = 0, atl = 0;
    std::vector<std::string> first0, firstl;
    for (const auto& e : d.failed) {
      if (e.tensor != 1 || e.h < 0 || e.j < 0 || !c.allowed(e.b, e.h, e.i, e.j)) continue;
      ++n;
      const std::string w = entry(e.b, e.j / P) + " (key " + std::to_string(e.j) + ")";
      if (e.j % P == 0 && e.j > 0) {
        ++at0;
        if (first0.size() < 3 && std::find(first0.begin(), first0.end(), w) == first0.end()) first0.push_back(w);
      }
      if (e.j % P == P - 1) {
        ++atl;
        if (firstl.size() < 3 && std::find(firstl.begin(), firstl.end(), w) == firstl.end()) firstl.push_back(w);
      }
    }
    if (n == 0) return;
    if (at0 == n)
      out.push_back({"paged_slot_first",
                     "the " + plural(n, "failing weight lies", "failing weights lie") + " at slot 0 of a page past the first (" +
                         list(first0, 3) + "): check the page of a page's first key (entry j / " + std::to_string(P) + ")",
                     elements});
    else if (atl == n)
      out.push_back({"paged_slot_last",
                     "the " + plural(n, "failing weight lies", "failing weights lie") + " at the last slot " + std::to_string(P - 1) +
                         " of a page (" + list(firstl, 3) + "): check the page of a page's last key",
                     elements});
  }
};

}  // namespace

std::vector<Finding> paged_findings(const Case& c, const RowFlags& rows, const Diagnosis& d) {
  std::vector<Finding> out;
  if (!c.paged || c.paged->page_size < 1 || d.failed_total == 0) return out;
  Paged p(c, rows);
  p.slots(d, d.failed_total, out);
  // the most specific kind of page, and those that fit the same number of rows (the data cannot
  // tell them apart)
  const auto cands = p.candidates();
  for (const auto& x : cands)
    if (x.f.with == cands.front().f.with && (out.empty() || out.back().name != x.name)) out.push_back({x.name, x.text, d.failed_total});
  return out;
}

}  // namespace attnoracle::conformance

// ---- split-KV

namespace attnoracle::conformance {
namespace {

// Per row (b, h, i) of [B, Hq, Nq] and split s: whether the split holds an allowed key of the row.
std::vector<std::vector<char>> split_keys(const Case& c) {
  const std::int64_t S = c.splits(), n = c.kv_split_size;
  std::vector<std::vector<char>> has(static_cast<std::size_t>(S), std::vector<char>(static_cast<std::size_t>(c.B * c.Hq * c.Nq)));
  std::size_t k = 0;
  for (std::int64_t b = 0; b < c.B; ++b)
    for (std::int64_t h = 0; h < c.Hq; ++h)
      for (std::int64_t i = 0; i < c.Nq; ++i, ++k) {
        const auto kr = c.key_range(b, i);
        for (std::int64_t j = kr.first; j <= kr.last; ++j)
          if (c.allowed_in_range(b, h, i, j)) has[static_cast<std::size_t>(j / n)][k] = 1;
      }
  return has;
}

std::string keys_of(const Case& c, std::int64_t s) {
  const std::int64_t lo = s * c.kv_split_size, hi = std::min(c.Nk, lo + c.kv_split_size) - 1;
  return "split " + std::to_string(s) + " (keys " + std::to_string(lo) + ".." + std::to_string(hi) + ")";
}
std::string row_name(const Case& c, std::size_t k) {
  const auto r = static_cast<std::int64_t>(k);
  return "batch " + std::to_string(r / c.Nq / c.Hq) + " head " + std::to_string(r / c.Nq % c.Hq) + " query " +
         std::to_string(r % c.Nq);
}

}  // namespace

std::vector<Finding> empty_split_rows(const Case& c, const RowFlags& rows, std::int64_t elements) {
  std::vector<Finding> out;
  if (c.kv_split_size < 1 || c.splits() < 2) return out;
  const auto has = split_keys(c);
  const std::int64_t S = c.splits();
  auto row_index = [&](std::int64_t b, std::int64_t h, std::int64_t i) { return static_cast<std::size_t>((b * c.Hq + h) * c.Nq + i); };
  auto with_keys = [&](std::size_t k) {
    std::int64_t n = 0;
    for (std::int64_t s = 0; s < S; ++s) n += has[static_cast<std::size_t>(s)][k];
    return n;
  };
  const Fit empty = fit(c.B, c.Hq, c.Nq, rows, [&](auto b, auto h, auto i) { return with_keys(row_index(b, h, i)) < S; });
  const Fit spans = fit(c.B, c.Hq, c.Nq, rows, [&](auto b, auto h, auto i) { return with_keys(row_index(b, h, i)) > 1; });
  // an example: the first failing row and its empty splits
  std::string example;
  for (std::size_t k = 0; k < rows.failing.size() && example.empty(); ++k) {
    if (!rows.compared[k] || !rows.failing[k]) continue;
    std::vector<std::string> v;
    for (std::int64_t s = 0; s < S; ++s)
      if (!has[static_cast<std::size_t>(s)][k]) v.push_back(keys_of(c, s));
    example = row_name(c, k) + ": " + list(v, 2);
  }
  // nine in ten: rows of distinct lengths have empty splits, and other bugs fail some of them
  if (empty.holds(0.9) && (!spans.holds(0.9) || empty.with <= spans.with)) {
    out.push_back({"split_empty_rows",
                   "failures only in rows with an empty split, one without an allowed key of the row (" + example + ") " +
                       empty.counts("with one") +
                       ": an empty split must give O_s = 0 and lse_s = -inf, and the merge must weigh it 0",
                   elements});
  } else if (spans.holds(0.9)) {
    out.push_back({"split_spanning_rows",
                   "failures only in rows whose allowed keys lie in more than one split of " + std::to_string(c.kv_split_size) +
                       " keys " + spans.counts("with keys in several splits") +
                       ": check the keys each split visits (none twice, none left out) and the merge of the splits",
                   elements});
  }
  return out;
}

std::vector<Finding> split_findings(const Case& c, const SplitFailures& f) {
  std::vector<Finding> out;
  const std::int64_t S = c.splits();
  if (S < 1 || static_cast<std::int64_t>(f.failing.size()) != S) return out;
  const auto has = split_keys(c);
  const std::size_t R = has.empty() ? 0 : has[0].size();
  // lse_partial's -inf where a split has no key
  if (!f.inf_mismatch.empty()) {
    std::int64_t at_empty = 0, at_keyed = 0, empty = 0;
    std::vector<std::string> ex;
    for (std::int64_t s = 0; s < S; ++s)
      for (std::size_t k = 0; k < R; ++k) {
        const auto b = static_cast<std::int64_t>(k) / c.Nq / c.Hq, i = static_cast<std::int64_t>(k) % c.Nq;
        if (!c.query_valid(b, i)) continue;
        const bool keyed = has[static_cast<std::size_t>(s)][k] != 0, bad = f.inf_mismatch[static_cast<std::size_t>(s)][k] != 0;
        empty += !keyed;
        at_empty += bad && !keyed;
        at_keyed += bad && keyed;
        if (bad && ex.size() < 2) ex.push_back(keys_of(c, s) + " of " + row_name(c, k));
      }
    const std::string v = f.inf_mismatch_nan ? "NaN, not -inf," : "not -inf (" + fmt_g(f.inf_mismatch_example) + " at the first)";
    if (at_empty > 0 && at_keyed == 0) {
      out.push_back({"split_empty_lse",
                     "lse_partial is " + v + " in " + std::to_string(at_empty) + " of the " +
                         std::to_string(empty) + " (split, row) pairs without an allowed key (" + list(ex, 2) +
                         (f.inf_mismatch_nan ? "): a split with no key must give O_s = 0 and lse_s = -inf (no exp(-inf - -inf), no 0 / 0)"
                                             : "): check the keys a split visits (split s: keys s * " + std::to_string(c.kv_split_size) +
                                                   " to (s + 1) * " + std::to_string(c.kv_split_size) + " - 1) and its -inf where none is allowed"),
                     at_empty});
    } else if (at_keyed > 0 && at_empty == 0) {
      out.push_back({"split_keyed_neginf",
                     "lse_partial is -inf in " + plural(at_keyed, "(split, row) pair", "(split, row) pairs") +
                         " that have allowed keys (" + list(ex, 2) + "): the split's keys were left out",
                     at_keyed});
    }
  }
  // the splits that fail
  std::vector<std::int64_t> bad;
  std::int64_t elements = 0;
  for (std::int64_t s = 0; s < S; ++s)
    if (f.elements[static_cast<std::size_t>(s)] > 0) bad.push_back(s), elements += f.elements[static_cast<std::size_t>(s)];
  if (bad.empty() || std::any_of(f.failing.begin(), f.failing.end(), [&](const auto& v) { return v.size() != R; })) return out;
  if (static_cast<std::int64_t>(bad.size()) < S) {
    std::vector<std::string> v;
    for (auto s : bad) v.push_back(keys_of(c, s));
    out.push_back({bad.size() == 1 ? "one_split" : "some_splits",
                   "failures in the partial states only in " + list(v, 4) + " of " + std::to_string(S) +
                       " splits; the other splits pass",
                   elements});
  }
  // (split, row) pairs of valid queries: those without a key in the split, those whose row
  // allows the key just past, or just before, the split
  auto pairs = [&](const std::function<bool(std::int64_t, std::size_t)>& in) {
    Fit r;
    for (std::int64_t s = 0; s < S; ++s)
      for (std::size_t k = 0; k < R; ++k) {
        const auto b = static_cast<std::int64_t>(k) / c.Nq / c.Hq, i = static_cast<std::int64_t>(k) % c.Nq;
        if (!c.query_valid(b, i)) continue;
        const bool x = in(s, k), fails = f.failing[static_cast<std::size_t>(s)][k] != 0;
        r.with += x, r.without += !x, r.fail_with += x && fails;
        r.all = r.all && (x || !fails);
      }
    return r;
  };
  auto allows = [&](std::size_t k, std::int64_t j) {
    const auto r = static_cast<std::int64_t>(k);
    const std::int64_t b = r / c.Nq / c.Hq, h = r / c.Nq % c.Hq, i = r % c.Nq;
    return j >= 0 && j < c.Nk && c.allowed(b, h, i, j);
  };
  const std::int64_t n = c.kv_split_size;
  auto keyed = [&](std::int64_t s, std::size_t k) { return has[static_cast<std::size_t>(s)][k] != 0; };
  const Fit empty = pairs([&](std::int64_t s, std::size_t k) { return !keyed(s, k); });
  const Fit after = pairs([&](std::int64_t s, std::size_t k) { return keyed(s, k) && allows(k, (s + 1) * n); });
  const Fit before = pairs([&](std::int64_t s, std::size_t k) { return keyed(s, k) && allows(k, s * n - 1); });
  auto counts = [](const Fit& x) {
    return "(" + std::to_string(x.fail_with) + " of the " + std::to_string(x.with) + " such (split, row) pairs fail; the " +
           std::to_string(x.without) + " other pairs pass)";
  };
  if (empty.holds(0.9)) {
    std::string ex;
    for (std::int64_t s = 0; s < S && ex.empty(); ++s)
      for (std::size_t k = 0; k < R && ex.empty(); ++k)
        if (f.failing[static_cast<std::size_t>(s)][k]) ex = keys_of(c, s) + " of " + row_name(c, k);
    out.push_back({"split_empty_partials",
                   "failures in the partial states only where the split has no allowed key of the row (" + ex + ") " +
                       counts(empty) + ": such a split must give O_s = 0 and lse_s = -inf (no exp(-inf - -inf), no 0 / 0)",
                   elements});
  } else if (after.holds() && (!before.holds() || after.with <= before.with)) {
    out.push_back({"split_next_key",
                   "failures in the partial states only where the row allows the key just past the split (key " +
                       std::to_string(n) + " for split 0, key " + std::to_string(2 * n) + " for split 1, ...) " + counts(after) +
                       ": check the split's last key (split s ends before key (s + 1) * " + std::to_string(n) + ")",
                   elements});
  } else if (before.holds()) {
    out.push_back({"split_previous_key",
                   "failures in the partial states only where the row allows the key just before the split (key " +
                       std::to_string(n - 1) + " for split 1, ...) " + counts(before) +
                       ": check the split's first key (split s starts at key s * " + std::to_string(n) + ")",
                   elements});
  }
  return out;
}

}  // namespace attnoracle::conformance

// ---- kind merge

namespace attnoracle::conformance {

std::optional<Finding> lse_without_sink(const Case& c, const RowFlags& rows,
                                        const std::function<double(std::int64_t, std::size_t)>& split_lse, std::int64_t S,
                                        const RawTensor* lse, std::int64_t elements) {
  if (!c.sinks || !lse || lse->shape != std::vector<std::int64_t>{c.B, c.Hq, c.Nq} || rows.failing.size() != lse->data.size() / dtype_size(lse->dtype))
    return std::nullopt;
  std::int64_t n = 0, fits = 0;
  for (std::size_t k = 0; k < rows.failing.size(); ++k) {
    if (!rows.compared[k] || !rows.failing[k]) continue;
    ++n;
    // log sum exp(lse_s) over the splits alone
    double t = -INFINITY, sum = 0;
    for (std::int64_t s = 0; s < S; ++s) t = std::max(t, split_lse(s, k));
    for (std::int64_t s = 0; s < S && t != -INFINITY; ++s) sum += std::exp(split_lse(s, k) - t);
    const double without = t == -INFINITY ? -INFINITY : t + std::log(sum);
    const double y = decode_float(lse->dtype, lse->data.data() + k * dtype_size(lse->dtype));
    // within 1e-3: far above an F32 merge's rounding, below the sink's term where it matters
    fits += y == without || std::fabs(y - without) <= 1e-3 * std::max(1.0, std::fabs(without));
  }
  if (n == 0 || fits < n) return std::nullopt;
  return Finding{"lse_without_sink",
                 "lse of the " + plural(n, "failing row is", "failing rows are") +
                     " the merge of the splits without the sink (log sum exp(lse_s), to 1e-3): add exp(sinks[h]) to the denominator",
                 elements};
}

std::vector<Finding> merge_findings(const Case& m, const RowFlags& rows, const RawTensor* lse, std::int64_t elements) {
  std::vector<Finding> out;
  const std::int64_t S = m.Nk, R = m.B * m.Hq * m.Nq;
  if (S < 1 || static_cast<std::int64_t>(rows.failing.size()) != R ||
      static_cast<std::int64_t>(m.lse_partial.values.size()) != S * R)
    return out;
  // +inf as written (read as -inf under attn.lse_posinf=empty)
  const RawTensor* raw = m.file.find("lse_partial");
  auto split_lse = [&](std::int64_t s, std::int64_t k) { return m.lse_partial.values[static_cast<std::size_t>(s * R + k)]; };
  auto written_posinf = [&](std::int64_t s, std::int64_t k) {
    return m.lse_posinf_empty && raw && decode_float(raw->dtype, raw->data.data() + static_cast<std::size_t>(s * R + k) * dtype_size(raw->dtype)) == INFINITY;
  };
  std::vector<std::int64_t> empty(static_cast<std::size_t>(R)), posinf(static_cast<std::size_t>(R));
  std::vector<double> top(static_cast<std::size_t>(R), -INFINITY);
  for (std::int64_t s = 0; s < S; ++s)
    for (std::int64_t k = 0; k < R; ++k) {
      const double x = split_lse(s, k);
      empty[static_cast<std::size_t>(k)] += x == -INFINITY;
      posinf[static_cast<std::size_t>(k)] += written_posinf(s, k);
      top[static_cast<std::size_t>(k)] = std::max(top[static_cast<std::size_t>(k)], x);
    }
  auto at = [&](std::int64_t b, std::int64_t h, std::int64_t i) { return static_cast<std::size_t>((b * m.Hq + h) * m.Nq + i); };
  struct Cand {
    const char* name;
    Fit f;
    std::string text;
  };
  std::vector<Cand> cands;
  auto add = [&](const char* name, const Fit& f, const std::string& what, const std::string& then) {
    if (f.holds()) cands.push_back({name, f, "failures only in rows " + what + " " + f.counts(nullptr) + ": " + then});
  };
  add("merge_all_empty", fit(m.B, m.Hq, m.Nq, rows, [&](auto b, auto h, auto i) { return empty[at(b, h, i)] == S; }),
      "whose every split is empty (lse_s -inf)", "such a row has out 0 and lse -inf (the sink's alone with a sink)");
  add("merge_posinf_split", fit(m.B, m.Hq, m.Nq, rows, [&](auto b, auto h, auto i) { return posinf[at(b, h, i)] > 0; }),
      "with a split whose lse_s is written +inf (attn.lse_posinf=empty: an empty split)",
      "read +inf as an empty split, weight 0, and leave its O_s out");
  add("merge_neginf_split", fit(m.B, m.Hq, m.Nq, rows, [&](auto b, auto h, auto i) { return empty[at(b, h, i)] > 0; }),
      "with an empty split (lse_s -inf)",
      "give an empty split weight 0 without computing exp(-inf - max) with max -inf, or 0 x its O_s (NaN, inf)");
  if (m.sinks)
    add("merge_sink_dominates",
        fit(m.B, m.Hq, m.Nq, rows, [&](auto b, auto h, auto i) { return m.sink(h) > top[at(b, h, i)]; }),
        "whose sink lies above every split's lse_s", "check the sink's term exp(sink - max) in the denominator");
  std::stable_sort(cands.begin(), cands.end(), [](const Cand& a, const Cand& b) { return a.f.with < b.f.with; });
  if (!cands.empty()) out.push_back({cands.front().name, cands.front().text, elements});
  if (m.sinks)
    if (auto f = lse_without_sink(m, rows, [&](std::int64_t s, std::size_t k) { return split_lse(s, static_cast<std::int64_t>(k)); }, S, lse, elements))
      out.push_back(std::move(*f));
  return out;
}

}  // namespace attnoracle::conformance
