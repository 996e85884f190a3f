// Argument checks shared by the CPU and CUDA backends: every message names the offending argument.
#include <cmath>
#include <string>

#include "dpvr/core.h"

namespace dpvr {
namespace {

[[noreturn]] void fail(const std::string& msg) { throw ArgumentError(msg); }

void check_vectors(const std::vector<Vector>& vs, const std::vector<int64_t>& sizes, const char* name) {
  if (vs.size() != sizes.size())
    fail(std::string(name) + ": expected " + std::to_string(sizes.size()) + " tensors, got " +
         std::to_string(vs.size()));
  for (size_t k = 0; k < vs.size(); ++k) {
    if (vs[k].size != sizes[k])
      fail(std::string(name) + "[" + std::to_string(k) + "]: expected " + std::to_string(sizes[k]) +
           " elements, got " + std::to_string(vs[k].size));
    if (vs[k].size > 0 && vs[k].data == nullptr) fail(std::string(name) + "[" + std::to_string(k) + "] is null");
  }
}

}  // namespace

void validate(const ClipArgs& a) {
  if (a.g.empty()) fail("grads: at least one tensor is required");
  if (a.batch <= 0) fail("grads: the batch is empty");
  if (!(a.clip > 0.0) || !std::isfinite(a.clip)) fail("clip: must be a finite number > 0, got " + std::to_string(a.clip));
  if (!a.h.empty() && a.h.size() != a.g.size())
    fail("grads_prev: expected " + std::to_string(a.g.size()) + " tensors, got " + std::to_string(a.h.size()));
  std::vector<int64_t> widths;
  for (size_t k = 0; k < a.g.size(); ++k) {
    const Matrix& m = a.g[k];
    const std::string name = "grads[" + std::to_string(k) + "]";
    if (m.rows != a.batch)
      fail(name + ": expected " + std::to_string(a.batch) + " samples, got " + std::to_string(m.rows));
    if (m.cols < 0) fail(name + ": negative width");
    if (m.cols > 0 && m.data == nullptr) fail(name + " is null");
    if (!a.h.empty()) {
      const Matrix& p = a.h[k];
      if (p.rows != m.rows || p.cols != m.cols)
        fail("grads_prev[" + std::to_string(k) + "]: shape differs from grads[" + std::to_string(k) + "]");
      if (p.cols > 0 && p.data == nullptr) fail("grads_prev[" + std::to_string(k) + "] is null");
    }
    widths.push_back(m.cols);
  }
  if (!a.out.empty()) check_vectors(a.out, widths, "out");
}

void validate(const UpdateArgs& a) {
  if (a.v.empty()) fail("v: at least one tensor is required");
  std::vector<int64_t> sizes;
  for (const Vector& v : a.v) sizes.push_back(v.size);
  check_vectors(a.v, sizes, "v");
  if (!a.sum.empty()) check_vectors(a.sum, sizes, "sum");
  if (!a.x.empty()) check_vectors(a.x, sizes, "params");
  if (!a.x_prev.empty()) {
    if (a.x.empty()) fail("params_prev: given without params");
    check_vectors(a.x_prev, sizes, "params_prev");
  }
  if (!(a.sigma >= 0.0) || !std::isfinite(a.sigma)) fail("sigma: must be a finite number >= 0");
  if (!std::isfinite(a.scale)) fail("scale: must be finite");
  if (!std::isfinite(a.lr)) fail("lr: must be finite");
}

}  // namespace dpvr
