// Native microbenchmark of every CPU kernel of the core, without Python: GB/s of the data each kernel must
// move, against a read roofline (an OpenMP sum over the per-sample data, all threads).
//
//   cmake -S . -B build/bench -DDPVR_BUILD_NATIVE_BENCH=ON -DDPVR_CUDA=OFF && cmake --build build/bench
//   build/bench/dpvr_native_bench [batch] [repeats] [mlp|linear]
//
// Each timed call is paired with a roofline run right before it, and "of roofline" is the median of the
// per-pair ratios: on a shared machine the load changes during a run, and a ratio of neighbours follows it
// better than a ratio of two medians taken seconds apart. Bytes counted per kernel:
//   clip_accumulate*      the per-sample data, once (twice that for the difference form);
//   noisy_update          v read + written, sum read, x read + written, x_prev written (6 D values);
//   add_noise             v read + written (2 D values);  philox_words: the words written;
//   ghost_norms           every input (activations, output gradients, indices, dense rows);
//   clip_factors          squared norms read, factors and norms written.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "dpvr/core.h"
#include "dpvr/ghost.h"

namespace {

double elapsed_ms(const std::function<void()>& f) {
  const auto a = std::chrono::steady_clock::now();
  f();
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - a).count();
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

double read_all(const std::vector<float>& data) {
  double total = 0.0;
#pragma omp parallel for simd reduction(+ : total) schedule(static)
  for (int64_t i = 0; i < static_cast<int64_t>(data.size()); ++i) total += data[i];
  return total;
}

struct Bench {
  const std::vector<float>& data;  // the per-sample data the roofline reads
  int repeats;
  volatile double sink = 0.0;

  double roofline_ms() {
    return elapsed_ms([&] { sink = sink + read_all(data); });
  }

  // Prints ms (median), GB/s of `bytes` at that median, and the median ratio to the paired roofline runs.
  void row(const char* name, double bytes, const std::function<void()>& f) {
    f();  // warm-up
    std::vector<double> ms, ratio;
    const double roof_bytes = static_cast<double>(data.size()) * sizeof(float);
    for (int r = 0; r < repeats; ++r) {
      const double roof = roofline_ms();
      const double t = elapsed_ms(f);
      ms.push_back(t);
      ratio.push_back((bytes / t) / (roof_bytes / roof));
    }
    const double m = median(ms);
    std::printf("%-30s %10.3f %10.2f %12.3f\n", name, m, bytes / m / 1e6, median(ratio));
  }
};

std::vector<float> normal_values(size_t n, unsigned seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal;
  std::vector<float> v(n);
  for (auto& e : v) e = normal(rng);
  return v;
}

// A B x T x width sequence stored contiguously.
dpvr::Sequence sequence(const std::vector<float>& v, int64_t batch, int64_t steps, int64_t width) {
  return {v.data(), batch, steps, width, steps * width, width, 1};
}

}  // namespace

int main(int argc, char** argv) {
  const int64_t batch = argc > 1 ? std::atoll(argv[1]) : 256;
  const int repeats = argc > 2 ? std::atoi(argv[2]) : 9;
  const std::string model = argc > 3 ? argv[3] : "mlp";
  if (batch <= 0 || repeats <= 0 || (model != "mlp" && model != "linear")) {
    std::fprintf(stderr, "usage: %s [batch > 0] [repeats > 0] [mlp|linear]\n", argv[0]);
    return 2;
  }
  // Parameter tensors (weight, bias per layer) of a 784-256-128-1 MLP or of one 1024 x 1024 linear map.
  const std::vector<std::pair<int64_t, int64_t>> layers =
      model == "mlp" ? std::vector<std::pair<int64_t, int64_t>>{{784, 256}, {256, 128}, {128, 1}}
                     : std::vector<std::pair<int64_t, int64_t>>{{1024, 1024}};
  std::vector<int64_t> widths;
  for (const auto& [p, q] : layers) widths.insert(widths.end(), {p * q, q});
  int64_t d = 0;
  for (int64_t w : widths) d += w;

  const std::vector<float> g = normal_values(batch * d, 1), h = normal_values(batch * d, 2);
  std::vector<float> out(d), v(d), x(d), prev(d), weights(batch, 0.5f);
  dpvr::ClipArgs plain;
  plain.dtype = dpvr::DType::f32;
  plain.batch = batch;
  plain.clip = 1.0;
  int64_t offset = 0;
  for (int64_t w : widths) {  // each tensor is a column block of the (batch x d) row-major array
    plain.g.push_back({const_cast<float*>(g.data()) + offset, batch, w, d, 1});
    plain.out.push_back({out.data() + offset, w});
    offset += w;
  }
  dpvr::ClipArgs weighted = plain, norms_only = plain, diff = plain;
  weighted.w = weights.data();
  norms_only.out.clear();
  std::vector<float> norms(batch);
  norms_only.norms = norms.data();
  offset = 0;
  for (int64_t w : widths) {
    diff.h.push_back({const_cast<float*>(h.data()) + offset, batch, w, d, 1});
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
  dpvr::UpdateArgs no_noise = update, noise_only;
  no_noise.sigma = 0.0;
  noise_only.dtype = dpvr::DType::f32;
  noise_only.v = {{v.data(), d}};
  noise_only.sigma = 1.0;
  std::vector<uint32_t> words(2 * d + 4);

  // Ghost norms of the layers' weights from activations (B x T x p) and output gradients (B x T x q): T = 1
  // is the MLP on one input per sample, T = 16 a sequence model; plus an embedding-like index term and the
  // biases as dense rows.
  struct Layer {
    std::vector<float> act, grad;
  };
  const int64_t steps = 16;
  std::vector<Layer> data1, dataT;
  for (const auto& [p, q] : layers) {
    data1.push_back({normal_values(batch * p, 3), normal_values(batch * q, 4)});
    dataT.push_back({normal_values(batch * steps * p, 5), normal_values(batch * steps * q, 6)});
  }
  auto ghost_args = [&](const std::vector<Layer>& ls, int64_t t, dpvr::NormForm form) {
    dpvr::GhostNormArgs a;
    a.batch = batch;
    double bytes = 0.0;
    for (size_t k = 0; k < layers.size(); ++k) {
      const auto [p, q] = layers[k];
      dpvr::OuterTerm term;
      term.left = {sequence(ls[k].act, batch, t, p)};
      term.right = {sequence(ls[k].grad, batch, t, q)};
      term.form = form;
      a.outer.push_back(term);
      bytes += 4.0 * batch * t * (p + q);
    }
    return std::make_pair(a, bytes);
  };
  std::vector<double> norms_sq(batch);
  auto [gram1, gram1_bytes] = ghost_args(data1, 1, dpvr::NormForm::gram);
  auto [direct1, direct1_bytes] = ghost_args(data1, 1, dpvr::NormForm::direct);
  auto [gramT, gramT_bytes] = ghost_args(dataT, steps, dpvr::NormForm::gram);
  for (auto* a : {&gram1, &direct1, &gramT}) a->norms_sq = norms_sq.data();

  const int64_t vocab = 1000, emb = 64;
  std::vector<int64_t> tokens(batch * steps);
  std::mt19937 rng(7);
  for (auto& e : tokens) e = static_cast<int64_t>(rng() % vocab);
  const std::vector<float> emb_grad = normal_values(batch * steps * emb, 8);
  dpvr::GhostNormArgs index;
  index.batch = batch;
  index.norms_sq = norms_sq.data();
  dpvr::IndexTerm term;
  term.index = {{tokens.data(), batch, steps, steps, 1}};
  term.right = {sequence(emb_grad, batch, steps, emb)};
  index.index = {term};
  const double index_bytes = 8.0 * batch * steps + 4.0 * batch * steps * emb;
  dpvr::GhostNormArgs dense;
  dense.batch = batch;
  dense.norms_sq = norms_sq.data();
  dense.dense = {{const_cast<float*>(g.data()), batch, d, d, 1}};  // every tensor as one dense row per sample
  std::vector<float> factors(batch), factor_norms(batch);
  dpvr::FactorArgs clip_factors;
  clip_factors.dtype = dpvr::DType::f32;
  clip_factors.batch = batch;
  clip_factors.norms_sq = norms_sq.data();
  clip_factors.factors = factors.data();
  clip_factors.norms = factor_norms.data();
  clip_factors.columns = d;

  const double bytes = static_cast<double>(batch) * d * sizeof(float);
  std::printf("model=%s batch=%lld d=%lld threads=%d\n", model.c_str(), static_cast<long long>(batch),
              static_cast<long long>(d), dpvr::max_threads());
  std::printf("%-30s %10s %10s %12s\n", "kernel", "ms", "GB/s", "of roofline");
  Bench bench{g, repeats};
  bench.row("read roofline", bytes, [&] { bench.sink = bench.sink + read_all(g); });
  bench.row("clip_accumulate", bytes, [&] { dpvr::clip_accumulate_cpu(plain); });
  bench.row("clip_accumulate weighted", bytes, [&] { dpvr::clip_accumulate_cpu(weighted); });
  bench.row("clip_accumulate norms only", bytes, [&] { dpvr::clip_accumulate_cpu(norms_only); });
  bench.row("clip_accumulate_diff", 2 * bytes, [&] { dpvr::clip_accumulate_cpu(diff); });
  bench.row("noisy_update", 6.0 * d * sizeof(float), [&] {
    ++update.key.step;
    dpvr::noisy_update_cpu(update);
  });
  bench.row("noisy_update sigma=0", 6.0 * d * sizeof(float), [&] { dpvr::noisy_update_cpu(no_noise); });
  bench.row("add_noise", 2.0 * d * sizeof(float), [&] {
    ++noise_only.key.step;
    dpvr::noisy_update_cpu(noise_only);
  });
  bench.row("philox_words", 4.0 * words.size(),
            [&] { dpvr::philox_words_cpu(words.data(), static_cast<int64_t>(words.size() / 4), {}); });
  bench.row("ghost_norms gram T=1", gram1_bytes, [&] { dpvr::ghost_norms_cpu(gram1); });
  bench.row("ghost_norms direct T=1", direct1_bytes, [&] { dpvr::ghost_norms_cpu(direct1); });
  bench.row("ghost_norms gram T=16", gramT_bytes, [&] { dpvr::ghost_norms_cpu(gramT); });
  bench.row("ghost_norms index T=16", index_bytes, [&] { dpvr::ghost_norms_cpu(index); });
  bench.row("ghost_norms dense", bytes, [&] { dpvr::ghost_norms_cpu(dense); });
  bench.row("clip_factors", 16.0 * batch, [&] { dpvr::clip_factors_cpu(clip_factors); });
  return 0;
}
