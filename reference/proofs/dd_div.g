# DWDivDW2 as dd.hpp codes it (div(DD, DD)):
#   th = xh / yh; (rh, rl) = y * th with DWTimesFP3 (TwoProd, fma, Fast2Sum);
#   pih = xh - rh; dl = xl - rl; d = pih + dl; tl = d / yh; (zh, zl) = Fast2Sum(th, tl).
# Relative error of zh + zl against the exact quotient (xh + xl) / (yh + yl).
# Joldes, Muller and Popescu 2017 (Algorithm 17, Theorem 7.1) prove 15u^2 + 56u^3 for the
# variant with DWTimesFP1 at its second line; for the fma product (DWTimesFP3, which the code
# uses) they only remark, without a proof, that the bound changes little. This script proves the
# variant the code runs, from scratch: 12u^2 (an 8 x 8 case split; 8u^2 does not go through).
# Normalised: xh, yh in [1, 2], |xl|, |yl| <= 2^-53; signs and powers of two scale out (no
# underflow or overflow). TwoProd exact (rounding.g), Fast2Sum exact when its first operand is
# the larger (goals 3-4); pih = xh - rh is exact (Sterbenz, goal 2).
# establishes: dwdivdw2_rel = 0x1.8p-103
# covers: kDivDD >= dwdivdw2_rel
# code: dd.hpp: inline DD div(DD x, DD y) { const double th = x.hi / y.hi; const DD r = mul(y, th); const double pih = x.hi - r.hi; const double dl = x.lo - r.lo; const double d = pih + dl; const double tl = d / y.hi; return fast_two_sum(th, tl); }
# code: dd.hpp: inline DD mul(DD x, double y) { const DD c = two_prod(x.hi, y); const double cl3 = std::fma(x.lo, y, c.lo); return fast_two_sum(c.hi, cl3); }
@rnd = float<ieee_64, ne>;
xh = rnd(xh_);
xl = rnd(xl_);
yh = rnd(yh_);
yl = rnd(yl_);
th = rnd(xh / yh);
ch = rnd(yh * th);               # r = DWTimesFP3(y, th)
cl = yh * th - ch;               #   TwoProd: exact
cl3 = rnd(yl * th + cl);         #   fma
rh = rnd(ch + cl3);              #   Fast2Sum: exact
rl = ch + cl3 - rh;
pih = rnd(xh - rh);
dl = rnd(xl - rl);
d = rnd(pih + dl);
tl = rnd(d / yh);
z = th + tl;                     # Fast2Sum: exact
X = xh + xl;
Y = yh + yl;
Q = X / Y;
D = X - Y * th;                  # the exact residual
{ xh in [1, 2] /\ xl in [-0x1p-53, 0x1p-53] /\ yh in [1, 2] /\ yl in [-0x1p-53, 0x1p-53]
  -> (z - Q) / Q in [-@dwdivdw2_rel@, @dwdivdw2_rel@]
  /\ pih - (xh - rh) in [0, 0]
  /\ |cl3| <= 0x1p-50 /\ ch >= 0x1p-1
  /\ |tl| <= 0x1p-50 /\ th >= 0x1p-1 }
z - Q -> (tl - d / yh) + (d - D) / yh + D * yl / (yh * Y) { yh <> 0, Y <> 0 };
d - D -> (d - (pih + dl)) + (dl - (xl - rl)) + (pih - (xh - rh)) - (cl3 - (yl * th + cl));
D -> (xh - yh * th) + xl - yl * th;
xh - yh * th -> -yh * (th - xh / yh) { yh <> 0 };
(z - Q) / Q $ xh in 8, yh in 8;
