// AVX2 + FMA copy of the ghost-norm kernel (compiled with -mavx2 -mfma on x86-64; chosen at run time).
#define DPVR_ISA avx2
#include "ghost_impl.h"

namespace dpvr::cpu {
void ghost_norms_avx2(const GhostNormArgs& a) { avx2::ghost_norms(a); }
}  // namespace dpvr::cpu
