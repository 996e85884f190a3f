// Python bindings of the ghost-norm kernel and of clip_factors (see dpvr/ghost.h). Arrays arrive as plain
// descriptions built by dpvr.ops, as in bindings.cpp.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <tuple>
#include <vector>

#include "dpvr/ghost.h"

namespace py = pybind11;

namespace {

// address, batch, steps, width, sample stride, step stride, entry stride
using SequenceDesc = std::tuple<uintptr_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t>;
// address, batch, steps, sample stride, step stride
using IndicesDesc = std::tuple<uintptr_t, int64_t, int64_t, int64_t, int64_t>;
using OuterDesc = std::tuple<std::vector<SequenceDesc>, std::vector<SequenceDesc>, int>;  // activations, grads, form
using IndexDesc = std::tuple<std::vector<IndicesDesc>, std::vector<SequenceDesc>, int64_t>;  // indices, grads, skip
using MatrixDesc = std::tuple<uintptr_t, int64_t, int64_t, int64_t, int64_t>;

std::vector<dpvr::Sequence> sequences(const std::vector<SequenceDesc>& ds) {
  std::vector<dpvr::Sequence> out;
  for (const auto& [p, b, t, w, ss, ts, es] : ds) out.push_back({reinterpret_cast<const void*>(p), b, t, w, ss, ts, es});
  return out;
}

dpvr::DType dtype_of(int code) {
  if (code != 0 && code != 1) throw dpvr::ArgumentError("dtype: must be float32 or float64");
  return static_cast<dpvr::DType>(code);
}

void host_only(int device) {
  if (device >= 0) throw dpvr::ArgumentError("device: ghost norms and clip_factors run on the host only");
}

}  // namespace

void bind_ghost(py::module_& m) {
  m.def(
      "ghost_norms",
      [](int device, int dtype, int64_t batch, const std::vector<OuterDesc>& outer,
         const std::vector<IndexDesc>& index, const std::vector<MatrixDesc>& dense, uintptr_t norms_sq,
         uintptr_t outer_bounds) {
        host_only(device);
        dpvr::GhostNormArgs a;
        a.dtype = dtype_of(dtype);
        a.batch = batch;
        for (const auto& [left, right, form] : outer) {
          if (form < 0 || form > 2) throw dpvr::ArgumentError("form: must be auto, gram or direct");
          a.outer.push_back({sequences(left), sequences(right), static_cast<dpvr::NormForm>(form)});
        }
        for (const auto& [indices, right, skip] : index) {
          dpvr::IndexTerm t;
          for (const auto& [p, b, s, ss, ts] : indices)
            t.index.push_back({reinterpret_cast<const int64_t*>(p), b, s, ss, ts});
          t.right = sequences(right);
          t.skip = skip;
          a.index.push_back(std::move(t));
        }
        for (const auto& [p, r, c, rs, cs] : dense) a.dense.push_back({reinterpret_cast<void*>(p), r, c, rs, cs});
        a.norms_sq = reinterpret_cast<double*>(norms_sq);
        a.outer_bounds = reinterpret_cast<double*>(outer_bounds);
        dpvr::ghost_norms_cpu(a);
      },
      py::call_guard<py::gil_scoped_release>());

  m.def(
      "clip_factors",
      [](int device, int dtype, int64_t batch, uintptr_t norms_sq, uintptr_t weights, uintptr_t factors,
         uintptr_t norms, double clip, int64_t columns, int nonfinite) -> int64_t {
        host_only(device);
        if (nonfinite != 0 && nonfinite != 1) throw dpvr::ArgumentError("nonfinite: must be zero or raise");
        dpvr::FactorArgs a;
        a.dtype = dtype_of(dtype);
        a.batch = batch;
        a.norms_sq = reinterpret_cast<const double*>(norms_sq);
        a.weights = reinterpret_cast<const void*>(weights);
        a.factors = reinterpret_cast<void*>(factors);
        a.norms = reinterpret_cast<void*>(norms);
        a.clip = clip;
        a.columns = columns;
        a.nonfinite = static_cast<dpvr::NonFinite>(nonfinite);
        return dpvr::clip_factors_cpu(a);
      },
      py::call_guard<py::gil_scoped_release>());
}
