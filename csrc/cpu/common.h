// Helpers shared by the CPU kernels: OpenMP shims and the column space of a list of tensors.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif

namespace dpvr {
namespace cpu {

inline int thread_count() {
#ifdef _OPENMP
  return omp_get_max_threads();
#else
  return 1;
#endif
}

inline int thread_id() {
#ifdef _OPENMP
  return omp_get_thread_num();
#else
  return 0;
#endif
}

inline int team_size() {
#ifdef _OPENMP
  return omp_get_num_threads();
#else
  return 1;
#endif
}

// A run of consecutive columns of one tensor: columns [begin, end) of tensor k.
struct Piece {
  int k;
  int64_t begin;
  int64_t end;
};

// Splits the concatenated column space [lo, hi) of tensors with the given widths into per-tensor pieces.
inline std::vector<Piece> pieces_of(const std::vector<int64_t>& widths, int64_t lo, int64_t hi) {
  std::vector<Piece> out;
  int64_t offset = 0;
  for (int k = 0; k < static_cast<int>(widths.size()); ++k) {
    const int64_t a = std::max(lo, offset), b = std::min(hi, offset + widths[k]);
    if (a < b) out.push_back({k, a - offset, b - offset});
    offset += widths[k];
  }
  return out;
}

template <typename T>
constexpr double unit_roundoff() {
  return sizeof(T) == 4 ? 5.9604644775390625e-08 : 1.1102230246251565e-16;
}

}  // namespace cpu
}  // namespace dpvr
