// CUDA clip-accumulate (plain, weighted and difference forms), same semantics as the CPU backend.
//
// Three passes; those that read the tensors take one launch per table of up to kLargeTable tensors (common.cuh):
//   1. norm pass: block (column tile, sample) sums the squares of its tile in double -> one partial per
//      (sample, tile). float64 tiles also record their largest |u|, for the overflow rescue below.
//   2. factor pass: one warp per sample sums its partials in a fixed order, and computes the clip factor and the
//      reported norm exactly as the CPU Clipper does.
//   3. accumulation pass: each thread owns one column and walks the samples in order, out[j] += sum_i f_i u_ij
//      (no atomics: the result is deterministic). When there are too few columns to fill the GPU, the samples
//      are split into slices whose column sums go to the workspace and are added in slice order by a finish pass.
// The per-sample vector u_i is computed in T by the same expression as on the CPU (a*g - b*h, no contraction),
// so both backends clip the same vector and the one whose norm was bounded is the one that is added.
#include <algorithm>
#include <string>
#include <type_traits>
#include <vector>

#include "common.cuh"

namespace dpvr {
namespace cuda {
namespace {

constexpr int64_t kMinTile = 4096;  // columns per norm-pass block, at least (16 per thread)
constexpr int kUnroll = 8;          // samples in flight per thread in the accumulation pass

template <int N>
struct ClipTable {
  int count;  // tensors in this launch
  const void* g[N];
  const void* h[N];
  void* out[N];
  bool out_f64;  // out holds double (else T)
  int64_t g_row[N], g_col[N], h_row[N], h_col[N];
  int64_t off[N + 1];  // column offsets of the tensors within this launch; off[count] is its width
};

// Norm-pass results, entry (sample i, tile b) at [i * stride + b]; tiles are numbered across launches.
struct Partials {
  double* ss;      // sum of squares of u over the tile
  double* peak;    // float64 only: largest |u| over the tile
  double* scaled;  // float64 only: sum of (u / peak)^2, written only for tiles whose sum of squares overflowed
  int64_t stride;
};

// Products and differences in T without contraction into fma: the CPU computes u_i the same way.
__device__ __forceinline__ float mul(float x, float y) { return __fmul_rn(x, y); }
__device__ __forceinline__ double mul(double x, double y) { return __dmul_rn(x, y); }
__device__ __forceinline__ float sub(float x, float y) { return __fsub_rn(x, y); }
__device__ __forceinline__ double sub(double x, double y) { return __dsub_rn(x, y); }

// Sample i's entries of one tensor.
template <typename T, bool Diff>
struct Row {
  const T* g;
  const T* h;
  int64_t gs, hs;
  T a, b;
  __device__ __forceinline__ double operator()(int64_t j) const {
    if constexpr (Diff)
      return static_cast<double>(sub(mul(a, __ldg(g + j * gs)), mul(b, __ldg(h + j * hs))));
    else
      return static_cast<double>(__ldg(g + j * gs));
  }
};

template <typename T, bool Diff, int N>
__device__ __forceinline__ Row<T, Diff> row_of(const ClipTable<N>& t, int k, int64_t i, const T* a, const T* b) {
  Row<T, Diff> r{static_cast<const T*>(t.g[k]) + i * t.g_row[k], nullptr, t.g_col[k], 0, T(1), T(1)};
  if constexpr (Diff) {
    r.h = static_cast<const T*>(t.h[k]) + i * t.h_row[k];
    r.hs = t.h_col[k];
    if (a) r.a = a[i];
    if (b) r.b = b[i];
  }
  return r;
}

// Calls fn(u) for this thread's share of sample i's entries in columns [lo, hi) of the launch.
template <typename T, bool Diff, int N, typename F>
__device__ __forceinline__ void for_tile(const ClipTable<N>& t, int64_t lo, int64_t hi, int64_t i, const T* a,
                                         const T* b, F&& fn) {
  for (int k = tensor_of(t.off, t.count, lo); k < t.count && t.off[k] < hi; ++k) {
    const Row<T, Diff> r = row_of<T, Diff>(t, k, i, a, b);
    const int64_t end = min(hi, t.off[k + 1]) - t.off[k];
#pragma unroll 4
    for (int64_t j = max(lo, t.off[k]) - t.off[k] + threadIdx.x; j < end; j += kThreads) fn(r(j));
  }
}

template <typename T, bool Diff, int N>
__global__ void __launch_bounds__(kThreads)
    norm_pass(const __grid_constant__ ClipTable<N> t, int64_t batch, int64_t tile, const T* a, const T* b,
              Partials p, int64_t first_tile) {
  // Only float64 data can overflow a double sum of squares (|u| < 2^128 for float32).
  constexpr bool kWide = sizeof(T) == 8;
  const int64_t lo = static_cast<int64_t>(blockIdx.x) * tile;
  const int64_t hi = min(t.off[t.count], lo + tile);
  for (int64_t i = blockIdx.y; i < batch; i += gridDim.y) {
    double ss = 0.0, peak = 0.0;
    for_tile<T, Diff>(t, lo, hi, i, a, b, [&](double u) {
      ss = fma(u, u, ss);  // the square is exact inside the fma: one rounding per term
      if constexpr (kWide) peak = fmax(peak, fabs(u));  // fmax skips NaN; a NaN entry makes ss NaN instead
    });
    ss = block_sum(ss);
    const int64_t slot = i * p.stride + first_tile + blockIdx.x;
    if constexpr (kWide) {
      peak = block_max(peak);
      if (isinf(ss) && isfinite(peak)) {
        // Finite entries whose squares overflow (rare): sum them again scaled by the tile's largest entry.
        double scaled = 0.0;
        for_tile<T, Diff>(t, lo, hi, i, a, b, [&](double u) {
          const double v = u / peak;
          scaled = fma(v, v, scaled);
        });
        scaled = block_sum(scaled);
        if (threadIdx.x == 0) p.scaled[slot] = scaled;
      }
      if (threadIdx.x == 0) p.peak[slot] = peak;
    }
    if (threadIdx.x == 0) p.ss[slot] = ss;
  }
}

// Norm of sample i when its double sum of squares is not finite (float64 only; the whole warp calls it): NaN if
// an entry is not finite, else the norm from tile partials rescaled by the sample's largest entry (as the CPU's
// robust_norm, with the scaling applied per tile).
__device__ double rescued_norm(const Partials& p, int64_t i, int64_t tiles, int lane) {
  const double* ss = p.ss + i * p.stride;
  const double* peak = p.peak + i * p.stride;
  const double* scaled = p.scaled + i * p.stride;
  bool bad = false;
  double top = 0.0;
  for (int64_t b = lane; b < tiles; b += 32) {
    bad |= isnan(ss[b]) || isinf(peak[b]);
    top = fmax(top, peak[b]);
  }
  if (__any_sync(0xffffffffu, bad)) return nan("");
  top = warp_max(top);
  if (!(top > 0.0)) return 0.0;
  double acc = 0.0;
  for (int64_t b = lane; b < tiles; b += 32) {
    const double m = peak[b];
    if (m > 0.0) {
      const double in_tile = isinf(ss[b]) ? scaled[b] : ss[b] / m / m;  // sum of (u / m)^2 over the tile
      const double r = m / top;
      acc = fma(r * r, in_tile, acc);
    }
  }
  return top * sqrt(warp_sum(acc));
}

template <typename T>
__global__ void __launch_bounds__(kThreads)
    factor_pass(int64_t batch, Partials p, int64_t tiles, const T* w, double target, double* factor, T* norms,
                unsigned long long* count) {
  const int lane = threadIdx.x & 31;
  const int64_t i = static_cast<int64_t>(blockIdx.x) * kWarps + (threadIdx.x >> 5);
  if (i >= batch) return;  // whole warps leave together
  double s = 0.0;
  for (int64_t b = lane; b < tiles; b += 32) s += p.ss[i * p.stride + b];
  double n = sqrt(warp_sum(s));
  if constexpr (sizeof(T) == 8) {
    if (!isfinite(n)) n = rescued_norm(p, i, tiles, lane);
  }
  if (lane != 0) return;
  // From here as the CPU Clipper: the weight scales the norm; a non-finite sample gets factor 0 and norm NaN.
  const double weight = w ? static_cast<double>(w[i]) : 1.0;
  n = __dmul_rn(n, fabs(weight));
  double f, norm;
  if (!isfinite(n) || !isfinite(weight)) {
    f = 0.0;
    norm = nan("");
    if (count) atomicAdd(count, 1ull);
  } else {
    norm = n;
    f = n > target ? __dmul_rn(weight, __ddiv_rn(target, n)) : weight;
  }
  factor[i] = f;
  if (norms) norms[i] = static_cast<T>(norm);
}

// out_k[j] += s, rounded once to out's dtype.
template <typename T, int N>
__device__ __forceinline__ void add_out(const ClipTable<N>& t, int k, int64_t j, double s) {
  if (t.out_f64) {
    double* o = static_cast<double*>(t.out[k]) + j;
    *o = __dadd_rn(*o, s);
  } else {
    T* o = static_cast<T*>(t.out[k]) + j;
    *o = static_cast<T>(static_cast<double>(*o) + s);
  }
}

template <typename T, bool Diff, int N>
__global__ void __launch_bounds__(kThreads)
    accumulate_pass(const __grid_constant__ ClipTable<N> t, int64_t batch, int64_t slice, const T* a, const T* b,
                    const double* factor, double* partial) {
  const int64_t width = t.off[t.count];
  const int64_t c = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (c >= width) return;
  const int k = tensor_of(t.off, t.count, c);
  const int64_t j = c - t.off[k];
  const T* g = static_cast<const T*>(t.g[k]) + j * t.g_col[k];
  const T* h = Diff ? static_cast<const T*>(t.h[k]) + j * t.h_col[k] : nullptr;
  const int64_t gr = t.g_row[k], hr = Diff ? t.h_row[k] : 0;
  auto value = [&](int64_t i) -> double {
    if constexpr (Diff) {
      const T ai = a ? a[i] : T(1), bi = b ? b[i] : T(1);
      return static_cast<double>(sub(mul(ai, __ldg(g + i * gr)), mul(bi, __ldg(h + i * hr))));
    } else {
      return static_cast<double>(__ldg(g + i * gr));
    }
  };
  const int64_t i0 = static_cast<int64_t>(blockIdx.y) * slice, i1 = min(batch, i0 + slice);
  double acc = 0.0;
  int64_t i = i0;
  // Loads first, then the fixed-order sum: kUnroll independent loads in flight per thread. A sample with
  // factor 0 (non-finite or zero weight) is skipped by a select, so its NaN/Inf entries never reach acc.
  for (; i + kUnroll <= i1; i += kUnroll) {
    double f[kUnroll], u[kUnroll];
#pragma unroll
    for (int q = 0; q < kUnroll; ++q) {
      f[q] = __ldg(factor + i + q);
      u[q] = value(i + q);
    }
#pragma unroll
    for (int q = 0; q < kUnroll; ++q) acc = f[q] != 0.0 ? fma(f[q], u[q], acc) : acc;
  }
  for (; i < i1; ++i) {
    const double f = __ldg(factor + i), u = value(i);
    acc = f != 0.0 ? fma(f, u, acc) : acc;
  }
  if (partial) {
    partial[static_cast<int64_t>(blockIdx.y) * width + c] = acc;
  } else {
    add_out<T>(t, k, j, acc);
  }
}

// Adds the slice sums of the accumulation pass to out, in slice order.
template <typename T, int N>
__global__ void __launch_bounds__(kThreads)
    finish_pass(const __grid_constant__ ClipTable<N> t, int64_t slices, const double* partial) {
  const int64_t width = t.off[t.count];
  const int64_t c = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (c >= width) return;
  double s = 0.0;
  for (int64_t y = 0; y < slices; ++y) s += partial[y * width + c];
  const int k = tensor_of(t.off, t.count, c);
  add_out<T>(t, k, c - t.off[k], s);
}

// Relative error bound of a computed norm, plus the rounding of clipped entries to T; clipping to
// C * (1 - margin) keeps every clipped vector's norm <= C after rounding. Squares are exact inside fma, so each
// term of the sum of squares meets one rounding per addition on its path to the total: at most
// (entries per thread) + 8 (block tree) + (tiles per lane) + 5 (warp tree) <= D + 13 additions. The rescue
// path, sqrt, the weight product, target / n, the factor product and f * u add fewer than 16 roundings; the
// bound below keeps more than 30 to spare.
template <typename T>
double clip_margin(int64_t columns) {
  constexpr double u64 = 1.1102230246251565e-16;  // 2^-53
  constexpr double u_t = sizeof(T) == 4 ? 5.9604644775390625e-08 : u64;
  return (static_cast<double>(columns) + 64.0) * u64 + 2.0 * u_t;
}

struct Plan {
  int64_t width = 0;       // columns of the launch
  int64_t tile = 0;        // norm pass: columns per block
  int64_t tiles = 0;       // norm pass: blocks per sample
  int64_t first_tile = 0;  // norm pass: index of this launch's first tile among all tiles
  int64_t slice = 0;       // accumulation pass: samples per slice
  int64_t slices = 1;
};

Plan plan_launch(int64_t width, int64_t batch, int sms) {
  Plan p;
  p.width = width;
  // Norm pass: about 32 blocks per SM in total (several waves, so the last one matters little), split over
  // samples first, then over column tiles of at least kMinTile columns.
  const int64_t want_tiles = std::max<int64_t>(1, ceil_div(32LL * sms, batch));
  p.tile = std::max(kMinTile, ceil_div(ceil_div(width, want_tiles), kThreads) * kThreads);
  p.tiles = ceil_div(width, p.tile);
  // Accumulation pass: one thread per column; slice the samples only when the columns alone cannot fill the
  // GPU (2048 threads per SM), keeping at least 32 samples per slice.
  const int64_t want_slices = ceil_div(2048LL * sms, std::max<int64_t>(1, width));
  const int64_t max_slices = std::min<int64_t>(65535, ceil_div(batch, 32));
  const int64_t slices = std::max<int64_t>(1, std::min(want_slices, max_slices));
  p.slice = ceil_div(batch, slices);
  p.slices = ceil_div(batch, p.slice);
  return p;
}

template <typename T, bool Diff, int N>
void run(const ClipArgs& args, cudaStream_t stream, int device, int64_t* user_count) {
  const int K = static_cast<int>(args.g.size());
  const int64_t B = args.batch;
  const bool accumulate = !args.out.empty();

  std::vector<ClipTable<N>> tables;
  int64_t columns = 0;
  for (int k0 = 0; k0 < K; k0 += N) {
    ClipTable<N>& t = tables.emplace_back();  // value-initialised: unused slots are zero
    t.count = std::min(N, K - k0);
    t.out_f64 = args.out_f64 || std::is_same_v<T, double>;
    for (int q = 0; q < t.count; ++q) {
      const Matrix& g = args.g[k0 + q];
      t.g[q] = g.data;
      t.g_row[q] = g.row_stride;
      t.g_col[q] = g.col_stride;
      if constexpr (Diff) {
        const Matrix& h = args.h[k0 + q];
        t.h[q] = h.data;
        t.h_row[q] = h.row_stride;
        t.h_col[q] = h.col_stride;
      }
      if (accumulate) t.out[q] = args.out[k0 + q].data;
      t.off[q + 1] = t.off[q] + g.cols;
    }
    columns += t.off[t.count];
  }

  const int sms = sm_count(device);
  std::vector<Plan> plans;
  int64_t tiles = 0, partial_doubles = 0;
  for (const ClipTable<N>& t : tables) {
    Plan p = plan_launch(t.off[t.count], B, sms);
    p.first_tile = tiles;
    tiles += p.tiles;
    if (accumulate && p.slices > 1) partial_doubles = std::max(partial_doubles, p.slices * p.width);
    plans.push_back(p);
  }

  constexpr bool kWide = sizeof(T) == 8;
  Layout layout;
  const size_t at_factor = layout.reserve<double>(B);
  const size_t at_count = layout.reserve<int64_t>(1);
  const size_t at_ss = layout.reserve<double>(B * tiles);
  const size_t at_peak = layout.reserve<double>(kWide ? B * tiles : 0);
  const size_t at_scaled = layout.reserve<double>(kWide ? B * tiles : 0);
  const size_t at_partial = layout.reserve<double>(partial_doubles);
  void* ws = workspace(device, stream, layout.size());
  double* factor = at<double>(ws, at_factor);
  auto* count = reinterpret_cast<unsigned long long*>(user_count ? user_count : at<int64_t>(ws, at_count));
  const Partials parts{at<double>(ws, at_ss), kWide ? at<double>(ws, at_peak) : nullptr,
                       kWide ? at<double>(ws, at_scaled) : nullptr, tiles};
  double* partial = at<double>(ws, at_partial);

  const T* a = Diff ? static_cast<const T*>(args.w) : nullptr;  // the plain form's w is a weight (below)
  const T* b = Diff ? static_cast<const T*>(args.b) : nullptr;
  const T* weights = Diff ? nullptr : static_cast<const T*>(args.w);
  T* norms = static_cast<T*>(args.norms);
  const bool look_first = args.nonfinite == NonFinite::raise && (accumulate || norms);

  check(cudaMemsetAsync(count, 0, sizeof(int64_t), stream), "cudaMemsetAsync");
  for (size_t c = 0; c < tables.size(); ++c) {
    const Plan& p = plans[c];
    if (p.tiles == 0) continue;
    const dim3 grid(static_cast<unsigned>(p.tiles), static_cast<unsigned>(std::min<int64_t>(B, 65535)));
    norm_pass<T, Diff, N><<<grid, kThreads, 0, stream>>>(tables[c], B, p.tile, a, b, parts, p.first_tile);
    check_launch("norm pass");
  }

  const double target = args.clip * (1.0 - clip_margin<T>(columns));
  const unsigned factor_blocks = static_cast<unsigned>(ceil_div(B, kWarps));
  if (look_first) {
    // nonfinite = raise: count first, and fail before any output is written. This waits for the device.
    factor_pass<T><<<factor_blocks, kThreads, 0, stream>>>(B, parts, tiles, weights, target, factor, nullptr,
                                                           count);
    check_launch("factor pass");
    int64_t bad = 0;
    check(cudaMemcpyAsync(&bad, count, sizeof(bad), cudaMemcpyDeviceToHost, stream), "cudaMemcpyAsync");
    check(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
    if (bad > 0) throw NonFiniteError(std::to_string(bad) + " sample(s) have non-finite gradients or weights");
    if (norms) {
      factor_pass<T><<<factor_blocks, kThreads, 0, stream>>>(B, parts, tiles, weights, target, factor, norms,
                                                             nullptr);
      check_launch("factor pass");
    }
  } else {
    factor_pass<T><<<factor_blocks, kThreads, 0, stream>>>(B, parts, tiles, weights, target, factor, norms, count);
    check_launch("factor pass");
  }
  if (!accumulate) return;

  for (size_t c = 0; c < tables.size(); ++c) {
    const Plan& p = plans[c];
    if (p.width == 0) continue;
    const unsigned blocks = static_cast<unsigned>(ceil_div(p.width, kThreads));
    const dim3 grid(blocks, static_cast<unsigned>(p.slices));
    accumulate_pass<T, Diff, N><<<grid, kThreads, 0, stream>>>(tables[c], B, p.slice, a, b, factor,
                                                                p.slices > 1 ? partial : nullptr);
    check_launch("accumulation pass");
    if (p.slices > 1) {
      finish_pass<T, N><<<blocks, kThreads, 0, stream>>>(tables[c], p.slices, partial);
      check_launch("accumulation finish");
    }
  }
}

template <typename T, bool Diff>
void dispatch_table(const ClipArgs& args, cudaStream_t stream, int device, int64_t* count) {
  if (args.g.size() <= static_cast<size_t>(kSmallTable))
    run<T, Diff, kSmallTable>(args, stream, device, count);
  else
    run<T, Diff, kLargeTable>(args, stream, device, count);
}

template <typename T>
void dispatch_form(const ClipArgs& args, cudaStream_t stream, int device, int64_t* count) {
  if (args.h.empty())
    dispatch_table<T, false>(args, stream, device, count);
  else
    dispatch_table<T, true>(args, stream, device, count);
}

}  // namespace
}  // namespace cuda

void clip_accumulate_cuda(const ClipArgs& args, void* stream_handle, int64_t* nonfinite_count) {
  validate(args);
  const auto stream = static_cast<cudaStream_t>(stream_handle);
  cuda::RelaxedCapture relaxed;
  if (args.nonfinite == NonFinite::raise && (!args.out.empty() || args.norms)) {
    cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
    cuda::check(cudaStreamIsCapturing(stream, &status), "cudaStreamIsCapturing");
    if (status != cudaStreamCaptureStatusNone)
      throw ArgumentError("nonfinite: 'raise' waits for the device and cannot be captured in a CUDA graph");
  }
  cuda::DeviceCheck devices;
  for (size_t k = 0; k < args.g.size(); ++k) {
    const int index = static_cast<int>(k);
    if (args.g[k].cols > 0) devices.add(args.g[k].data, "grads", index);
    if (!args.h.empty() && args.h[k].cols > 0) devices.add(args.h[k].data, "grads_prev", index);
    if (!args.out.empty() && args.out[k].size > 0) devices.add(args.out[k].data, "out", index);
  }
  devices.add(args.w, args.h.empty() ? "weights" : "a");
  devices.add(args.b, "b");
  devices.add(args.norms, "norms");
  devices.add(nonfinite_count, "nonfinite_count");
  const cuda::DeviceGuard guard(devices.device());
  if (args.dtype == DType::f32)
    cuda::dispatch_form<float>(args, stream, devices.device(), nonfinite_count);
  else
    cuda::dispatch_form<double>(args, stream, devices.device(), nonfinite_count);
}

}  // namespace dpvr
