// CPU noisy estimator update and raw Philox output. Noise is addressed by global element index, so results do
// not depend on the thread count or on how the elements are split into tensors.
#include <cmath>
#include <vector>

#include "common.h"
#include "dpvr/core.h"
#include "dpvr/philox.h"

namespace dpvr {
namespace {

constexpr int64_t kTile = 4096;  // even, so a Gaussian pair never straddles two tiles

template <typename T>
void update(const UpdateArgs& a) {
  const int K = static_cast<int>(a.v.size());
  std::vector<int64_t> widths(K);
  int64_t D = 0;
  for (int k = 0; k < K; ++k) D += (widths[k] = a.v[k].size);
  const bool noise = a.sigma > 0.0, has_sum = !a.sum.empty(), step = !a.x.empty(), keep = !a.x_prev.empty();
  const int64_t tiles = (D + kTile - 1) / kTile;
  const int nt = cpu::thread_count();
  std::vector<double> partial(nt, 0.0);

#pragma omp parallel
  {
    const int t = cpu::thread_id(), team = cpu::team_size();
    double z[kTile];
    double sq = 0.0;
    for (int64_t tile = tiles * t / team; tile < tiles * (t + 1) / team; ++tile) {
      const int64_t lo = tile * kTile, hi = std::min(D, lo + kTile);
      if (noise)
        for (int64_t e = lo; e < hi; e += 2) {
          double z0, z1;
          philox::gaussian_pair(a.key.seed, a.key.stream, a.key.step, static_cast<uint64_t>(e) >> 1, z0, z1);
          z[e - lo] = z0;
          z[e - lo + 1] = z1;
        }
      int64_t base = lo;
      for (const cpu::Piece& p : cpu::pieces_of(widths, lo, hi)) {
        T* v = static_cast<T*>(a.v[p.k].data);
        const T* s = has_sum ? static_cast<const T*>(a.sum[p.k].data) : nullptr;
        T* x = step ? static_cast<T*>(a.x[p.k].data) : nullptr;
        T* xp = keep ? static_cast<T*>(a.x_prev[p.k].data) : nullptr;
        const double* zp = z + (base - lo) - p.begin;
        for (int64_t j = p.begin; j < p.end; ++j) {
          double nv = a.reset ? 0.0 : static_cast<double>(v[j]);
          if (s) nv += a.scale * static_cast<double>(s[j]);
          if (noise) nv += a.sigma * zp[j];
          const T vt = static_cast<T>(nv);
          v[j] = vt;
          if (x) {
            const T old = x[j];
            const T now = static_cast<T>(static_cast<double>(old) - a.lr * static_cast<double>(vt));
            if (xp) xp[j] = old;
            x[j] = now;
            const double d = static_cast<double>(now) - static_cast<double>(old);
            sq += d * d;
          }
        }
        base += p.end - p.begin;
      }
    }
    partial[t] = sq;
  }
  if (a.step_norm) {
    double total = 0.0;
    for (double s : partial) total += s;  // fixed order: deterministic for a given thread count
    *a.step_norm = std::sqrt(total);
  }
}

}  // namespace

void noisy_update_cpu(const UpdateArgs& args) {
  validate(args);
  if (args.dtype == DType::f32)
    update<float>(args);
  else
    update<double>(args);
}

void philox_words_cpu(uint32_t* out, int64_t n_blocks, NoiseKey key) {
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n_blocks; ++i) {
    const philox::Block b = philox::block_at(key.seed, key.stream, key.step, static_cast<uint64_t>(i));
    for (int w = 0; w < 4; ++w) out[4 * i + w] = b.w[w];
  }
}

}  // namespace dpvr
