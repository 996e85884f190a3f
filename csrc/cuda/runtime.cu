// Host-side runtime of the CUDA backend: availability, errors, guards, pointer checks and workspaces.
#include <algorithm>
#include <map>
#include <mutex>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "common.cuh"

namespace dpvr {

bool cuda_compiled() { return true; }

bool cuda_available() {
  // The runtime is linked statically, so this also runs where no driver is installed: any error means "no".
  int count = 0;
  const cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  return count > 0;
}

namespace cuda {

void check(cudaError_t err, const char* what) {
  if (err == cudaSuccess) return;
  (void)cudaGetLastError();  // clear a non-sticky error so later calls are not blamed for it
  throw std::runtime_error(std::string("dpvr CUDA: ") + what + ": " + cudaGetErrorString(err));
}

RelaxedCapture::RelaxedCapture() : previous_(cudaStreamCaptureModeRelaxed) {
  check(cudaThreadExchangeStreamCaptureMode(&previous_), "cudaThreadExchangeStreamCaptureMode");
}

RelaxedCapture::~RelaxedCapture() { (void)cudaThreadExchangeStreamCaptureMode(&previous_); }

DeviceGuard::DeviceGuard(int device) {
  check(cudaGetDevice(&previous_), "cudaGetDevice");
  if (previous_ != device) check(cudaSetDevice(device), "cudaSetDevice");
}

DeviceGuard::~DeviceGuard() {
  int now = -1;
  if (cudaGetDevice(&now) == cudaSuccess && now != previous_) (void)cudaSetDevice(previous_);
}

namespace {

std::string label(const char* name, int index) {
  return index < 0 ? std::string(name) : std::string(name) + "[" + std::to_string(index) + "]";
}

}  // namespace

void DeviceCheck::add(const void* p, const char* name, int index) {
  if (p == nullptr) return;
  cudaPointerAttributes attr{};
  const cudaError_t err = cudaPointerGetAttributes(&attr, p);
  if (err != cudaSuccess) {
    (void)cudaGetLastError();
    throw ArgumentError(label(name, index) + ": not a CUDA device pointer (" + cudaGetErrorString(err) + ")");
  }
  if (attr.type != cudaMemoryTypeDevice && attr.type != cudaMemoryTypeManaged)
    throw ArgumentError(label(name, index) + ": is host memory; the CUDA backend needs device memory");
  if (device_ < 0) {
    device_ = attr.device;
    first_name_ = name;
    first_index_ = index;
  } else if (attr.device != device_) {
    throw ArgumentError(label(name, index) + ": on cuda:" + std::to_string(attr.device) + ", but " +
                        label(first_name_, first_index_) + " is on cuda:" + std::to_string(device_));
  }
}

int DeviceCheck::device() const {
  if (device_ >= 0) return device_;
  int d = 0;
  check(cudaGetDevice(&d), "cudaGetDevice");
  return d;
}

namespace {

struct Workspace {
  void* ptr = nullptr;
  size_t bytes = 0;
  std::vector<void*> retired;
};

std::mutex workspace_mutex;
std::map<std::pair<int, cudaStream_t>, Workspace> workspaces;

}  // namespace

void* workspace(int device, cudaStream_t stream, size_t bytes) {
  std::lock_guard<std::mutex> lock(workspace_mutex);
  Workspace& w = workspaces[{device, stream}];
  if (w.bytes >= bytes) return w.ptr;
  size_t grown = std::max(bytes, 2 * w.bytes);
  grown = (grown + (1u << 20) - 1) / (1u << 20) * (1u << 20);  // whole MiB
  void* p = nullptr;
  check(cudaMalloc(&p, grown), "cudaMalloc (workspace)");
  if (w.ptr) w.retired.push_back(w.ptr);
  w.ptr = p;
  w.bytes = grown;
  return p;
}

int sm_count(int device) {
  int n = 0;
  check(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device), "cudaDeviceGetAttribute");
  return n;
}

}  // namespace cuda
}  // namespace dpvr
