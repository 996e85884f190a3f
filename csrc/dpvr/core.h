// dpvr native core: fused per-sample clipping, accumulation and noisy estimator updates.
//
// The core sees typed buffers only (no torch, no Python). Every array is described by a pointer, a shape and
// strides counted in elements; the Python ops layer builds these descriptions from torch/numpy/cupy arrays
// without copying. The same structs drive the CPU backend (always built) and the CUDA backend (optional).
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

namespace dpvr {

enum class DType : int { f32 = 0, f64 = 1 };

// Per-sample data of one parameter tensor, viewed as a B x cols matrix: row i is sample i.
struct Matrix {
  void* data = nullptr;
  int64_t rows = 0;
  int64_t cols = 0;
  int64_t row_stride = 0;  // elements between consecutive samples
  int64_t col_stride = 1;  // elements between consecutive entries of one sample
};

// A contiguous vector (parameter-shaped buffers are viewed flat).
struct Vector {
  void* data = nullptr;
  int64_t size = 0;
};

// What a sample whose gradient (or weight) is NaN/Inf does.
enum class NonFinite : int {
  zero = 0,   // it contributes nothing (keeps the sensitivity bound); its norm is reported as NaN
  raise = 1,  // the call fails before any output is written
};

// Arguments of clip_accumulate and of its difference form.
//   u_i = w_i * g_i                 (plain form;   h empty, w = weights or null meaning 1)
//   u_i = a_i * g_i - b_i * h_i     (difference form; h non-empty, a/b null meaning 1)
//   n_i = ||u_i||_2 over all tensors, c_i = min(1, C / n_i) (1 when n_i = 0),
//   out_k += sum_i c_i * u_i,k.    Optional: norms[i] = n_i.
// An empty `out` computes norms only. The sum over samples is accumulated in double on every backend and
// schedule and added to `out` once: `out` is of `dtype`, or float64 with `out_f64` (a float32 model whose
// clipped sum stays in float64 until the noise is added, so that no float32 rounding of a sum over records,
// which one record can move by more than its clipped norm, reaches a release).
struct ClipArgs {
  DType dtype = DType::f32;
  int64_t batch = 0;
  std::vector<Matrix> g;
  std::vector<Matrix> h;
  std::vector<Vector> out;
  bool out_f64 = false;     // out holds float64 (always so when dtype is f64)
  const void* w = nullptr;  // plain-form weights, or difference-form a_i
  const void* b = nullptr;  // difference-form b_i
  void* norms = nullptr;    // length-batch output of dtype `dtype`
  double clip = 1.0;
  NonFinite nonfinite = NonFinite::zero;
};

// Counter-based noise address: (seed) x (stream, step) x element.
struct NoiseKey {
  uint64_t seed = 0;
  uint32_t stream = 0;
  uint32_t step = 0;
};

// Noisy estimator update, over K tensors viewed as one concatenated vector (noise index = global offset):
//   v <- (reset ? 0 : v) + scale * sum + sigma * xi,   xi ~ N(0, I) from `key`
//   if x given:  x_prev <- x (when given);  x <- x - lr * v;  *step_norm = ||x_new - x_old||_2
// `sum` may be empty (treated as zero). Adding plain noise to a buffer is the case sum = x = empty.
// `sum` is of `dtype`, or float64 with `sum_f64`: v + scale * sum + sigma * xi is formed in double and rounded
// to `dtype` once, after the noise.
struct UpdateArgs {
  DType dtype = DType::f32;
  std::vector<Vector> v;
  std::vector<Vector> sum;
  bool sum_f64 = false;  // sum holds float64 (always so when dtype is f64)
  std::vector<Vector> x;
  std::vector<Vector> x_prev;
  double scale = 1.0;
  double sigma = 0.0;
  double lr = 0.0;
  bool reset = false;
  NoiseKey key;
  double* step_norm = nullptr;  // one double, on the device of the data; may be null
};

class ArgumentError : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

class NonFiniteError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// ---- CPU backend (always built) ----
// Returns the number of samples with non-finite data (they contributed nothing).
int64_t clip_accumulate_cpu(const ClipArgs& args);
void noisy_update_cpu(const UpdateArgs& args);
// Raw Philox-4x32-10 output words, for cross-backend and statistical tests: n words of counter blocks
// (pair index, step, stream) as used by the Gaussian generator.
void philox_words_cpu(uint32_t* out, int64_t n_blocks, NoiseKey key);
int max_threads();
// The instruction set the CPU kernels run with: "avx512", "avx2" or "baseline".
const char* cpu_instruction_set();

// ---- CUDA backend (DPVR_WITH_CUDA) ----
// All work is enqueued on `stream` (a cudaStream_t); nothing synchronises the host.
// `nonfinite_count` is a device int64 that receives the count (may be null).
bool cuda_compiled();
bool cuda_available();
void clip_accumulate_cuda(const ClipArgs& args, void* stream, int64_t* nonfinite_count);
void noisy_update_cuda(const UpdateArgs& args, void* stream);
void philox_words_cuda(uint32_t* out, int64_t n_blocks, NoiseKey key, void* stream);

// Validation shared by both backends. Throws ArgumentError naming the argument.
void validate(const ClipArgs& args);
void validate(const UpdateArgs& args);

}  // namespace dpvr
