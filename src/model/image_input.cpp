// Image input: image token counts and the processor's files (image_input.h).
#include "model/image_input.h"

#include "core/check.h"

namespace tessera::model {

int64_t image_tokens(const VisionConfig& v, ops::PatchGrid g) {
    TESSERA_CHECK(g.h > 0 && g.w > 0 && g.h <= v.max_grid && g.w <= v.max_grid,
                  "vision tower: an image of {}x{} patches (sides 1 to {})", g.h, g.w, v.max_grid);
    TESSERA_CHECK(g.h % v.merge_h == 0 && g.w % v.merge_w == 0,
                  "vision tower: an image of {}x{} patches is not whole {}x{} cells", g.h, g.w, v.merge_h, v.merge_w);
    return g.patches() / (v.merge_h * v.merge_w);
}

Tensor read_processor_images(const SafetensorsFile& in,
                             const std::string& file,
                             const VisionConfig& v,
                             std::vector<ops::PatchGrid>& grids) {
    TESSERA_CHECK(in.contains("pixel_values") && in.contains("image_grid_hws"),
                  "{}: images need both pixel_values and image_grid_hws", file);
    const Tensor g = in.load("image_grid_hws");
    TESSERA_CHECK(g.view().ndim() == 2 && g.view().size(1) == 2 && g.view().size(0) > 0 &&
                      (g.view().dtype == DType::i32 || g.view().dtype == DType::i64),
                  "{}: image_grid_hws must be [images, 2] i32 or i64, not {} {}", file, dtype_name(g.view().dtype),
                  g.view().shape.str());
    int64_t want = 0;
    for (int64_t i = 0; i < g.view().size(0); ++i) {
        auto at = [&](int64_t k) {
            return g.view().dtype == DType::i32 ? int64_t(g.view().ptr<int32_t>()[2 * i + k])
                                                : g.view().ptr<int64_t>()[2 * i + k];
        };
        const ops::PatchGrid grid{at(0), at(1)};
        TESSERA_CHECK(grid.h > 0 && grid.w > 0, "{}: image_grid_hws holds a {}x{} image", file, grid.h, grid.w);
        grids.push_back(grid);
        want += grid.patches();
    }
    const Tensor p = in.load("pixel_values");
    const int64_t N = p.view().ndim() > 0 ? p.view().size(0) : 0;
    TESSERA_CHECK((p.view().ndim() == 4 && p.view().shape == (Shape{N, v.channels, v.patch_size, v.patch_size})) ||
                      (p.view().ndim() == 2 && p.view().size(1) == v.patch_dim()),
                  "{}: pixel_values must be [patches, {}, {}, {}] or [patches, {}], not {}", file, v.channels,
                  v.patch_size, v.patch_size, v.patch_dim(), p.view().shape.str());
    TESSERA_CHECK(N == want, "{}: pixel_values holds {} patches, image_grid_hws {}", file, N, want);
    Tensor patches(DType::f32, Shape{N, v.patch_dim()});
    convert(p.view().reshape(Shape{N, v.patch_dim()}), patches);
    return patches;
}

}  // namespace tessera::model
