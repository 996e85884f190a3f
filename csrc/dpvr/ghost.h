// Ghost norms: per-sample gradient norms from what a layer sees in the forward and backward passes, without
// forming any per-sample gradient; and the clip factors computed from them.
//
// A layer's per-sample gradient (or same-sample gradient difference) u_i is described by terms:
//   outer: u_i = sum_j sum_t n_{j,i,t} m_{j,i,t}^T   (a linear map's weight: m = activations, n = gradients of
//          the layer output; a convolution after unfolding; a difference as two pieces, see below)
//   index: u_i = sum_j sum_t e_{k_{j,i,t}} n_{j,i,t}^T  (rows k of an embedding table)
//   dense: u_i = row i of a B x k matrix               (biases, normalisation layers, materialised layers)
// The same-sample difference of a linear map at two points, a_i N^T M - b_i N'^T M', is the outer term with the
// pieces (M, a_i N - b_i N') and (M - M', b_i N'): its norm is then computed from differences, so it is accurate
// relative to the difference itself and exactly zero at identical points (no cancellation of two large terms).
//
// The kernel returns, per sample, an upper bound on the exact squared norm of the sum of all terms (the
// rounding of every computation is bounded explicitly and added), so clipping with it bounds the exact norm.
#pragma once

#include <cstdint>
#include <vector>

#include "dpvr/core.h"

namespace dpvr {

// B x T x width per-sample sequences: entry w of step t of sample i is at
// data[i * sample_stride + t * step_stride + w * entry_stride] (strides in elements).
struct Sequence {
  const void* data = nullptr;
  int64_t batch = 0;
  int64_t steps = 0;
  int64_t width = 0;
  int64_t sample_stride = 0;
  int64_t step_stride = 0;
  int64_t entry_stride = 1;
};

// B x T int64 indices.
struct Indices {
  const int64_t* data = nullptr;
  int64_t batch = 0;
  int64_t steps = 0;
  int64_t sample_stride = 0;
  int64_t step_stride = 1;
};

// How an outer term's norm is computed: from Gram matrices, sum over step pairs of (m.m')(n.n'), cost
// ~(JT)^2 (p + q) / 2; or directly, forming the q x p per-sample matrix in a scratch buffer, cost ~JTpq.
// `automatic` picks the cheaper one per term.
enum class NormForm : int { automatic = 0, gram = 1, direct = 2 };

struct OuterTerm {
  std::vector<Sequence> left;   // m pieces: B x T_j x p
  std::vector<Sequence> right;  // n pieces: B x T_j x q
  NormForm form = NormForm::automatic;
};

struct IndexTerm {
  std::vector<Indices> index;   // B x T_j
  std::vector<Sequence> right;  // B x T_j x q
  int64_t skip = -1;            // positions with this index contribute nothing (an embedding's padding_idx); < 0: none
};

struct GhostNormArgs {
  DType dtype = DType::f32;  // of every floating-point input
  int64_t batch = 0;
  std::vector<OuterTerm> outer;
  std::vector<IndexTerm> index;
  std::vector<Matrix> dense;
  double* norms_sq = nullptr;  // out, length batch: upper bound on ||u_i||^2 (NaN/Inf when data is not finite)
  // out, optional, outer.size() x batch: R of each outer term of each sample, sum over its pieces and steps of
  // ||m|| ||n|| in double (the magnitude that bounds the rounding of the term's matmul)
  double* outer_bounds = nullptr;
};

// Clip factors from per-sample squared norms, with the rule of clip_accumulate (same margin for `columns`
// columns, same weights and non-finite policy):  n_i = |w_i| sqrt(norms_sq_i),  f_i = w_i min(1, C' / n_i).
// f_i multiplies the unweighted vector u_i, so f_i u_i has norm <= C whenever sqrt(norms_sq_i) >= ||u_i||.
struct FactorArgs {
  DType dtype = DType::f32;  // of weights, factors and norms
  int64_t batch = 0;
  const double* norms_sq = nullptr;
  const void* weights = nullptr;  // optional
  void* factors = nullptr;        // out
  void* norms = nullptr;          // optional out: n_i, NaN for a non-finite sample
  double clip = 1.0;
  int64_t columns = 0;  // the per-sample dimension (entries of u_i), for the margin
  NonFinite nonfinite = NonFinite::zero;
};

void validate(const GhostNormArgs& args);
void validate(const FactorArgs& args);

// ---- CPU backend ----
void ghost_norms_cpu(const GhostNormArgs& args);
// Returns the number of non-finite samples (their factor is 0).
int64_t clip_factors_cpu(const FactorArgs& args);

}  // namespace dpvr
