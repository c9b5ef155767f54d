# The helpers of the ball operations (ball.hpp).
#   mag(x) = |x.hi| * (1 + kMagRel) must bound |x.hi + x.lo| with room. Normalised x.hi = h in
#   [1, 2] (a normal double; signs and powers of two scale out), |x.lo| <= 2^-53:
#   (1) mag - h >= 2^-52 (one ulp: the product h (1 + 2^-52) is at least h + 2^-52, a double);
#   (2) hence mag >= |x| (1 + 2^-55). Where the code writes mag(m) * (1 + 0x1p-80) (exp) or
#       mag(m) * (1 + kDivQuotient) (div), those factors are exactly 1 in binary64 (goal 3): the
#       bound |exact| <= |m| / (1 - k) <= |m| (1 + 2^-55) <= mag(m) rests on (2) instead, which
#       needs k <= 2^-56 for the operation's relative error k (covers lines below).
#   (4) div's denominator: t1 = RN(|bh| (1 - kMagRel)) <= |bh + bl| for a normal bh, so with
#       den = RN(t1 - rb): den <= (t1 - rb)(1 + u) <= (|b| - rb)(1 + u) (goal 5, REL), and
#       den > 0 when the caller's check bh > 2 rb holds (goal 6).
# (Subnormal x.hi: mag can fall short of |x|; every radius then gets kRadiusFloor, far above
# the absolute error of any double-double operation on such numbers: see radius.g.)
# covers: kAddFP <= 2^-56
# covers: kAddDD <= 2^-56
# covers: kMulFP <= 2^-56
# covers: kMulDD <= 2^-56
# covers: kDivDD <= 2^-56
# covers: kExpRel <= 2^-56
# covers: kMagRel >= 2^-52
# covers: (1 + kExpMid) * (1 - kExpRel) >= 1
# covers: (1 + kDivQuotient) * (1 - kDivDD) >= 1
# covers: kDivMargin >= 2
# code: ball.hpp: inline double mag(DD x) { return std::fabs(x.hi) * (1 + kMagRel); }
# code: ball.hpp: const double q = mag(m) * (1 + kDivQuotient);
# code: ball.hpp: const double den = std::fabs(b.mid.hi) * (1 - kMagRel) - b.rad;
# code: ball.hpp: const double e = mag(m) * (1 + kExpMid);
# code: fast_row.cpp: if (!(z.mid.hi > kDivMargin * z.rad)) return false;
#@-Eno-auto-dichotomy
@rnd = float<ieee_64, ne>;
h = rnd(h_);
c52 = rnd(1 + @kMagRel@);
mag = rnd(h * c52);
bh = rnd(bh_);
rb = rnd(rb_);
t1 = rnd(bh * rnd(1 - @kMagRel@));
den = rnd(t1 - rb);
{ h in [1, 2] /\ l in [-0x1p-53, 0x1p-53]
  /\ bh in [1, 2] /\ bl in [-0x1p-53, 0x1p-53] /\ rb >= 0 /\ bh - 2 * rb >= 0 /\ rb <= 1
  -> mag - h >= 0x1p-52
  /\ mag - (h + l) * (1 + 0x1p-55) >= 0
  /\ rnd(1 + @kExpMid@) in [1, 1] /\ rnd(1 + @kDivQuotient@) in [1, 1]
  /\ (bh + bl) - t1 >= 0
  /\ den -/ (t1 - rb) in [-0x1p-53, 0x1p-53]
  /\ den >= 0x1p-2 }
mag - h -> (mag - h * c52) + h * (c52 - 1);
mag - (h + l) * (1 + 0x1p-55) -> (mag - h) - l - (h + l) * 0x1p-55;
(bh + bl) - t1 -> (bh - t1) + bl;
bh - t1 -> bh * (1 - rnd(1 - @kMagRel@)) - (t1 - bh * rnd(1 - @kMagRel@));
t1 - rb -> (t1 - bh) + (bh - 2 * rb) / 2 + bh / 2;
mag - h $ h in (1.5, 1.9999);
