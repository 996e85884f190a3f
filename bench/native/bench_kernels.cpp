// Native microbenchmark of the CPU kernels, without Python: GB/s of per-sample data against a read roofline
// (an OpenMP sum over the same bytes) measured in the same run.
//
//   cmake -S . -B build/bench -DDPVR_BUILD_NATIVE_BENCH=ON -DDPVR_CUDA=OFF && cmake --build build/bench
//   build/bench/dpvr_native_bench [batch] [repeats]
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

#include "dpvr/core.h"

namespace {

template <typename F>
double median_ms(F&& f, int repeats) {
  f();  // warm-up
  std::vector<double> t;
  for (int r = 0; r < repeats; ++r) {
    const auto a = std::chrono::steady_clock::now();
    f();
    t.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - a).count());
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

double read_all(const std::vector<float>& data) {
  double total = 0.0;
#pragma omp parallel for simd reduction(+ : total) schedule(static)
  for (int64_t i = 0; i < static_cast<int64_t>(data.size()); ++i) total += data[i];
  return total;
}

}  // namespace

int main(int argc, char** argv) {
  const int64_t batch = argc > 1 ? std::atoll(argv[1]) : 256;
  const int repeats = argc > 2 ? std::atoi(argv[2]) : 9;
  const std::vector<int64_t> widths = {256 * 784, 256, 128 * 256, 128, 128, 1};  // 784-256-128-1 MLP
  int64_t d = 0;
  for (int64_t w : widths) d += w;

  std::mt19937 rng(0);
  std::normal_distribution<float> normal;
  std::vector<float> g(batch * d), h(batch * d), out(d), v(d), x(d), prev(d);
  for (auto& e : g) e = normal(rng);
  for (auto& e : h) e = normal(rng);

  dpvr::ClipArgs plain;
  plain.dtype = dpvr::DType::f32;
  plain.batch = batch;
  plain.clip = 1.0;
  int64_t offset = 0;
  for (int64_t w : widths) {  // each tensor is a column block of the (batch x d) row-major array
    plain.g.push_back({g.data() + offset, batch, w, d, 1});
    plain.out.push_back({out.data() + offset, w});
    offset += w;
  }
  dpvr::ClipArgs diff = plain;
  offset = 0;
  for (int64_t w : widths) {
    diff.h.push_back({h.data() + offset, batch, w, d, 1});
    offset += w;
  }
  dpvr::UpdateArgs update;
  update.dtype = dpvr::DType::f32;
  update.v = {{v.data(), d}};
  update.sum = {{out.data(), d}};
  update.x = {{x.data(), d}};
  update.x_prev = {{prev.data(), d}};
  update.sigma = 1.0;
  update.lr = 0.1;
  double step_norm = 0.0;
  update.step_norm = &step_norm;

  const double bytes = static_cast<double>(batch) * d * sizeof(float);
  volatile double sink = 0.0;
  const double roof = median_ms([&] { sink = sink + read_all(g); }, repeats);
  const double clip = median_ms([&] { dpvr::clip_accumulate_cpu(plain); }, repeats);
  const double dif = median_ms([&] { dpvr::clip_accumulate_cpu(diff); }, repeats);
  const double upd = median_ms([&] { ++update.key.step; dpvr::noisy_update_cpu(update); }, repeats);

  std::printf("batch=%lld d=%lld threads=%d\n", static_cast<long long>(batch), static_cast<long long>(d),
              dpvr::max_threads());
  std::printf("%-22s %10s %10s %12s\n", "kernel", "ms", "GB/s", "of roofline");
  const double roof_gbps = bytes / roof / 1e6;
  auto row = [&](const char* name, double ms, double data) {
    std::printf("%-22s %10.3f %10.2f %12.3f\n", name, ms, data / ms / 1e6, data / ms / 1e6 / roof_gbps);
  };
  row("read roofline", roof, bytes);
  row("clip_accumulate", clip, bytes);
  row("clip_accumulate_diff", dif, 2 * bytes);
  row("noisy_update", upd, d * 6.0 * sizeof(float));  // v, x read+written; sum read; x_prev written
  return 0;
}
