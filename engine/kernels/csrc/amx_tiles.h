// The AMX tile unit's process permission and tile configuration, shared by the engine's C++ CPU
// kernels (engine/kernels/panel_linear, engine/kernels/attention). Header-only: each kernel's build includes it
// and engine/kernels/cpp_build.py keys the build on its contents. Defines TOKENMILL_AMX where the build
// targets AMX-BF16 (-march=native on such a CPU); elsewhere it declares nothing.
//
// Each kernel configures its thread's tiles before a call's (or work item's) tile code and
// releases them after: oneDNN and torch's brgemm, which use the tile unit too, configure again
// on their next use (oneDNN compares the loaded configuration; torch forgets its own on release).
#pragma once

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define TOKENMILL_AMX 1

#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>

namespace tokenmill_amx {

// Whether this process may use the tile registers: Linux grants them on request, once per process
// (the grant is inherited by forked children).
inline bool usable() {
  static const bool granted = [] {
    constexpr int kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;  // asm/prctl.h (Linux >= 5.16)
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return granted;
}

// Loads this thread's tile configuration (palette 1): tile t holds rows[t] rows of 64 bytes
// (0: unused).
inline void configure(const int (&rows)[8]) {
  struct alignas(64) {
    uint8_t palette = 1, start_row = 0, reserved[14] = {};
    uint16_t colsb[16] = {};
    uint8_t rows[16] = {};
  } config;
  for (int t = 0; t < 8; ++t) {
    config.rows[t] = uint8_t(rows[t]);
    config.colsb[t] = rows[t] > 0 ? 64 : 0;
  }
  _tile_loadconfig(&config);
}

}  // namespace tokenmill_amx
#endif
