# exp_dd's argument reduction (exp_dd.cpp): for a double-double x = xh + xl with
# kExpMin <= xh <= 8 (ball.hpp calls exp_dd only there),
#   k = nearbyint(RN(xh * 1.4426950408889634)); r = add(x, mul(LN2, -k)) (DWTimesFP3, then
#   AccurateDWPlusDW); t = scale2(r, -10).
# R = x - k ln 2 is the exact reduced argument: exp(x) = 2^k exp(R). tau = 2^10 t is r, except
# that scale2 may round r.lo when r.lo * 2^-10 is subnormal (|tau - r| <= 2^-1065).
# The DD operations are modelled by their relative error bounds, the header's kMulFP and
# kAddDD (proven by dd_mul_fp.g / published, see docs/PROOFS.md); LN2 is the code's
# double-double (the driver substitutes the values the code computes) and ln2_dd_err its
# proven error (exp_constants.sollya).
# Goals: the range of k (scale2(p, k) keeps p.hi normal for k >= -1021; exp_dd.g uses the
# lower end), |tau| (the polynomial's interval, exp_poly.sollya; the code's comment says
# |r| <= 0.3466 + 2^-40, which this implies), and |tau - R|.
# |xl| <= ulp(xh) / 2 <= 2^-44 needs |xh| < 1024: kExpMin >= -1023.
# establishes: exp_k_min = -894
# establishes: exp_reduced_abs = 0x1.62e44p-2
# establishes: exp_reduction_abs = 0x1.3fp-95
# covers: kExpMin >= -1023
# covers: exp_reduced_abs <= 0.3466 + 2^-40
# code: exp_dd.cpp: const double k = std::nearbyint(x.hi * 1.4426950408889634);
# code: exp_dd.cpp: const DD r = add(x, mul(K.ln2, -k));
# code: exp_dd.cpp: const DD t = scale2(r, -10);
# covers: kExpMax <= 8
# code: ball.hpp: inline bool exp_applies(const Ball& a) { return a.rad <= kExpMaxRad && a.mid.hi <= kExpMax; }
# code: ball.hpp: if (a.mid.hi < kExpMin) return {DD{}, kTinyExp};
@rnd = float<ieee_64, ne>;
@rint = int<ne>;
LN2 = @ln2_hi@ + @ln2_lo@;
xh = rnd(xh_);
xl = rnd(xl_);
X = xh + xl;
c = rnd(1.4426950408889634);     # the literal in exp_dd.cpp, rounded as the compiler does
kf = rnd(xh * c);
k = rint(kf);                    # nearbyint, rounding to nearest even
nk = -k;
m = mul_rel<@prec:kMulFP@>(nk, LN2);
r = add_rel<@prec:kAddDD@>(X, m);
tau = r + eta;                   # scale2's possible rounding of a subnormal low part
R = X + nk * ln2;
{ xh in [@kExpMin@, @kExpMax@] /\ xl in [-0x1p-44, 0x1p-44] /\ eta in [-0x1p-1065, 0x1p-1065]
  /\ LN2 - ln2 in [-@ln2_dd_err@, @ln2_dd_err@] /\ ln2 in [0.6931471805599453, 0.6931471805599454]
  -> k in [@exp_k_min@, 12]
  /\ |tau| <= @exp_reduced_abs@
  /\ |tau - R| <= @exp_reduction_abs@ }
R -> ln2 * ((kf - k) + (xh * c - kf)) + xh * (1 - ln2 * c) + xl;
tau - R -> (r - (X + m)) + (m - nk * LN2) + nk * (LN2 - ln2) + eta;
X + m -> R + ((m - nk * LN2) + nk * (LN2 - ln2));
