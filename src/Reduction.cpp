// Names and properties of the element types and operators (shared by both engines).
#include "myccl/Reduction.hpp"

namespace myccl {

size_t dtypeSize(DType dt) {
  switch (dt) {
    case DType::F32: return 4;
    case DType::F64: return 8;
    case DType::F16: return 2;
    case DType::BF16: return 2;
    case DType::I8: return 1;
    case DType::U8: return 1;
    case DType::I16: return 2;
    case DType::I32: return 4;
    case DType::I64: return 8;
    case DType::Bool: return 1;
    case DType::C64: return 8;
    case DType::C128: return 16;
    case DType::U32: return 4;
    case DType::U64: return 8;
    case DType::F8E4M3: return 1;
    case DType::F8E5M2: return 1;
  }
  return 1;
}

const char* dtypeName(DType dt) {
  switch (dt) {
    case DType::F32: return "float32";
    case DType::F64: return "float64";
    case DType::F16: return "float16";
    case DType::BF16: return "bfloat16";
    case DType::I8: return "int8";
    case DType::U8: return "uint8";
    case DType::I16: return "int16";
    case DType::I32: return "int32";
    case DType::I64: return "int64";
    case DType::Bool: return "bool";
    case DType::C64: return "complex64";
    case DType::C128: return "complex128";
    case DType::U32: return "uint32";
    case DType::U64: return "uint64";
    case DType::F8E4M3: return "float8_e4m3fn";
    case DType::F8E5M2: return "float8_e5m2";
  }
  return "?";
}

const char* redOpName(RedOp op) {
  switch (op) {
    case RedOp::Sum: return "SUM";
    case RedOp::Prod: return "PRODUCT";
    case RedOp::Min: return "MIN";
    case RedOp::Max: return "MAX";
    case RedOp::BAnd: return "BAND";
    case RedOp::BOr: return "BOR";
    case RedOp::BXor: return "BXOR";
  }
  return "?";
}

bool isFloating(DType dt) {
  return dt == DType::F32 || dt == DType::F64 || dt == DType::F16 || dt == DType::BF16 || dt == DType::F8E4M3 ||
         dt == DType::F8E5M2;
}

bool isComplex(DType dt) {
  return dt == DType::C64 || dt == DType::C128;
}

bool cpuReducible(DType dt) {
  return dt != DType::U32 && dt != DType::U64 && dt != DType::F8E4M3 && dt != DType::F8E5M2;
}

}  // namespace myccl
