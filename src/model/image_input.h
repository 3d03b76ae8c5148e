// Images as the model takes them (model.vision, Kimi K3): how many image tokens an image gives, and the files Kimi's
// processor writes. Apart from the tower (model/vision.h) so the data tools read images without the ops.
#pragma once

#include <string>
#include <vector>

#include "core/safetensors.h"
#include "model/config.h"
#include "ops/vision.h"

namespace tessera::model {

// Image tokens of one image: h·w / (merge_h·merge_w); checks the grid is whole merge cells within max_grid.
int64_t image_tokens(const VisionConfig& v, ops::PatchGrid g);

// Images as Kimi's processor writes them to a safetensors file `in` (named `file` in errors): pixel_values
// [N, C, p, p] or [N, C·p·p] (any float dtype) and image_grid_hws [images, 2] (i32 or i64). Appends the grids;
// returns the patches, f32 [N, patch_dim]. Each mistake one line naming the file.
Tensor read_processor_images(const SafetensorsFile& in,
                             const std::string& file,
                             const VisionConfig& v,
                             std::vector<ops::PatchGrid>& grids);

}  // namespace tessera::model
