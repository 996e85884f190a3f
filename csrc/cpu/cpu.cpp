// Public CPU entry points: validation, the non-finite policy, and the choice of instruction set.
#include <string>

#include "common.h"
#include "dpvr/core.h"
#include "dpvr/philox.h"

namespace dpvr {
namespace cpu {
int64_t clip_accumulate_base(const ClipArgs& a, bool write);
void noisy_update_base(const UpdateArgs& a);
#ifdef DPVR_HAVE_AVX2
int64_t clip_accumulate_avx2(const ClipArgs& a, bool write);
void noisy_update_avx2(const UpdateArgs& a);
#endif
#ifdef DPVR_HAVE_AVX512
int64_t clip_accumulate_avx512(const ClipArgs& a, bool write);
void noisy_update_avx512(const UpdateArgs& a);
#endif

namespace {
int64_t clip_pass(const ClipArgs& a, bool write) {
#ifdef DPVR_HAVE_AVX512
  if (use_avx512()) return clip_accumulate_avx512(a, write);
#endif
#ifdef DPVR_HAVE_AVX2
  if (use_avx2()) return clip_accumulate_avx2(a, write);
#endif
  return clip_accumulate_base(a, write);
}
}  // namespace
}  // namespace cpu

int64_t clip_accumulate_cpu(const ClipArgs& args) {
  validate(args);
  if (args.nonfinite == NonFinite::raise && (!args.out.empty() || args.norms)) {
    // Look before writing anything, so a failing call leaves every output untouched.
    const int64_t bad = cpu::clip_pass(args, false);
    if (bad > 0) throw NonFiniteError(std::to_string(bad) + " sample(s) have non-finite gradients or weights");
  }
  return cpu::clip_pass(args, true);
}

void noisy_update_cpu(const UpdateArgs& args) {
  validate(args);
#ifdef DPVR_HAVE_AVX512
  if (cpu::use_avx512()) return cpu::noisy_update_avx512(args);
#endif
#ifdef DPVR_HAVE_AVX2
  if (cpu::use_avx2()) return cpu::noisy_update_avx2(args);
#endif
  cpu::noisy_update_base(args);
}

void philox_words_cpu(uint32_t* out, int64_t n_blocks, NoiseKey key) {
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n_blocks; ++i) {
    const philox::Block b = philox::block_at(key.seed, key.stream, key.step, static_cast<uint64_t>(i));
    for (int w = 0; w < 4; ++w) out[4 * i + w] = b.w[w];
  }
}

int max_threads() { return cpu::thread_count(); }

const char* cpu_instruction_set() { return cpu::instruction_set(); }

}  // namespace dpvr
