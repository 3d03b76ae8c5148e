// The CUDA attention kernels' tile plan (ops/attention_tiles.h).
#include "ops/attention_tiles.h"

namespace tessera::ops {

void attention_tiles(int64_t B, int64_t T, const int64_t* cu, size_t num_cu, int64_t rows, std::vector<AttnTile>& out) {
    out.clear();
    auto add = [&](int64_t b, int64_t first, int64_t len) {
        for (int64_t t0 = 0; t0 < len; t0 += rows) out.push_back({b, first, len, t0});
    };
    if (num_cu == 0) {
        for (int64_t b = 0; b < B; ++b) add(b, 0, T);
    } else {
        for (size_t s = 0; s + 1 < num_cu; ++s) add(0, cu[s], cu[s + 1] - cu[s]);
    }
}

size_t attention_smem_bytes(AttnKernel kernel, int64_t rows, int64_t D, size_t elem) {
    const int64_t tile = rows * (D + 1), chunk = kAttnChunk * D;
    const int64_t n = kernel == AttnKernel::forward ? 2 * tile + 2 * chunk
                      : kernel == AttnKernel::dq    ? 3 * tile + 2 * chunk
                                                    : 4 * tile + 2 * chunk + 2 * kAttnChunk;
    return size_t(n) * elem;
}

int64_t attention_block_rows(AttnKernel kernel, int64_t D, size_t elem, size_t smem_limit) {
    for (int64_t rows : {64, 32})
        if (attention_smem_bytes(kernel, rows, D, elem) <= smem_limit) return rows;
    return 0;
}

AttnTcLayout attention_tc_layout(AttnKernel kernel, int64_t D, size_t smem_limit) {
    for (int64_t warps : {4, 2, 1})
        for (int64_t chunk : {64, 32, 16}) {
            const AttnTcLayout at(kernel, warps, chunk, D);
            if (size_t(at.bytes) <= smem_limit) return at;
        }
    return AttnTcLayout(kernel, 0, 16, D);
}

}  // namespace tessera::ops
