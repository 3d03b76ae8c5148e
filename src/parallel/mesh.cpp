// The process mesh (see mesh.h).
#include "parallel/mesh.h"

#include "core/check.h"

namespace tessera::parallel {

Mesh::Mesh(Comm& world, int ep) : world_(world), ep_(ep) {
    const int W = world_.size(), r = world_.rank();
    TESSERA_CHECK(ep >= 1 && W % ep == 0,
                  "parallel.ep = {} does not divide the {} ranks (world size must be a multiple)", ep, W);
    expert_ = world_.split(r / ep, r % ep);
    expert_data_ = world_.split(r % ep, r / ep);
}

}  // namespace tessera::parallel
