// The ghost-norm kernel, compiled once per instruction set like kernels_impl.h (the including file defines
// DPVR_ISA). Samples are independent: each thread takes whole samples and sums one sample's terms in a fixed
// order, so results do not depend on the thread count.
//
// Everything is accumulated in double. For every term the kernel also computes R, an upper bound on the exact
// norm of the term (triangle inequality over its rank-one pieces: R = sum_rows ||m_r|| ||n_r||), and bounds the
// rounding error of the term's squared norm by 2 (chain + 8) u R^2, where chain is the longest sequence of
// roundings one product meets (dot products, the pair or entry sum) and u = 2^-53. The reported value is the
// computed squared norm plus these bounds, so it is never below the exact squared norm.
#include <algorithm>
#include <cmath>
#include <limits>
#include <utility>
#include <vector>

#include "common.h"
#include "dpvr/ghost.h"

#ifndef DPVR_ISA
#error "define DPVR_ISA before including ghost_impl.h"
#endif

DPVR_ISA_BEGIN
namespace dpvr {
namespace cpu {
namespace DPVR_ISA {

constexpr int64_t kMaxScratch = int64_t{1} << 22;  // doubles of the direct form's per-thread q x p matrix

template <typename T>
inline double dot(const T* x, int64_t xs, const T* y, int64_t ys, int64_t n) {
  double acc = 0.0;
  if (xs == 1 && ys == 1) {
#pragma omp simd reduction(+ : acc)
    for (int64_t k = 0; k < n; ++k) acc += static_cast<double>(x[k]) * static_cast<double>(y[k]);
  } else {
    for (int64_t k = 0; k < n; ++k) acc += static_cast<double>(x[k * xs]) * static_cast<double>(y[k * ys]);
  }
  return acc;
}

// One step of one piece of a sample: a row of width `width` at `p` with entry stride `s`.
template <typename T>
struct Row {
  const T* p;
  int64_t s;
};

template <typename T>
inline Row<T> row_of(const Sequence& q, int64_t i, int64_t t) {
  return {static_cast<const T*>(q.data) + i * q.sample_stride + t * q.step_stride, q.entry_stride};
}

// The squared norm of one term of one sample, its bound R^2 and its rounding chain.
struct TermNorm {
  double sumsq = 0.0;
  double r = 0.0;  // outer terms: sum of ||m|| ||n|| over the pieces' steps
  double r2 = 0.0;
  double chain = 0.0;
};

// Per-thread scratch space, reused across samples.
template <typename T>
struct Scratch {
  std::vector<std::pair<Row<T>, Row<T>>> rows;  // outer term: (m, n) per step of every piece
  std::vector<Row<T>> grads;                    // index term: n per kept step
  std::vector<std::pair<int64_t, int64_t>> keys;  // index term: (index, step number)
  std::vector<double> matrix;                   // direct form: q x p
  std::vector<double> row;                      // direct form: one inner row; index term: one group's sum
};

inline bool use_gram(const OuterTerm& term) {
  if (term.form != NormForm::automatic) return term.form == NormForm::gram;
  const double p = static_cast<double>(term.left[0].width), q = static_cast<double>(term.right[0].width);
  if (p * q > static_cast<double>(kMaxScratch)) return true;
  double n = 0.0;
  for (const Sequence& s : term.left) n += static_cast<double>(s.steps);
  return 0.5 * n * (n + 1.0) * (p + q) <= n * (p * q + p + q);
}

template <typename T>
TermNorm outer_norm(const OuterTerm& term, bool gram, int64_t i, Scratch<T>& scratch) {
  const int64_t p = term.left[0].width, q = term.right[0].width;
  auto& rows = scratch.rows;
  rows.clear();
  for (size_t j = 0; j < term.left.size(); ++j)
    for (int64_t t = 0; t < term.left[j].steps; ++t)
      rows.push_back({row_of<T>(term.left[j], i, t), row_of<T>(term.right[j], i, t)});
  const double n_rows = static_cast<double>(rows.size());
  TermNorm out;
  double r = 0.0;
  if (gram) {
    // <M M^T, N N^T> over all step pairs; the diagonal gives the row norms for R.
    for (size_t a = 0; a < rows.size(); ++a) {
      const auto& [ma, na] = rows[a];
      const double mm = dot(ma.p, ma.s, ma.p, ma.s, p), nn = dot(na.p, na.s, na.p, na.s, q);
      out.sumsq += mm * nn;
      r += std::sqrt(mm) * std::sqrt(nn);
      for (size_t b = a + 1; b < rows.size(); ++b) {
        const auto& [mb, nb] = rows[b];
        out.sumsq += 2.0 * dot(ma.p, ma.s, mb.p, mb.s, p) * dot(na.p, na.s, nb.p, nb.s, q);
      }
    }
    out.chain = static_cast<double>(p + q) + 0.5 * n_rows * (n_rows + 1.0);
  } else {
    // The q x p matrix itself, accumulated with the longer side contiguous.
    const bool m_inner = p >= q;
    const int64_t inner = m_inner ? p : q, outer = m_inner ? q : p;
    scratch.matrix.assign(static_cast<size_t>(inner * outer), 0.0);
    scratch.row.resize(static_cast<size_t>(inner));
    double* acc = scratch.matrix.data();
    double* in = scratch.row.data();
    for (const auto& [m, n] : rows) {
      const Row<T> iv = m_inner ? m : n, ov = m_inner ? n : m;
      for (int64_t k = 0; k < inner; ++k) in[k] = static_cast<double>(iv.p[k * iv.s]);
      for (int64_t o = 0; o < outer; ++o) {
        const double x = static_cast<double>(ov.p[o * ov.s]);
        double* a = acc + o * inner;
#pragma omp simd
        for (int64_t k = 0; k < inner; ++k) a[k] += x * in[k];
      }
      r += std::sqrt(dot(m.p, m.s, m.p, m.s, p)) * std::sqrt(dot(n.p, n.s, n.p, n.s, q));
    }
    out.sumsq = dot(acc, 1, acc, 1, inner * outer);
    out.chain = 2.0 * n_rows + static_cast<double>(p * q);
  }
  out.r = r;
  out.r2 = r * r;
  return out;
}

template <typename T>
TermNorm index_norm(const IndexTerm& term, int64_t i, Scratch<T>& scratch) {
  const int64_t q = term.right[0].width;
  auto& keys = scratch.keys;  // sorted below, so the steps that hit one table row are summed together
  auto& rows = scratch.grads;
  keys.clear();
  rows.clear();
  for (size_t j = 0; j < term.index.size(); ++j) {
    const Indices& ix = term.index[j];
    for (int64_t t = 0; t < ix.steps; ++t) {
      const int64_t k = ix.data[i * ix.sample_stride + t * ix.step_stride];
      if (k == term.skip) continue;
      keys.push_back({k, static_cast<int64_t>(rows.size())});
      rows.push_back(row_of<T>(term.right[j], i, t));
    }
  }
  std::sort(keys.begin(), keys.end());
  scratch.row.resize(static_cast<size_t>(q));
  double* sum = scratch.row.data();
  TermNorm out;
  double r = 0.0;
  for (size_t a = 0; a < keys.size();) {
    std::fill(sum, sum + q, 0.0);
    size_t b = a;
    for (; b < keys.size() && keys[b].first == keys[a].first; ++b) {
      const Row<T> n = rows[static_cast<size_t>(keys[b].second)];
      for (int64_t k = 0; k < q; ++k) sum[k] += static_cast<double>(n.p[k * n.s]);
      r += std::sqrt(dot(n.p, n.s, n.p, n.s, q));
    }
    out.sumsq += dot(sum, 1, sum, 1, q);
    a = b;
  }
  out.r2 = r * r;
  out.chain = 2.0 * static_cast<double>(rows.size()) + static_cast<double>(q);
  return out;
}

template <typename T>
TermNorm dense_norm(const Matrix& d, int64_t i) {
  const T* u = static_cast<const T*>(d.data) + i * d.row_stride;
  TermNorm out;
  out.sumsq = dot(u, d.col_stride, u, d.col_stride, d.cols);
  out.r2 = std::fabs(out.sumsq);
  out.chain = static_cast<double>(d.cols);
  return out;
}

template <typename T>
void ghost_norms_impl(const GhostNormArgs& args) {
  const double u = unit_roundoff<double>();
  std::vector<char> gram(args.outer.size());
  for (size_t k = 0; k < args.outer.size(); ++k) gram[k] = use_gram(args.outer[k]);
  const double terms = static_cast<double>(args.outer.size() + args.index.size() + args.dense.size());

#pragma omp parallel
  {
    Scratch<T> scratch;
#pragma omp for schedule(static)
    for (int64_t i = 0; i < args.batch; ++i) {
      double sumsq = 0.0, bound = 0.0, magnitude = 0.0;
      const auto add = [&](const TermNorm& t) {
        sumsq += t.sumsq;
        magnitude += std::fabs(t.sumsq);
        bound += 2.0 * (t.chain + 8.0) * u * t.r2;
      };
      for (size_t k = 0; k < args.outer.size(); ++k) {
        const TermNorm t = outer_norm<T>(args.outer[k], gram[k] != 0, i, scratch);
        add(t);
        if (args.outer_bounds != nullptr) args.outer_bounds[static_cast<int64_t>(k) * args.batch + i] = t.r;
      }
      for (const IndexTerm& term : args.index) add(index_norm<T>(term, i, scratch));
      for (const Matrix& d : args.dense) add(dense_norm<T>(d, i));
      // Summing the terms adds at most (terms + 4) u of their magnitudes; the final (1 + 8u) covers this line.
      const double upper = (std::max(sumsq, 0.0) + bound + (terms + 4.0) * u * magnitude) * (1.0 + 8.0 * u);
      args.norms_sq[i] = std::isfinite(upper) ? upper : std::numeric_limits<double>::quiet_NaN();
    }
  }
}

inline void ghost_norms(const GhostNormArgs& args) {
  if (args.dtype == DType::f32)
    ghost_norms_impl<float>(args);
  else
    ghost_norms_impl<double>(args);
}

}  // namespace DPVR_ISA
}  // namespace cpu
}  // namespace dpvr
DPVR_ISA_END
