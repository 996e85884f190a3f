// Shared pieces of the CUDA backend: error handling, device and capture-mode guards, pointer checks, the
// per-stream workspace, and the block/warp reductions and tensor lookup used by the kernels.
//
// Kernels receive their tensor tables by value as kernel parameters (`__grid_constant__`, so they are read in
// place from the parameter bank, never copied per thread). That is what makes a call one launch per pass with
// no host-to-device upload, no host synchronisation and nothing to allocate: the launch captures the table,
// so a step can be recorded in a CUDA graph and replayed.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "dpvr/core.h"

namespace dpvr {
namespace cuda {

constexpr int kThreads = 256;  // threads per block of every kernel (the reductions assume it)
constexpr int kWarps = kThreads / 32;

// Tensors per launch. Small calls use a ~2 KB parameter table (cheap to launch); larger ones a table that
// stays under the 32 KB kernel-parameter limit (CUDA 12.1+, sm_70+). Beyond kLargeTable tensors a pass is
// split into one launch per kLargeTable tensors.
constexpr int kSmallTable = 32;
constexpr int kLargeTable = 448;

// Throws std::runtime_error("dpvr CUDA: <what>: <CUDA error string>") if err is not cudaSuccess.
void check(cudaError_t err, const char* what);
inline void check_launch(const char* what) { check(cudaGetLastError(), what); }

// Relaxed stream-capture mode for this thread while in scope. Pointer queries and (rare) workspace growth are
// not stream work; relaxed mode lets them run while the caller captures a CUDA graph in global mode.
class RelaxedCapture {
 public:
  RelaxedCapture();
  ~RelaxedCapture();
  RelaxedCapture(const RelaxedCapture&) = delete;
  RelaxedCapture& operator=(const RelaxedCapture&) = delete;

 private:
  cudaStreamCaptureMode previous_;
};

// Makes `device` current while in scope (the data may live on another device than the caller's current one).
class DeviceGuard {
 public:
  explicit DeviceGuard(int device);
  ~DeviceGuard();
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = -1;
};

// Checks that every pointer of a call is device memory on one device; the first pointer fixes the device.
// Names are built only when a check fails ("grads[3]", "norms", ...). Throws ArgumentError.
class DeviceCheck {
 public:
  void add(const void* p, const char* name, int index = -1);
  // The device of the checked pointers (the current device when no pointer was added).
  int device() const;

 private:
  int device_ = -1;
  const char* first_name_ = nullptr;
  int first_index_ = -1;
};

// Scratch memory on `device` reserved for work queued on `stream`, at least `bytes` long. Allocated once per
// (device, stream) and grown geometrically; steady-state calls allocate nothing. Work on one stream runs in
// order, so calls on the same stream can share it; different streams get different buffers. A buffer that is
// outgrown is kept alive (never freed) because a captured CUDA graph may still refer to it.
void* workspace(int device, cudaStream_t stream, size_t bytes);

int sm_count(int device);

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Carves aligned regions out of one workspace allocation.
class Layout {
 public:
  template <typename T>
  size_t reserve(int64_t count) {
    const size_t at = size_;
    size_ += (static_cast<size_t>(count) * sizeof(T) + 255) / 256 * 256;
    return at;
  }
  size_t size() const { return size_ > 0 ? size_ : 256; }

 private:
  size_t size_ = 0;
};

template <typename T>
T* at(void* base, size_t offset) {
  return reinterpret_cast<T*>(static_cast<char*>(base) + offset);
}

// ---- device helpers ----

// Butterfly reductions: every lane ends with the same value, and the order of operations is fixed, so results
// are deterministic (a + b == b + a exactly in IEEE arithmetic).
__device__ __forceinline__ double warp_sum(double v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

__device__ __forceinline__ double warp_max(double v) {
  for (int o = 16; o > 0; o >>= 1) v = fmax(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Block-wide sum / max over kThreads threads, returned to every thread. Must be reached by the whole block.
template <bool Max>
__device__ __forceinline__ double block_reduce(double v) {
  __shared__ double partial[kWarps];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  v = Max ? warp_max(v) : warp_sum(v);
  if (lane == 0) partial[warp] = v;
  __syncthreads();
  v = lane < kWarps ? partial[lane] : 0.0;  // every warp reduces the same values (0 is neutral: values >= 0)
  v = Max ? warp_max(v) : warp_sum(v);
  __syncthreads();  // `partial` may be reused by the next call
  return v;
}

__device__ __forceinline__ double block_sum(double v) { return block_reduce<false>(v); }
__device__ __forceinline__ double block_max(double v) { return block_reduce<true>(v); }

// Index of the tensor holding column c of the concatenated column space: the last k with off[k] <= c, which
// skips empty tensors. Requires off[0] <= c < off[count].
__device__ __forceinline__ int tensor_of(const int64_t* off, int count, int64_t c) {
  int lo = 0, hi = count;  // invariant: off[lo] <= c < off[hi]
  while (hi - lo > 1) {
    const int mid = (lo + hi) >> 1;
    if (off[mid] <= c)
      lo = mid;
    else
      hi = mid;
  }
  return lo;
}

}  // namespace cuda
}  // namespace dpvr
