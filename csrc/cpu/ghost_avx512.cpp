// AVX-512 copy of the ghost-norm kernel (x86-64; chosen at run time, see DPVR_ISA_BEGIN in common.h).
#define DPVR_ISA avx512
#define DPVR_ISA_AVX2
#define DPVR_ISA_AVX512
#include "ghost_impl.h"

namespace dpvr::cpu {
void ghost_norms_avx512(const GhostNormArgs& a) { avx512::ghost_norms(a); }
}  // namespace dpvr::cpu
