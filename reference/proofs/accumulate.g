# One step of the induction behind every data-length-dependent bound of the fast path (Dot2
# over Dk terms for q.k; the P V and bound accumulations over the allowed keys; the sums of
# |q_d k_d|, e.rad |v| and |e.hi v| that scale them). Each step adds a rounded product to a
# partial sum: s' = RN(s + RN(a b)), a, b, s doubles.
#   (1) RN(a b) = a b (1 + d1), |d1| <= u, when |a b| >= 2^-1021;
#   (2) s' = (s + RN(a b))(1 + d2), |d2| <= u, when |s + RN(a b)| >= 2^-1021, and exactly
#       s + RN(a b) below (rounding.g (3)): sums have no underflow term;
#   (3) below 2^-1021, |RN(a2 b2) - a2 b2| <= 2^-1075 (the underflow term eta of Higham's
#       model, rounding.g (2)).
# So s' = (s + a b (1 + d1) + eta)(1 + d2). Chaining n such steps gives Higham's bound
# (Accuracy and Stability of Numerical Algorithms, 2nd ed., Lemma 3.1 and Section 3.1):
#   |computed - exact| <= gamma_n sum |a_i b_i| + n eta_max (1 + gamma_n),
#   gamma_n = n u / (1 - n u), n u < 1, in any summation order;
# and Ogita, Rump and Oishi's Dot2 (SIAM J. Sci. Comput. 26(6), 2005, Theorem 5.3: before the
# final rounding, |p + s - x.y| <= gamma_n^2 sum |x_i y_i|, no underflow), whose proof is the
# same induction on TwoProd / TwoSum (exact: rounding.g) plus (1)-(2) on the error terms.
# Where these bounds are used and how their conditions are checked: docs/PROOFS.md.
# No overflow: a product of two inputs is at most kMaxInput^2, and a sum of n < 2^63 of them
# (Dk is an int64) at most 2^63 kMaxInput^2 <= 2^1023, so Dot2's partial sums, TwoSum's
# intermediates and sabs stay finite. (The scale times q.k can still overflow: that is left to
# the run-time checks, see docs/PROOFS.md.)
# establishes: step_rel = 0x1p-53
# covers: kU >= step_rel
# covers: kMaxInput * kMaxInput * 2^63 <= 2^1023
@rnd = float<ieee_64, ne>;
a = rnd(a_);
b = rnd(b_);
s = rnd(s_);
p = rnd(a * b);
sn = rnd(s + p);
a2 = rnd(a2_);
b2 = rnd(b2_);
{ |a * b| in [0x1p-1021, 0x1p1023] /\ |s + p| in [0x1p-1021, 0x1p1023]
  /\ |a2 * b2| <= 0x1p-1021
  -> p -/ a * b in [-@step_rel@, @step_rel@]
  /\ sn -/ (s + p) in [-@step_rel@, @step_rel@]
  /\ rnd(a2 * b2) - a2 * b2 in [-0x1p-1075, 0x1p-1075] }
