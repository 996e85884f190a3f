// AVX-512 copy of the kernels (x86-64; chosen at run time, see DPVR_ISA_BEGIN in common.h). It keeps the AVX2
// copy's Philox intrinsics (DPVR_ISA_AVX2) and lets the compiler vectorise the rest with 512-bit registers.
#define DPVR_ISA avx512
#define DPVR_ISA_AVX2
#define DPVR_ISA_AVX512
#include "kernels_impl.h"

namespace dpvr::cpu {
int64_t clip_accumulate_avx512(const ClipArgs& a, bool write) { return avx512::clip_accumulate(a, write); }
void noisy_update_avx512(const UpdateArgs& a) { avx512::noisy_update(a); }
}  // namespace dpvr::cpu
