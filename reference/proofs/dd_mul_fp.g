# DWTimesFP3 (dd.hpp mul(DD, double); Joldes, Muller, Popescu 2017, Algorithm 9):
#   (ch, cl) = TwoProd(xh, y); cl3 = fma(xl, y, cl); (zh, zl) = Fast2Sum(ch, cl3).
# Relative error of zh + zl against the exact product (xh + xl) y.
# Normalised: xh, y in [1, 2] and |xl| <= ulp(xh) / 2 = 2^-53; signs and powers of two scale out
# (no underflow or overflow: the fast path's ranges, see docs/PROOFS.md). TwoProd is exact
# (rounding.g), so cl = xh y - ch; Fast2Sum is exact when |ch| >= |cl3| (Dekker; proven for
# binary floating point in Coq by Boldo, Graillat and Muller 2017), which the second goal
# shows, so zh + zl = ch + cl3.
# Published bound: 2u^2 (JMP 2017). The goal is 2^-105 (1 + 2^-28); Gappa's best enclosure is
# 2^-105 (1 + 2^-59), a hair above 2u^2 because |xl| <= 2^-53 is looser than the paper's
# hypothesis.
# establishes: dwtimesfp3_rel = 0x1.0000001p-105
# covers: kMulFP >= dwtimesfp3_rel
# code: dd.hpp: inline DD mul(DD x, double y) { const DD c = two_prod(x.hi, y); const double cl3 = std::fma(x.lo, y, c.lo); return fast_two_sum(c.hi, cl3); }
@rnd = float<ieee_64, ne>;
xh = rnd(xh_);
xl = rnd(xl_);
y = rnd(y_);
ch = rnd(xh * y);
cl = xh * y - ch;                # TwoProd: exact
cl3 = rnd(xl * y + cl);          # fma
z = ch + cl3;                    # Fast2Sum: exact
P = (xh + xl) * y;
{ xh in [1, 2] /\ xl in [-0x1p-53, 0x1p-53] /\ y in [1, 2]
  -> (z - P) / P in [-@dwtimesfp3_rel@, @dwtimesfp3_rel@]
  /\ |cl3| <= 0x1p-50 /\ ch >= 1 }
z - P -> cl3 - (xl * y + cl);
