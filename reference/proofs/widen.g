# The final widening of a ball into an interval (fast_row.hpp lower() / upper()):
#   s = radius_up(rad + kEndRel * (mag(mid) + rad)); lower = add(mid, -s), upper = add(mid, s),
# add being DWPlusFP, relative error at most kAddFP (published, see docs/PROOFS.md).
# Claim: lower <= mid - rad and upper >= mid + rad (so [lower, upper] holds the exact value).
# By radius.g, s >= rad + kEndRel (M + rad) with M = mag(mid) >= |mid| (ball.g); write
# s = rad + kEndRel (M + rad) + w with w >= 0. The claim is homogeneous (scale mid, rad, M, s
# by the same positive factor), so normalise M + rad = 1: rad = rho, M = 1 - rho,
# mid = M mu with |mu| <= 1. Then
#   (mid - rad) - lower = (s - rad)(1 + e) + (rad - mid) e,  e the DWPlusFP error,
# which is >= kEndRel (1 - k) - 2k >= 0 for |e| <= k = kAddFP (and symmetrically for upper).
# (rad = 0 returns mid itself; M + rad = 0 is that case.)
# The goals are proven with the header's kAddFP (they fail for kAddFP = 2^-102).
# covers: kEndRel * (1 - kAddFP) >= 2 * kAddFP
# code: fast_row.hpp: const double s = radius_up(b.rad + kEndRel * (mag(b.mid) + b.rad));
# code: fast_row.hpp: return fast::add(b.mid, -s);
# code: fast_row.hpp: return fast::add(b.mid, s);
#@-Eprecision=200
M = 1 - rho;
mid = M * mu;
s = rho + @kEndRel@ * (M + rho) + w;
lower = (mid - s) * (1 + e);
upper = (mid + s) * (1 + f);
{ rho in [0, 1] /\ mu in [-1, 1] /\ w in [0, 0x1p1000]
  /\ e in [-@kAddFP@, @kAddFP@] /\ f in [-@kAddFP@, @kAddFP@]
  -> (mid - rho) - lower >= 0 /\ upper - (mid + rho) >= 0 }
(mid - rho) - lower -> (s - rho) * (1 + e) + (rho - mid) * e;
upper - (mid + rho) -> (s - rho) * (1 + f) + (mid + rho) * f;
s - rho -> @kEndRel@ + w;
