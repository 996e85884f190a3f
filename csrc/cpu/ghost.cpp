// Public entry points of the ghost-norm kernel and of clip_factors: validation, the choice of instruction set,
// and the norm -> factor step, which uses the clip rule of clip-accumulate (common.h) so that both paths clip
// identically.
#include <cmath>
#include <string>

#include "common.h"
#include "dpvr/ghost.h"

namespace dpvr {
namespace cpu {
void ghost_norms_base(const GhostNormArgs& a);
#ifdef DPVR_HAVE_AVX2
void ghost_norms_avx2(const GhostNormArgs& a);
#endif
#ifdef DPVR_HAVE_AVX512
void ghost_norms_avx512(const GhostNormArgs& a);
#endif
}  // namespace cpu

namespace {

[[noreturn]] void fail(const std::string& msg) { throw ArgumentError(msg); }

void check_sequence(const Sequence& s, int64_t batch, const std::string& name) {
  if (s.batch != batch)
    fail(name + ": expected " + std::to_string(batch) + " samples, got " + std::to_string(s.batch));
  if (s.steps < 0 || s.width < 0) fail(name + ": negative size");
  if (s.steps > 0 && s.width > 0 && s.data == nullptr) fail(name + " is null");
}

// Pieces of one term: as many gradient pieces as left pieces, equal steps per piece, one width per side.
template <typename Left>
void check_pieces(const std::vector<Left>& left, const std::vector<Sequence>& right, int64_t batch,
                  const std::string& name, const char* left_name) {
  if (left.empty() || left.size() != right.size())
    fail(name + ": needs at least one (" + left_name + ", grads) piece, got " + std::to_string(left.size()) + " " +
         left_name + " and " + std::to_string(right.size()) + " grads");
  for (size_t j = 0; j < right.size(); ++j) {
    const std::string piece = name + "[" + std::to_string(j) + "]";
    check_sequence(right[j], batch, piece + ".grads");
    if (right[j].width != right[0].width)
      fail(piece + ".grads: width " + std::to_string(right[j].width) + " differs from piece 0's " +
           std::to_string(right[0].width));
    if (left[j].steps != right[j].steps)
      fail(piece + ": " + left_name + " have " + std::to_string(left[j].steps) + " steps, grads " +
           std::to_string(right[j].steps));
  }
}

}  // namespace

void validate(const GhostNormArgs& a) {
  if (a.batch <= 0) fail("norms_sq: the batch is empty");
  if (a.norms_sq == nullptr) fail("norms_sq is null");
  for (size_t k = 0; k < a.outer.size(); ++k) {
    const OuterTerm& t = a.outer[k];
    const std::string name = "outer[" + std::to_string(k) + "]";
    check_pieces(t.left, t.right, a.batch, name, "activations");
    for (size_t j = 0; j < t.left.size(); ++j) {
      const std::string piece = name + "[" + std::to_string(j) + "].activations";
      check_sequence(t.left[j], a.batch, piece);
      if (t.left[j].width != t.left[0].width)
        fail(piece + ": width " + std::to_string(t.left[j].width) + " differs from piece 0's " +
             std::to_string(t.left[0].width));
    }
    if (static_cast<int>(t.form) < 0 || static_cast<int>(t.form) > 2) fail(name + ": unknown norm form");
  }
  for (size_t k = 0; k < a.index.size(); ++k) {
    const IndexTerm& t = a.index[k];
    const std::string name = "index[" + std::to_string(k) + "]";
    check_pieces(t.index, t.right, a.batch, name, "indices");
    for (size_t j = 0; j < t.index.size(); ++j) {
      const Indices& ix = t.index[j];
      const std::string piece = name + "[" + std::to_string(j) + "].indices";
      if (ix.batch != a.batch)
        fail(piece + ": expected " + std::to_string(a.batch) + " samples, got " + std::to_string(ix.batch));
      if (ix.steps < 0) fail(piece + ": negative size");
      if (ix.steps > 0 && ix.data == nullptr) fail(piece + " is null");
    }
  }
  for (size_t k = 0; k < a.dense.size(); ++k) {
    const Matrix& m = a.dense[k];
    const std::string name = "dense[" + std::to_string(k) + "]";
    if (m.rows != a.batch)
      fail(name + ": expected " + std::to_string(a.batch) + " samples, got " + std::to_string(m.rows));
    if (m.cols < 0) fail(name + ": negative width");
    if (m.cols > 0 && m.data == nullptr) fail(name + " is null");
  }
}

void validate(const FactorArgs& a) {
  if (a.batch <= 0) fail("norms_sq: the batch is empty");
  if (!(a.clip > 0.0) || !std::isfinite(a.clip)) fail("clip: must be a finite number > 0, got " + std::to_string(a.clip));
  if (a.columns < 0) fail("columns: must be >= 0, got " + std::to_string(a.columns));
  if (a.norms_sq == nullptr) fail("norms_sq is null");
  if (a.factors == nullptr) fail("factors is null");
}

void ghost_norms_cpu(const GhostNormArgs& args) {
  validate(args);
#ifdef DPVR_HAVE_AVX512
  if (cpu::use_avx512()) return cpu::ghost_norms_avx512(args);
#endif
#ifdef DPVR_HAVE_AVX2
  if (cpu::use_avx2()) return cpu::ghost_norms_avx2(args);
#endif
  cpu::ghost_norms_base(args);
}

namespace {

template <typename T>
int64_t factors(const FactorArgs& a, bool write) {
  const double target = a.clip * (1.0 - cpu::clip_margin<T>(a.columns, cpu::thread_count()));
  const T* w = static_cast<const T*>(a.weights);
  T* f_out = static_cast<T*>(a.factors);
  T* n_out = static_cast<T*>(a.norms);
  int64_t nonfinite = 0;
  for (int64_t i = 0; i < a.batch; ++i) {
    double f, norm;
    cpu::clip_factor(std::sqrt(a.norms_sq[i]), w ? static_cast<double>(w[i]) : 1.0, target, f, norm);
    if (std::isnan(norm)) ++nonfinite;
    if (!write) continue;
    f_out[i] = static_cast<T>(f);
    if (n_out) n_out[i] = static_cast<T>(norm);
  }
  return nonfinite;
}

}  // namespace

int64_t clip_factors_cpu(const FactorArgs& args) {
  validate(args);
  const auto pass = args.dtype == DType::f32 ? factors<float> : factors<double>;
  if (args.nonfinite == NonFinite::raise) {
    // Look before writing anything, so a failing call leaves every output untouched.
    const int64_t bad = pass(args, false);
    if (bad > 0) throw NonFiniteError(std::to_string(bad) + " sample(s) have non-finite gradients or weights");
  }
  return pass(args, true);
}

}  // namespace dpvr
