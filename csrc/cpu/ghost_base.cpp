// Baseline instruction set copy of the ghost-norm kernel.
#define DPVR_ISA base
#include "ghost_impl.h"

namespace dpvr::cpu {
void ghost_norms_base(const GhostNormArgs& a) { base::ghost_norms(a); }
}  // namespace dpvr::cpu
