# The radius formulas of ball.hpp and fast_row.hpp: every radius is computed in binary64 (rounding to
# nearest) from nonnegative numbers by at most N = 15 roundings (additions, multiplications,
# divisions; the only subtraction, div's denominator, is bounded by ball.g), then passed
# through radius_up(r) = RN(RN(r (1 + kRadiusSlack)) + kRadiusFloor). docs/PROOFS.md lists each
# formula with its count (10 at most).
# Lemma. Let E >= 0 be the formula's exact value on the same (double) operands and c its
# computed value. Each rounding of a nonnegative y gives RN(y) >= y (1 - u) when y >= 2^-1021
# and RN(y) >= y - 2^-1075 below (rounding.g); a divisor's rounding gives RN(y) <= y (1 + u).
# All operations are monotone in their operands, so by induction c >= E (1 - u)^N - A, where A
# collects the absolute terms 2^-1075, amplified by the factors they are later multiplied by.
# The second rounding in radius_up() has an argument >= kRadiusFloor >= 2^-1021 (relative), so
#   radius_up(c) >= (c (1 + s)(1 - u) - 2^-1075 + F)(1 - u)
#         >= E (1 - u)^(N + 2) (1 + s) + (F - 2^-1075)(1 - u) - A (1 + s),
# which is >= E when
#   (a) (1 - u)^17 (1 + s) >= 1, i.e. s >= radius_slack_needed (goal 1: proven for that value;
#       the left side grows with s), and
#   (b) F (1 - u) >= A (1 + s) + 2^-1075.
# For (b), A <= radius_underflow_budget, a count argued in docs/PROOFS.md ("Underflow"), not
# machine-checked: a sum over n <= 2^50 keys (BallSums; P V has two) misses at most three terms 2^-1075
# per key (in the sum: an inexact fma residual in TwoProd and the fma w = e.lo v + a; in R:
# the rounding of e.rad |v|), weighted in its radius by at most 1 + 2 g < 4 (g = gamma_{n+2}
# of dot2_factors.sollya at n = 2^50): at most 2^52 terms in all; any other formula at most 15 (one per rounding). A term that is then
# added to a radius carrying kRadiusFloor or kExpRel, before any division or multiplication
# (div's numerator, exp's sum), is below 2^-54 of that sum: it counts as one more relative
# rounding, not as an absolute term. Budget: (2^52 + 2^13) 2^-1075, with room.
# n <= 2^50: 2^50 keys are 8 PiB of keys even at Dk = 1.
# establishes: radius_slack_needed = 0x1.2p-49
# establishes: radius_underflow_budget = (2^52 + 2^13) * 2^-1075
# covers: kRadiusSlack >= radius_slack_needed
# covers: kRadiusFloor * (1 - u) >= radius_underflow_budget * (1 + kRadiusSlack) + 2^-1075
# covers: kRadiusFloor >= 2^-1021
# code: ball.hpp: inline double radius_up(double r) { return r * (1 + kRadiusSlack) + kRadiusFloor; }
# code: ball.hpp: return {m, radius_up(a.rad + b.rad + kAddDD * mag(m))};
# code: ball.hpp: return {m, radius_up(a.rad + kAddFP * mag(m))};
# code: ball.hpp: return {m, radius_up(a.rad * std::fabs(y) + kMulFP * mag(m))};
# code: ball.hpp: return {m, radius_up(mag(a.mid) * b.rad + mag(b.mid) * a.rad + a.rad * b.rad + kMulDD * mag(m))};
# code: ball.hpp: return {m, radius_up((a.rad + q * b.rad) / den + kDivDD * mag(m))};
# code: ball.hpp: return {m, radius_up(e * (a.rad * (1 + a.rad) + kExpRel))};
# code: ball.hpp: return {two_sum(sh, sl), radius_up(dot_factor * sabs)};
# code: ball.hpp: return {two_sum(hi_[c], lo_[c]), radius_up((radsum_[c] + kU * errsum_[c]) * (1 + 2 * gk))};
# code: fast_row.cpp: const double rad = radius_up(factor * sum_abs + w.zero_count * w.zero_rad * r.absmax[ci]);
# code: fast_row.hpp: const double s = radius_up(b.rad + kEndRel * (mag(b.mid) + b.rad));
#@-Eprecision=300
v = 1 - 0x1p-53;
v17 = v * v * v * v * v * v * v * v * v * v * v * v * v * v * v * v * v;
{ v17 * (1 + @radius_slack_needed@) - 1 >= 0 }
