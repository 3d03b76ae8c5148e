// dtype names, ours and safetensors'.
#include "core/dtype.h"

namespace tessera {

std::string_view dtype_name(DType t) {
    switch (t) {
        case DType::f32:
            return "f32";
        case DType::f64:
            return "f64";
        case DType::bf16:
            return "bf16";
        case DType::i32:
            return "i32";
        case DType::i64:
            return "i64";
        case DType::u8:
            return "u8";
        case DType::u16:
            return "u16";
        case DType::f8e4m3:
            return "f8e4m3";
        case DType::mxfp4:
            return "mxfp4";
    }
    return "?";
}

std::string_view dtype_safetensors_name(DType t) {
    switch (t) {
        case DType::f32:
            return "F32";
        case DType::f64:
            return "F64";
        case DType::bf16:
            return "BF16";
        case DType::i32:
            return "I32";
        case DType::i64:
            return "I64";
        case DType::u8:
            return "U8";
        case DType::u16:
            return "U16";
        case DType::f8e4m3:
            return "F8_E4M3";
        case DType::mxfp4:
            return "?";  // not a safetensors dtype (checkpoints store its packed values and scales as U8)
    }
    return "?";
}

std::optional<DType> dtype_from_safetensors_name(std::string_view name) {
    for (DType t :
         {DType::f32, DType::f64, DType::bf16, DType::i32, DType::i64, DType::u8, DType::u16, DType::f8e4m3}) {
        if (dtype_safetensors_name(t) == name) return t;
    }
    return std::nullopt;
}

}  // namespace tessera
