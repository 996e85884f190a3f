// Baseline instruction set (whatever the compiler targets by default).
#define DPVR_ISA base
#include "kernels_impl.h"

namespace dpvr::cpu {
int64_t clip_accumulate_base(const ClipArgs& a, bool write) { return base::clip_accumulate(a, write); }
void noisy_update_base(const UpdateArgs& a) { base::noisy_update(a); }
}  // namespace dpvr::cpu
