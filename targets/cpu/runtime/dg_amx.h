// dg_amx.h: Intel AMX (Advanced Matrix Extensions) tiles for the reduced
// precision products (dg_bf16.h, dg_int8.h).
//
// AMX adds eight tile registers of up to 16 rows x 64 bytes and one instruction
// that multiplies two tiles into a third: 16 x 16 float32 sums of 32 bf16
// products each (tdpbf16ps), or 16 x 16 int32 sums of 64 int8 products each
// (tdpbssd), in ~16 cycles: 8-16 times the multiply-adds of an AVX-512
// instruction. Where the compiler targets AMX (-march=native on Sapphire Rapids
// and later), DG_AMX is 1 and the kernels use tiles once amx_ready() says the
// process may: Linux gives a process the 8 KB of tile state only after it asks
// (arch_prctl ARCH_REQ_XCOMP_PERM), once. DG_AMX=0 in the environment turns the
// tiles off for the process (to compare with the AVX-512 kernels they replace).
//
// Part of the deepgen runtime: hand-written, copied unchanged into every
// generated project that uses it. Header-only, C++17.
#pragma once

#include <cstdint>
#include <cstdlib>
#include <cstring>

#if defined(__AMX_TILE__) && defined(__linux__)
#define DG_AMX 1
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#else
#define DG_AMX 0
#endif

namespace dg {

// Whether this process may use the tiles: compiled for AMX, the kernel grants
// the tile state, and DG_AMX is not "0" in the environment. Asked once.
inline bool amx_ready() {
#if DG_AMX
  static const bool ready = [] {
    const char* env = std::getenv("DG_AMX");
    if (env != nullptr && std::strcmp(env, "0") == 0) return false;
    constexpr long kReqPermission = 0x1023;  // ARCH_REQ_XCOMP_PERM
    constexpr long kTileData = 18;           // XFEATURE_XTILEDATA
    return syscall(SYS_arch_prctl, kReqPermission, kTileData) == 0;
  }();
  return ready;
#else
  return false;
#endif
}

#if DG_AMX
// A tile configuration (palette 1): tile t has rows[t] rows of bytes[t] bytes.
// load() makes it the thread's configuration; the tiles hold zeros until
// loaded. Each thread that runs tile instructions loads one itself.
struct TileConfig {
  alignas(64) uint8_t raw[64] = {};

  TileConfig() { raw[0] = 1; }
  void set(int t, int rows, int bytes) {
    raw[48 + t] = static_cast<uint8_t>(rows);
    const uint16_t b = static_cast<uint16_t>(bytes);
    std::memcpy(raw + 16 + 2 * t, &b, 2);
  }
  void load() const { _tile_loadconfig(raw); }
};

// Releases the thread's tile state at the end of a scope (tilerelease), so that
// a context switch does not save 8 KB for a thread done with the tiles.
struct TileScope {
  explicit TileScope(const TileConfig& config) { config.load(); }
  ~TileScope() { _tile_release(); }
  TileScope(const TileScope&) = delete;
  TileScope& operator=(const TileScope&) = delete;
};
#endif

}  // namespace dg
