#include "core/element.h"

#include "core/fp8.h"
#include "core/mxfp4.h"

namespace tessera {

double element_as_double(const TensorView& t, int64_t i) {
    switch (t.dtype) {
        case DType::f32:
            return static_cast<const float*>(t.data)[i];
        case DType::f64:
            return static_cast<const double*>(t.data)[i];
        case DType::bf16:
            return bf16_to_float(static_cast<const bf16*>(t.data)[i]);
        case DType::i32:
            return static_cast<const int32_t*>(t.data)[i];
        case DType::i64:
            return double(static_cast<const int64_t*>(t.data)[i]);
        case DType::u8:
            return static_cast<const uint8_t*>(t.data)[i];
        case DType::u16:
            return static_cast<const uint16_t*>(t.data)[i];
        case DType::f8e4m3:
            return e4m3_to_float(static_cast<const uint8_t*>(t.data)[i]);
        case DType::mxfp4: {
            float x;
            mxfp4_to_f32(Mxfp4{static_cast<const uint8_t*>(t.data), i}, 1, &x);
            return x;
        }
    }
    return 0;
}

}  // namespace tessera
