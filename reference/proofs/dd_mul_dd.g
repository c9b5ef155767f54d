# DWTimesDW3 (dd.hpp mul(DD, DD); Joldes, Muller, Popescu 2017, Algorithm 12):
#   (ch, cl) = TwoProd(xh, yh); tl0 = xl yl; tl1 = fma(xh, yl, tl0); cl2 = fma(xl, yh, tl1);
#   cl3 = cl + cl2; (zh, zl) = Fast2Sum(ch, cl3).
# Relative error of zh + zl against the exact product (xh + xl)(yh + yl).
# Normalised: xh, yh in [1, 2], |xl|, |yl| <= 2^-53 (half an ulp of the high parts); signs and
# powers of two scale out (no underflow or overflow). TwoProd exact (rounding.g); Fast2Sum
# exact as |ch| >= 1 >= |cl3| (second goal).
# Published bounds: 5u^2 (JMP 2017), improved to 4u^2 by Muller and Rideau 2022 (Coq). Gappa
# proves 5.5u^2 here with a 16 x 16 case split: above 5u^2 = 2^-103.68, below kMulDD.
# establishes: dwtimesdw3_rel = 0x1.6p-104
# covers: kMulDD >= dwtimesdw3_rel
# code: dd.hpp: inline DD mul(DD x, DD y) { const DD c = two_prod(x.hi, y.hi); const double tl0 = x.lo * y.lo; const double tl1 = std::fma(x.hi, y.lo, tl0); const double cl2 = std::fma(x.lo, y.hi, tl1); const double cl3 = c.lo + cl2; return fast_two_sum(c.hi, cl3); }
@rnd = float<ieee_64, ne>;
xh = rnd(xh_);
xl = rnd(xl_);
yh = rnd(yh_);
yl = rnd(yl_);
ch = rnd(xh * yh);
cl = xh * yh - ch;               # TwoProd: exact
tl0 = rnd(xl * yl);
tl1 = rnd(xh * yl + tl0);        # fma
cl2 = rnd(xl * yh + tl1);        # fma
cl3 = rnd(cl + cl2);
z = ch + cl3;                    # Fast2Sum: exact
P = (xh + xl) * (yh + yl);
{ xh in [1, 2] /\ xl in [-0x1p-53, 0x1p-53] /\ yh in [1, 2] /\ yl in [-0x1p-53, 0x1p-53]
  -> (z - P) / P in [-@dwtimesdw3_rel@, @dwtimesdw3_rel@]
  /\ |cl3| <= 0x1p-50 /\ ch >= 1 }
z - P -> (cl3 - (cl + cl2)) + (cl2 - (xl * yh + tl1)) + (tl1 - (xh * yl + tl0)) + (tl0 - xl * yl);
(z - P) / P $ xh in 16, yh in 16;
