// CUDA noisy estimator update (with the fused parameter step) and raw Philox output.
//
// Element e of the concatenated tensors gets component e & 1 of gaussian_pair(seed, stream, step, e >> 1), as on
// the CPU; each thread computes one pair, so every Philox block is evaluated once. The arithmetic is the CPU's,
// in double, with explicit round-to-nearest intrinsics so that nvcc does not contract it into fma: given the
// same Gaussian, both backends write the same bits. The step norm ||x_new - x_old|| is reduced in two fixed
// levels (block partials, then one block), so it is deterministic and needs no host synchronisation.
#include <algorithm>
#include <vector>

#include "common.cuh"
#include "dpvr/philox.h"

namespace dpvr {
namespace cuda {
namespace {

constexpr int kBlocksPerSm = 8;

template <int N>
struct UpdateTable {
  int count;  // tensors in this launch
  void* v[N];
  const void* sum[N];
  void* x[N];
  void* x_prev[N];
  int64_t off[N + 1];  // global element offsets (the noise index); off[0] is this launch's first element
};

struct UpdateScalars {
  double scale, sigma, lr;
  NoiseKey key;
  bool reset, noise, has_sum, has_x, has_prev;
  bool sum_f64;  // the sum holds double (a float32 model's sum, kept in double until the noise is added)
};

// Updates element e (global index) with Gaussian z; returns (x_new - x_old)^2 (0 without a step).
template <typename T, int N>
__device__ __forceinline__ double update_one(const UpdateTable<N>& t, const UpdateScalars& s, int64_t e, double z) {
  const int k = tensor_of(t.off, t.count, e);
  const int64_t j = e - t.off[k];
  T* v = static_cast<T*>(t.v[k]) + j;
  double nv = s.reset ? 0.0 : static_cast<double>(*v);
  if (s.has_sum) {
    const double sum = s.sum_f64 ? static_cast<const double*>(t.sum[k])[j]
                                 : static_cast<double>(static_cast<const T*>(t.sum[k])[j]);
    nv = __dadd_rn(nv, __dmul_rn(s.scale, sum));
  }
  if (s.noise) nv = __dadd_rn(nv, __dmul_rn(s.sigma, z));
  const T vt = static_cast<T>(nv);
  *v = vt;
  if (!s.has_x) return 0.0;
  T* x = static_cast<T*>(t.x[k]) + j;
  const T old = *x;
  const T now = static_cast<T>(__dsub_rn(static_cast<double>(old), __dmul_rn(s.lr, static_cast<double>(vt))));
  if (s.has_prev) static_cast<T*>(t.x_prev[k])[j] = old;
  *x = now;
  const double d = __dsub_rn(static_cast<double>(now), static_cast<double>(old));
  return d * d;
}

template <typename T, int N>
__global__ void __launch_bounds__(kThreads)
    update_pass(const __grid_constant__ UpdateTable<N> t, UpdateScalars s, double* partial, int64_t first_block) {
  const int64_t e0 = t.off[0], e1 = t.off[t.count];
  const int64_t pairs_end = (e1 + 1) >> 1;
  double sq = 0.0;
  for (int64_t p = (e0 >> 1) + static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; p < pairs_end;
       p += static_cast<int64_t>(gridDim.x) * kThreads) {
    double z0 = 0.0, z1 = 0.0;
    if (s.noise) philox::gaussian_pair(s.key.seed, s.key.stream, s.key.step, static_cast<uint64_t>(p), z0, z1);
    const int64_t e = 2 * p;
    if (e >= e0) sq += update_one<T>(t, s, e, z0);  // the pair's first element may belong to the previous launch
    if (e + 1 < e1) sq += update_one<T>(t, s, e + 1, z1);
  }
  if (partial == nullptr) return;  // uniform over the grid
  sq = block_sum(sq);
  if (threadIdx.x == 0) partial[first_block + blockIdx.x] = sq;
}

__global__ void __launch_bounds__(kThreads) step_norm_pass(const double* partial, int64_t n, double* out) {
  double s = 0.0;
  for (int64_t i = threadIdx.x; i < n; i += kThreads) s += partial[i];
  s = block_sum(s);
  if (threadIdx.x == 0) *out = sqrt(s);
}

__global__ void __launch_bounds__(kThreads) philox_pass(uint32_t* out, int64_t n_blocks, NoiseKey key) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; i < n_blocks;
       i += static_cast<int64_t>(gridDim.x) * kThreads) {
    const philox::Block b = philox::block_at(key.seed, key.stream, key.step, static_cast<uint64_t>(i));
    for (int w = 0; w < 4; ++w) out[4 * i + w] = b.w[w];
  }
}

unsigned grid_for(int64_t items, int device) {
  const int64_t cap = static_cast<int64_t>(sm_count(device)) * kBlocksPerSm;
  return static_cast<unsigned>(std::max<int64_t>(1, std::min(ceil_div(items, kThreads), cap)));
}

template <typename T, int N>
void run(const UpdateArgs& a, cudaStream_t stream, int device) {
  const int K = static_cast<int>(a.v.size());
  const bool has_sum = !a.sum.empty(), has_x = !a.x.empty(), has_prev = !a.x_prev.empty();
  const UpdateScalars s{a.scale, a.sigma, a.lr, a.key, a.reset, a.sigma > 0.0, has_sum, has_x, has_prev,
                        has_sum && a.sum_f64};

  std::vector<UpdateTable<N>> tables;
  int64_t offset = 0;
  for (int k0 = 0; k0 < K; k0 += N) {
    UpdateTable<N>& t = tables.emplace_back();  // value-initialised: unused slots are zero
    t.count = std::min(N, K - k0);
    t.off[0] = offset;
    for (int q = 0; q < t.count; ++q) {
      const int k = k0 + q;
      t.v[q] = a.v[k].data;
      if (has_sum) t.sum[q] = a.sum[k].data;
      if (has_x) t.x[q] = a.x[k].data;
      if (has_prev) t.x_prev[q] = a.x_prev[k].data;
      t.off[q + 1] = t.off[q] + a.v[k].size;
    }
    offset = t.off[t.count];
  }

  std::vector<unsigned> grids;
  int64_t blocks = 0;
  for (const UpdateTable<N>& t : tables) {
    const int64_t pairs = ((t.off[t.count] + 1) >> 1) - (t.off[0] >> 1);
    grids.push_back(t.off[t.count] > t.off[0] ? grid_for(pairs, device) : 0);
    blocks += grids.back();
  }
  const bool reduce = has_x && a.step_norm != nullptr;
  double* partial = reduce ? static_cast<double*>(workspace(device, stream, sizeof(double) * blocks)) : nullptr;

  int64_t first = 0;
  for (size_t c = 0; c < tables.size(); ++c) {
    if (grids[c] == 0) continue;
    update_pass<T, N><<<grids[c], kThreads, 0, stream>>>(tables[c], s, partial, first);
    check_launch("noisy update");
    first += grids[c];
  }
  if (a.step_norm) {
    step_norm_pass<<<1, kThreads, 0, stream>>>(partial, reduce ? blocks : 0, a.step_norm);
    check_launch("step norm");
  }
}

template <typename T>
void dispatch_table(const UpdateArgs& a, cudaStream_t stream, int device) {
  if (a.v.size() <= static_cast<size_t>(kSmallTable))
    run<T, kSmallTable>(a, stream, device);
  else
    run<T, kLargeTable>(a, stream, device);
}

}  // namespace
}  // namespace cuda

void noisy_update_cuda(const UpdateArgs& args, void* stream_handle) {
  validate(args);
  const cuda::RelaxedCapture relaxed;
  cuda::DeviceCheck devices;
  for (size_t k = 0; k < args.v.size(); ++k) {
    if (args.v[k].size == 0) continue;
    const int index = static_cast<int>(k);
    devices.add(args.v[k].data, "v", index);
    if (!args.sum.empty()) devices.add(args.sum[k].data, "sum", index);
    if (!args.x.empty()) devices.add(args.x[k].data, "params", index);
    if (!args.x_prev.empty()) devices.add(args.x_prev[k].data, "params_prev", index);
  }
  devices.add(args.step_norm, "step_norm");
  const int device = devices.device();
  const cuda::DeviceGuard guard(device);
  const auto stream = static_cast<cudaStream_t>(stream_handle);
  if (args.sigma > 0.0) {
    // The noise key is a launch argument: a captured graph would add the same noise on every replay.
    cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
    if (cudaStreamIsCapturing(stream, &status) == cudaSuccess && status != cudaStreamCaptureStatusNone)
      throw ArgumentError("sigma: a noisy update cannot be captured in a CUDA graph (every replay would add "
                          "the same noise); capture the noise-free part only");
  }
  if (args.dtype == DType::f32)
    cuda::dispatch_table<float>(args, stream, device);
  else
    cuda::dispatch_table<double>(args, stream, device);
}

void philox_words_cuda(uint32_t* out, int64_t n_blocks, NoiseKey key, void* stream_handle) {
  if (n_blocks < 0) throw ArgumentError("n_blocks: must be >= 0");
  if (n_blocks == 0) return;
  if (out == nullptr) throw ArgumentError("out is null");
  const cuda::RelaxedCapture relaxed;
  cuda::DeviceCheck devices;
  devices.add(out, "out");
  const int device = devices.device();
  const cuda::DeviceGuard guard(device);
  cuda::philox_pass<<<cuda::grid_for(n_blocks, device), cuda::kThreads, 0,
                      static_cast<cudaStream_t>(stream_handle)>>>(out, n_blocks, key);
  cuda::check_launch("philox words");
}

}  // namespace dpvr
