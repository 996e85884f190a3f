// Python bindings of the dpvr core. Arrays arrive as plain descriptions (address, shape, strides in elements)
// built by dpvr.ops from torch/numpy/cupy arrays; this module never sees a framework type.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <tuple>
#include <vector>

#include "dpvr/core.h"

namespace py = pybind11;
using dpvr::Matrix;
using dpvr::Vector;

namespace {

using MatrixDesc = std::tuple<uintptr_t, int64_t, int64_t, int64_t, int64_t>;  // address, rows, cols, strides
using VectorDesc = std::tuple<uintptr_t, int64_t>;                            // address, size

std::vector<Matrix> matrices(const std::vector<MatrixDesc>& ds) {
  std::vector<Matrix> out;
  for (const auto& [p, r, c, rs, cs] : ds) out.push_back({reinterpret_cast<void*>(p), r, c, rs, cs});
  return out;
}

std::vector<Vector> vectors(const std::vector<VectorDesc>& ds) {
  std::vector<Vector> out;
  for (const auto& [p, n] : ds) out.push_back({reinterpret_cast<void*>(p), n});
  return out;
}

dpvr::DType dtype_of(int code) {
  if (code != 0 && code != 1) throw dpvr::ArgumentError("dtype: must be float32 or float64");
  return static_cast<dpvr::DType>(code);
}

bool on_cuda(int device) { return device >= 0; }

void require_cuda() {
  if (!dpvr::cuda_compiled()) throw dpvr::ArgumentError("device: this build of dpvr has no CUDA backend");
  if (!dpvr::cuda_available()) throw dpvr::ArgumentError("device: no usable CUDA device");
}

}  // namespace

#ifndef DPVR_WITH_CUDA
namespace dpvr {
bool cuda_compiled() { return false; }
bool cuda_available() { return false; }
void clip_accumulate_cuda(const ClipArgs&, void*, int64_t*) { require_cuda(); }
void noisy_update_cuda(const UpdateArgs&, void*) { require_cuda(); }
void philox_words_cuda(uint32_t*, int64_t, NoiseKey, void*) { require_cuda(); }
}  // namespace dpvr
#endif

void bind_ghost(py::module_& m);  // bindings_ghost.cpp

PYBIND11_MODULE(_C, m) {
  m.doc() = "dpvr native core (fused per-sample clipping, accumulation and noise)";
  py::register_exception<dpvr::ArgumentError>(m, "ArgumentError", PyExc_ValueError);
  py::register_exception<dpvr::NonFiniteError>(m, "NonFiniteError", PyExc_FloatingPointError);

  m.def(
      "clip_accumulate",
      [](int device, int dtype, int64_t batch, const std::vector<MatrixDesc>& g, const std::vector<MatrixDesc>& h,
         const std::vector<VectorDesc>& out, uintptr_t w, uintptr_t b, uintptr_t norms, double clip,
         int nonfinite, uintptr_t stream, uintptr_t count, int out_dtype) -> int64_t {
        dpvr::ClipArgs a;
        a.dtype = dtype_of(dtype);
        a.batch = batch;
        a.g = matrices(g);
        a.h = matrices(h);
        a.out = vectors(out);
        a.out_f64 = out_dtype < 0 ? a.dtype == dpvr::DType::f64 : dtype_of(out_dtype) == dpvr::DType::f64;
        if (a.dtype == dpvr::DType::f64 && !a.out_f64)
          throw dpvr::ArgumentError("out: float64 per-sample data needs float64 accumulators");
        a.w = reinterpret_cast<const void*>(w);
        a.b = reinterpret_cast<const void*>(b);
        a.norms = reinterpret_cast<void*>(norms);
        a.clip = clip;
        a.nonfinite = static_cast<dpvr::NonFinite>(nonfinite);
        if (!on_cuda(device)) return dpvr::clip_accumulate_cpu(a);
        require_cuda();
        dpvr::clip_accumulate_cuda(a, reinterpret_cast<void*>(stream), reinterpret_cast<int64_t*>(count));
        return -1;  // the count is written to `count` on the device
      },
      py::arg("device"), py::arg("dtype"), py::arg("batch"), py::arg("g"), py::arg("h"), py::arg("out"),
      py::arg("w"), py::arg("b"), py::arg("norms"), py::arg("clip"), py::arg("nonfinite"), py::arg("stream"),
      py::arg("count"), py::arg("out_dtype") = -1, py::call_guard<py::gil_scoped_release>());

  m.def(
      "noisy_update",
      [](int device, int dtype, const std::vector<VectorDesc>& v, const std::vector<VectorDesc>& sum,
         const std::vector<VectorDesc>& x, const std::vector<VectorDesc>& x_prev, double scale, double sigma,
         double lr, bool reset, uint64_t seed, uint32_t stream_id, uint32_t step, uintptr_t step_norm,
         uintptr_t stream, int sum_dtype) {
        dpvr::UpdateArgs a;
        a.dtype = dtype_of(dtype);
        a.v = vectors(v);
        a.sum = vectors(sum);
        a.sum_f64 = sum_dtype < 0 ? a.dtype == dpvr::DType::f64 : dtype_of(sum_dtype) == dpvr::DType::f64;
        if (a.dtype == dpvr::DType::f64 && !a.sum_f64)
          throw dpvr::ArgumentError("sum: a float32 sum cannot be added to float64 values");
        a.x = vectors(x);
        a.x_prev = vectors(x_prev);
        a.scale = scale;
        a.sigma = sigma;
        a.lr = lr;
        a.reset = reset;
        a.key = {seed, stream_id, step};
        a.step_norm = reinterpret_cast<double*>(step_norm);
        if (!on_cuda(device)) return dpvr::noisy_update_cpu(a);
        require_cuda();
        dpvr::noisy_update_cuda(a, reinterpret_cast<void*>(stream));
      },
      py::arg("device"), py::arg("dtype"), py::arg("v"), py::arg("sum"), py::arg("x"), py::arg("x_prev"),
      py::arg("scale"), py::arg("sigma"), py::arg("lr"), py::arg("reset"), py::arg("seed"), py::arg("stream_id"),
      py::arg("step"), py::arg("step_norm"), py::arg("stream"), py::arg("sum_dtype") = -1,
      py::call_guard<py::gil_scoped_release>());

  m.def(
      "philox_words",
      [](int device, uintptr_t out, int64_t n_blocks, uint64_t seed, uint32_t stream_id, uint32_t step,
         uintptr_t stream) {
        if (n_blocks < 0) throw dpvr::ArgumentError("n_blocks: must be >= 0");
        const dpvr::NoiseKey key{seed, stream_id, step};
        if (!on_cuda(device)) return dpvr::philox_words_cpu(reinterpret_cast<uint32_t*>(out), n_blocks, key);
        require_cuda();
        dpvr::philox_words_cuda(reinterpret_cast<uint32_t*>(out), n_blocks, key, reinterpret_cast<void*>(stream));
      },
      py::call_guard<py::gil_scoped_release>());

  bind_ghost(m);
  m.def("cuda_compiled", &dpvr::cuda_compiled);
  m.def("cuda_available", &dpvr::cuda_available);
  m.def("max_threads", &dpvr::max_threads);
  m.def("cpu_instruction_set", [] { return std::string(dpvr::cpu_instruction_set()); });
}
