// Reduction kernels. Work goes in L1-sized blocks: each input is converted (if needed) into
// a float32 block and folded into an accumulator block, so n-way reductions read every input
// once and round once. Each dtype entry point is compiled three times (x86-64-v4 / v3 /
// baseline) and the loader picks the best one the CPU supports.
#include "myccl/cpu/Reduce.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <stdexcept>
#include <string>
#include <type_traits>

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define MYCCL_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define MYCCL_CLONES
#endif
#define MYCCL_INLINE inline __attribute__((always_inline))

namespace myccl::cpu {

namespace {

struct bf16_t {
  uint16_t v;
};
struct c64_t {
  float re, im;
};
struct c128_t {
  double re, im;
};
struct f16_t {
  uint16_t v;
};

constexpr size_t kBlock = 512;

// ---- element conversions -------------------------------------------------------------------
template <typename S, typename A>
struct Conv {
  static MYCCL_INLINE void load(A* __restrict d, const S* __restrict s, size_t m) {
    for (size_t j = 0; j < m; ++j) d[j] = static_cast<A>(s[j]);
  }
  static MYCCL_INLINE void store(S* __restrict d, const A* __restrict s, size_t m) {
    for (size_t j = 0; j < m; ++j) d[j] = static_cast<S>(s[j]);
  }
};

template <>
struct Conv<bf16_t, float> {
  static MYCCL_INLINE void load(float* __restrict d, const bf16_t* __restrict s, size_t m) {
    for (size_t j = 0; j < m; ++j) {
      uint32_t u = static_cast<uint32_t>(s[j].v) << 16;
      float f;
      std::memcpy(&f, &u, 4);
      d[j] = f;
    }
  }
  static MYCCL_INLINE void store(bf16_t* __restrict d, const float* __restrict s, size_t m) {
    for (size_t j = 0; j < m; ++j) {
      uint32_t u;
      std::memcpy(&u, &s[j], 4);
      // Round to nearest even; keep NaNs quiet NaNs.
      uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
      bool nan = (u & 0x7fffffffu) > 0x7f800000u;
      d[j].v = static_cast<uint16_t>(nan ? ((u >> 16) | 0x40u) : rounded);
    }
  }
};

// IEEE half <-> float with integer tricks and selects only, so the loops vectorise on every
// instruction set (GCC does not vectorise _Float16 conversions).
template <>
struct Conv<f16_t, float> {
  static MYCCL_INLINE float one(uint16_t h) {
    uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
    uint32_t em = h & 0x7fffu;
    uint32_t bits = em << 13;
    float f;
    std::memcpy(&f, &bits, 4);
    f *= 0x1p112f;  // rebias the exponent; also right for subnormals
    uint32_t fin;
    std::memcpy(&fin, &f, 4);
    uint32_t special = bits | 0x7f800000u;  // inf / nan keep their payload
    uint32_t out = (em >= 0x7c00u ? special : fin) | sign;
    std::memcpy(&f, &out, 4);
    return f;
  }
  static MYCCL_INLINE uint16_t back(float x) {
    uint32_t f;
    std::memcpy(&f, &x, 4);
    uint32_t sign = (f >> 16) & 0x8000u;
    f &= 0x7fffffffu;
    // normal range: round to nearest even by adding half an ulp (+1 if the kept lsb is odd)
    uint32_t normal = (f + (static_cast<uint32_t>(15 - 127) << 23) + 0xfffu + ((f >> 13) & 1u)) >> 13;
    // subnormal range: let the FPU round by adding 0.5 (whose ulp is 2^-24, half's subnormal step)
    float t;
    std::memcpy(&t, &f, 4);
    t += 0.5f;
    uint32_t tb;
    std::memcpy(&tb, &t, 4);
    uint32_t sub = tb - 0x3f000000u;
    uint32_t big = f > 0x7f800000u ? 0x7e00u : 0x7c00u;
    uint32_t r = f >= 0x47800000u ? big : (f < 0x38800000u ? sub : normal);
    return static_cast<uint16_t>(r | sign);
  }
  static MYCCL_INLINE void load(float* __restrict d, const f16_t* __restrict s, size_t m) {
    for (size_t j = 0; j < m; ++j) d[j] = one(s[j].v);
  }
  static MYCCL_INLINE void store(f16_t* __restrict d, const float* __restrict s, size_t m) {
    for (size_t j = 0; j < m; ++j) d[j].v = back(s[j]);
  }
};

template <>
struct Conv<c64_t, c64_t> {
  static MYCCL_INLINE void load(c64_t* d, const c64_t* s, size_t m) { std::memcpy(d, s, m * sizeof(c64_t)); }
  static MYCCL_INLINE void store(c64_t* d, const c64_t* s, size_t m) { std::memcpy(d, s, m * sizeof(c64_t)); }
};
template <>
struct Conv<c128_t, c128_t> {
  static MYCCL_INLINE void load(c128_t* d, const c128_t* s, size_t m) { std::memcpy(d, s, m * sizeof(c128_t)); }
  static MYCCL_INLINE void store(c128_t* d, const c128_t* s, size_t m) { std::memcpy(d, s, m * sizeof(c128_t)); }
};

// ---- operators -----------------------------------------------------------------------------
template <typename A>
struct OpSum {
  MYCCL_INLINE A operator()(A a, A b) const {
    if constexpr (std::is_integral_v<A>) {
      using U = std::make_unsigned_t<A>;
      return static_cast<A>(static_cast<U>(static_cast<U>(a) + static_cast<U>(b)));
    } else {
      return a + b;
    }
  }
};
template <typename A>
struct OpProd {
  MYCCL_INLINE A operator()(A a, A b) const {
    if constexpr (std::is_integral_v<A>) {
      using U = std::make_unsigned_t<A>;
      // Promote unsigned 8/16-bit operands through unsigned int, not int, to avoid overflow UB.
      using W = std::conditional_t<(sizeof(U) < sizeof(unsigned)), unsigned, U>;
      return static_cast<A>(static_cast<U>(static_cast<W>(static_cast<U>(a)) * static_cast<W>(static_cast<U>(b))));
    } else {
      return a * b;
    }
  }
};
// min/max propagate NaN, as torch.minimum / torch.maximum do.
template <typename A>
struct OpMin {
  MYCCL_INLINE A operator()(A a, A b) const {
    if constexpr (std::is_floating_point_v<A>) {
      return (a != a) ? a : ((b != b) ? b : (b < a ? b : a));
    } else {
      return b < a ? b : a;
    }
  }
};
template <typename A>
struct OpMax {
  MYCCL_INLINE A operator()(A a, A b) const {
    if constexpr (std::is_floating_point_v<A>) {
      return (a != a) ? a : ((b != b) ? b : (b > a ? b : a));
    } else {
      return b > a ? b : a;
    }
  }
};
template <typename A>
struct OpAnd {
  MYCCL_INLINE A operator()(A a, A b) const { return a & b; }
};
template <typename A>
struct OpOr {
  MYCCL_INLINE A operator()(A a, A b) const { return a | b; }
};
template <typename A>
struct OpXor {
  MYCCL_INLINE A operator()(A a, A b) const { return a ^ b; }
};
template <typename C>
struct OpCSum {
  MYCCL_INLINE C operator()(C a, C b) const { return C{a.re + b.re, a.im + b.im}; }
};
template <typename C>
struct OpCProd {
  MYCCL_INLINE C operator()(C a, C b) const { return C{a.re * b.re - a.im * b.im, a.re * b.im + a.im * b.re}; }
};

// ---- the blocked kernel --------------------------------------------------------------------
template <typename A>
MYCCL_INLINE void divideBlock(A* acc, size_t m, int64_t divisor) {
  if constexpr (std::is_same_v<A, c64_t> || std::is_same_v<A, c128_t>) {
    using R = std::remove_reference_t<decltype(acc[0].re)>;
    const R d = static_cast<R>(divisor);
    for (size_t j = 0; j < m; ++j) acc[j].re /= d, acc[j].im /= d;
  } else {
    const A d = static_cast<A>(divisor);
    for (size_t j = 0; j < m; ++j) acc[j] = acc[j] / d;
  }
}

template <typename S, typename A, typename Op>
MYCCL_INLINE void runBlocked(S* out, const S* const* ins, int n, size_t count, int64_t divisor) {
  Op op;
  constexpr bool same = std::is_same_v<S, A>;
  if (same && n <= 2 && divisor == 0) {
    // Streaming fast path (the common two-rank case): no accumulator round trip.
    const A* a = reinterpret_cast<const A*>(ins[0]);
    A* o = reinterpret_cast<A*>(out);
    if (n == 1) {
      if (static_cast<const void*>(o) != static_cast<const void*>(a)) std::memcpy(o, a, count * sizeof(A));
      return;
    }
    const A* b = reinterpret_cast<const A*>(ins[1]);
    for (size_t i = 0; i < count; ++i) o[i] = op(a[i], b[i]);
    return;
  }
  alignas(64) A acc[kBlock];
  alignas(64) A tmp[kBlock];
  for (size_t base = 0; base < count; base += kBlock) {
    const size_t m = std::min(kBlock, count - base);
    Conv<S, A>::load(acc, ins[0] + base, m);
    for (int k = 1; k < n; ++k) {
      const A* src;
      if constexpr (same) {
        src = reinterpret_cast<const A*>(ins[k] + base);
      } else {
        Conv<S, A>::load(tmp, ins[k] + base, m);
        src = tmp;
      }
      for (size_t j = 0; j < m; ++j) acc[j] = op(acc[j], src[j]);
    }
    if (divisor != 0) divideBlock(acc, m, divisor);
    Conv<S, A>::store(out + base, acc, m);
  }
}

[[noreturn]] void unsupported(DType dt, RedOp op) {
  throw std::invalid_argument(std::string("reduction ") + redOpName(op) + " is not defined for " + dtypeName(dt));
}

template <typename S, typename A>
MYCCL_INLINE void realKernel(DType dt, RedOp op, void* out, const void* const* ins, int n, size_t count,
                             int64_t divisor) {
  auto o = static_cast<S*>(out);
  auto in = reinterpret_cast<const S* const*>(ins);
  switch (op) {
    case RedOp::Sum: return runBlocked<S, A, OpSum<A>>(o, in, n, count, divisor);
    case RedOp::Prod: return runBlocked<S, A, OpProd<A>>(o, in, n, count, divisor);
    case RedOp::Min: return runBlocked<S, A, OpMin<A>>(o, in, n, count, divisor);
    case RedOp::Max: return runBlocked<S, A, OpMax<A>>(o, in, n, count, divisor);
    default: break;
  }
  if constexpr (std::is_integral_v<A>) {
    switch (op) {
      case RedOp::BAnd: return runBlocked<S, A, OpAnd<A>>(o, in, n, count, divisor);
      case RedOp::BOr: return runBlocked<S, A, OpOr<A>>(o, in, n, count, divisor);
      case RedOp::BXor: return runBlocked<S, A, OpXor<A>>(o, in, n, count, divisor);
      default: break;
    }
  }
  unsupported(dt, op);
}

template <typename C>
MYCCL_INLINE void complexKernel(DType dt, RedOp op, void* out, const void* const* ins, int n, size_t count,
                                int64_t divisor) {
  auto o = static_cast<C*>(out);
  auto in = reinterpret_cast<const C* const*>(ins);
  if (op == RedOp::Sum) return runBlocked<C, C, OpCSum<C>>(o, in, n, count, divisor);
  if (op == RedOp::Prod) return runBlocked<C, C, OpCProd<C>>(o, in, n, count, divisor);
  unsupported(dt, op);
}

// Bool lives in bytes holding 0/1: SUM and MAX are OR, PRODUCT and MIN are AND.
MYCCL_INLINE RedOp boolOp(RedOp op) {
  switch (op) {
    case RedOp::Sum:
    case RedOp::Max:
      return RedOp::BOr;
    case RedOp::Prod:
    case RedOp::Min:
      return RedOp::BAnd;
    default:
      return op;
  }
}

#define MYCCL_ENTRY(NAME, BODY)                                                                  \
  MYCCL_CLONES void NAME(DType dt, RedOp op, void* out, const void* const* ins, int n, size_t count, \
                         int64_t divisor) {                                                      \
    BODY;                                                                                        \
  }

MYCCL_ENTRY(reduceF32, (realKernel<float, float>(dt, op, out, ins, n, count, divisor)))
MYCCL_ENTRY(reduceF64, (realKernel<double, double>(dt, op, out, ins, n, count, divisor)))
MYCCL_ENTRY(reduceF16, (realKernel<f16_t, float>(dt, op, out, ins, n, count, divisor)))
MYCCL_ENTRY(reduceBF16, (realKernel<bf16_t, float>(dt, op, out, ins, n, count, divisor)))
MYCCL_ENTRY(reduceI8, (realKernel<int8_t, int8_t>(dt, op, out, ins, n, count, divisor)))
MYCCL_ENTRY(reduceU8, (realKernel<uint8_t, uint8_t>(dt, op, out, ins, n, count, divisor)))
MYCCL_ENTRY(reduceI16, (realKernel<int16_t, int16_t>(dt, op, out, ins, n, count, divisor)))
MYCCL_ENTRY(reduceI32, (realKernel<int32_t, int32_t>(dt, op, out, ins, n, count, divisor)))
MYCCL_ENTRY(reduceI64, (realKernel<int64_t, int64_t>(dt, op, out, ins, n, count, divisor)))
MYCCL_ENTRY(reduceBool, (realKernel<uint8_t, uint8_t>(dt, boolOp(op), out, ins, n, count, divisor)))
MYCCL_ENTRY(reduceC64, (complexKernel<c64_t>(dt, op, out, ins, n, count, divisor)))
MYCCL_ENTRY(reduceC128, (complexKernel<c128_t>(dt, op, out, ins, n, count, divisor)))

// sum(round(ins[q][i] * s)) in input order. Two statements per element so that no multiply
// is fused into the add (an FMA would round differently from scaling first, then summing).
template <typename T>
MYCCL_INLINE void scaledSum(T* out, const T* const* ins, int n, size_t count, T s) {
  if (n == 2) {
    const T* a = ins[0];
    const T* b = ins[1];
    for (size_t i = 0; i < count; ++i) {
      const T x = a[i] * s;
      const T y = b[i] * s;
      out[i] = x + y;
    }
    return;
  }
  alignas(64) T acc[kBlock];
  for (size_t base = 0; base < count; base += kBlock) {
    const size_t m = std::min(kBlock, count - base);
    for (size_t j = 0; j < m; ++j) acc[j] = ins[0][base + j] * s;
    for (int k = 1; k < n; ++k) {
      const T* src = ins[k] + base;
      for (size_t j = 0; j < m; ++j) {
        const T y = src[j] * s;
        acc[j] = acc[j] + y;
      }
    }
    std::memcpy(out + base, acc, m * sizeof(T));
  }
}

MYCCL_CLONES void scaledSumF32(void* out, const void* const* ins, int n, size_t count, double s) {
  scaledSum<float>(static_cast<float*>(out), reinterpret_cast<const float* const*>(ins), n, count,
                   static_cast<float>(s));
}
MYCCL_CLONES void scaledSumF64(void* out, const void* const* ins, int n, size_t count, double s) {
  scaledSum<double>(static_cast<double*>(out), reinterpret_cast<const double* const*>(ins), n, count, s);
}

template <typename S, typename A>
void scaleTyped(void* data, size_t count, double factor) {
  auto p = static_cast<S*>(data);
  alignas(64) A buf[kBlock];
  const A f = static_cast<A>(factor);  // multiply in the compute type, as torch does
  for (size_t base = 0; base < count; base += kBlock) {
    size_t m = std::min(kBlock, count - base);
    Conv<S, A>::load(buf, p + base, m);
    for (size_t j = 0; j < m; ++j) buf[j] = buf[j] * f;
    Conv<S, A>::store(p + base, buf, m);
  }
}

template <typename C>
void scaleComplex(void* data, size_t count, double factor) {
  auto p = static_cast<C*>(data);
  using R = std::remove_reference_t<decltype(p[0].re)>;
  const R f = static_cast<R>(factor);
  for (size_t i = 0; i < count; ++i) {
    p[i].re *= f;
    p[i].im *= f;
  }
}

}  // namespace

void reduceInto(const ReduceSpec& spec, void* out, const void* const* ins, int n, size_t count) {
  if (count == 0 || n <= 0) return;
  if (spec.scale != 0.0) {
    if (spec.op != RedOp::Sum || spec.divisor != 0 || (spec.dtype != DType::F32 && spec.dtype != DType::F64))
      throw std::invalid_argument(std::string("a scaled sum needs SUM of float32/float64, got ") + redOpName(spec.op) +
                                  " of " + dtypeName(spec.dtype));
    if (spec.dtype == DType::F32) return scaledSumF32(out, ins, n, count, spec.scale);
    return scaledSumF64(out, ins, n, count, spec.scale);
  }
  const int64_t div = spec.divisor;
  switch (spec.dtype) {
    case DType::F32: return reduceF32(spec.dtype, spec.op, out, ins, n, count, div);
    case DType::F64: return reduceF64(spec.dtype, spec.op, out, ins, n, count, div);
    case DType::F16: return reduceF16(spec.dtype, spec.op, out, ins, n, count, div);
    case DType::BF16: return reduceBF16(spec.dtype, spec.op, out, ins, n, count, div);
    case DType::I8: return reduceI8(spec.dtype, spec.op, out, ins, n, count, div);
    case DType::U8: return reduceU8(spec.dtype, spec.op, out, ins, n, count, div);
    case DType::I16: return reduceI16(spec.dtype, spec.op, out, ins, n, count, div);
    case DType::I32: return reduceI32(spec.dtype, spec.op, out, ins, n, count, div);
    case DType::I64: return reduceI64(spec.dtype, spec.op, out, ins, n, count, div);
    case DType::Bool: return reduceBool(spec.dtype, spec.op, out, ins, n, count, div);
    case DType::C64: return reduceC64(spec.dtype, spec.op, out, ins, n, count, div);
    case DType::C128: return reduceC128(spec.dtype, spec.op, out, ins, n, count, div);
    case DType::U32:
    case DType::U64:
    case DType::F8E4M3:
    case DType::F8E5M2:
      break;  // the backend routes these to NCCL only (cpuReducible)
  }
  throw std::invalid_argument(std::string("the CPU kernels do not reduce ") + dtypeName(spec.dtype));
}

MYCCL_CLONES void toFloat32(DType from, const void* in, float* out, size_t count) {
  if (from == DType::BF16) {
    Conv<bf16_t, float>::load(out, static_cast<const bf16_t*>(in), count);
  } else if (from == DType::F16) {
    Conv<f16_t, float>::load(out, static_cast<const f16_t*>(in), count);
  } else {
    throw std::invalid_argument(std::string("toFloat32: unsupported ") + dtypeName(from));
  }
}

MYCCL_CLONES void fromFloat32(DType to, const float* in, void* out, size_t count) {
  if (to == DType::BF16) {
    Conv<bf16_t, float>::store(static_cast<bf16_t*>(out), in, count);
  } else if (to == DType::F16) {
    Conv<f16_t, float>::store(static_cast<f16_t*>(out), in, count);
  } else {
    throw std::invalid_argument(std::string("fromFloat32: unsupported ") + dtypeName(to));
  }
}

void scaleInPlace(DType dt, void* data, size_t count, double factor) {
  switch (dt) {
    case DType::F32: return scaleTyped<float, float>(data, count, factor);
    case DType::F64: return scaleTyped<double, double>(data, count, factor);
    case DType::F16: return scaleTyped<f16_t, float>(data, count, factor);
    case DType::BF16: return scaleTyped<bf16_t, float>(data, count, factor);
    case DType::C64: return scaleComplex<c64_t>(data, count, factor);
    case DType::C128: return scaleComplex<c128_t>(data, count, factor);
    default: throw std::invalid_argument(std::string("PREMUL_SUM is not defined for ") + dtypeName(dt));
  }
}

const char* reduceIsa() {
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq"))
    return "x86-64-v4 (avx512)";
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return "x86-64-v3 (avx2)";
#endif
  return "baseline";
}

}  // namespace myccl::cpu
